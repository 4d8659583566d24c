// stderr logger; see log.h.
#include "common/log.h"

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
const bool g_journal = std::getenv("JOURNAL_STREAM") != nullptr;

}  // namespace

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
  static constexpr const char* kNames[] = {"DEBUG", "INFO", "WARN", "ERROR"};
  static constexpr int kSyslog[] = {7, 6, 4, 3};
  const int l = static_cast<int>(level);
  std::string line;
  if (g_journal) {
    line = fmt::format("<{}>{} {}: {}\n", kSyslog[l], kNames[l], component, message);
  } else {
    timeval tv{};
    gettimeofday(&tv, nullptr);
    tm utc{};
    gmtime_r(&tv.tv_sec, &utc);
    line = fmt::format("{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z {} {}: {}\n", utc.tm_year + 1900, utc.tm_mon + 1,
                       utc.tm_mday, utc.tm_hour, utc.tm_min, utc.tm_sec, tv.tv_usec / 1000, kNames[l], component,
                       message);
  }
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
