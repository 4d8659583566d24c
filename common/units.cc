// Byte-size parsing and formatting.
#include "common/units.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <string>

namespace flexkv {

Result<uint64_t> ParseByteSize(std::string_view text) {
  auto fail = [&]() -> Status {
    return Status::InvalidArgument(fmt::format(
        "'{}' is not a byte size; expected a number with an optional unit, e.g. 4096, 512MiB, 64GiB, 1.5GB", text));
  };
  std::string s(text);
  s.erase(std::remove_if(s.begin(), s.end(), [](unsigned char c) { return std::isspace(c) != 0; }), s.end());
  if (s.empty()) return fail();
  size_t pos = 0;
  while (pos < s.size() && (std::isdigit(static_cast<unsigned char>(s[pos])) != 0 || s[pos] == '.')) ++pos;
  std::string number = s.substr(0, pos);
  std::string unit = s.substr(pos);
  if (number.empty() || std::count(number.begin(), number.end(), '.') > 1 || number == ".") return fail();
  std::transform(unit.begin(), unit.end(), unit.begin(), [](unsigned char c) { return std::tolower(c); });
  long double mult;
  if (unit.empty() || unit == "b") mult = 1;
  else if (unit == "k" || unit == "kib") mult = 1024.0L;
  else if (unit == "m" || unit == "mib") mult = 1024.0L * 1024;
  else if (unit == "g" || unit == "gib") mult = 1024.0L * 1024 * 1024;
  else if (unit == "t" || unit == "tib") mult = 1024.0L * 1024 * 1024 * 1024;
  else if (unit == "kb") mult = 1e3L;
  else if (unit == "mb") mult = 1e6L;
  else if (unit == "gb") mult = 1e9L;
  else if (unit == "tb") mult = 1e12L;
  else return fail();
  long double value = std::stold(number) * mult;
  if (value >= 18446744073709551615.0L) {
    return Status::InvalidArgument(fmt::format("'{}' is too large; expected at most 16 EiB", text));
  }
  if (value != std::floor(value)) {
    return Status::InvalidArgument(fmt::format("'{}' is not a whole number of bytes", text));
  }
  return static_cast<uint64_t>(value);
}

std::string FormatByteSize(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int unit = 0;
  uint64_t v = bytes;
  while (unit < 5 && v >= 1024 && v % 1024 == 0) {
    v /= 1024;
    ++unit;
  }
  if (v < 1024 || unit == 5) return fmt::format("{} {}", v, kUnits[unit]);
  double d = static_cast<double>(bytes);
  unit = 0;
  while (unit < 5 && d >= 1024) {
    d /= 1024;
    ++unit;
  }
  return fmt::format("{:.1f} {}", d, kUnits[unit]);
}

}  // namespace flexkv
