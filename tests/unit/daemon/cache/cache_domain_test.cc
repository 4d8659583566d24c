// CacheDomain: the first Attach fixes the domain; later ones must match.
#include <catch2/catch.hpp>

#include "daemon/cache/cache_domain.h"

using flexkv::CacheDomain;
using flexkv::StatusCode;

TEST_CASE("first geometry fixes block size and capacity", "[unit]") {
  CacheDomain d(64ULL << 20);
  CHECK_FALSE(d.Snapshot().geometry.has_value());
  REQUIRE(d.Admit("llama", flexkv::Llama3_8B()).ok());
  CHECK(d.Snapshot().block_bytes == 2ULL << 20);
  CHECK(d.Snapshot().capacity_blocks == 32);
  CHECK(d.Admit("llama", flexkv::Llama3_8B()).ok());
  auto other = d.Admit("llama", flexkv::Qwen3_8B());
  CHECK(other.code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(other.message(), Catch::Contains("num_layers"));
  auto ns = d.Admit("qwen", flexkv::Llama3_8B());
  CHECK(ns.code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(ns.message(), Catch::Contains("model_namespace"));
}

TEST_CASE("a block larger than the pool is invalid", "[unit]") {
  CacheDomain d(1ULL << 20);
  auto s = d.Admit("llama", flexkv::Llama3_8B());
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(s.message(), Catch::Contains("pool"));
  CHECK(d.Admit("", flexkv::Llama3_8B()).code() == StatusCode::kInvalidArgument);
  CHECK_FALSE(d.Snapshot().geometry.has_value());
}
