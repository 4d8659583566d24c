// One line per event on stderr: level, component, message. When stderr is the journal (JOURNAL_STREAM names
// it) each line carries a <N> syslog priority prefix (sd-daemon(3)) so `journalctl -p warning` works.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"
#include "flexkv/status.h"

namespace flexkv::log {

enum class Level { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

void SetLevel(Level level);
bool Enabled(Level level);
// "debug", "info", "warning" (or "warn"), "error".
Result<Level> ParseLevel(std::string_view text);
// Thread-safe; writes one whole line.
void Write(Level level, std::string_view component, std::string_view message);

// How a line looks. Journal: "<P>LEVEL component: message\n", P the syslog priority (debug 7, info 6, warning 4,
// error 3) and no timestamp (the journal has its own). Otherwise: "2026-12-04T02:40:42.123Z LEVEL component:
// message\n" (UTC). One event is one line: a newline, carriage return or other control character (tab excepted)
// in the component or message is written escaped ("\n", "\r", "\x1b"), so nothing can split an event or forge
// a line. Pure; Write uses it.
struct LineFormat {
  bool journal = false;
  int64_t unix_ms = 0;  // the timestamp, when not journal
};
std::string FormatLine(Level level, std::string_view component, std::string_view message, const LineFormat& format);

// True when fd 2 is the stream systemd connected to the journal: $JOURNAL_STREAM is "DEV:INODE" of that fd
// (systemd.exec(5)), so a child whose stderr was redirected elsewhere does not prefix. `journal_stream` is the
// variable's value, or null when unset.
bool StderrIsJournal(const char* journal_stream);

template <typename... Args>
void Debug(std::string_view component, fmt::format_string<Args...> f, Args&&... args) {
  if (Enabled(Level::kDebug)) Write(Level::kDebug, component, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void Info(std::string_view component, fmt::format_string<Args...> f, Args&&... args) {
  if (Enabled(Level::kInfo)) Write(Level::kInfo, component, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void Warning(std::string_view component, fmt::format_string<Args...> f, Args&&... args) {
  if (Enabled(Level::kWarning)) Write(Level::kWarning, component, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void Error(std::string_view component, fmt::format_string<Args...> f, Args&&... args) {
  if (Enabled(Level::kError)) Write(Level::kError, component, fmt::format(f, std::forward<Args>(args)...));
}

// Rate limit for a line that an untrusted peer can make the daemon repeat (refused Attach calls, accept failures):
// at most one line per interval; the next line that passes says how many were suppressed since the last one.
// Keep one RateLimited per kind of event. Thread-safe.
class RateLimited {
 public:
  explicit RateLimited(int64_t interval_ms = 1000) : interval_ms_(interval_ms) {}
  RateLimited(const RateLimited&) = delete;
  RateLimited& operator=(const RateLimited&) = delete;

  // Writes `message` (with " (N similar lines suppressed)" appended when N > 0) if the interval has passed since
  // the last line written, else counts it. True when written.
  bool Write(Level level, std::string_view component, std::string_view message);
  template <typename... Args>
  bool Warning(std::string_view component, fmt::format_string<Args...> f, Args&&... args) {
    if (!Enabled(Level::kWarning)) return false;
    return Write(Level::kWarning, component, fmt::format(f, std::forward<Args>(args)...));
  }
  // Lines counted and not written since the last one written.
  uint64_t suppressed() const;

 private:
  const int64_t interval_ms_;
  mutable Mutex mu_;
  bool written_ ABSL_GUARDED_BY(mu_) = false;
  int64_t last_ms_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t suppressed_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace flexkv::log
