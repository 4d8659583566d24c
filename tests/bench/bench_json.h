// JSON for flexkv-bench's --json reports, through nlohmann-json: keys keep the order they are written in (the
// reports read like the text form), figures are rounded to the digits the text form prints.
#pragma once

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace flexkv::bench {

using Json = nlohmann::ordered_json;

// `value` rounded to `digits` decimals (prints as e.g. 0.1235, not 0.12345678).
inline double Rounded(double value, int digits) {
  const double scale = std::pow(10.0, digits);
  return std::round(value * scale) / scale;
}

// `value` rounded to a whole number, printed without a fraction (rates: 123456, not 123456.0).
inline int64_t Whole(double value) { return std::llround(value); }

// One line; bytes that are not UTF-8 (a path) print as U+FFFD instead of failing the report.
inline std::string DumpLine(const Json& report) {
  return report.dump(-1, ' ', false, Json::error_handler_t::replace) + "\n";
}

}  // namespace flexkv::bench
