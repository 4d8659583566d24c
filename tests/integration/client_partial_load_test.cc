// Loads from where the engine's own prefix ends, and stores of every window block the engine has (ring layout 5,
// docs/hybrid.md), through a real flexkvd with host KV buffers: a Llama, a gpt-oss-like (FULL + SLIDING_WINDOW) and a
// Qwen3-Next-like (FULL + STATE) geometry. A load from block k moves only blocks k.. (the completion and the daemon's
// counters count those bytes), leaves every other engine block as it was (a sentinel), and is byte-exact.
#include <catch2/catch.hpp>

#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "flexkv/client.h"
#include "tests/support/process.h"

using namespace std::chrono_literals;
using flexkv::BlockKey;
using flexkv::ComponentKind;
using flexkv::Geometry;
using flexkv::StatusCode;
using flexkv::testing::DaemonUnderTest;

namespace {

using Spans = std::vector<std::span<const uint32_t>>;
using Ids = std::vector<uint32_t>;

constexpr uint32_t kEngineBlocks = 32;
constexpr uint8_t kSentinel = 0xEE;

Geometry LlamaSmall() {
  Geometry g = flexkv::Llama3_8B();
  g.num_layers = 2;
  return g;
}

// gpt-oss's shape with 2 layers of each kind and a 48-token (3-block) window.
Geometry GptOssLike() {
  Geometry g = flexkv::GptOss20B();
  g.num_layers = 2;
  g.components[0].num_layers = 2;
  g.components[0].window_tokens = 48;
  return g;
}

// Qwen3-Next's shape with 2 full-attention layers and 3 Gated-DeltaNet layers of a 1 KiB state.
Geometry Qwen3NextLike() {
  Geometry g = flexkv::Qwen3Next80B();
  g.num_layers = 2;
  g.components[0].num_layers = 3;
  g.components[0].state_bytes_per_layer = 1024;
  return g;
}

// A window of 2 blocks and a state: a prefix end is a hit only with both.
Geometry WindowAndState() {
  Geometry g = GptOssLike();
  g.components[0].window_tokens = 32;
  flexkv::ComponentSpec state;
  state.kind = ComponentKind::kState;
  state.num_layers = 2;
  state.state_bytes_per_layer = 256;
  g.components.push_back(state);
  return g;
}

// The bytes an engine block of component c holds for prompt position `at` (a block, or a state boundary) of prompt
// `prompt`: different for every (prompt, component, position, byte).
void Fill(uint8_t* p, uint64_t bytes, uint32_t prompt, size_t c, uint32_t at) {
  for (uint64_t i = 0; i < bytes; ++i) p[i] = static_cast<uint8_t>(prompt * 89 + c * 53 + at * 31 + i * 7 + (i >> 8));
}

bool Holds(const uint8_t* p, uint64_t bytes, uint32_t prompt, size_t c, uint32_t at) {
  std::vector<uint8_t> want(bytes);
  Fill(want.data(), bytes, prompt, c, at);
  return std::memcmp(p, want.data(), bytes) == 0;
}

bool IsSentinel(const uint8_t* p, uint64_t bytes) {
  for (uint64_t i = 0; i < bytes; ++i) {
    if (p[i] != kSentinel) return false;
  }
  return true;
}

// One engine: a session with kEngineBlocks host blocks (slots, for a state) per component.
struct Engine {
  std::unique_ptr<flexkv::Client> client;
  Geometry geometry;
  std::vector<flexkv::HostKvBuffers> kv;
  std::vector<uint64_t> block_bytes;

  Engine(const DaemonUnderTest& d, const Geometry& g, const std::string& ns) : geometry(g) {
    auto c = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
    REQUIRE(c.ok());
    client = std::move(*c);
    flexkv::AttachOptions o;
    o.client_name = "partial";
    o.model_namespace = ns;
    o.geometry = g;
    auto info = client->Attach(o);
    REQUIRE(info.ok());
    block_bytes = info->component_slot_bytes;
    for (uint32_t i = 0; i < g.component_count(); ++i) {
      auto buffers = g.is_hybrid() ? client->CreateHostKv(i, flexkv::KvLayout::kBlockFirst, kEngineBlocks)
                                   : client->CreateHostKv(flexkv::KvLayout::kBlockFirst, kEngineBlocks);
      REQUIRE(buffers.ok());
      std::memset(buffers->data, kSentinel, buffers->bytes);
      kv.push_back(*buffers);
    }
  }

  uint8_t* Block(size_t c, uint32_t id) const { return kv[c].data + id * block_bytes[c]; }

  flexkv::OpResult Wait(const flexkv::Result<flexkv::Ticket>& t) {
    REQUIRE(t.ok());
    auto r = client->Wait(*t, 10s);
    REQUIRE(r.ok());
    INFO(r->status.ToString());
    REQUIRE(r->status.ok());
    return *r;
  }

  std::map<std::string, uint64_t> Counters() {
    auto st = client->GetStatus();
    REQUIRE(st.ok());
    return st->counters;
  }

  // Pins the longest hit of `keys`; returns (handle, e).
  std::pair<uint64_t, uint32_t> Pin(std::span<const BlockKey> keys) {
    const flexkv::OpResult r = Wait(client->Match(keys, /*pin=*/true));
    return {r.match_handle, r.matched_blocks};
  }
};

std::vector<BlockKey> Keys(const Geometry& g, const std::string& ns, uint32_t blocks, int32_t seed,
                           uint32_t shared_with_seed_blocks = 0, int32_t shared_seed = 0) {
  std::vector<int32_t> tokens(blocks * g.tokens_per_block);
  for (size_t i = 0; i < tokens.size(); ++i) {
    const bool shared = i < shared_with_seed_blocks * g.tokens_per_block;
    tokens[i] = static_cast<int32_t>(i * 17 + 1000 * (shared ? shared_seed : seed));
  }
  return flexkv::ComputeBlockKeys(ns, tokens, g.tokens_per_block);
}

}  // namespace

TEST_CASE("partial load: a Llama load from block k moves only blocks k.., byte-exact, and counts their bytes",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  Engine e(d, LlamaSmall(), "llama");
  const uint64_t bb = e.block_bytes[0];
  const std::vector<BlockKey> keys = Keys(e.geometry, "llama", 8, 1);
  Ids src;
  for (uint32_t j = 0; j < 8; ++j) {
    Fill(e.Block(0, j), bb, 1, 0, j);
    src.push_back(j);
  }
  CHECK(e.Wait(e.client->Store(flexkv::BlockKeyChain(keys), src)).done_blocks == 8);
  auto [handle, end] = e.Pin(keys);
  REQUIRE(end == 8);

  // The engine holds blocks 0..2 in its blocks 8..10; it loads blocks 3..7 into 11..15.
  const auto before = e.Counters();
  const flexkv::OpResult r = e.Wait(e.client->Load(handle, Ids{11, 12, 13, 14, 15}, false, /*first_block=*/3));
  CHECK(r.done_blocks == 5);
  CHECK(r.bytes == 5 * bb);
  const auto after = e.Counters();
  CHECK(after.at("load_blocks") - before.at("load_blocks") == 5);
  CHECK(after.at("bytes_loaded") - before.at("bytes_loaded") == 5 * bb);
  for (uint32_t j = 0; j < 8; ++j) CHECK(Holds(e.Block(0, j), bb, 1, 0, j));  // the sources are untouched
  for (uint32_t id = 8; id < 11; ++id) CHECK(IsSentinel(e.Block(0, id), bb));
  for (uint32_t j = 3; j < 8; ++j) CHECK(Holds(e.Block(0, 8 + j), bb, 1, 0, j));
  for (uint32_t id = 16; id < kEngineBlocks; ++id) CHECK(IsSentinel(e.Block(0, id), bb));

  SECTION("layer-wise from block k: every layer lands, and only the blocks past k move") {
    auto t = e.client->Load(handle, Ids{22, 23}, /*layerwise=*/true, /*first_block=*/6);
    REQUIRE(t.ok());
    auto landed = e.client->WaitLayers(*t, e.geometry.num_layers, 10s);
    REQUIRE(landed.ok());
    CHECK(*landed == e.geometry.num_layers);
    const flexkv::OpResult lw = e.Wait(t);
    CHECK(lw.done_blocks == 2);
    CHECK(lw.bytes == 2 * bb);
    CHECK(Holds(e.Block(0, 22), bb, 1, 0, 6));
    CHECK(Holds(e.Block(0, 23), bb, 1, 0, 7));
    for (uint32_t id = 16; id < 22; ++id) CHECK(IsSentinel(e.Block(0, id), bb));
  }
  SECTION("a first block at or past the prefix end is refused, naming the values") {
    // count = first_block + ids = 9 > the handle's 8 blocks.
    auto past = e.client->Load(handle, Ids{20}, false, 8);
    REQUIRE(past.ok());
    auto refused = e.client->Wait(*past, 10s);
    REQUIRE(refused.ok());
    CHECK(refused->status.code() == StatusCode::kOutOfRange);
    CHECK_THAT(refused->status.message(), Catch::Contains("count 9 exceeds the 8 blocks"));
    CHECK(e.client->Load(handle, Ids{}, false, 3).status().code() == StatusCode::kInvalidArgument);
  }
  REQUIRE(e.Wait(e.client->Release(handle)).status.ok());
}

TEST_CASE("partial load: a gpt-oss-like load from block k moves FULL blocks k to e and the window blocks past k only",
          "[integration][hybrid]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  Engine e(d, GptOssLike(), "gpt-oss");
  REQUIRE(e.geometry.window_blocks(1) == 3);
  const uint64_t full_bb = e.block_bytes[0], window_bb = e.block_bytes[1];
  const std::vector<BlockKey> keys = Keys(e.geometry, "gpt-oss", 8, 2);
  Ids full, window;
  for (uint32_t j = 0; j < 8; ++j) {
    Fill(e.Block(0, j), full_bb, 2, 0, j);
    Fill(e.Block(1, j), window_bb, 2, 1, j);
    full.push_back(j);
    if (j >= 5) window.push_back(j);  // the trailing window: blocks 5..7
  }
  e.Wait(e.client->Store(flexkv::BlockKeyChain(keys), Spans{full, window}, {}));
  auto [handle, end] = e.Pin(keys);
  REQUIRE(end == 8);

  struct Case {
    uint32_t k;
    uint32_t window_from;  // max(k, e - w)
  };
  // k = 4: FULL [4, 8), the whole window [5, 8). k = 6: FULL [6, 8), the window [6, 8). Engine blocks 16 + j.
  const Case c = GENERATE(Case{4, 5}, Case{6, 6});
  CAPTURE(c.k);
  Ids full_dst, window_dst;
  for (uint32_t j = c.k; j < 8; ++j) full_dst.push_back(16 + j);
  for (uint32_t j = c.window_from; j < 8; ++j) window_dst.push_back(16 + j);
  const auto before = e.Counters();
  const flexkv::OpResult r = e.Wait(e.client->Load(handle, Spans{full_dst, window_dst}, c.k));
  const uint64_t moved = full_dst.size() * full_bb + window_dst.size() * window_bb;
  CHECK(r.done_blocks == 8 - c.k);
  CHECK(r.bytes == moved);
  const auto after = e.Counters();
  CHECK(after.at("load_blocks") - before.at("load_blocks") == 8 - c.k);
  CHECK(after.at("bytes_loaded") - before.at("bytes_loaded") == moved);
  for (uint32_t j = 0; j < 8; ++j) {
    CAPTURE(j);
    CHECK((j >= c.k ? Holds(e.Block(0, 16 + j), full_bb, 2, 0, j) : IsSentinel(e.Block(0, 16 + j), full_bb)));
    CHECK((j >= c.window_from ? Holds(e.Block(1, 16 + j), window_bb, 2, 1, j)
                              : IsSentinel(e.Block(1, 16 + j), window_bb)));
  }
  // The FULL ids say where the load ends: the whole prefix's ids from k name an end past the match, refused.
  auto whole = e.client->Load(handle, Spans{full, window}, c.k);
  REQUIRE(whole.ok());
  auto refused = e.client->Wait(*whole, 10s);
  REQUIRE(refused.ok());
  CHECK(refused->status.code() == StatusCode::kOutOfRange);
  CHECK_THAT(refused->status.message(), Catch::Contains("exceeds the 8 blocks"));
  REQUIRE(e.Wait(e.client->Release(handle)).status.ok());
}

TEST_CASE("partial load: a Qwen3-Next-like load from block k moves FULL blocks k to e and the state at e",
          "[integration][hybrid]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  Engine e(d, Qwen3NextLike(), "qwen3-next");
  const uint64_t full_bb = e.block_bytes[0], state_bb = e.block_bytes[1];
  REQUIRE(state_bb == 3 * 1024);
  const std::vector<BlockKey> keys = Keys(e.geometry, "qwen3-next", 8, 3);
  Ids full;
  for (uint32_t j = 0; j < 8; ++j) {
    Fill(e.Block(0, j), full_bb, 3, 0, j);
    full.push_back(j);
  }
  // Snapshots at 4 and 8 in engine state slots 0 and 1.
  Fill(e.Block(1, 0), state_bb, 3, 1, 4);
  Fill(e.Block(1, 1), state_bb, 3, 1, 8);
  e.Wait(e.client->Store(flexkv::BlockKeyChain(keys), Spans{full, Ids{0, 1}}, Ids{4, 8}));
  auto [handle, end] = e.Pin(keys);
  REQUIRE(end == 8);

  const auto before = e.Counters();
  const flexkv::OpResult r = e.Wait(e.client->Load(handle, Spans{Ids{21, 22, 23}, Ids{10}}, /*first_block=*/5));
  CHECK(r.done_blocks == 3);
  CHECK(r.bytes == 3 * full_bb + state_bb);
  CHECK(e.Counters().at("bytes_loaded") - before.at("bytes_loaded") == 3 * full_bb + state_bb);
  for (uint32_t j = 0; j < 8; ++j) {
    CAPTURE(j);
    CHECK((j >= 5 ? Holds(e.Block(0, 16 + j), full_bb, 3, 0, j) : IsSentinel(e.Block(0, 16 + j), full_bb)));
  }
  CHECK(Holds(e.Block(1, 10), state_bb, 3, 1, 8));
  for (uint32_t slot = 2; slot < kEngineBlocks; ++slot) {
    if (slot != 10) CHECK(IsSentinel(e.Block(1, slot), state_bb));
  }
  // From the prefix end itself only the state moves.
  const flexkv::OpResult state_only = e.Wait(e.client->Load(handle, Spans{Ids{}, Ids{11}}, 8));
  CHECK(state_only.done_blocks == 0);
  CHECK(state_only.bytes == state_bb);
  CHECK(Holds(e.Block(1, 11), state_bb, 3, 1, 8));
  REQUIRE(e.Wait(e.client->Release(handle)).status.ok());
}

TEST_CASE("window stores: a store with every window block makes a prefix end inside it a hit, byte-exact",
          "[integration][hybrid]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  Engine e(d, GptOssLike(), "gpt-oss");
  const uint64_t full_bb = e.block_bytes[0], window_bb = e.block_bytes[1];
  // Two prompts of 8 blocks; a later prompt shares the first 5 blocks of each, then differs.
  for (uint32_t prompt : {1u, 2u}) {
    const std::vector<BlockKey> keys = Keys(e.geometry, "gpt-oss", 8, static_cast<int32_t>(prompt));
    Ids full, window;
    for (uint32_t j = 0; j < 8; ++j) {
      Fill(e.Block(0, j), full_bb, prompt, 0, j);
      Fill(e.Block(1, j), window_bb, prompt, 1, j);
      full.push_back(j);
    }
    // Prompt 1 as before (the trailing window, blocks 5..7); prompt 2 with every window block the engine has.
    const uint32_t window_keys = prompt == 1 ? 0 : 8;
    for (uint32_t j = prompt == 1 ? 5 : 0; j < 8; ++j) window.push_back(j);
    e.Wait(e.client->Store(flexkv::BlockKeyChain(keys), Spans{full, window}, {}, window_keys));
  }
  const std::vector<BlockKey> shares_1 = Keys(e.geometry, "gpt-oss", 8, 7, 5, 1);
  const std::vector<BlockKey> shares_2 = Keys(e.geometry, "gpt-oss", 8, 7, 5, 2);
  CHECK(e.Pin(shares_1).second == 0);  // its window [2, 5) was never stored
  auto [handle, end] = e.Pin(shares_2);
  REQUIRE(end == 5);
  e.Wait(e.client->Load(handle, Spans{Ids{20, 21, 22, 23, 24}, Ids{22, 23, 24}}));
  for (uint32_t j = 0; j < 5; ++j) CHECK(Holds(e.Block(0, 20 + j), full_bb, 2, 0, j));
  for (uint32_t j = 2; j < 5; ++j) CHECK(Holds(e.Block(1, 20 + j), window_bb, 2, 1, j));
  CHECK(IsSentinel(e.Block(1, 21), window_bb));
  REQUIRE(e.Wait(e.client->Release(handle)).status.ok());

  SECTION("window_keys below the widest window or above the keys is refused before anything is sent") {
    const std::vector<BlockKey> keys = Keys(e.geometry, "gpt-oss", 8, 9);
    const Ids full{0, 1, 2, 3, 4, 5, 6, 7}, two{6, 7};
    auto narrow = e.client->Store(flexkv::BlockKeyChain(keys), Spans{full, two}, {}, 2);
    CHECK(narrow.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(narrow.status().message(), Catch::Contains("window_keys 2 for a store of 8 keys"));
    auto mismatched = e.client->Store(flexkv::BlockKeyChain(keys), Spans{full, two}, {}, 4);
    CHECK_THAT(mismatched.status().message(), Catch::Contains("component 1 (sliding_window) has 2 block ids; expected 4"));
  }
}

TEST_CASE("window stores: with a state, a boundary inside the store becomes a hit once its window is stored too",
          "[integration][hybrid]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  Engine e(d, WindowAndState(), "gpt-oss-state");
  REQUIRE(e.geometry.window_blocks(1) == 2);
  const uint64_t full_bb = e.block_bytes[0], window_bb = e.block_bytes[1], state_bb = e.block_bytes[2];
  for (uint32_t prompt : {1u, 2u}) {
    const std::vector<BlockKey> keys = Keys(e.geometry, "gpt-oss-state", 8, static_cast<int32_t>(prompt));
    Ids full, window;
    for (uint32_t j = 0; j < 8; ++j) {
      Fill(e.Block(0, j), full_bb, prompt, 0, j);
      Fill(e.Block(1, j), window_bb, prompt, 1, j);
      full.push_back(j);
    }
    Fill(e.Block(2, 0), state_bb, prompt, 2, 5);
    Fill(e.Block(2, 1), state_bb, prompt, 2, 8);
    // Both stores carry the states at 5 and 8; prompt 1 only the trailing window (6, 7), prompt 2 blocks 3..7.
    const uint32_t window_keys = prompt == 1 ? 0 : 5;
    for (uint32_t j = prompt == 1 ? 6 : 3; j < 8; ++j) window.push_back(j);
    e.Wait(e.client->Store(flexkv::BlockKeyChain(keys), Spans{full, window, Ids{0, 1}}, Ids{5, 8}, window_keys));
  }
  CHECK(e.Pin(Keys(e.geometry, "gpt-oss-state", 8, 7, 5, 1)).second == 0);
  auto [handle, end] = e.Pin(Keys(e.geometry, "gpt-oss-state", 8, 7, 5, 2));
  REQUIRE(end == 5);
  // The engine holds blocks 0..3: it loads block 4, the window past it (block 4 of [3, 5)) and the state at 5.
  const flexkv::OpResult r = e.Wait(e.client->Load(handle, Spans{Ids{24}, Ids{24}, Ids{9}}, /*first_block=*/4));
  CHECK(r.bytes == full_bb + window_bb + state_bb);
  CHECK(Holds(e.Block(0, 24), full_bb, 2, 0, 4));
  CHECK(Holds(e.Block(1, 24), window_bb, 2, 1, 4));
  CHECK(Holds(e.Block(2, 9), state_bb, 2, 2, 5));
  CHECK(IsSentinel(e.Block(0, 23), full_bb));
  CHECK(IsSentinel(e.Block(1, 23), window_bb));
  // From block 0 the whole window [3, 5) is there, byte-exact.
  e.Wait(e.client->Load(handle, Spans{Ids{10, 11, 12, 13, 14}, Ids{13, 14}, Ids{8}}));
  CHECK(Holds(e.Block(1, 13), window_bb, 2, 1, 3));
  CHECK(Holds(e.Block(1, 14), window_bb, 2, 1, 4));
  REQUIRE(e.Wait(e.client->Release(handle)).status.ok());
}
