// Cache::ReservePulledHybrid / CommitPulledHybrid (daemon/cache/cache_hybrid_pull.cc): a hybrid prefix pulled from a
// peer is reserved all or none - FULL blocks under the local prefix and the entries the caller names, a window
// reaching back before the pulled blocks included - matchable only once committed, and given back whole by an abort.
#include <catch2/catch.hpp>

#include <span>
#include <vector>

#include "common/block_checksum.h"
#include "daemon/cache/cache.h"
#include "flexkv/block_key.h"
#include "tests/unit/daemon/cache/temp_cache.h"

using flexkv::BlockKey;
using flexkv::Cache;
using flexkv::ComponentIndex;
using flexkv::SlotId;
using flexkv::StatusCode;
using flexkv::testing::TempCache;
using flexkv::testing::TinyHybrid;

namespace {

const flexkv::PoolSplit kSplit{0.1, 0.05};

std::vector<BlockKey> Keys(uint64_t chain, size_t n) {
  std::vector<BlockKey> keys(n);
  for (size_t i = 0; i < n; ++i) keys[i] = BlockKey{chain * 1000 + i + 1, chain};
  return keys;
}

uint64_t Fill(Cache& cache, SlotId slot, uint8_t seed) {
  uint8_t* bytes = cache.SlotData(slot);
  const uint64_t n = cache.SlotBytes(slot);
  for (uint64_t i = 0; i < n; ++i) bytes[i] = static_cast<uint8_t>(i * 13 + seed + slot);
  return flexkv::BlockChecksum(bytes, n);
}

// Fills every reserved slot and returns the checksums in CommitHybrid's order.
std::vector<std::vector<uint64_t>> FillAll(Cache& cache, const Cache::HybridReservation& r) {
  std::vector<std::vector<uint64_t>> sums(r.slots.size());
  for (SlotId s : r.full.slots) sums[0].push_back(Fill(cache, s, 3));
  for (size_t c = 1; c < r.slots.size(); ++c) {
    for (SlotId s : r.slots[c]) {
      if (s != ComponentIndex::kNoSlot) sums[c].push_back(Fill(cache, s, static_cast<uint8_t>(c + 3)));
    }
  }
  return sums;
}

// A node holding keys[0, 4) as a hit at 4 (window [2, 4), state at 4) - a store of the engine's.
void StoreFirstFour(Cache& cache, const std::vector<BlockKey>& keys) {
  const std::span<const BlockKey> four(keys.data(), 4);
  const std::vector<uint32_t> boundaries = {4};
  Cache::HybridReservation r = cache.ReserveHybrid(flexkv::kRootParent, four, boundaries);
  REQUIRE(r.shortfall == StatusCode::kOk);
  cache.CommitHybrid(flexkv::kRootParent, four, r, FillAll(cache, r));
  REQUIRE(cache.Match(four, false, nullptr) == 4);
}

// What the hit rule at e needs of TinyHybrid besides FULL blocks: the window [e - 2, e) and the state at e.
std::vector<std::vector<BlockKey>> EntriesAt(const std::vector<BlockKey>& keys, size_t e) {
  return {{}, {keys[e - 2], keys[e - 1]}, {keys[e - 1]}};
}

}  // namespace

TEST_CASE("hybrid pull: a pulled set is a hit only once committed, its window reaching back into the local prefix",
          "[unit][cache][hybrid]") {
  TempCache t(64 * 1024, kSplit);
  REQUIRE(t.cache().RecoverPool(false).ok());
  REQUIRE(t.cache().Admit("ns", TinyHybrid()).ok());
  const std::vector<BlockKey> keys = Keys(1, 8);
  StoreFirstFour(t.cache(), keys);
  const uint64_t full_before = t.cache().GetStats().components[0].used;

  // The peer's hit end is 5: FULL block 4, the window [3, 5) - key 3's window block is held here already - and the
  // state at 5.
  const std::span<const BlockKey> pulled(keys.data() + 4, 1);
  const Cache::HybridReservation r = t.cache().ReservePulledHybrid(keys[3], pulled, EntriesAt(keys, 5));
  REQUIRE(r.shortfall == StatusCode::kOk);
  CHECK(r.full.cached == 0);
  REQUIRE(r.full.slots.size() == 1);
  REQUIRE(r.slots[1].size() == 2);
  CHECK(r.slots[1][0] == ComponentIndex::kNoSlot);  // cached: not read again
  CHECK(r.slots[1][1] != ComponentIndex::kNoSlot);
  REQUIRE(r.slots[2].size() == 1);
  CHECK(t.cache().Match(std::span(keys).first(5), false, nullptr) == 4);  // pending: not matchable yet

  const auto sums = FillAll(t.cache(), r);
  const std::vector<uint64_t> stored_before = t.cache().ComponentBytesStored();
  t.cache().CommitPulledHybrid(keys[3], pulled, r, sums);
  // The pull counts in each sub-pool's demand as a store would: one FULL block, one window block, one state.
  const std::vector<uint64_t> stored_after = t.cache().ComponentBytesStored();
  REQUIRE(stored_after.size() == 3);
  for (size_t c = 0; c < 3; ++c) CHECK(stored_after[c] - stored_before[c] == t.cache().pool_region(c)->slot_bytes);
  std::vector<SlotId> pinned;
  REQUIRE(t.cache().Match(std::span(keys).first(5), true, &pinned) == 5);
  CHECK(pinned.size() == 5 + 2 + 1);
  // Each pulled slot holds what was committed, with its checksum in the slot entry.
  CHECK(t.cache().EntryChecksum(r.full.slots[0]) == sums[0][0]);
  CHECK(t.cache().EntryChecksum(r.slots[1][1]) == sums[1][0]);
  CHECK(t.cache().EntryChecksum(r.slots[2][0]) == sums[2][0]);
  t.cache().Unpin(pinned);
  CHECK(t.cache().GetStats().components[0].used == full_before + 1);
}

TEST_CASE("hybrid pull: an abort gives the whole set back - nothing matchable, no slot held", "[unit][cache][hybrid]") {
  TempCache t(64 * 1024, kSplit);
  REQUIRE(t.cache().RecoverPool(false).ok());
  REQUIRE(t.cache().Admit("ns", TinyHybrid()).ok());
  const std::vector<BlockKey> keys = Keys(2, 8);
  StoreFirstFour(t.cache(), keys);
  const Cache::Stats before = t.cache().GetStats();
  const std::span<const BlockKey> pulled(keys.data() + 4, 4);
  Cache::HybridReservation r = t.cache().ReservePulledHybrid(keys[3], pulled, EntriesAt(keys, 8));
  REQUIRE(r.shortfall == StatusCode::kOk);
  CHECK(r.full.slots.size() == 4);
  (void)FillAll(t.cache(), r);  // read, then one entry failed its checksum: the caller aborts everything
  t.cache().AbortHybrid(r);
  CHECK(t.cache().Match(keys, false, nullptr) == 4);
  const Cache::Stats after = t.cache().GetStats();
  for (size_t c = 0; c < 3; ++c) CHECK(after.components[c].used == before.components[c].used);
  // And the keys may be pulled again.
  r = t.cache().ReservePulledHybrid(keys[3], pulled, EntriesAt(keys, 8));
  REQUIRE(r.shortfall == StatusCode::kOk);
  t.cache().CommitPulledHybrid(keys[3], pulled, r, FillAll(t.cache(), r));
  CHECK(t.cache().Match(keys, false, nullptr) == 8);
}

TEST_CASE("hybrid pull: refused whole when the local prefix went or a component cannot take its part",
          "[unit][cache][hybrid]") {
  TempCache t(64 * 1024, kSplit);
  REQUIRE(t.cache().RecoverPool(false).ok());
  REQUIRE(t.cache().Admit("ns", TinyHybrid()).ok());
  const std::vector<BlockKey> keys = Keys(3, 8);
  StoreFirstFour(t.cache(), keys);
  const std::span<const BlockKey> pulled(keys.data() + 4, 4);
  const Cache::Stats before = t.cache().GetStats();

  SECTION("a parent that is not committed here") {
    const Cache::HybridReservation r = t.cache().ReservePulledHybrid(BlockKey{77, 77}, pulled, EntriesAt(keys, 8));
    CHECK(r.shortfall != StatusCode::kOk);
    CHECK(r.full.parent_refused);
    CHECK(r.full.slots.empty());
    CHECK(r.slots.empty());
  }
  SECTION("a window entry pending in another store: ABORTED naming the component, no FULL block reserved") {
    // An engine's store of keys[0, 8) is copying (reserved, not committed): its window holds keys 6 and 7.
    const std::vector<uint32_t> boundaries = {8};
    Cache::HybridReservation other = t.cache().ReserveHybrid(flexkv::kRootParent, keys, boundaries);
    REQUIRE(other.shortfall == StatusCode::kOk);
    const Cache::HybridReservation r = t.cache().ReservePulledHybrid(keys[3], pulled, EntriesAt(keys, 8));
    CHECK(r.shortfall == StatusCode::kAborted);
    CHECK(r.component == 1);
    CHECK(r.full.slots.empty());
    t.cache().AbortHybrid(other);
  }
  SECTION("entry lists that are not one per component") {
    const Cache::HybridReservation r =
        t.cache().ReservePulledHybrid(keys[3], pulled, std::vector<std::vector<BlockKey>>{{}, {keys[7]}});
    CHECK(r.shortfall == StatusCode::kFailedPrecondition);
    CHECK(r.full.slots.empty());
  }
  const Cache::Stats after = t.cache().GetStats();
  for (size_t c = 0; c < 3; ++c) CHECK(after.components[c].used == before.components[c].used);
  CHECK(t.cache().Match(keys, false, nullptr) == 4);
}
