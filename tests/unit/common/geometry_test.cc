// Geometry validation, host block sizes of the reference models, cache-domain compatibility.
#include <catch2/catch.hpp>

#include "flexkv/geometry.h"

using flexkv::Geometry;
using flexkv::StatusCode;

TEST_CASE("reference geometries have the sizes DESIGN 4.4 gives", "[unit]") {
  CHECK(flexkv::Llama3_8B().chunk_bytes_per_rank() == 32 * 1024);
  CHECK(flexkv::Llama3_8B().host_block_bytes() == 2ULL << 20);
  CHECK(flexkv::Qwen3_8B().host_block_bytes() == 2304ULL * 1024);
  CHECK(flexkv::DeepSeekMla().chunk_bytes_per_rank() == 18 * 1024);
  CHECK(flexkv::DeepSeekMla().host_block_bytes() == 61ULL * 18 * 1024);
  for (const Geometry& g : {flexkv::Llama3_8B(), flexkv::Qwen3_8B(), flexkv::DeepSeekMla()}) CHECK(g.Validate().ok());
}

TEST_CASE("TP=2 halves the per-rank chunk of a GQA model but not the host block", "[unit]") {
  Geometry tp2 = flexkv::Llama3_8B();
  tp2.tp_size = 2;
  tp2.kv_heads_per_rank = 4;
  CHECK(tp2.chunk_bytes_per_rank() == 16 * 1024);
  CHECK(tp2.host_block_bytes() == flexkv::Llama3_8B().host_block_bytes());
  // Same bytes per block, but shards sit at other offsets than a TP=1 engine's heads: not shareable.
  CHECK_THAT(tp2.CheckSameHostLayout(flexkv::Llama3_8B()).message(), Catch::Contains("tp_size"));
  Geometry mla_tp8 = flexkv::DeepSeekMla();
  mla_tp8.tp_size = 8;  // MLA KV is the same on every rank: stored once
  CHECK(mla_tp8.host_block_bytes() == flexkv::DeepSeekMla().host_block_bytes());
  CHECK(mla_tp8.CheckSameHostLayout(flexkv::DeepSeekMla()).ok());
}

TEST_CASE("invalid geometries name the field", "[unit]") {
  struct Case {
    const char* field;
    void (*mutate)(Geometry&);
  };
  const Case cases[] = {
      {"tokens_per_block", [](Geometry& g) { g.tokens_per_block = 12; }},
      {"tokens_per_block", [](Geometry& g) { g.tokens_per_block = 0; }},
      {"num_layers", [](Geometry& g) { g.num_layers = 0; }},
      {"kv_planes", [](Geometry& g) { g.kv_planes = 3; }},
      {"kv_heads_per_rank", [](Geometry& g) { g.kv_heads_per_rank = 0; }},
      {"head_dim", [](Geometry& g) { g.head_dim = 0; }},
      {"dtype_bytes", [](Geometry& g) { g.dtype_bytes = 3; }},
      {"tp_size", [](Geometry& g) { g.tp_size = 0; }},
  };
  for (const Case& c : cases) {
    Geometry g = flexkv::Llama3_8B();
    c.mutate(g);
    const flexkv::Status s = g.Validate();
    INFO(c.field << ": " << s.ToString());
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(s.message(), Catch::Contains(c.field));
  }
}

TEST_CASE("a different host layout names the field and both values", "[unit]") {
  Geometry qwen = flexkv::Qwen3_8B();
  const flexkv::Status s = qwen.CheckSameHostLayout(flexkv::Llama3_8B());
  CHECK(s.code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(s.message(), Catch::Contains("num_layers") && Catch::Contains("36") && Catch::Contains("32"));
  Geometry tp2 = flexkv::Llama3_8B();
  tp2.tp_size = 2;  // 8 heads per rank * 2 = 16 heads: not the same host block
  CHECK_THAT(tp2.CheckSameHostLayout(flexkv::Llama3_8B()).message(), Catch::Contains("tp_size"));
}
