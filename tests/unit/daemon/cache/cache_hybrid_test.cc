// Cache with a hybrid geometry (docs/hybrid.md): sub-pools per component, the hit rule over FULL blocks, sliding
// windows and states, all-or-none stores, and a restart that restores every component (or drops what is torn).
#include <catch2/catch.hpp>

#include <span>
#include <vector>

#include "common/block_checksum.h"
#include "common/hybrid_ids.h"
#include "daemon/cache/block_verifier.h"
#include "daemon/cache/cache.h"
#include "flexkv/block_key.h"
#include "tests/unit/daemon/cache/temp_cache.h"

using flexkv::BlockKey;
using flexkv::Cache;
using flexkv::ComponentIndex;
using flexkv::ComponentKind;
using flexkv::SlotId;
using flexkv::StatusCode;
using flexkv::testing::TempCache;
using flexkv::testing::TinyHybrid;

namespace {


// Tiny blocks make the default split (4096 tokens of FULL blocks per window and state) leave the window and state
// sub-pools less than a slot at these budgets: the tests set the shares.
const flexkv::PoolSplit kSplit{0.1, 0.05};

std::vector<BlockKey> Keys(uint64_t chain, size_t n) {
  std::vector<BlockKey> keys(n);
  for (size_t i = 0; i < n; ++i) keys[i] = BlockKey{chain * 1000 + i + 1, chain};
  return keys;
}

uint64_t SlotBytes(const Cache& cache, SlotId slot) {
  const std::vector<SlotId> bases = cache.component_bases();
  size_t c = bases.size() - 1;
  while (c > 0 && slot < bases[c]) --c;
  return cache.pool_region(c)->slot_bytes;
}

uint64_t Fill(Cache& cache, SlotId slot, uint8_t seed) {
  uint8_t* bytes = cache.SlotData(slot);
  const uint64_t n = SlotBytes(cache, slot);
  for (uint64_t i = 0; i < n; ++i) bytes[i] = static_cast<uint8_t>(i * 7 + seed + slot);
  return flexkv::BlockChecksum(bytes, n);
}

// A hybrid store as the request handlers run it: reserve, fill every reserved slot, commit. Returns the shortfall.
StatusCode Store(Cache& cache, std::span<const BlockKey> keys, std::vector<uint32_t> boundaries,
                 const BlockKey& parent = flexkv::kRootParent, uint32_t window_keys = 0) {
  Cache::HybridReservation r = cache.ReserveHybrid(parent, keys, boundaries, window_keys);
  if (r.shortfall != StatusCode::kOk) return r.shortfall;
  std::vector<std::vector<uint64_t>> sums(r.slots.size());
  for (SlotId s : r.full.slots) sums[0].push_back(Fill(cache, s, 1));
  for (size_t c = 1; c < r.slots.size(); ++c) {
    for (SlotId s : r.slots[c]) {
      if (s != ComponentIndex::kNoSlot) sums[c].push_back(Fill(cache, s, static_cast<uint8_t>(c)));
    }
  }
  cache.CommitHybrid(parent, keys, r, sums);
  return StatusCode::kOk;
}

}  // namespace

TEST_CASE("hybrid cache: a store with window_keys makes each boundary inside it whose window it holds a hit",
          "[unit][cache][hybrid]") {
  TempCache t(64 * 1024, kSplit);
  REQUIRE(t.cache().RecoverPool(false).ok());
  REQUIRE(t.cache().Admit("ns", TinyHybrid()).ok());
  const std::vector<BlockKey> keys = Keys(2, 6);
  // Windows of the last 4 keys (blocks 2..5) and states at 3 and 6: the end 3 lacks block 1 of its window [1, 3).
  // The same store with every key's window block adds blocks 0 and 1, and the end 3 becomes a hit.
  REQUIRE(Store(t.cache(), keys, {3, 6}, flexkv::kRootParent, 4) == StatusCode::kOk);
  CHECK(t.cache().Match(std::span(keys).first(3), false, nullptr) == 0);
  CHECK(t.cache().GetStats().components[1].used == 4);
  REQUIRE(Store(t.cache(), keys, {3, 6}, flexkv::kRootParent, 6) == StatusCode::kOk);  // adds blocks 0, 1
  CHECK(t.cache().GetStats().components[1].used == 6);
  CHECK(t.cache().Match(std::span(keys).first(3), false, nullptr) == 3);
  std::vector<SlotId> pinned;
  CHECK(t.cache().Match(std::span(keys).first(4), true, &pinned) == 3);  // no state at 4
  CHECK(pinned.size() == 3 + 2 + 1);  // FULL [0, 3), the window [1, 3), the state at 3
  t.cache().Unpin(pinned);
}

TEST_CASE("hybrid cache: a hit needs the FULL prefix, its trailing window and its state", "[unit][cache][hybrid]") {
  TempCache t(64 * 1024, kSplit);
  REQUIRE(t.cache().RecoverPool(false).ok());
  REQUIRE(t.cache().Admit("ns", TinyHybrid()).ok());
  REQUIRE(t.cache().component_bases().size() == 3);
  CHECK(t.cache().pool_region(1)->slot_bytes == 128);
  CHECK(t.cache().pool_region(2)->slot_bytes == 64);

  const std::vector<BlockKey> keys = Keys(1, 6);
  REQUIRE(Store(t.cache(), keys, {3, 6}) == StatusCode::kOk);
  CHECK(t.cache().Match(keys, false, nullptr) == 6);
  // The window was stored right-aligned (blocks 4 and 5): the state at 3 has no window, so a 5-block prompt has no
  // usable end although its FULL blocks and the state at 3 are cached.
  CHECK(t.cache().Match(std::span(keys).first(5), false, nullptr) == 0);
  CHECK(t.cache().Match(std::span(keys).first(3), false, nullptr) == 0);
  // A longer prompt hits at 6.
  std::vector<BlockKey> longer = keys;
  longer.push_back(BlockKey{999, 999});
  CHECK(t.cache().Match(longer, false, nullptr) == 6);

  // A pinned match pins exactly FULL[0,6), the window [4,6) and the state at 6, in a Load's id order.
  std::vector<SlotId> pinned;
  REQUIRE(t.cache().Match(keys, true, &pinned) == 6);
  const flexkv::HybridIdLayout layout = flexkv::LayoutIds(TinyHybrid(), false, 6);
  REQUIRE(pinned.size() == layout.total);
  REQUIRE(layout.total == 6 + 2 + 1);
  const std::vector<SlotId> bases = t.cache().component_bases();
  for (size_t i = 0; i < 6; ++i) CHECK(pinned[layout.offset[0] + i] < bases[1]);
  for (size_t i = 0; i < 2; ++i) CHECK((pinned[layout.offset[1] + i] >= bases[1] && pinned[layout.offset[1] + i] < bases[2]));
  CHECK(pinned[layout.offset[2]] >= bases[2]);
  CHECK(t.cache().GetStats().pinned == 9);
  t.cache().Unpin(pinned);
  CHECK(t.cache().GetStats().pinned == 0);
}

TEST_CASE("hybrid cache: a continuation store adds a later end, and the state alone makes a shorter end usable",
          "[unit][cache][hybrid]") {
  TempCache t(64 * 1024, kSplit);
  REQUIRE(t.cache().RecoverPool(false).ok());
  REQUIRE(t.cache().Admit("ns", TinyHybrid()).ok());
  const std::vector<BlockKey> keys = Keys(2, 8);
  // First a chunk of 4 (window [2,4), state at 4), then the rest under keys[3] (window [6,8), state at 8).
  REQUIRE(Store(t.cache(), std::span(keys).first(4), {4}) == StatusCode::kOk);
  REQUIRE(Store(t.cache(), std::span(keys).subspan(4), {4}, keys[3]) == StatusCode::kOk);
  CHECK(t.cache().Match(keys, false, nullptr) == 8);
  // A prompt that diverges after block 5 falls back to the chunk boundary at 4: FULL[0,4), window [2,4), state at 4.
  std::vector<BlockKey> diverging(keys.begin(), keys.begin() + 6);
  diverging.push_back(BlockKey{4242, 1});
  CHECK(t.cache().Match(diverging, false, nullptr) == 4);
}

TEST_CASE("hybrid cache: a store is all or none - a full sub-pool refuses it and leaves every index as it was",
          "[unit][cache][hybrid]") {
  // 20 KiB, 30 % of it for windows and 0.95 % for states: 3 state slots, plenty of FULL and window slots.
  TempCache t(20 * 1024, flexkv::PoolSplit{0.3, 0.0095});
  REQUIRE(t.cache().RecoverPool(false).ok());
  REQUIRE(t.cache().Admit("ns", TinyHybrid()).ok());
  const uint32_t state_slots = t.cache().pool_region(2)->slots;
  REQUIRE(state_slots == 3);
  REQUIRE(t.cache().pool_region(1)->slots == 48);
  // Fill and pin every state slot with ends of single-block prompts.
  std::vector<SlotId> pins;
  for (uint32_t i = 0; i < state_slots; ++i) {
    const std::vector<BlockKey> one = Keys(100 + i, 1);
    REQUIRE(Store(t.cache(), one, {1}) == StatusCode::kOk);
    REQUIRE(t.cache().Match(one, true, &pins) == 1);
  }
  const Cache::Stats before = t.cache().GetStats();
  const std::vector<BlockKey> keys = Keys(3, 2);
  CHECK(Store(t.cache(), keys, {2}) == StatusCode::kResourceExhausted);
  const Cache::Stats after = t.cache().GetStats();
  CHECK(after.used == before.used);  // no FULL block, window block or state was kept from the refused store
  CHECK(after.blocks == before.blocks);
  CHECK(t.cache().Match(keys, false, nullptr) == 0);
  // Without state boundaries the same store needs no state slot: FULL and window go in, but there is no hit.
  CHECK(Store(t.cache(), keys, {}) == StatusCode::kOk);
  CHECK(t.cache().GetStats().blocks == before.blocks + 2);
  CHECK(t.cache().Match(keys, false, nullptr) == 0);
  t.cache().Unpin(pins);
  // Once the pins are gone the state goes in (evicting another), and the end is a hit.
  CHECK(Store(t.cache(), keys, {2}) == StatusCode::kOk);
  CHECK(t.cache().Match(keys, false, nullptr) == 2);
}

TEST_CASE("hybrid cache: a restart restores every component, verified - a torn state or window is not served",
          "[unit][cache][hybrid]") {
  TempCache t(64 * 1024, kSplit);
  const std::vector<BlockKey> a = Keys(4, 5), b = Keys(5, 5);
  {
    REQUIRE(t.cache().RecoverPool(false).ok());
    REQUIRE(t.cache().Admit("ns", TinyHybrid()).ok());
    REQUIRE(Store(t.cache(), a, {5}) == StatusCode::kOk);
    REQUIRE(Store(t.cache(), b, {5}) == StatusCode::kOk);
    REQUIRE(t.cache().Match(a, false, nullptr) == 5);
    REQUIRE(t.cache().Match(b, false, nullptr) == 5);
    // b's state changes after its store (as a torn write would leave it): its checksum no longer matches.
    std::vector<SlotId> pinned;
    REQUIRE(t.cache().Match(b, true, &pinned) == 5);
    const flexkv::HybridIdLayout layout = flexkv::LayoutIds(TinyHybrid(), false, 5);
    t.cache().SlotData(pinned[layout.offset[2]])[10] ^= 0x40;
    t.cache().Unpin(pinned);
  }
  t.Reopen();
  REQUIRE(t.cache().RecoverPool(false).ok());
  CHECK(t.cache().Match(a, false, nullptr) == 0);  // unverified: not served yet
  flexkv::BlockVerifier(&t.cache()).VerifyRestored();
  CHECK(t.cache().GetStats().unverified == 0);
  CHECK(t.cache().Match(a, false, nullptr) == 5);
  CHECK(t.cache().Match(b, false, nullptr) == 0);  // its FULL blocks and window are there, its state is not
  CHECK(t.cache().counters().data_loss_blocks.load() == 1);
  CHECK(t.cache().Domain().geometry->is_hybrid());
}

TEST_CASE("hybrid cache: a store refused for a full sub-pool evicts nothing from the others", "[unit][cache][hybrid]") {
  TempCache t(20 * 1024, flexkv::PoolSplit{0.3, 0.0095});
  REQUIRE(t.cache().RecoverPool(false).ok());
  REQUIRE(t.cache().Admit("ns", TinyHybrid()).ok());
  const uint32_t full_slots = t.cache().pool_region(0)->slots;
  const uint32_t state_slots = t.cache().pool_region(2)->slots;
  REQUIRE(state_slots == 3);
  // Every state slot pinned by a one-block prompt; the rest of the FULL sub-pool filled with one unpinned chain.
  std::vector<SlotId> pins;
  for (uint32_t i = 0; i < state_slots; ++i) {
    const std::vector<BlockKey> one = Keys(200 + i, 1);
    REQUIRE(Store(t.cache(), one, {1}) == StatusCode::kOk);
    REQUIRE(t.cache().Match(one, true, &pins) == 1);
  }
  REQUIRE(Store(t.cache(), Keys(7, full_slots - state_slots), {}) == StatusCode::kOk);
  const Cache::Stats before = t.cache().GetStats();
  REQUIRE(before.blocks == full_slots);
  // A new prompt would have to evict FULL blocks, but its state cannot be placed: refused before anything is evicted.
  CHECK(Store(t.cache(), Keys(8, 2), {2}) == StatusCode::kResourceExhausted);
  const Cache::Stats after = t.cache().GetStats();
  CHECK(after.blocks == before.blocks);
  CHECK(after.evicted == before.evicted);
  CHECK(t.cache().Match(Keys(7, full_slots - state_slots), false, nullptr) == 0);  // no state: no hit, but cached
  t.cache().Unpin(pins);
}
