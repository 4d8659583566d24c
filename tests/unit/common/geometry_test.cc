// Geometry validation, host block sizes of the reference models, cache-domain compatibility.
#include <catch2/catch.hpp>

#include <vector>

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

// ---- Hybrid geometries: components (docs/hybrid.md) ----

TEST_CASE("hybrid presets validate and their copy geometries have the hand-computed slot sizes", "[unit]") {
  // gpt-oss-20b: 12 full + 12 sliding layers of 8 KV heads x 64, bf16, 16 tokens: 16*8*64*2 = 16 KiB per chunk,
  // x 2 planes x 12 layers = 384 KiB per block for both; the 128-token window is 8 blocks.
  const Geometry oss = flexkv::GptOss20B();
  REQUIRE(oss.Validate().ok());
  CHECK(oss.is_hybrid());
  CHECK(oss.component_count() == 2);
  CHECK(oss.component_kind(0) == flexkv::ComponentKind::kFull);
  CHECK(oss.component_kind(1) == flexkv::ComponentKind::kSlidingWindow);
  CHECK(oss.Component(0).host_block_bytes() == 393216);
  CHECK(oss.Component(1).host_block_bytes() == 393216);
  CHECK(oss.window_blocks(0) == 0);
  CHECK(oss.window_blocks(1) == 8);
  CHECK_FALSE(oss.Component(0).is_hybrid());

  // Gemma-3-27B: 10 global + 52 local layers of 16 x 128: 16*16*128*2 = 64 KiB per chunk; 10*2*64 KiB = 1.25 MiB,
  // 52*2*64 KiB = 6.5 MiB; the 1024-token window is 64 blocks.
  const Geometry gemma = flexkv::Gemma3_27B();
  REQUIRE(gemma.Validate().ok());
  CHECK(gemma.Component(0).host_block_bytes() == 1310720);
  CHECK(gemma.Component(1).host_block_bytes() == 6815744);
  CHECK(gemma.window_blocks(1) == 64);

  // Qwen3-Next-80B: 12 full layers of 2 x 256: 16*2*256*2 = 16 KiB per chunk, 12*2*16 KiB = 384 KiB; 36 states of
  // 32*128*128*4 + 8192*3*2 = 2,146,304 bytes = 77,266,944 bytes per snapshot.
  const Geometry qwen = flexkv::Qwen3Next80B();
  REQUIRE(qwen.Validate().ok());
  CHECK(qwen.component_kind(1) == flexkv::ComponentKind::kState);
  CHECK(qwen.Component(0).host_block_bytes() == 393216);
  const Geometry state = qwen.Component(1);
  CHECK(state.tokens_per_block == 1);
  CHECK(state.kv_planes == 1);
  CHECK(state.state_bytes_per_layer == 2146304);
  CHECK(state.chunk_bytes_per_rank() == 2146304);
  CHECK(state.host_block_bytes() == 77266944);
  CHECK_FALSE(state.is_mla());
  CHECK(state.Validate().ok());
  CHECK(qwen.window_blocks(1) == 0);

  // Jamba-like: 4 attention layers of 8 x 128: 32 KiB per chunk, 4*2*32 KiB = 256 KiB; 28 states of
  // 8192*16*4 + 8192*3*2 = 573,440 bytes = 16,056,320 bytes per snapshot.
  const Geometry jamba = flexkv::JambaLike();
  REQUIRE(jamba.Validate().ok());
  CHECK(jamba.Component(0).host_block_bytes() == 262144);
  CHECK(jamba.Component(1).host_block_bytes() == 16056320);
}

TEST_CASE("a state copy geometry at TP 2 holds every rank's shard", "[unit]") {
  Geometry g = flexkv::JambaLike();
  g.tp_size = 2;
  g.kv_heads_per_rank = 4;
  REQUIRE(g.Validate().ok());
  CHECK(g.Component(1).chunk_bytes_per_rank() == 573440);  // one rank's state of one layer
  CHECK(g.Component(1).host_block_bytes() == 2ULL * 28 * 573440);
}

TEST_CASE("a window that is not a whole number of blocks rounds up", "[unit]") {
  Geometry g = flexkv::GptOss20B();
  g.components[0].window_tokens = 129;
  CHECK(g.window_blocks(1) == 9);
  g.components[0].window_tokens = 1;
  CHECK(g.window_blocks(1) == 1);
}

TEST_CASE("invalid components name the component and the field", "[unit]") {
  struct Case {
    const char* field;
    Geometry base;
    void (*mutate)(Geometry&);
  };
  const Case cases[] = {
      {"components[0].num_layers", flexkv::GptOss20B(), [](Geometry& g) { g.components[0].num_layers = 0; }},
      {"components[0].num_layers", flexkv::JambaLike(), [](Geometry& g) { g.components[0].num_layers = 1025; }},
      {"components[0].kv_planes", flexkv::GptOss20B(), [](Geometry& g) { g.components[0].kv_planes = 3; }},
      {"components[0].kv_heads_per_rank", flexkv::GptOss20B(),
       [](Geometry& g) { g.components[0].kv_heads_per_rank = 0; }},
      {"components[0].head_dim", flexkv::GptOss20B(), [](Geometry& g) { g.components[0].head_dim = 0; }},
      {"components[0].dtype_bytes", flexkv::GptOss20B(), [](Geometry& g) { g.components[0].dtype_bytes = 3; }},
      {"components[0].window_tokens", flexkv::GptOss20B(), [](Geometry& g) { g.components[0].window_tokens = 0; }},
      {"components[0].window_tokens", flexkv::GptOss20B(),
       [](Geometry& g) { g.components[0].window_tokens = (1u << 20) + 1; }},
      {"components[0].state_bytes_per_layer", flexkv::GptOss20B(),
       [](Geometry& g) { g.components[0].state_bytes_per_layer = 16; }},
      {"components[0].state_bytes_per_layer", flexkv::JambaLike(),
       [](Geometry& g) { g.components[0].state_bytes_per_layer = 0; }},
      {"components[0].state_bytes_per_layer", flexkv::JambaLike(),
       [](Geometry& g) { g.components[0].state_bytes_per_layer = 24; }},
      {"components[0].state_bytes_per_layer", flexkv::JambaLike(),
       [](Geometry& g) { g.components[0].state_bytes_per_layer = (uint64_t{1} << 30) + 16; }},
      {"components[0].window_tokens", flexkv::JambaLike(), [](Geometry& g) { g.components[0].window_tokens = 16; }},
      {"components[0].kind", flexkv::GptOss20B(),
       [](Geometry& g) { g.components[0].kind = flexkv::ComponentKind::kFull; }},
      {"components[0].kind", flexkv::GptOss20B(),
       [](Geometry& g) { g.components[0].kind = static_cast<flexkv::ComponentKind>(9); }},
      {"components[1].head_dim", flexkv::GptOss20B(),
       [](Geometry& g) {
         g.components.push_back(g.components[0]);
         g.components[1].head_dim = 70000;
       }},
      {"state_bytes_per_layer", flexkv::Llama3_8B(), [](Geometry& g) { g.state_bytes_per_layer = 16; }},
  };
  for (const Case& c : cases) {
    Geometry g = c.base;
    c.mutate(g);
    const flexkv::Status s = g.Validate();
    INFO(c.field << ": " << s.ToString());
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(s.message(), Catch::Contains(c.field));
  }
}

TEST_CASE("a sliding-window component whose chunk is not a multiple of 16 bytes is refused", "[unit]") {
  Geometry g = flexkv::GptOss20B();
  g.tokens_per_block = 1;
  g.components[0].head_dim = 4;
  g.components[0].dtype_bytes = 1;
  g.components[0].kv_heads_per_rank = 1;  // 1 token x 1 head x 4 x 1 byte = 4-byte chunks
  const flexkv::Status s = g.Validate();
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(s.message(), Catch::Contains("multiple of 16"));
}

TEST_CASE("more than 7 components beside the full-attention layers are refused", "[unit]") {
  Geometry g = flexkv::GptOss20B();
  g.components.assign(Geometry::kMaxComponents, g.components[0]);
  const flexkv::Status s = g.Validate();
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(s.message(), Catch::Contains("8 components") && Catch::Contains("at most 7"));
  g.components.resize(Geometry::kMaxComponents - 1);
  CHECK(g.Validate().ok());
}

TEST_CASE("differing components are a different host layout", "[unit]") {
  const Geometry oss = flexkv::GptOss20B();
  CHECK(oss.CheckSameHostLayout(flexkv::GptOss20B()).ok());
  // A full-attention geometry with gpt-oss's FULL layers differs in the component count.
  Geometry full_only = oss;
  full_only.components.clear();
  flexkv::Status s = full_only.CheckSameHostLayout(oss);
  CHECK(s.code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(s.message(), Catch::Contains("components (count)") && Catch::Contains("0") && Catch::Contains("1"));
  // Another window: the component is named, with both shapes.
  Geometry wider = oss;
  wider.components[0].window_tokens = 256;
  s = wider.CheckSameHostLayout(oss);
  CHECK(s.code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(s.message(), Catch::Contains("components[0]") && Catch::Contains("sliding_window"));
  // Another state size.
  Geometry jamba = flexkv::JambaLike();
  jamba.components[0].state_bytes_per_layer += 16;
  s = jamba.CheckSameHostLayout(flexkv::JambaLike());
  CHECK(s.code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(s.message(), Catch::Contains("components[0]") && Catch::Contains("state"));
  // Another kind at the same place.
  Geometry kinds = flexkv::GptOss20B();
  kinds.components[0] = flexkv::JambaLike().components[0];
  CHECK(kinds.CheckSameHostLayout(oss).code() == StatusCode::kFailedPrecondition);
}

TEST_CASE("ToString names every component with its slot bytes", "[unit]") {
  CHECK(flexkv::Llama3_8B().ToString() ==
        "{tokens_per_block=16, num_layers=32, kv_planes=2, kv_heads_per_rank=8, head_dim=128, dtype_bytes=2, "
        "tp_size=1, host_block_bytes=2097152}");
  CHECK(flexkv::GptOss20B().ToString() ==
        "{tokens_per_block=16, num_layers=12, kv_planes=2, kv_heads_per_rank=8, head_dim=64, dtype_bytes=2, "
        "tp_size=1, host_block_bytes=393216, sliding_window{num_layers=12, kv_planes=2, kv_heads_per_rank=8, "
        "head_dim=64, dtype_bytes=2, window_tokens=128, slot_bytes=393216}}");
  CHECK_THAT(flexkv::JambaLike().ToString(),
             Catch::EndsWith(", state{num_layers=28, state_bytes_per_layer=573440, slot_bytes=16056320}}"));
  CHECK(flexkv::JambaLike().Component(1).ToString() ==
        "{state: num_layers=28, state_bytes_per_layer=573440, tp_size=1, snapshot_bytes=16056320}");
}

TEST_CASE("geometry: MLA FULL layers with a sharded window or state do not mix TP sizes", "[unit][hybrid]") {
  flexkv::Geometry a = flexkv::DeepSeekMla();
  flexkv::ComponentSpec swa;
  swa.kind = flexkv::ComponentKind::kSlidingWindow;
  swa.num_layers = 2;
  swa.kv_planes = 2;
  swa.kv_heads_per_rank = 8;
  swa.head_dim = 128;
  swa.window_tokens = 128;
  a.components = {swa};
  flexkv::Geometry b = a;
  b.tp_size = 2;
  REQUIRE(a.Component(1).host_block_bytes() != b.Component(1).host_block_bytes());
  const flexkv::Status st = b.CheckSameHostLayout(a);
  CHECK(st.code() == flexkv::StatusCode::kFailedPrecondition);
  CHECK_THAT(st.message(), Catch::Contains("tp_size"));
  // Plain MLA still mixes TP sizes: its latent plane is the same on every rank.
  flexkv::Geometry mla2 = flexkv::DeepSeekMla();
  mla2.tp_size = 2;
  CHECK(mla2.CheckSameHostLayout(flexkv::DeepSeekMla()).ok());
}

TEST_CASE("geometry: a layer-wise load's order merges the components by depth, each one's layers in order", "[unit]") {
  flexkv::Geometry g;  // three components of two layers each
  g.num_layers = 2;
  g.kv_heads_per_rank = 1;
  g.head_dim = 8;
  flexkv::ComponentSpec swa;
  swa.num_layers = 2;
  swa.kv_heads_per_rank = 1;
  swa.head_dim = 8;
  swa.window_tokens = 32;
  flexkv::ComponentSpec state;
  state.kind = flexkv::ComponentKind::kState;
  state.num_layers = 2;
  state.state_bytes_per_layer = 64;
  g.components = {swa, state};
  REQUIRE(g.Validate().ok());
  using flexkv::LayerStep;
  CHECK(g.total_layers() == 6);
  // The state's layers first, then the full and window layers alternating as the model has them.
  CHECK(g.LayerOrder() == std::vector<LayerStep>{{2, 0}, {2, 1}, {0, 0}, {1, 0}, {0, 1}, {1, 1}});
  // gpt-oss: 12 full and 12 sliding-window layers alternate.
  const std::vector<LayerStep> gpt_oss = flexkv::GptOss20B().LayerOrder();
  REQUIRE(gpt_oss.size() == 24);
  CHECK(std::vector<LayerStep>(gpt_oss.begin(), gpt_oss.begin() + 4) ==
        std::vector<LayerStep>{{0, 0}, {1, 0}, {0, 1}, {1, 1}});
  // Gemma 3: 10 global and 52 local layers, five local then a global one in the model: the same here.
  const std::vector<LayerStep> gemma = flexkv::Gemma3_27B().LayerOrder();
  REQUIRE(gemma.size() == 62);
  CHECK(gemma[4] == LayerStep{1, 4});
  CHECK(gemma[5] == LayerStep{0, 0});
  CHECK(gemma[6] == LayerStep{1, 5});
  // Qwen3-Next: the 36 Gated DeltaNet states first, then the 12 full-attention layers.
  const flexkv::Geometry next = flexkv::Qwen3Next80B();
  const std::vector<LayerStep> order = next.LayerOrder();
  REQUIRE(order.size() == 48);
  CHECK(order[35] == LayerStep{1, 35});
  CHECK(order[36] == LayerStep{0, 0});
  std::vector<uint32_t> seen(next.component_count(), 0);
  for (const LayerStep& s : order) CHECK(s.layer == seen[s.component]++);
  CHECK(seen == std::vector<uint32_t>{12, 36});
  // A full-attention geometry: its layers as they are.
  const flexkv::Geometry llama = flexkv::Llama3_8B();
  REQUIRE(llama.LayerOrder().size() == 32);
  CHECK(llama.LayerOrder()[31] == LayerStep{0, 31});
}
