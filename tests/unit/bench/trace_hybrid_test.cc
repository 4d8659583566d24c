// flexkv-bench trace, hybrid geometries: the hit rule, the component sub-pool's eviction order and the simulated
// hybrid pool (tests/bench/trace_bench.h).
#include <catch2/catch.hpp>
#include <vector>

#include "flexkv/block_key.h"
#include "tests/bench/trace_bench.h"

namespace {

using flexkv::BlockKey;
using flexkv::ComponentKind;
using flexkv::bench::ComponentLru;
using flexkv::bench::HybridPoolSim;
using flexkv::bench::SimComponent;

std::vector<BlockKey> Keys(const std::vector<uint64_t>& ids) {
  std::vector<int32_t> tokens;
  for (uint64_t id : ids) flexkv::bench::AppendBlockTokens(id, 4, &tokens);
  return flexkv::ComputeBlockKeys("ns", tokens, 4);
}

std::vector<uint64_t> Range(uint64_t first, uint64_t n) {
  std::vector<uint64_t> ids;
  for (uint64_t i = 0; i < n; ++i) ids.push_back(first + i);
  return ids;
}

}  // namespace

TEST_CASE("hybrid hit rule takes the longest end whose window and state are held", "[unit][bench]") {
  const std::vector<SimComponent> comps = {
      {ComponentKind::kFull, 0, 100}, {ComponentKind::kSlidingWindow, 2, 100}, {ComponentKind::kState, 0, 100}};
  // Window entries for every block but 3; states at the ends 2, 5 and 6 (the entries of blocks 1, 4 and 5).
  auto has = [](size_t c, size_t j) { return c == 1 ? j != 3 : (j == 1 || j == 4 || j == 5); };
  CHECK(flexkv::bench::HybridHitEnd(6, comps, has) == 6);
  // Window partly evicted: 5 and 4 lack block 3 in their window, 3 has no state; 2 has both.
  CHECK(flexkv::bench::HybridHitEnd(5, comps, has) == 2);
  CHECK(flexkv::bench::HybridHitEnd(0, comps, has) == 0);
  // A window larger than the prefix is clamped at 0: the end 1 needs block 0 only.
  auto first_only = [](size_t, size_t j) { return j == 0; };
  CHECK(flexkv::bench::HybridHitEnd(4, comps, first_only) == 1);
  // The state missing at the longest end, present at a shorter one.
  auto state_at_3 = [](size_t c, size_t j) { return c == 1 || j == 2; };
  CHECK(flexkv::bench::HybridHitEnd(8, comps, state_at_3) == 3);
}

TEST_CASE("component sub-pool evicts unanchored entries first, never the store's own, all or none", "[unit][bench]") {
  const auto k = Keys(Range(10, 5));
  ComponentLru lru(3);
  CHECK(lru.Insert(std::span(k).first(3)) == 3u);
  lru.Touch(k[0]);  // least recently used first: 1, 2, 0
  lru.Unanchor(k[2]);
  CHECK(lru.unanchored() == 1);
  const std::vector<BlockKey> one = {k[3]};
  CHECK(lru.Insert(one) == 1u);  // evicts 2 (unanchored) before 1 (least recently used)
  CHECK_FALSE(lru.Has(k[2]));
  CHECK(lru.Has(k[1]));
  CHECK(lru.unanchored_evictions() == 1);
  // Held: 1, 0, 3. Two new keys (4, 2) but only 1 is evictable (0 and 3 are this store's own): nothing changes.
  const std::vector<BlockKey> too_many = {k[3], k[4], k[2], k[0]};
  CHECK_FALSE(lru.CanInsert(too_many));
  CHECK(lru.Insert(too_many) == std::nullopt);
  CHECK(lru.size() == 3);
  CHECK(lru.Has(k[1]));
  CHECK(lru.evictions() == 1);
  // Two new keys, two evictable entries (1, then 0): both go, least recently used first.
  const std::vector<BlockKey> fits = {k[3], k[4], k[2]};
  CHECK(lru.Insert(fits) == 2u);
  CHECK_FALSE(lru.Has(k[1]));
  CHECK_FALSE(lru.Has(k[0]));
  CHECK(lru.Has(k[3]));
  // Least recently used first: 3, 4, 2. A store that finds its key cached marks it used, as the daemon's does.
  const std::vector<BlockKey> again = {k[3]};
  CHECK(lru.Insert(again) == 0u);
  const std::vector<BlockKey> next = {k[0]};
  CHECK(lru.Insert(next) == 1u);  // evicts 4, not 3
  CHECK_FALSE(lru.Has(k[4]));
  CHECK(lru.Has(k[3]));
  // Anchoring again moves an entry back behind the unanchored ones.
  lru.Unanchor(k[3]);
  lru.Anchor(k[3]);
  CHECK(lru.unanchored() == 0);
}

TEST_CASE("a window stored only at a request's end serves no shorter shared prefix, chunk-boundary stores do",
          "[unit][bench]") {
  const std::vector<SimComponent> comps = {{ComponentKind::kFull, 0, 100}, {ComponentKind::kSlidingWindow, 2, 100}};
  const auto a = Keys(Range(0, 6));
  const auto b = Keys({0, 1, 2, 3, 50, 51});  // shares a's first 4 blocks
  HybridPoolSim end_only(comps);
  auto ra = end_only.Replay(a, 0);
  CHECK(ra.hit_end == 0);
  CHECK(ra.stored == std::vector<uint64_t>{6, 2});
  CHECK(ra.stores == 1);
  auto rb = end_only.Replay(b, 0);
  CHECK(rb.full_prefix == 4);
  CHECK(rb.hit_end == 0);  // the window at 4 (blocks 2, 3) was never stored

  HybridPoolSim chunked(comps);
  ra = chunked.Replay(a, 2);  // stores at 2, 4 and 6: every block's window entry
  CHECK(ra.stored == std::vector<uint64_t>{6, 6});
  CHECK(ra.stores == 3);
  rb = chunked.Replay(b, 2);
  CHECK(rb.hit_end == 4);
  CHECK(rb.loaded == std::vector<uint64_t>{4, 2});
  CHECK(rb.stores == 1);  // 4 + 2 = 6 = n
  CHECK(rb.stored == std::vector<uint64_t>{2, 2});
  CHECK(chunked.Replay(a, 2).hit_end == 6);  // a full hit stores nothing
}

TEST_CASE("a store with every window block computed since the last store serves a shared prefix inside a chunk",
          "[unit][bench]") {
  const std::vector<SimComponent> comps = {{ComponentKind::kFull, 0, 100}, {ComponentKind::kSlidingWindow, 2, 100}};
  const auto a = Keys(Range(0, 8));
  const auto b = Keys({0, 1, 2, 90, 91});  // shares a's first 3 blocks: an end inside a's first chunk of 4
  HybridPoolSim trailing(comps);
  CHECK(trailing.Replay(a, 4).stored == std::vector<uint64_t>{8, 4});  // windows at 4 (2, 3) and 8 (6, 7)
  CHECK(trailing.Replay(b, 4).hit_end == 0);
  HybridPoolSim every(comps);
  CHECK(every.Replay(a, 4, /*every_window=*/true).stored == std::vector<uint64_t>{8, 8});  // [0, 4), then [4, 8)
  auto rb = every.Replay(b, 4, true);
  CHECK(rb.hit_end == 3);
  CHECK(rb.loaded == std::vector<uint64_t>{3, 2});
}

TEST_CASE("state snapshots serve exactly the boundaries they were taken at", "[unit][bench]") {
  HybridPoolSim sim({{ComponentKind::kFull, 0, 100}, {ComponentKind::kState, 0, 100}});
  auto r = sim.Replay(Keys(Range(0, 8)), 3);  // boundaries 3, 6, 8
  CHECK(r.stored == std::vector<uint64_t>{8, 3});
  r = sim.Replay(Keys({0, 1, 2, 3, 4, 5, 6, 90}), 3);
  CHECK(r.full_prefix == 7);
  CHECK(r.hit_end == 6);  // no snapshot at 7
  CHECK(r.loaded == std::vector<uint64_t>{6, 1});
  CHECK(sim.UsableEndsHeld() == 4);  // 3, 6 and 8 of the first request, 8 of the second
}

TEST_CASE("an evicted FULL block unanchors its window entry and a store of it anchors it again", "[unit][bench]") {
  HybridPoolSim sim({{ComponentKind::kFull, 0, 2}, {ComponentKind::kSlidingWindow, 1, 10}});
  const auto a = Keys(Range(0, 2));
  sim.Replay(a, 0);
  CHECK(sim.unanchored(1) == 0);
  CHECK(sim.UsableEndsHeld() == 1);  // the end 2 (window: block 1); the end 1 lacks its window (block 0)
  sim.Replay(Keys(Range(10, 2)), 0);  // evicts a's FULL blocks
  CHECK(sim.held(0) == 2);
  CHECK(sim.held(1) == 2);
  CHECK(sim.unanchored(1) == 1);
  CHECK(sim.UsableEnd(a) == 0);
  auto r = sim.Replay(a, 0);  // FULL again; its window entry was still held
  CHECK(r.stored == std::vector<uint64_t>{2, 0});
  CHECK(sim.unanchored(1) == 1);  // now the second request's
  CHECK(sim.UsableEnd(a) == 2);
}

TEST_CASE("a store that a sub-pool cannot take stores nothing in any component", "[unit][bench]") {
  HybridPoolSim sim({{ComponentKind::kFull, 0, 100}, {ComponentKind::kSlidingWindow, 2, 1}});
  auto r = sim.Replay(Keys(Range(0, 4)), 0);
  CHECK(r.refused_stores == 1);
  CHECK(r.stored == std::vector<uint64_t>{0, 0});
  CHECK(sim.held(0) == 0);
  r = sim.Replay(Keys({7}), 0);  // a one-block prompt needs one window entry
  CHECK(r.refused_stores == 0);
  CHECK(r.stored == std::vector<uint64_t>{1, 1});
}

TEST_CASE("a one-component pool large enough reaches the infinite-cache bound", "[unit][bench]") {
  std::vector<flexkv::bench::TraceRequest> trace(3);
  trace[0].hash_ids = {0, 1, 2};
  trace[1].hash_ids = {0, 1, 3};
  trace[2].hash_ids = {0, 1, 2, 5};
  HybridPoolSim sim({{ComponentKind::kFull, 0, 100}});
  uint64_t hits = 0;
  for (const auto& t : trace) hits += sim.Replay(Keys(t.hash_ids), 0).hit_end;
  CHECK(hits == flexkv::bench::InfiniteCacheBound(trace).hits);
  CHECK(hits == 5);
  CHECK(sim.UsableEndsHeld() == sim.held(0));
}

TEST_CASE("the all-FULL reference counts every layer", "[unit][bench]") {
  auto gpt = flexkv::bench::AllFullReference(flexkv::GptOss20B());
  REQUIRE(gpt.ok());
  CHECK(gpt->num_layers == 24);
  CHECK_FALSE(gpt->is_hybrid());
  CHECK(gpt->host_block_bytes() == 2 * flexkv::GptOss20B().host_block_bytes());
  auto qwen = flexkv::bench::AllFullReference(flexkv::Qwen3Next80B());
  REQUIRE(qwen.ok());
  CHECK(qwen->num_layers == 48);  // 36 Gated-DeltaNet layers counted as attention layers of the same shape
  CHECK(qwen->head_dim == 256);
  flexkv::Geometry odd = flexkv::GptOss20B();
  odd.components[0].head_dim = 128;
  CHECK(flexkv::bench::AllFullReference(odd).status().code() == flexkv::StatusCode::kInvalidArgument);
}

TEST_CASE("scaled trace geometries keep every slot's ratio and stay valid", "[unit][bench]") {
  for (const char* name : {"llama3-8b", "gpt-oss-20b", "gemma3-27b", "qwen3-next", "jamba", "deepseek-mla"}) {
    auto g = flexkv::bench::TracePreset(name, 512);
    REQUIRE(g.ok());
    const uint64_t scale = flexkv::bench::TraceScale(*g, 4096);
    CHECK(scale >= 64);
    const flexkv::Geometry small = flexkv::bench::ScaledGeometry(*g, scale);
    INFO(name << " scale " << scale << " " << small.ToString());
    REQUIRE(small.Validate().ok());
    for (size_t c = 0; c < g->component_count(); ++c) {
      CHECK(small.Component(c).host_block_bytes() * scale == g->Component(c).host_block_bytes());
      CHECK(small.window_blocks(c) == g->window_blocks(c));
    }
  }
  CHECK(flexkv::bench::TraceScale(*flexkv::bench::TracePreset("qwen3-next", 512), 4096) == 1024);  // the state: 2^14 x 131
  CHECK_FALSE(flexkv::bench::TracePreset("gpt-oss", 512).ok());
}

TEST_CASE("trace --split weights: one positive number per component", "[unit][bench]") {
  CHECK(flexkv::bench::ParseSplitWeights("3,1", 2).value() == std::vector<double>{3, 1});
  CHECK(flexkv::bench::ParseSplitWeights("0.5,0.25,0.25", 3).ok());
  for (const char* bad : {"1", "1,x", "1,0", "1,-2", "1,,2", "", "1,2,"}) {
    INFO(bad);
    CHECK(flexkv::bench::ParseSplitWeights(bad, 2).status().code() == flexkv::StatusCode::kInvalidArgument);
  }
}

TEST_CASE("trace --window-churn repeats the trace with new ids each pass, keeping its sharing", "[unit][bench]") {
  std::vector<flexkv::bench::TraceRequest> trace(2);
  trace[0] = {10, {1, 2, 3}};
  trace[1] = {20, {1, 2, 7}};
  auto repeated = flexkv::bench::RepeatTrace(trace, 3);
  REQUIRE(repeated.ok());
  REQUIRE(repeated->size() == 6);
  CHECK((*repeated)[2].hash_ids == std::vector<uint64_t>{65537, 65538, 65539});
  CHECK((*repeated)[5].hash_ids == std::vector<uint64_t>{131073, 131074, 131079});
  CHECK((*repeated)[3].timestamp_ms > (*repeated)[1].timestamp_ms);  // pass after pass
  CHECK(flexkv::bench::InfiniteCacheBound(*repeated).hits == 3 * flexkv::bench::InfiniteCacheBound(trace).hits);
  trace[1].hash_ids.push_back(65536);  // a copy would share it
  CHECK(flexkv::bench::RepeatTrace(trace, 2).status().code() == flexkv::StatusCode::kInvalidArgument);
  CHECK(flexkv::bench::RepeatTrace(trace, 0).status().code() == flexkv::StatusCode::kInvalidArgument);
}
