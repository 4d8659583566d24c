// Cache: the pool created by the first admitted session (or re-attached at start), the index operations a
// request goes through (match, reserve, commit, abort), and the pool announcing itself to its listener.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <string>
#include <span>
#include <thread>
#include <vector>

#include "common/block_checksum.h"
#include "daemon/cache/block_verifier.h"
#include "daemon/cache/cache.h"
#include "flexkv/block_key.h"
#include "tests/unit/daemon/cache/temp_cache.h"

using flexkv::BlockKey;
using flexkv::PoolRegion;
using flexkv::SlotId;
using flexkv::StatusCode;
using flexkv::testing::SmallGeometry;
using flexkv::testing::StoreBlocks;
using flexkv::testing::TempCache;

namespace {

std::vector<BlockKey> Keys(uint64_t chain, size_t n) {
  std::vector<BlockKey> keys(n);
  for (size_t i = 0; i < n; ++i) keys[i] = BlockKey{chain * 1000 + i + 1, chain};
  return keys;
}

// Fills the slots with bytes of their own and commits them with their content checksums, as a store does.
void FillAndCommit(flexkv::Cache& cache, std::span<const BlockKey> keys, size_t first, std::span<const SlotId> slots,
                   const BlockKey& parent = flexkv::kRootParent) {
  std::vector<uint64_t> sums;
  for (SlotId s : slots) {
    uint8_t* bytes = cache.SlotData(s);
    for (uint64_t i = 0; i < cache.block_bytes(); ++i) bytes[i] = static_cast<uint8_t>(i * 3 + s);
    sums.push_back(flexkv::BlockChecksum(bytes, cache.block_bytes()));
  }
  cache.Commit(parent, keys, first, slots, sums);
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
  FillAndCommit(cache, keys, 0, r.slots);
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
  FillAndCommit(cache, keys, 0, r.slots);
  std::vector<SlotId> pinned;
  CHECK(cache.Match(keys, /*pin=*/true, &pinned) == 3);
  CHECK(pinned == r.slots);
  CHECK(cache.GetStats().pinned == 3);
  cache.Unpin(pinned);
  CHECK(cache.GetStats().pinned == 0);
}

TEST_CASE("cache: the pool announces each of its grants once to its listener, at creation or at once if it exists",
          "[unit][cache]") {
  TempCache t;
  std::vector<PoolRegion> heard;
  t.cache().AddObserver(std::make_shared<flexkv::FunctionCacheObserver>([&](const PoolRegion& r) {
    heard.push_back(r);
    return flexkv::Status::Ok();
  }, nullptr));
  REQUIRE(t.cache().RecoverPool(false).ok());
  CHECK(heard.empty());  // no pool file yet
  REQUIRE(t.cache().Admit("ns", SmallGeometry()).ok());
  REQUIRE(heard.size() == 16);  // 64 slots in grants of 4, in slot order
  for (size_t i = 0; i < heard.size(); ++i) {
    CHECK(heard[i].base == t.cache().SlotData(static_cast<SlotId>(4 * i)));
    CHECK(heard[i].slots == 4);
    CHECK(heard[i].bytes == 4 * 4096);
    CHECK(heard[i].slot_bytes == 4096);
  }
  REQUIRE(t.cache().Admit("ns", SmallGeometry()).ok());
  CHECK(heard.size() == 16);  // a second session does not announce it again

  // A listener set after the pool exists hears of it at once.
  std::vector<PoolRegion> late;
  t.cache().AddObserver(std::make_shared<flexkv::FunctionCacheObserver>([&](const PoolRegion& r) {
    late.push_back(r);
    return flexkv::Status::Ok();
  }, nullptr));
  REQUIRE(late.size() == 16);
  CHECK(late[0].base == heard[0].base);
  CHECK(heard.size() == 16);  // only the new observer hears of the grants that exist
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
    FillAndCommit(t.cache(), keys, 0, std::span(r.slots).first(3));  // the last two never completed
  }
  t.Reopen();
  int announced = 0;
  t.cache().AddObserver(std::make_shared<flexkv::FunctionCacheObserver>([&](const PoolRegion&) {
    ++announced;
    return flexkv::Status::Ok();
  }, nullptr));
  REQUIRE(t.cache().RecoverPool(false).ok());
  CHECK(announced == 16);  // each grant
  CHECK(t.cache().has_pool());
  // Restored blocks are served only once their bytes are verified.
  CHECK(t.cache().Match(keys, false, nullptr) == 0);
  CHECK(t.cache().GetStats().unverified == 3);
  flexkv::BlockVerifier(&t.cache()).VerifyRestored();
  CHECK(t.cache().GetStats().unverified == 0);
  CHECK(t.cache().Match(keys, false, nullptr) == 3);
  CHECK(t.cache().counters().data_loss_blocks.load() == 0);
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
    FillAndCommit(t.cache(), std::span(keys).first(3), 0, head.slots);
    auto tail = t.cache().Reserve(keys[2], std::span(keys).subspan(3));
    REQUIRE(tail.shortfall == StatusCode::kOk);
    REQUIRE(tail.slots.size() == 3);
    FillAndCommit(t.cache(), std::span(keys).subspan(3), 0, tail.slots, keys[2]);
    CHECK(t.cache().Match(keys, false, nullptr) == 6);
  }
  t.Reopen();
  REQUIRE(t.cache().RecoverPool(false).ok());
  flexkv::BlockVerifier(&t.cache()).VerifyRestored();
  CHECK(t.cache().GetStats().blocks == 6);
  CHECK(t.cache().Match(keys, false, nullptr) == 6);  // the pool recorded keys[3]'s parent as keys[2], not root
}

TEST_CASE("cache: a restored block whose bytes changed is never served - dropped with its descendants and counted",
          "[unit][cache][checksum][regression]") {
  TempCache t;
  const std::vector<BlockKey> a = Keys(4, 5), b = Keys(5, 3);
  std::vector<SlotId> a_slots;
  {
    REQUIRE(t.cache().RecoverPool(false).ok());
    REQUIRE(t.cache().Admit("ns", SmallGeometry()).ok());
    auto ra = t.cache().Reserve(flexkv::kRootParent, a);
    a_slots = ra.slots;
    FillAndCommit(t.cache(), a, 0, ra.slots);
    auto rb = t.cache().Reserve(flexkv::kRootParent, b);
    FillAndCommit(t.cache(), b, 0, rb.slots);
    t.cache().SlotData(a_slots[2])[100] ^= 0x01;  // one bit of a's third block, as if flipped while stopped
  }
  t.Reopen();
  REQUIRE(t.cache().RecoverPool(false).ok());
  flexkv::BlockVerifier(&t.cache()).VerifyRestored();
  CHECK(t.cache().Match(a, false, nullptr) == 2);  // stops before the changed block
  CHECK(t.cache().Match(b, false, nullptr) == 3);
  CHECK(t.cache().counters().data_loss_blocks.load() == 1);
  CHECK(t.cache().GetStats().blocks == 5);
  CHECK(t.cache().GetStats().used == 5);  // the failed block's and its descendants' slots are free again
  // Nor after another restart: the dropped entries were cleared.
  t.Reopen();
  REQUIRE(t.cache().RecoverPool(false).ok());
  CHECK(t.cache().GetStats().unverified == 5);
  flexkv::BlockVerifier(&t.cache()).VerifyRestored();
  CHECK(t.cache().Match(a, false, nullptr) == 2);
  CHECK(t.cache().counters().data_loss_blocks.load() == 0);
}

// --verify-threads: a batch's blocks are read by several threads; each block's verdict is its own, whichever thread
// read it, and the failed ones are dropped with their descendants as with one thread.
TEST_CASE("cache: the restart check with several threads passes and drops exactly what one thread does",
          "[unit][cache][checksum]") {
  for (unsigned threads : {1u, 2u, 3u, 8u}) {
    CAPTURE(threads);
    TempCache t;
    std::vector<std::vector<BlockKey>> chains;
    std::vector<std::vector<SlotId>> slots;
    {
      REQUIRE(t.cache().RecoverPool(false).ok());
      REQUIRE(t.cache().Admit("ns", SmallGeometry()).ok());
      for (uint64_t c = 0; c < 12; ++c) {
        chains.push_back(Keys(10 + c, 4));
        auto r = t.cache().Reserve(flexkv::kRootParent, chains.back());
        REQUIRE(r.slots.size() == 4);
        FillAndCommit(t.cache(), chains.back(), 0, r.slots);
        slots.push_back(r.slots);
      }
      // Chain 3 changed at its second block, chain 7 at its last, chain 11 at its first.
      t.cache().SlotData(slots[3][1])[7] ^= 0x10;
      t.cache().SlotData(slots[7][3])[0] ^= 0x01;
      t.cache().SlotData(slots[11][0])[99] ^= 0x80;
    }
    t.Reopen();
    REQUIRE(t.cache().RecoverPool(false).ok());
    flexkv::BlockVerifier(&t.cache(), threads).VerifyRestored();
    for (size_t c = 0; c < chains.size(); ++c) {
      CAPTURE(c);
      const size_t want = c == 3 ? 1 : c == 7 ? 3 : c == 11 ? 0 : 4;
      CHECK(t.cache().Match(chains[c], false, nullptr) == want);
    }
    CHECK(t.cache().counters().data_loss_blocks.load() == 3);
    CHECK(t.cache().GetStats().unverified == 0);
    CHECK(t.cache().GetStats().blocks == 48 - 3 - 1 - 4);  // the failed ones and their descendants
  }
}

TEST_CASE("cache: a pool file of layout version 1 is dropped at start with one log line, not refused",
          "[unit][cache][checksum]") {
  TempCache t;
  {
    REQUIRE(t.cache().RecoverPool(false).ok());
    REQUIRE(t.cache().Admit("ns", SmallGeometry()).ok());
    const std::vector<BlockKey> keys = Keys(6, 2);
    FillAndCommit(t.cache(), keys, 0, t.cache().Reserve(flexkv::kRootParent, keys).slots);
  }
  t.Reopen();
  {
    const int fd = open((t.dir() + "/pool").c_str(), O_WRONLY | O_CLOEXEC);
    REQUIRE(fd >= 0);
    const uint32_t v1 = 1;
    REQUIRE(pwrite(fd, &v1, sizeof(v1), 8) == sizeof(v1));
    close(fd);
  }
  REQUIRE(t.cache().RecoverPool(false).ok());
  CHECK_FALSE(t.cache().has_pool());
  CHECK_FALSE(std::filesystem::exists(t.dir() + "/pool"));
  REQUIRE(t.cache().Admit("other", SmallGeometry()).ok());  // the first Attach fixes the domain again
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
  cache.AddObserver(std::make_shared<flexkv::FunctionCacheObserver>(
      [&](const PoolRegion&) {
        ++registered;
        return flexkv::Status::Ok();
      },
      [&](const PoolRegion&) { ++unregistered; }));
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
  FillAndCommit(cache, keys, 0, r.slots);
  std::vector<SlotId> pinned;
  REQUIRE(cache.Match(keys, /*pin=*/true, &pinned) == 3);
  CHECK(cache.DropDomain(false, nullptr).code() == StatusCode::kFailedPrecondition);
  cache.Unpin(pinned);
  CHECK(cache.DropDomain(/*only_if_empty=*/true, nullptr).code() == StatusCode::kFailedPrecondition);  // 3 blocks

  uint64_t dropped = 0;
  REQUIRE(cache.DropDomain(false, &dropped).ok());
  CHECK(dropped == 3);
  CHECK(unregistered == 16);  // each grant
  CHECK_FALSE(cache.has_pool());
  CHECK(cache.generation() != first_generation);
  CHECK(cache.Match(keys, false, nullptr) == 0);
  CHECK_FALSE(cache.Domain().geometry.has_value());

  flexkv::Geometry other = SmallGeometry();
  other.num_layers = 4;
  REQUIRE(cache.Admit("other", other).ok());  // a new domain, a new pool
  CHECK(registered == 32);
  CHECK(cache.block_bytes() == other.host_block_bytes());
  CHECK(cache.Match(keys, false, nullptr) == 0);
  CHECK(cache.GetStats().blocks == 0);
}

TEST_CASE("cache: a scrub drops a block whose bytes changed under the running cache - a pinned one keeps its slot "
          "until unpinned",
          "[unit][cache][checksum][regression]") {
  TempCache t;
  flexkv::Cache& cache = t.cache();
  REQUIRE(cache.RecoverPool(false).ok());
  REQUIRE(cache.Admit("ns", SmallGeometry()).ok());
  const std::vector<BlockKey> a = Keys(7, 4), b = Keys(8, 2);
  auto ra = cache.Reserve(flexkv::kRootParent, a);
  FillAndCommit(cache, a, 0, ra.slots);
  auto rb = cache.Reserve(flexkv::kRootParent, b);
  FillAndCommit(cache, b, 0, rb.slots);
  flexkv::BlockVerifier verifier(&cache);

  auto clean = verifier.Scrub({});
  REQUIRE(clean.ok());
  CHECK(clean->checked_blocks == 6);
  CHECK(clean->failed_blocks == 0);
  CHECK(clean->bytes == 6 * cache.block_bytes());

  std::vector<SlotId> pinned;
  REQUIRE(cache.Match(a, /*pin=*/true, &pinned) == 4);  // a load holds a's blocks
  cache.SlotData(ra.slots[1])[7] ^= 0x80;
  // A store extending b is in flight when b's first block turns out bad.
  std::vector<BlockKey> b_longer = Keys(8, 3);
  cache.SlotData(rb.slots[0])[0] ^= 0x02;
  auto pending = cache.Reserve(flexkv::kRootParent, b_longer);
  REQUIRE(pending.slots.size() == 1);

  auto found = verifier.Scrub({});
  REQUIRE(found.ok());
  CHECK(found->checked_blocks == 6);
  CHECK(found->failed_blocks == 2);
  CHECK(found->dropped_blocks == 3 + 2);  // a[1..3] and b[0..1]
  CHECK(cache.counters().data_loss_blocks.load() == 2);
  CHECK(cache.Match(a, false, nullptr) == 1);
  CHECK(cache.Match(b_longer, false, nullptr) == 0);
  CHECK(cache.GetStats().used == 1 + 3 + 2 + 1);  // a[0]; a[1..3] pinned; b[0..1] lead to the pending store; it
  cache.Unpin(pinned);
  CHECK(cache.GetStats().used == 1 + 2 + 1);
  // The store that was in flight under the dropped block finishes: nothing of it is published.
  FillAndCommit(cache, b_longer, 2, pending.slots);
  CHECK(cache.GetStats().used == 1);
  CHECK(cache.Match(b_longer, false, nullptr) == 0);
  // The keys can be stored again.
  auto again = cache.Reserve(flexkv::kRootParent, b);
  REQUIRE(again.slots.size() == 2);
  FillAndCommit(cache, b, 0, again.slots);
  CHECK(cache.Match(b, false, nullptr) == 2);
}

TEST_CASE("cache: a scrub running beside stores, evictions and pinned reads finds no false failures",
          "[unit][cache][checksum][concurrency]") {
  // 64 slots and chains of 4 from 40 prompts: stores evict all the time, so a scrub that read a slot without
  // holding it would see bytes change under it and report a failure.
  TempCache t;
  flexkv::Cache& cache = t.cache();
  REQUIRE(cache.RecoverPool(false).ok());
  REQUIRE(cache.Admit("ns", SmallGeometry()).ok());
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> stores{0};
  std::thread writer([&] {
    uint64_t round = 0;
    while (!stop.load()) {
      const std::vector<BlockKey> keys = Keys(100 + round % 40, 4);
      auto r = cache.Reserve(flexkv::kRootParent, keys);
      // Each store writes the bytes of its own round, so an evicted and re-stored slot really changes.
      std::vector<uint64_t> sums;
      for (SlotId s : r.slots) {
        uint8_t* bytes = cache.SlotData(s);
        for (uint64_t i = 0; i < cache.block_bytes(); ++i) bytes[i] = static_cast<uint8_t>(i + round * 7 + s);
        sums.push_back(flexkv::BlockChecksum(bytes, cache.block_bytes()));
      }
      cache.Commit(flexkv::kRootParent, keys, r.cached, r.slots, sums);
      ++round;
      stores.fetch_add(1);
    }
  });
  std::thread reader([&] {
    uint64_t round = 0;
    while (!stop.load()) {
      std::vector<SlotId> pinned;
      cache.Match(Keys(100 + round++ % 40, 4), /*pin=*/true, &pinned);
      cache.Unpin(pinned);
    }
  });
  flexkv::BlockVerifier verifier(&cache);
  uint64_t checked = 0;
  for (int i = 0; i < 200 || stores.load() < 200; ++i) {
    auto report = verifier.Scrub({});
    REQUIRE(report.ok());
    CHECK(report->failed_blocks == 0);
    checked += report->checked_blocks;
  }
  stop.store(true);
  writer.join();
  reader.join();
  CHECK(checked > 0);
  CHECK(cache.counters().data_loss_blocks.load() == 0);
}

TEST_CASE("cache: a scrub stops when cancelled, and only one runs at a time", "[unit][cache][checksum]") {
  TempCache t;
  flexkv::Cache& cache = t.cache();
  flexkv::BlockVerifier verifier(&cache);
  REQUIRE(cache.RecoverPool(false).ok());
  CHECK(verifier.Scrub({}).status().code() == StatusCode::kFailedPrecondition);  // no pool yet
  REQUIRE(cache.Admit("ns", SmallGeometry()).ok());
  const std::vector<BlockKey> keys = Keys(9, 8);
  FillAndCommit(cache, keys, 0, cache.Reserve(flexkv::kRootParent, keys).slots);

  // The cancel callback runs inside the scrub: a second scrub started from there is refused.
  flexkv::ScrubOptions nested;
  flexkv::Status inner;
  nested.cancelled = [&] {
    if (inner.ok()) inner = verifier.Scrub({}).status();
    return false;
  };
  auto outer = verifier.Scrub(nested);
  REQUIRE(outer.ok());
  CHECK(outer->checked_blocks == 8);
  CHECK(inner.code() == StatusCode::kAborted);

  flexkv::ScrubOptions cancelled;
  cancelled.cancelled = [] { return true; };
  auto stopped = verifier.Scrub(cancelled);
  CHECK(stopped.status().code() == StatusCode::kCancelled);
  CHECK_THAT(stopped.status().message(), Catch::Contains("scrub cancelled after checking 0 blocks"));
  // Rate-limited, it still checks everything (the limit only spaces the ranges out).
  flexkv::ScrubOptions slow;
  slow.max_bytes_per_s = 1ULL << 30;
  auto paced = verifier.Scrub(slow);
  REQUIRE(paced.ok());
  CHECK(paced->checked_blocks == 8);
  CHECK(cache.counters().data_loss_blocks.load() == 0);
}

TEST_CASE("cache: observers are told each grant in the order they were added, one that refuses a grow stops the rest, "
          "each told it added hears it removed once, a removed observer hears nothing more",
          "[unit][cache]") {
  TempCache t;
  REQUIRE(t.cache().SetBudget(64 * 4096, 16 * 4096).ok());  // 4 of 16 grants active at first
  std::vector<std::string> heard;
  bool refuse = false;
  auto first = std::make_shared<flexkv::FunctionCacheObserver>(
      [&](const PoolRegion&) {
        heard.push_back("1+");
        return flexkv::Status::Ok();
      },
      [&](const PoolRegion&) { heard.push_back("1-"); },
      [&](const flexkv::CacheBlockEvent& e) {
        if (e.kind == flexkv::CacheBlockEvent::kCommitted) heard.push_back("1b");
      });
  auto second = std::make_shared<flexkv::FunctionCacheObserver>(
      [&](const PoolRegion&) {
        heard.push_back("2+");
        return refuse ? flexkv::Status::ResourceExhausted("cannot register") : flexkv::Status::Ok();
      },
      [&](const PoolRegion&) { heard.push_back("2-"); });
  auto third = std::make_shared<flexkv::FunctionCacheObserver>(
      [&](const PoolRegion&) {
        heard.push_back("3+");
        return flexkv::Status::Ok();
      },
      [&](const PoolRegion&) { heard.push_back("3-"); });
  t.cache().AddObserver(first);
  t.cache().AddObserver(second);
  t.cache().AddObserver(third);
  REQUIRE(t.cache().RecoverPool(false).ok());
  REQUIRE(t.cache().Admit("ns", SmallGeometry()).ok());
  REQUIRE(heard.size() == 12);  // 4 grants x 3 observers, in order
  for (size_t i = 0; i < heard.size(); i += 3) CHECK((heard[i] == "1+" && heard[i + 1] == "2+" && heard[i + 2] == "3+"));

  // The second refuses the first grant of a grow: the third never hears of it, the first two hear it removed.
  heard.clear();
  refuse = true;
  const auto grown = t.cache().Resize(32 * 4096);
  CHECK(grown.status().code() == flexkv::StatusCode::kResourceExhausted);
  CHECK(heard == std::vector<std::string>{"1+", "2+", "2-", "1-"});
  CHECK(t.cache().capacity_slots() == 16);

  // Blocks reach the observers that want them (only the first).
  heard.clear();
  StoreBlocks(t.cache(), {BlockKey{1, 1}, BlockKey{2, 1}});
  CHECK(heard == std::vector<std::string>{"1b", "1b"});

  // Removed: no more calls, the others still hear.
  heard.clear();
  refuse = false;
  t.cache().RemoveObserver(first.get());
  StoreBlocks(t.cache(), {BlockKey{3, 1}});
  REQUIRE(t.cache().Resize(20 * 4096).ok());  // one more grant
  CHECK(heard == std::vector<std::string>{"2+", "3+"});
  heard.clear();
  uint64_t dropped = 0;
  REQUIRE(t.cache().DropDomain(false, &dropped).ok());
  CHECK(std::count(heard.begin(), heard.end(), "3-") == 5);  // every active grant, in reverse observer order
  CHECK(std::count(heard.begin(), heard.end(), "2-") == 5);
  CHECK(std::count(heard.begin(), heard.end(), "1-") == 0);
  CHECK(heard.front() == "3-");
}
