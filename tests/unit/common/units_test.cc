// ParseByteSize / FormatByteSize.
#include <catch2/catch.hpp>

#include "common/units.h"

using flexkv::FormatByteSize;
using flexkv::ParseByteSize;
using flexkv::StatusCode;

TEST_CASE("byte sizes parse with binary and decimal units", "[unit]") {
  CHECK(*ParseByteSize("4096") == 4096);
  CHECK(*ParseByteSize("512MiB") == 512ULL << 20);
  CHECK(*ParseByteSize("64GiB") == 64ULL << 30);
  CHECK(*ParseByteSize("64 gib") == 64ULL << 30);
  CHECK(*ParseByteSize("2M") == 2ULL << 20);
  CHECK(*ParseByteSize("1.5GB") == 1500000000ULL);
  CHECK(*ParseByteSize("1TiB") == 1ULL << 40);
  CHECK(*ParseByteSize("0.5KiB") == 512);
}

TEST_CASE("byte sizes refuse garbage with the accepted form", "[unit]") {
  for (const char* bad : {"", "GiB", "12XB", "-5", "1.2.3MiB", "1..", "0.3B", "99999999999TiB"}) {
    auto r = ParseByteSize(bad);
    INFO(bad);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
  }
  CHECK_THAT(ParseByteSize("12XB").status().message(), Catch::Contains("512MiB"));
}

TEST_CASE("byte sizes format with the largest exact unit", "[unit]") {
  CHECK(FormatByteSize(2ULL << 20) == "2 MiB");
  CHECK(FormatByteSize(64ULL << 30) == "64 GiB");
  CHECK(FormatByteSize(1000) == "1000 B");
  CHECK(FormatByteSize(1536ULL << 20) == "1.5 GiB");
  CHECK(FormatByteSize((2ULL << 20) + 1) == "2.0 MiB");
}
