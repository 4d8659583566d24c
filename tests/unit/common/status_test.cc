// Status and Result<T> (common/include/flexkv/status.h).
#include <catch2/catch.hpp>

#include <string>

#include "flexkv/status.h"

using flexkv::Result;
using flexkv::Status;
using flexkv::StatusCode;

TEST_CASE("a Result built from an OK status holds INTERNAL, never an OK without a value", "[unit]") {
  Result<int> r = Status::Ok();
  CHECK_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::kInternal);
  CHECK_THAT(r.status().message(), Catch::Contains("OK status without a value"));

  Result<std::string> s{Status()};
  CHECK_FALSE(s.ok());
  CHECK(s.status().code() == StatusCode::kInternal);
}

TEST_CASE("a Result holds a value or the error it was built from", "[unit]") {
  Result<int> v = 7;
  REQUIRE(v.ok());
  CHECK(*v == 7);
  CHECK(v.status().ok());
  Result<int> e = Status::NotFound("no such block");
  CHECK_FALSE(e.ok());
  CHECK(e.status().code() == StatusCode::kNotFound);
  CHECK(e.status().ToString() == "NOT_FOUND: no such block");
}
