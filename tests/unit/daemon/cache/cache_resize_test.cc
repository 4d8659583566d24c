// Cache::Resize on a hybrid geometry: every component shrinks to whole grants, evicting what sits in the slots it
// gives back (held up by pinned blocks until they go) and grows back; the blocks in the kept slots stay matchable
// with their bytes intact, and the pool listener hears exactly the grants that come and go.
#include <catch2/catch.hpp>

#include <cstdint>
#include <map>
#include <span>
#include <vector>

#include "common/block_checksum.h"
#include "common/hybrid_ids.h"
#include "daemon/cache/block_verifier.h"
#include "daemon/cache/cache.h"
#include "daemon/tiers/dram/dram_tier.h"
#include "tests/unit/daemon/cache/temp_cache.h"

using flexkv::BlockKey;
using flexkv::Cache;
using flexkv::ComponentIndex;
using flexkv::ComponentKind;
using flexkv::PoolRegion;
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

uint8_t Pattern(uint64_t i, uint8_t seed, SlotId slot) { return static_cast<uint8_t>(i * 7 + seed + slot); }

uint64_t Fill(Cache& cache, SlotId slot, uint8_t seed) {
  uint8_t* bytes = cache.SlotData(slot);
  const uint64_t n = cache.SlotBytes(slot);
  for (uint64_t i = 0; i < n; ++i) bytes[i] = Pattern(i, seed, slot);
  return flexkv::BlockChecksum(bytes, n);
}

StatusCode Store(Cache& cache, std::span<const BlockKey> keys, std::vector<uint32_t> boundaries) {
  Cache::HybridReservation r = cache.ReserveHybrid(flexkv::kRootParent, keys, boundaries);
  if (r.shortfall != StatusCode::kOk) return r.shortfall;
  std::vector<std::vector<uint64_t>> sums(r.slots.size());
  for (SlotId s : r.full.slots) sums[0].push_back(Fill(cache, s, 0));
  for (size_t c = 1; c < r.slots.size(); ++c) {
    for (SlotId s : r.slots[c]) {
      if (s != ComponentIndex::kNoSlot) sums[c].push_back(Fill(cache, s, static_cast<uint8_t>(c)));
    }
  }
  cache.CommitHybrid(flexkv::kRootParent, keys, r, sums);
  return StatusCode::kOk;
}

// The prompt is a hit at its full length and every byte of what serves it (FULL blocks, window, state) is as stored.
void CheckServed(Cache& cache, std::span<const BlockKey> keys) {
  std::vector<SlotId> pinned;
  REQUIRE(cache.Match(keys, true, &pinned) == keys.size());
  const flexkv::HybridIdLayout layout = flexkv::LayoutIds(TinyHybrid(), false, static_cast<uint32_t>(keys.size()));
  size_t wrong = 0;
  for (size_t c = 0; c < 3; ++c) {
    const size_t end = c + 1 < 3 ? layout.offset[c + 1] : layout.total;
    for (size_t i = layout.offset[c]; i < end; ++i) {
      const SlotId slot = pinned[i];
      const uint8_t* bytes = cache.SlotData(slot);
      for (uint64_t b = 0; b < cache.SlotBytes(slot); ++b) wrong += bytes[b] != Pattern(b, static_cast<uint8_t>(c), slot);
    }
  }
  CHECK(wrong == 0);
  cache.Unpin(pinned);
}

// The pool listener's view: the grants announced and not removed, by base; a grant added or removed twice is noted.
struct GrantLog {
  std::map<const uint8_t*, PoolRegion> live;
  int twice = 0;
  int refuse_in = -1;  // >= 0: the grant announced after this many more is refused (as a failed DMA registration)
  void Listen(Cache& cache) {
    cache.AddObserver(std::make_shared<flexkv::FunctionCacheObserver>(
        [this](const PoolRegion& r) {
          twice += live.emplace(r.base, r).second ? 0 : 1;
          if (refuse_in >= 0 && refuse_in-- == 0) return flexkv::Status::FailedPrecondition("registration refused");
          return flexkv::Status::Ok();
        },
        [this](const PoolRegion& r) { twice += live.erase(r.base) == 1 ? 0 : 1; }));
  }
};

// The grants the cache's active capacity has now, by base (as the listener should have heard them).
std::map<const uint8_t*, uint32_t> ActiveGrants(const Cache& cache, const std::vector<uint32_t>& max_slots) {
  std::map<const uint8_t*, uint32_t> grants;
  for (size_t c = 0; c < max_slots.size(); ++c) {
    const PoolRegion r = *cache.pool_region(c);
    const uint32_t grant = (max_slots[c] + 15) / 16;
    for (uint32_t first = 0; first < r.slots; first += grant) {
      grants.emplace(r.SlotData(first), std::min(grant, r.slots - first));
    }
  }
  return grants;
}

std::map<const uint8_t*, uint32_t> Heard(const GrantLog& log) {
  std::map<const uint8_t*, uint32_t> heard;
  for (const auto& [base, r] : log.live) heard.emplace(base, r.slots);
  return heard;
}

uint32_t RoundUp(uint32_t slots, uint32_t grant) { return (slots + grant - 1) / grant * grant; }

uint64_t ActiveBytes(const Cache& cache) {
  uint64_t bytes = 0;
  for (size_t c = 0; c < 3; ++c) bytes += uint64_t{cache.pool_region(c)->slots} * cache.pool_region(c)->slot_bytes;
  return bytes;
}

}  // namespace

TEST_CASE("cache resize: every component shrinks and grows back - kept blocks stay served, the listener hears each grant",
          "[unit][cache][hybrid][elastic]") {
  TempCache t(64 * 1024, kSplit);
  Cache& cache = t.cache();
  GrantLog log;
  log.Listen(cache);
  REQUIRE(cache.RecoverPool(false).ok());
  CHECK(cache.Resize(1).status().code() == StatusCode::kFailedPrecondition);  // no pool yet
  CHECK(cache.active_bytes() == 0);
  CHECK(cache.max_bytes() == 0);
  CHECK(cache.min_bytes() == 0);
  REQUIRE(cache.Admit("ns", TinyHybrid()).ok());
  const uint64_t max_bytes = cache.max_bytes();
  CHECK(cache.active_bytes() == max_bytes);
  std::vector<uint32_t> max_slots;
  for (size_t c = 0; c < 3; ++c) max_slots.push_back(cache.pool_region(c)->slots);
  REQUIRE(max_slots[0] > 320);
  REQUIRE(max_slots[1] >= 16);
  CHECK(Heard(log) == ActiveGrants(cache, max_slots));

  const std::vector<BlockKey> a = Keys(1, 20), b = Keys(2, 300);
  REQUIRE(Store(cache, a, {20}) == StatusCode::kOk);  // FULL slots 0..19
  REQUIRE(Store(cache, b, {300}) == StatusCode::kOk);  // FULL slots 20..319
  std::vector<SlotId> b_pins;
  REQUIRE(cache.Match(b, true, &b_pins) == 300);

  // A quarter: B's pinned FULL blocks hold the FULL sub-pool at the grant holding slot 319.
  const uint64_t quarter = max_bytes / 4;
  auto reached = cache.Resize(quarter);
  REQUIRE(reached.ok());
  const uint32_t full_grant = (max_slots[0] + 15) / 16;
  CHECK(cache.pool_region(0)->slots == RoundUp(320, full_grant));
  // The other components at a quarter, rounded down to whole grants (a share is never exceeded).
  for (size_t c = 1; c < 3; ++c) {
    const uint32_t grant = (max_slots[c] + 15) / 16;
    CHECK(cache.pool_region(c)->slots == std::max(max_slots[c] / 4 / grant * grant, grant));
  }
  CHECK(*reached == cache.active_bytes());
  CHECK(*reached == ActiveBytes(cache));
  CHECK(*reached > quarter);
  CHECK(cache.Match(b, false, nullptr) == 300);
  CheckServed(cache, a);
  CHECK(Heard(log) == ActiveGrants(cache, max_slots));

  // Unpinned, B's blocks beyond the quarter go, with their descendants; the next Resize gets there.
  cache.Unpin(b_pins);
  const uint64_t evicted_before = cache.GetStats().evicted;
  reached = cache.Resize(quarter);
  REQUIRE(reached.ok());
  const uint32_t full_quarter = cache.pool_region(0)->slots;
  CHECK(full_quarter == max_slots[0] / 4 / full_grant * full_grant);
  CHECK(full_quarter < 320);
  CHECK(*reached == ActiveBytes(cache));
  CHECK(*reached <= quarter);
  CHECK(*reached + full_grant * 128 + 2 * 4 * 128 > quarter);
  CHECK(cache.GetStats().evicted - evicted_before >= 320 - full_quarter);
  CHECK(cache.Match(b, false, nullptr) == 0);
  CheckServed(cache, a);
  const Cache::Stats shrunk = cache.GetStats();
  CHECK(shrunk.capacity == cache.capacity_slots());
  CHECK(shrunk.capacity == uint64_t{full_quarter} + cache.pool_region(1)->slots + cache.pool_region(2)->slots);
  CHECK(shrunk.components[0].capacity == full_quarter);
  CHECK(Heard(log) == ActiveGrants(cache, max_slots));
  CHECK(log.twice == 0);

  // Grown back to the whole budget: a large prompt fits again, and A is still there.
  reached = cache.Resize(max_bytes);
  REQUIRE(reached.ok());
  CHECK(*reached == max_bytes);
  for (size_t c = 0; c < 3; ++c) CHECK(cache.pool_region(c)->slots == max_slots[c]);
  CHECK(Heard(log) == ActiveGrants(cache, max_slots));
  const std::vector<BlockKey> big = Keys(3, 400);
  REQUIRE(Store(cache, big, {400}) == StatusCode::kOk);
  CheckServed(cache, big);
  CheckServed(cache, a);

  // Down to one grant each (the least there is): A, in the first slots of each sub-pool, stays.
  reached = cache.Resize(0);
  REQUIRE(reached.ok());
  for (size_t c = 0; c < 3; ++c) CHECK(cache.pool_region(c)->slots == (max_slots[c] + 15) / 16);
  CHECK(*reached == cache.min_bytes());
  CheckServed(cache, a);
  CHECK(cache.Match(big, false, nullptr) == 0);
  CHECK(Heard(log) == ActiveGrants(cache, max_slots));
  const std::vector<uint32_t> one_grant{cache.pool_region(0)->slots, cache.pool_region(1)->slots,
                                        cache.pool_region(2)->slots};

  // A scrub still reaches every component's blocks (slot ids run to the maximum, not to the active count).
  {
    const Cache::Stats now = cache.GetStats();
    auto scrubbed = flexkv::BlockVerifier(&cache).Scrub({});
    REQUIRE(scrubbed.ok());
    CHECK(scrubbed->checked_blocks == now.used);
    CHECK(scrubbed->failed_blocks == 0);
  }

  // A restart keeps the active capacities and A.
  t.Reopen();
  GrantLog relog;
  relog.Listen(t.cache());
  REQUIRE(t.cache().RecoverPool(false).ok());
  for (size_t c = 0; c < 3; ++c) CHECK(t.cache().pool_region(c)->slots == one_grant[c]);
  CHECK(Heard(relog) == ActiveGrants(t.cache(), max_slots));
  CHECK(relog.live.size() == 3);
  flexkv::BlockVerifier(&t.cache()).VerifyRestored();
  CheckServed(t.cache(), a);

  // Dropping the domain removes every active grant, each once.
  REQUIRE(t.cache().DropDomain(false, nullptr).ok());
  CHECK(relog.live.empty());
  CHECK(relog.twice == 0);
}

TEST_CASE("cache resize: the DRAM tier and the capacity figures follow the active size, and a slot beyond it is refused",
          "[unit][cache][elastic][tiers]") {
  TempCache t;  // 64 slots of 4 KiB: grants of 4
  Cache& cache = t.cache();
  REQUIRE(cache.RecoverPool(false).ok());
  REQUIRE(cache.Admit("ns", flexkv::testing::SmallGeometry()).ok());
  flexkv::DramTier tier(&cache);
  CHECK(tier.capacity_slots() == 64);
  auto reached = cache.Resize(cache.max_bytes() / 4);
  REQUIRE(reached.ok());
  CHECK(*reached == 16 * 4096);
  CHECK(cache.capacity_slots() == 16);
  CHECK(cache.GetStats().capacity == 16);
  CHECK(cache.pool_region(0)->slots == 16);
  CHECK(tier.capacity_slots() == 16);
  CHECK(tier.region()->base == cache.SlotData(0));  // no slot moved
  std::vector<uint8_t> bytes(tier.slot_bytes(), 0x11);
  CHECK(tier.WriteSlot(15, bytes).ok());
  CHECK(tier.WriteSlot(16, bytes).code() == StatusCode::kOutOfRange);
  CHECK(tier.ReadSlot(63, bytes).code() == StatusCode::kOutOfRange);
  // Stores go to the active slots only, evicting there when they are full.
  for (uint64_t chain = 0; chain < 6; ++chain) {
    const std::vector<BlockKey> keys = Keys(10 + chain, 5);
    auto r = cache.Reserve(flexkv::kRootParent, keys);
    for (SlotId s : r.slots) CHECK(s < 16);
    std::vector<uint64_t> sums;
    for (SlotId s : r.slots) sums.push_back(Fill(cache, s, 0));
    cache.Commit(flexkv::kRootParent, keys, 0, r.slots, sums);
  }
  CHECK(cache.GetStats().used <= 16);
  REQUIRE(cache.Resize(cache.max_bytes()).ok());
  CHECK(tier.capacity_slots() == 64);
  CHECK(tier.WriteSlot(63, bytes).ok());
}

TEST_CASE("cache resize: a grant the listener cannot register is given back and none of its slots is handed out",
          "[unit][cache][elastic]") {
  TempCache t;  // 64 slots of 4 KiB: grants of 4
  Cache& cache = t.cache();
  GrantLog log;
  log.Listen(cache);
  REQUIRE(cache.RecoverPool(false).ok());
  REQUIRE(cache.Admit("ns", flexkv::testing::SmallGeometry()).ok());
  REQUIRE(cache.Resize(cache.max_bytes() / 4).ok());
  REQUIRE(cache.capacity_slots() == 16);
  // Growing to all 64 slots: the third new grant (slots 24..27) is refused.
  log.refuse_in = 2;
  auto grown = cache.Resize(cache.max_bytes());
  REQUIRE_FALSE(grown.ok());
  CHECK(grown.status().code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(grown.status().message(), Catch::Contains("registration refused") && Catch::Contains("16 to 64"));
  CHECK(cache.capacity_slots() == 16);
  CHECK(cache.active_bytes() == 16 * 4096);
  CHECK(log.twice == 0);
  CHECK(log.live.size() == 4);  // the 4 grants it had; every grant told during the failed grow was taken back
  // Stores get only the 16 active slots.
  for (uint64_t chain = 0; chain < 8; ++chain) {
    auto r = cache.Reserve(flexkv::kRootParent, Keys(40 + chain, 4));
    for (SlotId s : r.slots) CHECK(s < 16);
    std::vector<uint64_t> sums;
    for (SlotId s : r.slots) sums.push_back(Fill(cache, s, 0));
    cache.Commit(flexkv::kRootParent, Keys(40 + chain, 4), 0, r.slots, sums);
  }
  // Once registration works again, the grow goes through.
  REQUIRE(cache.Resize(cache.max_bytes()).ok());
  CHECK(cache.capacity_slots() == 64);
  CHECK(log.live.size() == 16);
  CHECK(log.twice == 0);
}
