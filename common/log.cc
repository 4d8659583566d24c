// stderr logger; see log.h.
#include "common/log.h"

#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>

#include "common/clock.h"

namespace flexkv::log {
namespace {

std::atomic<int> g_level{static_cast<int>(Level::kInfo)};
const bool g_journal = StderrIsJournal(std::getenv("JOURNAL_STREAM"));

// `text` with every control character but tab escaped, appended to `out`.
void AppendEscaped(std::string& out, std::string_view text) {
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if ((c < 0x20 && c != '\t') || c == 0x7F) {
      out += fmt::format("\\x{:02x}", c);
    } else {
      out += ch;
    }
  }
}

}  // namespace

bool StderrIsJournal(const char* journal_stream) {
  if (journal_stream == nullptr) return false;
  unsigned long long dev = 0, ino = 0;
  char tail = 0;
  if (std::sscanf(journal_stream, "%llu:%llu%c", &dev, &ino, &tail) != 2) return false;
  struct stat st {};
  if (fstat(STDERR_FILENO, &st) != 0) return false;
  return static_cast<unsigned long long>(st.st_dev) == dev && static_cast<unsigned long long>(st.st_ino) == ino;
}

std::string FormatLine(Level level, std::string_view component, std::string_view message, const LineFormat& format) {
  static constexpr const char* kNames[] = {"DEBUG", "INFO", "WARN", "ERROR"};
  static constexpr int kSyslog[] = {7, 6, 4, 3};
  const int l = static_cast<int>(level);
  std::string line;
  if (format.journal) {
    line = fmt::format("<{}>{} ", kSyslog[l], kNames[l]);
  } else {
    const time_t seconds = static_cast<time_t>(format.unix_ms / 1000);
    tm utc{};
    gmtime_r(&seconds, &utc);
    line = fmt::format("{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z {} ", utc.tm_year + 1900, utc.tm_mon + 1,
                       utc.tm_mday, utc.tm_hour, utc.tm_min, utc.tm_sec, format.unix_ms % 1000, kNames[l]);
  }
  AppendEscaped(line, component);
  line += ": ";
  AppendEscaped(line, message);
  line += '\n';
  return line;
}

void SetLevel(Level level) { g_level.store(static_cast<int>(level), std::memory_order_relaxed); }

bool Enabled(Level level) { return static_cast<int>(level) >= g_level.load(std::memory_order_relaxed); }

Result<Level> ParseLevel(std::string_view text) {
  if (text == "debug") return Level::kDebug;
  if (text == "info") return Level::kInfo;
  if (text == "warning" || text == "warn") return Level::kWarning;
  if (text == "error") return Level::kError;
  return Status::InvalidArgument(fmt::format("log level '{}' is unknown; expected debug, info, warning or error", text));
}

void Write(Level level, std::string_view component, std::string_view message) {
  LineFormat format{.journal = g_journal};
  if (!g_journal) {
    timeval tv{};
    gettimeofday(&tv, nullptr);
    format.unix_ms = int64_t{tv.tv_sec} * 1000 + tv.tv_usec / 1000;
  }
  const std::string line = FormatLine(level, component, message, format);
  // One write(2) per line keeps lines whole across threads.
  ssize_t ignored = ::write(STDERR_FILENO, line.data(), line.size());
  (void)ignored;
}

bool RateLimited::Write(Level level, std::string_view component, std::string_view message) {
  uint64_t suppressed = 0;
  {
    MutexLock lock(&mu_);
    const int64_t now = MonotonicMs();
    if (written_ && now - last_ms_ < interval_ms_) {
      ++suppressed_;
      return false;
    }
    written_ = true;
    last_ms_ = now;
    suppressed = suppressed_;
    suppressed_ = 0;
  }
  if (suppressed == 0) {
    log::Write(level, component, message);
  } else {
    log::Write(level, component, fmt::format("{} ({} similar lines suppressed)", message, suppressed));
  }
  return true;
}

uint64_t RateLimited::suppressed() const {
  MutexLock lock(&mu_);
  return suppressed_;
}

}  // namespace flexkv::log
