// CacheSet: several cache domains in one daemon - pool file naming, budget shares (equal while idle, by demand
// after), replacement of an unused empty domain, the refusal when nothing fits, isolation, and re-attaching every
// domain at restart.
#include "daemon/cache/cache_set.h"

#include <stdlib.h>

#include <catch2/catch.hpp>

#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "common/block_checksum.h"
#include "tests/support/temp_dir.h"
#include "tests/unit/daemon/cache/temp_cache.h"

using flexkv::BlockKey;
using flexkv::Cache;
using flexkv::CacheSet;
using flexkv::CacheSetOptions;
using flexkv::SlotId;
using flexkv::StatusCode;
using flexkv::testing::ShmOrTmp;
using flexkv::testing::SmallGeometry;
using flexkv::testing::StoreBlocks;
using flexkv::testing::TempDir;

namespace {

constexpr uint64_t kBlock = 4096;  // SmallGeometry's host block

CacheSetOptions Options(const TempDir& dir, uint64_t budget, size_t max_domains) {
  CacheSetOptions o;
  o.budget_bytes = budget;
  o.pool_path = dir.path + "/pool";
  o.max_domains = max_domains;
  return o;
}

// Another geometry (8 KiB blocks), so that two domains differ in more than their namespace.
flexkv::Geometry WideGeometry() {
  flexkv::Geometry g = SmallGeometry();
  g.head_dim = 64;
  return g;
}

bool NeverInUse(const std::string&) { return false; }
bool AlwaysInUse(const std::string&) { return true; }

std::vector<BlockKey> Keys(size_t n, uint64_t chain = 42) {
  std::vector<BlockKey> keys(n);
  for (size_t i = 0; i < n; ++i) keys[i] = BlockKey{i + 7, chain};
  return keys;
}

}  // namespace

TEST_CASE("cache set: domain i's pool file is <pool_path> for 0 and <pool_path>.<i> after it", "[unit][cache]") {
  CHECK(CacheSet::PoolPathOf("/dev/shm/x/pool", 0) == "/dev/shm/x/pool");
  CHECK(CacheSet::PoolPathOf("/dev/shm/x/pool", 1) == "/dev/shm/x/pool.1");
  CHECK(CacheSet::PoolPathOf("/dev/shm/x/pool", 12) == "/dev/shm/x/pool.12");
  TempDir dir("flexkv-cacheset", ShmOrTmp());
  CacheSet caches(Options(dir, 64 * kBlock, 2));
  REQUIRE(caches.RecoverPools(false).ok());
  auto a = caches.Admit("llama", SmallGeometry(), 0, NeverInUse);
  REQUIRE(a.ok());
  auto b = caches.Admit("gpt-oss", WideGeometry(), 0, NeverInUse);
  REQUIRE(b.ok());
  CHECK(*a != *b);
  CHECK((*a)->GetStats().backing == dir.path + "/pool");
  CHECK((*b)->GetStats().backing == dir.path + "/pool.1");
  CHECK(std::filesystem::exists(dir.path + "/pool.1"));
  CHECK(caches.Find("llama") == *a);
  CHECK(caches.Find("gpt-oss") == *b);
  CHECK(caches.Find("qwen") == nullptr);
  // A known namespace is found again; another geometry in it is refused naming the field.
  CHECK(*caches.Admit("llama", SmallGeometry(), 0, NeverInUse) == *a);
  auto other = caches.Admit("llama", WideGeometry(), 0, NeverInUse);
  REQUIRE_FALSE(other.ok());
  CHECK(other.status().code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(other.status().message(), Catch::Contains("head_dim"));
  const std::vector<CacheSet::Domain> domains = caches.Domains();
  REQUIRE(domains.size() == 2);
  CHECK(domains[0].model_namespace == "llama");
  CHECK(domains[1].model_namespace == "gpt-oss");
  CHECK(domains[1].geometry.head_dim == 64);
}

// The active bytes of every domain together: never more than the budget.
uint64_t Held(const CacheSet& caches) {
  uint64_t held = 0;
  for (const CacheSet::Domain& d : caches.Domains()) held += d.cache->active_bytes();
  return held;
}

TEST_CASE("cache set: the first domain takes the budget or its pool_size, later ones an equal share of idle ones",
          "[unit][cache]") {
  TempDir dir("flexkv-cacheset", ShmOrTmp());
  CacheSetOptions o = Options(dir, 256 * kBlock, 4);  // 1 MiB
  o.namespace_pool_bytes.emplace("big", 128 * kBlock);
  CacheSet caches(std::move(o));
  REQUIRE(caches.RecoverPools(false).ok());
  CHECK(caches.MaxFor("big") == 128 * kBlock);
  CHECK(caches.MaxFor("a") == 256 * kBlock);
  auto big = caches.Admit("big", SmallGeometry(), 0, NeverInUse);
  REQUIRE(big.ok());
  CHECK((*big)->budget_bytes() == 128 * kBlock);  // laid out for its pool_size
  CHECK((*big)->active_bytes() == 128 * kBlock);  // alone, it has all it may have
  CHECK((*big)->capacity_slots() == 128);
  const std::vector<BlockKey> keys = Keys(120);
  StoreBlocks(**big, keys);

  // "a" (no pool_size, laid out for the whole budget): no domain has traffic, so equal shares: 128 blocks each.
  REQUIRE(caches.Admit("a", SmallGeometry(), 0, NeverInUse).ok());
  CHECK(caches.Find("a")->budget_bytes() == 256 * kBlock);
  CHECK(caches.Find("a")->active_bytes() == 128 * kBlock);
  CHECK(caches.Find("big")->active_bytes() == 128 * kBlock);
  CHECK((*big)->Match(keys, false, nullptr) == 120);
  CHECK(Held(caches) <= 256 * kBlock);

  // "b": a third each (85 blocks), rounded down to whole grants (big's grant is 8 slots, a's 16): big gives up its
  // slots beyond 80, evicting the blocks there.
  REQUIRE(caches.Admit("b", SmallGeometry(), 0, AlwaysInUse).ok());
  CHECK((*big)->active_bytes() == 80 * kBlock);
  CHECK(caches.Find("a")->active_bytes() == 80 * kBlock);
  CHECK(caches.Find("b")->active_bytes() == 80 * kBlock);
  CHECK(Held(caches) <= 256 * kBlock);
  const size_t kept = (*big)->Match(keys, false, nullptr);
  CHECK(kept <= 80);
  CHECK(kept > 0);
  CHECK(caches.Domains()[0].limit_bytes == 128 * kBlock);
  CHECK(caches.Domains()[0].budget_bytes == 80 * kBlock);
  CHECK(caches.Domains()[1].limit_bytes == 0);

  // A fourth: a quarter each.
  REQUIRE(caches.Admit("c", SmallGeometry(), 0, AlwaysInUse).ok());
  for (const CacheSet::Domain& d : caches.Domains()) CHECK(d.cache->active_bytes() == 64 * kBlock);

  // Every slot is taken and every domain is in use: refused, naming the budget, each domain and what to do.
  auto refused = caches.Admit("d", SmallGeometry(), 0, AlwaysInUse);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == StatusCode::kResourceExhausted);
  const std::string m = refused.status().message();
  INFO(m);
  CHECK_THAT(m, Catch::Contains("'d'") && Catch::Contains("1 MiB") && Catch::Contains("'big' holds 256 KiB") &&
                    Catch::Contains("all 4 domains") && Catch::Contains("--max-domains") &&
                    Catch::Contains("pool_size") && Catch::Contains("flexkvctl drop-domain"));
  CHECK(caches.Find("d") == nullptr);
  CHECK(caches.Domains().size() == 4);
}

TEST_CASE("cache set: shares follow demand, and a dropped domain's budget goes to the others", "[unit][cache]") {
  TempDir dir("flexkv-cacheset", ShmOrTmp());
  CacheSet caches(Options(dir, 256 * kBlock, 3));
  REQUIRE(caches.RecoverPools(false).ok());
  Cache* busy = *caches.Admit("busy", SmallGeometry(), 0, NeverInUse);
  Cache* idle = *caches.Admit("idle", SmallGeometry(), 0, NeverInUse);
  CHECK(busy->active_bytes() == 128 * kBlock);
  CHECK(idle->active_bytes() == 128 * kBlock);
  StoreBlocks(*idle, Keys(100));

  int64_t now = 1000;
  caches.Rebalance(now);  // the meters start; nobody has traffic: nothing moves
  CHECK(busy->active_bytes() == 128 * kBlock);
  CHECK(idle->active_bytes() == 128 * kBlock);

  // "busy" has traffic but room to spare: nothing is taken from "idle" for it.
  busy->counters().bytes_stored += 1ULL << 30;
  now += CacheSet::kRebalanceIntervalMs;
  caches.Rebalance(now);
  CHECK(busy->active_bytes() == 128 * kBlock);
  CHECK(idle->active_bytes() == 128 * kBlock);

  // Now its pool is full (its next stores would evict) and it keeps storing and loading, "idle" does nothing: idle
  // keeps one grant of its pool (16 slots), busy takes the rest - at most an eighth of the budget a call.
  StoreBlocks(*busy, Keys(120));
  for (int i = 0; i < 10; ++i) {
    // It keeps its pool full: a new prompt of as many blocks as it got (evicting its oldest when it has to).
    StoreBlocks(*busy, Keys(busy->capacity_slots() - busy->GetStats().used + 8, 100 + i));
    busy->counters().bytes_stored += 1ULL << 30;
    now += CacheSet::kRebalanceIntervalMs;
    caches.Rebalance(now);
    CHECK(Held(caches) <= 256 * kBlock);
  }
  CHECK(idle->active_bytes() == 16 * kBlock);
  CHECK(busy->active_bytes() == 240 * kBlock);
  CHECK(idle->Match(Keys(100), false, nullptr) <= 16);

  // Within the interval nothing is looked at.
  idle->counters().bytes_loaded += 1ULL << 40;
  caches.Rebalance(now + 1);
  CHECK(idle->active_bytes() == 16 * kBlock);

  // A new domain while one has traffic: its demand is taken as the mean of those with traffic.
  Cache* late = *caches.Admit("late", SmallGeometry(), 0, NeverInUse);
  CHECK(late->active_bytes() > 16 * kBlock);
  CHECK(Held(caches) <= 256 * kBlock);

  // The dropped domains' budget goes to the one left, traffic or not, an eighth of the budget a call.
  REQUIRE(caches.DropDomain("idle", false, nullptr).ok());
  REQUIRE(caches.DropDomain("late", false, nullptr).ok());
  for (int i = 0; i < 10; ++i) {
    now += 100 * CacheSet::kRebalanceIntervalMs;
    caches.Rebalance(now);
  }
  CHECK(busy->active_bytes() == 256 * kBlock);
}

TEST_CASE("cache set: regression - an idle domain gives up only what the busy one grows into, the budget stays "
          "assigned and the idle one keeps its blocks meanwhile",
          "[unit][cache][regression]") {
  // Before the fix the idle domain was cut to its floor at the first call (128 -> 16 blocks, 84 of its 100 blocks
  // lost) while the busy one grew by an eighth of the budget a call: 80 of the 256 blocks assigned to nobody.
  TempDir dir("flexkv-cacheset", ShmOrTmp());
  CacheSet caches(Options(dir, 256 * kBlock, 2));
  REQUIRE(caches.RecoverPools(false).ok());
  Cache* busy = *caches.Admit("busy", SmallGeometry(), 0, NeverInUse);
  Cache* idle = *caches.Admit("idle", SmallGeometry(), 0, NeverInUse);
  StoreBlocks(*idle, Keys(100));
  StoreBlocks(*busy, Keys(120));
  int64_t now = 1000;
  caches.Rebalance(now);  // the meters start
  uint64_t idle_was = idle->active_bytes(), busy_was = busy->active_bytes();
  for (int i = 0; i < 10; ++i) {
    StoreBlocks(*busy, Keys(busy->capacity_slots() - busy->GetStats().used + 8, 100 + i));  // a full pool, evicting
    busy->counters().bytes_stored += 1ULL << 30;
    now += CacheSet::kRebalanceIntervalMs;
    caches.Rebalance(now);
    INFO("call " << i << ": idle " << idle_was / kBlock << " -> " << idle->active_bytes() / kBlock << " blocks, busy "
                 << busy_was / kBlock << " -> " << busy->active_bytes() / kBlock);
    CHECK(Held(caches) == 256 * kBlock);                                      // all of it assigned, every call
    CHECK(idle_was - idle->active_bytes() == busy->active_bytes() - busy_was);  // given up = grown into
    CHECK(busy->active_bytes() - busy_was <= 32 * kBlock);                    // an eighth of the budget a call
    idle_was = idle->active_bytes();
    busy_was = busy->active_bytes();
    if (i == 0) CHECK(idle->Match(Keys(100), false, nullptr) >= 90);  // the first step cost it only what it gave
  }
  CHECK(idle->active_bytes() == 16 * kBlock);
  CHECK(busy->active_bytes() == 240 * kBlock);
}

TEST_CASE("cache set: a new domain is refused while the others' pinned blocks hold the budget", "[unit][cache]") {
  TempDir dir("flexkv-cacheset", ShmOrTmp());
  CacheSet caches(Options(dir, 64 * kBlock, 2));
  REQUIRE(caches.RecoverPools(false).ok());
  Cache* a = *caches.Admit("a", SmallGeometry(), 0, NeverInUse);
  const std::vector<BlockKey> keys = Keys(64);
  StoreBlocks(*a, keys);
  std::vector<SlotId> pins;
  REQUIRE(a->Match(keys, true, &pins) == 64);
  auto refused = caches.Admit("b", SmallGeometry(), 0, NeverInUse);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == StatusCode::kResourceExhausted);
  CHECK_THAT(refused.status().message(), Catch::Contains("64 pinned") && Catch::Contains("0 B of the budget is free"));
  CHECK(a->Match(keys, false, nullptr) == 64);  // nothing pinned was evicted
  // The refused domain gave "a" back what the planning had held: no shrink is left waiting on its pins.
  CHECK_FALSE(a->shrink_held());
  CHECK(a->active_bytes() == 64 * kBlock);
  a->Unpin(pins);
  auto admitted = caches.Admit("b", SmallGeometry(), 0, NeverInUse);
  REQUIRE(admitted.ok());
  CHECK((*admitted)->active_bytes() == 32 * kBlock);
  CHECK(a->active_bytes() == 32 * kBlock);
  CHECK(a->Match(keys, false, nullptr) <= 32);
}

TEST_CASE("cache set: an unused empty domain gives way to a new one, one in use or holding blocks does not",
          "[unit][cache]") {
  TempDir dir("flexkv-cacheset", ShmOrTmp());
  CacheSet caches(Options(dir, 64 * kBlock, 2));
  REQUIRE(caches.RecoverPools(false).ok());
  REQUIRE(caches.Admit("empty", SmallGeometry(), 0, NeverInUse).ok());
  auto full = caches.Admit("full", SmallGeometry(), 0, NeverInUse);
  REQUIRE(full.ok());
  StoreBlocks(**full, Keys(2));

  // Both slots taken; "empty" is in use: nothing gives way.
  const auto empty_in_use = [](const std::string& name) { return name == "empty"; };
  auto refused = caches.Admit("new", WideGeometry(), 0, empty_in_use);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == StatusCode::kResourceExhausted);
  CHECK_THAT(refused.status().message(), Catch::Contains("all 2 domains"));

  std::vector<std::string> replaced;
  auto admitted = caches.Admit("new", WideGeometry(), 0, NeverInUse, &replaced);
  REQUIRE(admitted.ok());
  CHECK(replaced == std::vector<std::string>{"empty"});
  CHECK(caches.Find("empty") == nullptr);
  CHECK(caches.Find("full") == *full);
  CHECK((*admitted)->Domain().geometry->head_dim == 64);
}

TEST_CASE("cache set: --max-domains 1 refuses a second namespace as a single-domain daemon did", "[unit][cache]") {
  TempDir dir("flexkv-cacheset", ShmOrTmp());
  CacheSet caches(Options(dir, 64 * kBlock, 1));
  REQUIRE(caches.RecoverPools(false).ok());
  auto first = caches.Admit("llama", SmallGeometry(), 0, NeverInUse);
  REQUIRE(first.ok());
  CHECK((*first)->budget_bytes() == 64 * kBlock);
  StoreBlocks(**first, Keys(1));
  auto refused = caches.Admit("mistral", WideGeometry(), 0, NeverInUse);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(refused.status().message(), Catch::Contains("'llama'"));
}

TEST_CASE("cache set: domains never see each other's blocks, and one is dropped without touching the other",
          "[unit][cache]") {
  TempDir dir("flexkv-cacheset", ShmOrTmp());
  CacheSet caches(Options(dir, 64 * kBlock, 2));
  REQUIRE(caches.RecoverPools(false).ok());
  Cache* a = *caches.Admit("a", SmallGeometry(), 0, NeverInUse);
  Cache* b = *caches.Admit("b", SmallGeometry(), 0, NeverInUse);
  const std::vector<BlockKey> keys = Keys(3);
  StoreBlocks(*a, keys);
  CHECK(a->Match(keys, false, nullptr) == 3);
  CHECK(b->Match(keys, false, nullptr) == 0);

  auto missing = caches.DropDomain("c", false, nullptr);
  CHECK(missing.code() == StatusCode::kNotFound);
  CHECK_THAT(missing.message(), Catch::Contains("'a'") && Catch::Contains("'b'"));
  a->counters().hit_blocks += 5;  // as the request handlers count a's hits
  CHECK(caches.Domains()[0].counters.hit_blocks == 5);
  uint64_t dropped = 0;
  REQUIRE(caches.DropDomain("a", false, &dropped).ok());
  CHECK(dropped == 3);
  CHECK(caches.Find("a") == nullptr);
  CHECK_FALSE(std::filesystem::exists(dir.path + "/pool"));
  StoreBlocks(*b, keys);
  CHECK(b->Match(keys, false, nullptr) == 3);
  // The freed slot (and its Cache object) serves the next domain, with a new generation.
  const uint64_t generation = a->generation();
  Cache* c = *caches.Admit("c", WideGeometry(), 0, NeverInUse);
  CHECK(c == a);
  CHECK(c->generation() != generation);
  CHECK(c->Match(keys, false, nullptr) == 0);
  // Its counters start at zero; the daemon's totals keep a's.
  for (const CacheSet::Domain& d : caches.Domains()) CHECK(d.counters.hit_blocks == 0);
  CHECK(caches.TotalCounters().hit_blocks == 5);
}

TEST_CASE("cache set: a restart re-attaches every domain with its blocks and active size, a changed layout is refused",
          "[unit][cache]") {
  TempDir dir("flexkv-cacheset", ShmOrTmp());
  const std::vector<BlockKey> keys = Keys(2);
  {
    CacheSetOptions o = Options(dir, 64 * kBlock, 2);
    o.namespace_pool_bytes.emplace("fixed", 16 * kBlock);
    CacheSet caches(std::move(o));
    REQUIRE(caches.RecoverPools(false).ok());
    StoreBlocks(**caches.Admit("default", SmallGeometry(), 0, NeverInUse), keys);
    StoreBlocks(**caches.Admit("fixed", WideGeometry(), 0, NeverInUse), keys);
  }
  {
    CacheSetOptions o = Options(dir, 64 * kBlock, 2);
    o.namespace_pool_bytes.emplace("fixed", 16 * kBlock);
    CacheSet caches(std::move(o));
    REQUIRE(caches.RecoverPools(false).ok());
    const std::vector<CacheSet::Domain> domains = caches.Domains();
    REQUIRE(domains.size() == 2);
    Cache* fixed = caches.Find("fixed");
    REQUIRE(fixed != nullptr);
    CHECK(fixed->budget_bytes() == 16 * kBlock);
    CHECK(fixed->active_bytes() == 16 * kBlock);
    // "default" (laid out for the budget) gave "fixed" its 16 blocks when it came: 48 active.
    CHECK(caches.Find("default")->budget_bytes() == 64 * kBlock);
    CHECK(caches.Find("default")->active_bytes() == 48 * kBlock);
    // Served once their bytes are verified (in the background).
    for (Cache* c : {fixed, caches.Find("default")}) {
      while (c->GetStats().unverified != 0) std::this_thread::yield();
      CHECK(c->Match(keys, false, nullptr) == 2);
    }
  }
  {
    CacheSetOptions o = Options(dir, 64 * kBlock, 2);
    o.namespace_pool_bytes.emplace("fixed", 24 * kBlock);  // the config changed its share
    CacheSet caches(std::move(o));
    flexkv::Status refused = caches.RecoverPools(false);
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(refused.message(), Catch::Contains(dir.path + "/pool.1") && Catch::Contains("--discard-pool"));
  }
  {
    // Fewer domains: pool.1 is beyond them, kept (and logged) without --discard-pool.
    CacheSet caches(Options(dir, 64 * kBlock, 1));
    REQUIRE(caches.RecoverPools(false).ok());
    CHECK(caches.Find("default") != nullptr);
    CHECK(caches.Find("fixed") == nullptr);
    CHECK(std::filesystem::exists(dir.path + "/pool.1"));
  }
  {
    CacheSetOptions o = Options(dir, 64 * kBlock, 2);
    o.namespace_pool_bytes.emplace("fixed", 24 * kBlock);
    CacheSet caches(std::move(o));
    REQUIRE(caches.RecoverPools(true).ok());  // --discard-pool: that domain is dropped, the other kept
    CHECK(caches.Find("fixed") == nullptr);
    CHECK(caches.Find("default") != nullptr);
  }
}

namespace {

// SmallGeometry plus a sliding window of the same shape, 4 blocks (a gpt-oss-like domain of 4 KiB slots).
flexkv::Geometry WindowGeometry() {
  flexkv::Geometry g = SmallGeometry();
  flexkv::ComponentSpec swa;
  swa.kind = flexkv::ComponentKind::kSlidingWindow;
  swa.num_layers = g.num_layers;
  swa.kv_planes = g.kv_planes;
  swa.kv_heads_per_rank = g.kv_heads_per_rank;
  swa.head_dim = g.head_dim;
  swa.dtype_bytes = g.dtype_bytes;
  swa.window_tokens = 4 * g.tokens_per_block;
  g.components.push_back(swa);
  return g;
}

// A hybrid store of `keys` from the root (all or none), as the data plane does it: REQUIRE it is reserved.
void StoreHybrid(Cache& cache, std::span<const BlockKey> keys) {
  Cache::HybridReservation r = cache.ReserveHybrid(flexkv::kRootParent, keys, {});
  REQUIRE(r.shortfall == StatusCode::kOk);
  std::vector<std::vector<uint64_t>> sums(r.slots.size());
  for (SlotId s : r.full.slots) sums[0].push_back(flexkv::BlockChecksum(cache.SlotData(s), cache.SlotBytes(s)));
  for (size_t c = 1; c < r.slots.size(); ++c) {
    for (SlotId s : r.slots[c]) {
      if (s != flexkv::ComponentIndex::kNoSlot) {
        sums[c].push_back(flexkv::BlockChecksum(cache.SlotData(s), cache.SlotBytes(s)));
      }
    }
  }
  cache.CommitHybrid(flexkv::kRootParent, keys, r, sums);
}

}  // namespace

TEST_CASE("cache set: a hybrid domain's sub-pools follow what is stored into each, within its share",
          "[unit][cache][hybrid]") {
  TempDir dir("flexkv-cacheset", ShmOrTmp());
  CacheSet caches(Options(dir, 256 * kBlock, 1));
  REQUIRE(caches.RecoverPools(false).ok());
  Cache* cache = *caches.Admit("gpt-oss", WindowGeometry(), 0, NeverInUse);
  // Each sub-pool laid out for the whole budget (256 slots, grants of 4); the window starts at one grant.
  REQUIRE(cache->ActiveSlots() == std::vector<uint32_t>{252, 4});
  CHECK(cache->max_bytes() == 256 * kBlock);
  int64_t now = 1000;
  caches.Rebalance(now);  // the meters start
  // Window churn: each store extends a prompt by one block (one FULL block, one window entry).
  uint64_t chain = 1;
  const auto churn = [&] {
    const std::vector<BlockKey> keys = Keys(16, chain++);
    for (size_t n = 1; n <= keys.size(); ++n) StoreHybrid(*cache, std::span<const BlockKey>(keys).first(n));
  };
  for (int i = 0; i < 12; ++i) {
    churn();
    now += CacheSet::kRebalanceIntervalMs;
    caches.Rebalance(now);
    CHECK(cache->active_bytes() <= 256 * kBlock);
  }
  // Half and half by what is stored, reached in steps of at most an eighth of the share.
  const std::vector<uint32_t> churned = cache->ActiveSlots();
  CHECK(churned[1] == 128);
  CHECK(churned[0] == 128);
  // Demand moves to FULL: long prompts stored whole (64 FULL blocks, a window of 4). Over a few minutes of that the
  // window gives memory back (it keeps at least one grant).
  for (int i = 0; i < 40; ++i) {
    StoreHybrid(*cache, Keys(64, 1000 + i));
    now += 2 * CacheSet::kRebalanceIntervalMs;
    caches.Rebalance(now);
    CHECK(cache->active_bytes() <= 256 * kBlock);
  }
  const std::vector<uint32_t> moved = cache->ActiveSlots();
  CHECK(moved[1] < churned[1]);
  CHECK(moved[1] >= 4);
  CHECK(moved[0] > churned[0]);
  // What is stored now is a hit, window included.
  StoreHybrid(*cache, Keys(64, 2000));
  CHECK(cache->Match(Keys(64, 2000), false, nullptr) == 64);
}

TEST_CASE("cache set: operator shares keep a hybrid domain's split fixed", "[unit][cache][hybrid]") {
  TempDir dir("flexkv-cacheset", ShmOrTmp());
  CacheSetOptions o = Options(dir, 256 * kBlock, 1);
  o.split.swa_share = 0.25;
  CacheSet caches(o);
  REQUIRE(caches.RecoverPools(false).ok());
  Cache* cache = *caches.Admit("gpt-oss", WindowGeometry(), 0, NeverInUse);
  const std::vector<uint32_t> before = cache->ActiveSlots();
  REQUIRE(before == std::vector<uint32_t>{192, 64});
  int64_t now = 1000;
  caches.Rebalance(now);
  uint64_t chain = 1;
  for (int i = 0; i < 8; ++i) {
    const std::vector<BlockKey> keys = Keys(16, chain++);
    for (size_t n = 1; n <= keys.size(); ++n) StoreHybrid(*cache, std::span<const BlockKey>(keys).first(n));
    now += CacheSet::kRebalanceIntervalMs;
    caches.Rebalance(now);
  }
  CHECK(cache->ActiveSlots() == before);
}
