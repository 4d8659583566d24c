// One line per event on stderr: level, component, message. Under journald (JOURNAL_STREAM set) each
// line carries a <N> syslog priority prefix so `journalctl -p warning` works.
#pragma once

#include <fmt/format.h>

#include <cstdint>
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
