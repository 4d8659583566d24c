// One line per event on stderr: level, component, message. Under journald (JOURNAL_STREAM set) each
// line carries a <N> syslog priority prefix so `journalctl -p warning` works.
#pragma once

#include <fmt/format.h>

#include <string_view>

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

}  // namespace flexkv::log
