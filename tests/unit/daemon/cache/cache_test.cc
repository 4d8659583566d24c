// Cache: the pool created by the first admitted session (or re-attached at start), the index operations a
// request goes through (match, reserve, commit, abort), and the pool announcing itself to its listener.
#include <catch2/catch.hpp>

#include <span>
#include <vector>

#include "daemon/cache/cache.h"
#include "flexkv/block_key.h"
#include "tests/unit/daemon/cache/temp_cache.h"

using flexkv::BlockKey;
using flexkv::PoolRegion;
using flexkv::SlotId;
using flexkv::StatusCode;
using flexkv::testing::SmallGeometry;
using flexkv::testing::TempCache;

namespace {

std::vector<BlockKey> Keys(uint64_t chain, size_t n) {
  std::vector<BlockKey> keys(n);
  for (size_t i = 0; i < n; ++i) keys[i] = BlockKey{chain * 1000 + i + 1, chain};
  return keys;
}

}  // namespace

TEST_CASE("cache: the first Admit creates the pool - a different geometry is refused", "[unit][cache]") {
  TempCache t;
  flexkv::Cache& cache = t.cache();
  REQUIRE(cache.RecoverPool(/*discard=*/false).ok());
  CHECK_FALSE(cache.has_pool());
  CHECK_FALSE(cache.pool_region().has_value());
  REQUIRE(cache.Admit("ns", SmallGeometry()).ok());
  CHECK(cache.has_pool());
  CHECK(cache.block_bytes() == SmallGeometry().host_block_bytes());
  const auto region = cache.pool_region();
  REQUIRE(region.has_value());
  CHECK(region->slot_bytes == cache.block_bytes());
  CHECK(region->slots == 64);
  CHECK(region->bytes == 64 * region->slot_bytes);
  CHECK(region->SlotData(3) == cache.SlotData(3));
  CHECK(cache.GetStats().capacity == 64);

  flexkv::Geometry other = SmallGeometry();
  other.num_layers = 4;
  CHECK(cache.Admit("ns", other).code() == StatusCode::kFailedPrecondition);
}

TEST_CASE("cache: a store is matchable only after Commit - Abort returns its slots", "[unit][cache]") {
  TempCache t;
  flexkv::Cache& cache = t.cache();
  REQUIRE(cache.RecoverPool(false).ok());
  REQUIRE(cache.Admit("ns", SmallGeometry()).ok());
  const std::vector<BlockKey> keys = Keys(1, 4);

  flexkv::PrefixIndex::Reservation r = cache.Reserve(flexkv::kRootParent, keys);
  CHECK(r.cached == 0);
  REQUIRE(r.slots.size() == 4);
  CHECK(r.shortfall == StatusCode::kOk);
  CHECK(cache.Match(keys, false, nullptr) == 0);  // pending: not visible before its bytes are complete
  cache.Commit(flexkv::kRootParent, keys, 0, r.slots);
  CHECK(cache.Match(keys, false, nullptr) == 4);
  CHECK(cache.GetStats().blocks == 4);

  // A longer chain: the first 4 are cached, the rest reserved, then aborted.
  const std::vector<BlockKey> longer = Keys(1, 6);
  flexkv::PrefixIndex::Reservation r2 = cache.Reserve(flexkv::kRootParent, longer);
  CHECK(r2.cached == 4);
  REQUIRE(r2.slots.size() == 2);
  const uint64_t used = cache.GetStats().used;
  cache.Abort(r2.slots);
  CHECK(cache.GetStats().used == used - 2);
  CHECK(cache.Match(longer, false, nullptr) == 4);
}

TEST_CASE("cache: pinned matches hold their slots until unpinned", "[unit][cache]") {
  TempCache t;
  flexkv::Cache& cache = t.cache();
  REQUIRE(cache.RecoverPool(false).ok());
  REQUIRE(cache.Admit("ns", SmallGeometry()).ok());
  const std::vector<BlockKey> keys = Keys(2, 3);
  auto r = cache.Reserve(flexkv::kRootParent, keys);
  cache.Commit(flexkv::kRootParent, keys, 0, r.slots);
  std::vector<SlotId> pinned;
  CHECK(cache.Match(keys, /*pin=*/true, &pinned) == 3);
  CHECK(pinned == r.slots);
  CHECK(cache.GetStats().pinned == 3);
  cache.Unpin(pinned);
  CHECK(cache.GetStats().pinned == 0);
}

TEST_CASE("cache: the pool announces itself once to its listener, at creation or at once if it exists",
          "[unit][cache]") {
  TempCache t;
  std::vector<PoolRegion> heard;
  t.cache().SetPoolListener([&](const PoolRegion& r) { heard.push_back(r); });
  REQUIRE(t.cache().RecoverPool(false).ok());
  CHECK(heard.empty());  // no pool file yet
  REQUIRE(t.cache().Admit("ns", SmallGeometry()).ok());
  REQUIRE(heard.size() == 1);
  CHECK(heard[0].base == t.cache().SlotData(0));
  CHECK(heard[0].slots == 64);
  REQUIRE(t.cache().Admit("ns", SmallGeometry()).ok());
  CHECK(heard.size() == 1);  // a second session does not announce it again

  // A listener set after the pool exists hears of it at once.
  std::vector<PoolRegion> late;
  t.cache().SetPoolListener([&](const PoolRegion& r) { late.push_back(r); });
  REQUIRE(late.size() == 1);
  CHECK(late[0].base == heard[0].base);
}

TEST_CASE("cache: a restarted cache re-attaches the pool, announces it, and serves the committed blocks",
          "[unit][cache]") {
  TempCache t;
  const std::vector<BlockKey> keys = Keys(3, 5);
  {
    REQUIRE(t.cache().RecoverPool(false).ok());
    REQUIRE(t.cache().Admit("ns", SmallGeometry()).ok());
    auto r = t.cache().Reserve(flexkv::kRootParent, keys);
    REQUIRE(r.slots.size() == 5);
    t.cache().Commit(flexkv::kRootParent, keys, 0, std::span(r.slots).first(3));  // the last two never completed
  }
  t.Reopen();
  int announced = 0;
  t.cache().SetPoolListener([&](const PoolRegion&) { ++announced; });
  REQUIRE(t.cache().RecoverPool(false).ok());
  CHECK(announced == 1);
  CHECK(t.cache().has_pool());
  CHECK(t.cache().Match(keys, false, nullptr) == 3);
  CHECK(t.cache().Domain().model_namespace == "ns");
}

TEST_CASE("cache: a store under a parent survives a restart under that parent, reachable from the root",
          "[unit][cache]") {
  TempCache t;
  const std::vector<BlockKey> keys = Keys(4, 6);
  {
    REQUIRE(t.cache().RecoverPool(false).ok());
    REQUIRE(t.cache().Admit("ns", SmallGeometry()).ok());
    auto head = t.cache().Reserve(flexkv::kRootParent, std::span(keys).first(3));
    REQUIRE(head.slots.size() == 3);
    t.cache().Commit(flexkv::kRootParent, std::span(keys).first(3), 0, head.slots);
    auto tail = t.cache().Reserve(keys[2], std::span(keys).subspan(3));
    REQUIRE(tail.shortfall == StatusCode::kOk);
    REQUIRE(tail.slots.size() == 3);
    t.cache().Commit(keys[2], std::span(keys).subspan(3), 0, tail.slots);
    CHECK(t.cache().Match(keys, false, nullptr) == 6);
  }
  t.Reopen();
  REQUIRE(t.cache().RecoverPool(false).ok());
  CHECK(t.cache().GetStats().blocks == 6);
  CHECK(t.cache().Match(keys, false, nullptr) == 6);  // the pool recorded keys[3]'s parent as keys[2], not root
}

TEST_CASE("cache: a store whose parent is not cached is refused and reserves nothing", "[unit][cache]") {
  TempCache t;
  flexkv::Cache& cache = t.cache();
  REQUIRE(cache.RecoverPool(false).ok());
  REQUIRE(cache.Admit("ns", SmallGeometry()).ok());
  const std::vector<BlockKey> keys = Keys(5, 4);
  auto r = cache.Reserve(keys[1], std::span(keys).subspan(2));
  CHECK(r.parent_refused);
  CHECK(r.shortfall == StatusCode::kFailedPrecondition);
  CHECK(r.cached == 0);
  CHECK(r.slots.empty());
  CHECK(cache.GetStats().used == 0);
}

TEST_CASE("cache: DropDomain waits for pins and stores, tells the listener, and the next Admit starts afresh",
          "[unit][cache]") {
  TempCache t;
  flexkv::Cache& cache = t.cache();
  int registered = 0, unregistered = 0;
  cache.SetPoolListener([&](const PoolRegion&) { ++registered; }, [&] { ++unregistered; });
  REQUIRE(cache.RecoverPool(false).ok());
  CHECK(cache.DropDomain(false, nullptr).code() == StatusCode::kNotFound);
  REQUIRE(cache.Admit("ns", SmallGeometry()).ok());
  const uint64_t first_generation = cache.generation();
  const std::vector<BlockKey> keys = Keys(2, 3);
  flexkv::PrefixIndex::Reservation r = cache.Reserve(flexkv::kRootParent, keys);
  REQUIRE(r.slots.size() == 3);
  const flexkv::Status storing = cache.DropDomain(false, nullptr);
  CHECK(storing.code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(storing.message(), Catch::Contains("3 blocks are being stored"));
  cache.Commit(flexkv::kRootParent, keys, 0, r.slots);
  std::vector<SlotId> pinned;
  REQUIRE(cache.Match(keys, /*pin=*/true, &pinned) == 3);
  CHECK(cache.DropDomain(false, nullptr).code() == StatusCode::kFailedPrecondition);
  cache.Unpin(pinned);
  CHECK(cache.DropDomain(/*only_if_empty=*/true, nullptr).code() == StatusCode::kFailedPrecondition);  // 3 blocks

  uint64_t dropped = 0;
  REQUIRE(cache.DropDomain(false, &dropped).ok());
  CHECK(dropped == 3);
  CHECK(unregistered == 1);
  CHECK_FALSE(cache.has_pool());
  CHECK(cache.generation() != first_generation);
  CHECK(cache.Match(keys, false, nullptr) == 0);
  CHECK_FALSE(cache.Domain().geometry.has_value());

  flexkv::Geometry other = SmallGeometry();
  other.num_layers = 4;
  REQUIRE(cache.Admit("other", other).ok());  // a new domain, a new pool
  CHECK(registered == 2);
  CHECK(cache.block_bytes() == other.host_block_bytes());
  CHECK(cache.Match(keys, false, nullptr) == 0);
  CHECK(cache.GetStats().blocks == 0);
}
