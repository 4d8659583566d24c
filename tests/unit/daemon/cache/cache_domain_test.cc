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

// Regression: a namespace with a NUL (or another control character, or bytes that are not UTF-8) was
// accepted, fixed the domain, and lost its tail at the NUL in the pool file after a restart.
TEST_CASE("names with NUL, control characters or invalid UTF-8 are refused naming the byte offset",
          "[unit][regression]") {
  CacheDomain d(64ULL << 20);
  const auto refused = [&](const std::string& ns, const std::string& mentions) {
    const flexkv::Status s = d.Admit(ns, flexkv::Llama3_8B());
    INFO(s.ToString());
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(s.message(), Catch::Contains(mentions));
  };
  refused(std::string("llama\0evil", 10), "model_namespace has control character U+0000 at byte offset 5");
  refused("llama\n[ERROR] forged", "control character U+000A at byte offset 5");
  refused("a\x7f", "U+007F at byte offset 1");
  refused("ab\xc2\x85", "U+0085 at byte offset 2");                       // C1 control (NEL) in UTF-8
  refused("x\xff", "model_namespace is not valid UTF-8 at byte offset 1 (byte 0xff)");
  refused("\xc0\xae", "not valid UTF-8 at byte offset 0");                // overlong
  refused("ok\xe2\x82", "not valid UTF-8 at byte offset 2");              // truncated
  refused("\xed\xa0\x80", "not valid UTF-8 at byte offset 0");            // surrogate
  refused(std::string(257, 'a'), "model_namespace has 257 bytes; expected 1..256");
  CHECK_FALSE(d.Snapshot().geometry.has_value());  // none of them fixed the domain
  REQUIRE(d.Admit("modèle/llama-3 ✓", flexkv::Llama3_8B()).ok());
  CHECK(d.Snapshot().model_namespace == "modèle/llama-3 ✓");
  CHECK(flexkv::CheckName("client_name", "", 128, /*may_be_empty=*/true).ok());
  CHECK(flexkv::CheckName("client_name", "vllm\tx", 128, true).code() == StatusCode::kInvalidArgument);
}
