// LayoutIds and ComponentIdCount (common/hybrid_ids.h): where a hybrid Load's and Store's ids sit, for a Load from
// a block past the engine's own prefix and a Store that carries more window blocks than its trailing window.
#include "common/hybrid_ids.h"

#include <catch2/catch.hpp>

#include <vector>

using flexkv::Geometry;
using flexkv::IdExtent;

namespace {

// FULL, a 48-token window (3 blocks at 16 tokens) and a state.
Geometry ThreeKinds() {
  Geometry g = flexkv::GptOss20B();
  g.components[0].window_tokens = 48;
  g.components.push_back(flexkv::JambaLike().components[0]);
  return g;
}

IdExtent LoadFrom(uint32_t k) {
  IdExtent e;
  e.first_block = k;
  return e;
}

IdExtent StoreOf(uint32_t state_count, uint32_t window_keys) {
  IdExtent e;
  e.state_count = state_count;
  e.window_keys = window_keys;
  return e;
}

}  // namespace

TEST_CASE("a hybrid load from block k carries FULL blocks k to e, the window past k and the state", "[unit]") {
  const Geometry g = ThreeKinds();
  REQUIRE(g.window_blocks(1) == 3);
  // e = 10: from 0 as before, then the FULL ids shrink, and the window's only once k is inside it.
  struct Case {
    uint32_t k;
    uint64_t full, window;
  };
  for (const Case& c : {Case{0, 10, 3}, Case{4, 6, 3}, Case{7, 3, 3}, Case{8, 2, 2}, Case{9, 1, 1}, Case{10, 0, 0}}) {
    CAPTURE(c.k);
    CHECK(flexkv::ComponentIdCount(g, 0, false, 10, LoadFrom(c.k)) == c.full);
    CHECK(flexkv::ComponentIdCount(g, 1, false, 10, LoadFrom(c.k)) == c.window);
    CHECK(flexkv::ComponentIdCount(g, 2, false, 10, LoadFrom(c.k)) == 1);
    const flexkv::HybridIdLayout l = flexkv::LayoutIds(g, false, 10, LoadFrom(c.k));
    CHECK(l.offset == std::vector<uint64_t>{0, c.full, c.full + c.window});
    CHECK(l.total == c.full + c.window + 1);
  }
  // The default extent is a load from block 0: the layout-4 request.
  CHECK(flexkv::LayoutIds(g, false, 10).total == flexkv::LayoutIds(g, false, 10, LoadFrom(0)).total);
}

TEST_CASE("a hybrid store with window_keys carries that many window ids, 0 keeping the trailing window", "[unit]") {
  const Geometry g = ThreeKinds();
  CHECK(flexkv::ComponentIdCount(g, 1, true, 8, StoreOf(2, 0)) == 3);
  CHECK(flexkv::ComponentIdCount(g, 1, true, 2, StoreOf(0, 0)) == 2);
  CHECK(flexkv::ComponentIdCount(g, 1, true, 8, StoreOf(2, 8)) == 8);
  CHECK(flexkv::ComponentIdCount(g, 0, true, 8, StoreOf(2, 8)) == 8);
  CHECK(flexkv::ComponentIdCount(g, 2, true, 8, StoreOf(2, 8)) == 2);
  // FULL 8, window 5, then the 2 boundaries, then the 2 state ids.
  const flexkv::HybridIdLayout l = flexkv::LayoutIds(g, true, 8, StoreOf(2, 5));
  CHECK(l.offset == std::vector<uint64_t>{0, 8, 15});
  CHECK(l.boundaries_offset == 13);
  CHECK(l.total == 17);
}

TEST_CASE("the least window_keys is the widest window's, clamped to the keys, and 0 without a window", "[unit]") {
  Geometry g = ThreeKinds();
  CHECK(flexkv::MinWindowKeys(g, 8) == 3);
  CHECK(flexkv::MinWindowKeys(g, 2) == 2);
  flexkv::ComponentSpec wide = g.components[0];
  wide.window_tokens = 80;  // 5 blocks
  g.components.push_back(wide);
  CHECK(flexkv::MinWindowKeys(g, 8) == 5);
  CHECK(flexkv::MinWindowKeys(flexkv::Qwen3Next80B(), 8) == 0);
}
