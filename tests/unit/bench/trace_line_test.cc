// flexkv-bench trace: bad trace lines are refused with a message that says what was wrong (the reader adds the
// file and line). Regression tests for the hand-written reader, which wrapped numbers past 2^64 (and timestamps
// past 2^63) silently, accepted lines that were not UTF-8 and took "hash_ids" from anywhere in the line.
#include <catch2/catch.hpp>
#include <string>

#include "tests/bench/trace_bench.h"

using flexkv::StatusCode;
using flexkv::bench::ParseTraceLine;

namespace {

std::string ErrorOf(std::string_view line) {
  auto r = ParseTraceLine(line);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::kInvalidArgument);
  return r.status().message();
}

}  // namespace

TEST_CASE("a trace id past 2^64-1 is refused, not wrapped", "[unit][bench]") {
  CHECK_THAT(ErrorOf(R"({"hash_ids": [1, 18446744073709551616]})"),
             Catch::Contains("\"hash_ids\"[1]") && Catch::Contains("0..2^64-1"));
  CHECK_THAT(ErrorOf(R"({"hash_ids": [99999999999999999999999]})"), Catch::Contains("\"hash_ids\"[0]"));
  auto max = ParseTraceLine(R"({"hash_ids": [18446744073709551615]})");
  REQUIRE(max.ok());
  CHECK(max->hash_ids == std::vector<uint64_t>{UINT64_MAX});
}

TEST_CASE("a timestamp past 2^63-1 or below 0 is refused", "[unit][bench]") {
  CHECK_THAT(ErrorOf(R"({"timestamp": 9223372036854775808, "hash_ids": [1]})"), Catch::Contains("\"timestamp\""));
  CHECK_THAT(ErrorOf(R"({"timestamp": -1, "hash_ids": [1]})"), Catch::Contains("\"timestamp\""));
  CHECK_THAT(ErrorOf(R"({"timestamp": 1.5, "hash_ids": [1]})"), Catch::Contains("\"timestamp\""));
}

TEST_CASE("a trace line with bytes that are not UTF-8 is refused", "[unit][bench]") {
  const std::string line = std::string(R"({"model": ")") + "\xff\xfe" + R"(", "hash_ids": [1, 2]})";
  CHECK_THAT(ErrorOf(line), Catch::Contains("not valid JSON") && Catch::Contains("UTF-8"));
}

TEST_CASE("a trace line without a hash_ids array says which field is missing or mistyped", "[unit][bench]") {
  CHECK_THAT(ErrorOf(R"({"timestamp": 1})"), Catch::Contains("no \"hash_ids\""));
  CHECK_THAT(ErrorOf(R"({"hash_ids": "1,2"})"), Catch::Contains("\"hash_ids\" is a JSON string"));
  CHECK_THAT(ErrorOf(R"({"hash_ids": [1, -2]})"), Catch::Contains("\"hash_ids\"[1] is -2"));
  CHECK_THAT(ErrorOf(R"([1, 2])"), Catch::Contains("expected an object"));
  // The old reader took the first "hash_ids" anywhere in the line, here one of a nested object.
  CHECK_THAT(ErrorOf(R"({"meta": {"hash_ids": [1]}})"), Catch::Contains("no \"hash_ids\""));
}
