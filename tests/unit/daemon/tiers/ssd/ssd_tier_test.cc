// SsdTier (daemon/tiers/ssd/ssd_tier.h) in process: a real CacheSet on a pool file, a real SsdStore on a disk
// filesystem (/var/tmp), the mover thread running. Write-back of the cold end, eviction of written blocks,
// promotion back byte-exact, a promotion cut at a block that fails verification, the write-all policy, the next-tier
// marks of the cache (TakeWriteBack's order), and stores, matches, promotions and write-backs from several threads
// at once (this file also runs under TSan).
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "common/block_checksum.h"
#include "common/hybrid_ids.h"
#include "daemon/cache/cache.h"
#include "daemon/cache/cache_set.h"
#include "daemon/tiers/ssd/ssd_format.h"
#include "daemon/tiers/ssd/ssd_tier.h"
#include "tests/unit/daemon/cache/temp_cache.h"

using flexkv::BlockKey;
using flexkv::Cache;
using flexkv::CacheSet;
using flexkv::CacheSetOptions;
using flexkv::SlotId;
using flexkv::SsdTier;
using flexkv::SsdTierOptions;
using flexkv::testing::SmallGeometry;

namespace {

constexpr uint64_t kBlock = 4096;  // SmallGeometry's host block

// A fresh directory under `root`, removed at the end.
class Dir {
 public:
  explicit Dir(const std::string& root) {
    std::string tmpl = root + "/flexkv-ssdtier-XXXXXX";
    REQUIRE(mkdtemp(tmpl.data()) != nullptr);
    path_ = tmpl;
  }
  ~Dir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::string PoolRoot() { return std::filesystem::exists("/dev/shm") ? "/dev/shm" : "/tmp"; }

bool NeverInUse(const std::string&) { return false; }

// Chain `chain`'s block i: key and bytes.
BlockKey KeyOf(uint64_t chain, size_t i) { return BlockKey{i + 1, chain * 1000003 + 17}; }
std::vector<BlockKey> Chain(uint64_t chain, size_t n) {
  std::vector<BlockKey> keys;
  for (size_t i = 0; i < n; ++i) keys.push_back(KeyOf(chain, i));
  return keys;
}
uint8_t ByteOf(uint64_t chain, size_t i, uint64_t offset) { return static_cast<uint8_t>(chain * 31 + i * 7 + offset * 13); }

// Stores chain `chain` (n blocks) as a Store does: reserve, fill, commit with the content checksums. False when
// the cache could not reserve all of it (every slot pinned, e.g. by write-backs in flight).
bool StoreChain(Cache& cache, uint64_t chain, size_t n) {
  const std::vector<BlockKey> keys = Chain(chain, n);
  flexkv::PrefixIndex::Reservation r = cache.Reserve(flexkv::kRootParent, keys);
  if (r.slots.size() != n - r.cached) {
    cache.Abort(r.slots);
    return false;
  }
  std::vector<uint64_t> sums;
  for (size_t k = 0; k < r.slots.size(); ++k) {
    uint8_t* bytes = cache.SlotData(r.slots[k]);
    for (uint64_t o = 0; o < kBlock; ++o) bytes[o] = ByteOf(chain, r.cached + k, o);
    sums.push_back(flexkv::BlockChecksum(bytes, kBlock));
  }
  cache.Commit(flexkv::kRootParent, keys, r.cached, r.slots, sums);
  return true;
}

// Matches chain `chain` with pins and checks every matched block's bytes; returns the hit.
size_t MatchAndCheck(Cache& cache, uint64_t chain, size_t n) {
  const std::vector<BlockKey> keys = Chain(chain, n);
  std::vector<SlotId> slots;
  const size_t hit = cache.Match(keys, true, &slots);
  for (size_t i = 0; i < hit; ++i) {
    const uint8_t* bytes = cache.SlotData(slots[i]);
    bool same = true;
    for (uint64_t o = 0; o < kBlock && same; ++o) same = bytes[o] == ByteOf(chain, i, o);
    CHECK(same);
  }
  cache.Unpin(slots);
  return hit;
}

// Promotes what SSD holds of chain `chain` after its DRAM prefix; waits for it. Returns the blocks promoted, or -1
// when no promotion started.
int PromoteAndWait(SsdTier& tier, Cache& cache, uint64_t chain, size_t n) {
  const std::vector<BlockKey> keys = Chain(chain, n);
  const size_t dram = cache.Match(keys, false, nullptr);
  if (dram == n) return 0;
  auto done = std::make_shared<std::promise<size_t>>();
  std::future<size_t> promoted = done->get_future();
  if (!tier.Promote(cache, keys, dram, [done](size_t p) { done->set_value(p); })) return -1;
  return static_cast<int>(promoted.get());
}

// Polls `ready` for up to 30 s.
template <typename Ready>
bool WaitFor(Ready&& ready) {
  for (int i = 0; i < 3000; ++i) {
    if (ready()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return ready();
}

struct Fixture {
  // `ssd_path`: another SSD directory (one that outlives this fixture) instead of its own.
  explicit Fixture(uint64_t pool_blocks, bool write_all = false, double window = 1.0, uint64_t ssd_blocks = 256,
                   bool start = true, const std::string& ssd_path = "", int64_t store_wait_ms = 1000)
      : pool_dir(PoolRoot()), ssd_dir("/var/tmp") {
    CacheSetOptions o;
    o.budget_bytes = pool_blocks * kBlock;
    o.pool_path = pool_dir.path() + "/pool";
    caches = std::make_unique<CacheSet>(o);
    REQUIRE(caches->RecoverPools(false).ok());
    auto admitted = caches->Admit("m", SmallGeometry(), 0, NeverInUse);
    REQUIRE(admitted.ok());
    cache = *admitted;
    SsdTierOptions t;
    t.store.paths = {ssd_path.empty() ? ssd_dir.path() : ssd_path};
    t.store_wait_ms = store_wait_ms;
    t.store.size_bytes = flexkv::kSsdHeaderSector + ssd_blocks * flexkv::SsdSlotStride(kBlock);
    t.write_all = write_all;
    t.writeback_window = window;
    t.mover_idle_ms = 1;
    auto created = SsdTier::Create(t, caches.get());
    REQUIRE(created.ok());
    tier = std::move(*created);
    REQUIRE(tier->open());  // a pool exists: opened at once
    if (start) tier->Start();
  }
  ~Fixture() { tier.reset(); }

  uint64_t Written() const { return tier->GetStatus().written_back_blocks; }
  // At least `n` blocks written and none being written (so none pinned by the mover).
  bool Settled(uint64_t n) const {
    return WaitFor([&] { return Written() >= n && cache->write_back_stats().writing == 0; });
  }

  Dir pool_dir, ssd_dir;
  std::unique_ptr<CacheSet> caches;
  Cache* cache = nullptr;
  std::unique_ptr<SsdTier> tier;
};

// The slot of the SSD block file holding `key` (reads every slot header), or -1.
int64_t SlotOnDisk(const std::string& file, const BlockKey& key) {
  const int fd = ::open(file.c_str(), O_RDONLY);
  REQUIRE(fd >= 0);
  const uint64_t stride = flexkv::SsdSlotStride(kBlock);
  int64_t found = -1;
  alignas(4096) std::array<uint8_t, flexkv::kSsdHeaderSector> sector{};
  for (uint64_t s = 0;; ++s) {
    const off_t at = static_cast<off_t>(flexkv::kSsdHeaderSector + s * stride);
    if (::pread(fd, sector.data(), sector.size(), at) != static_cast<ssize_t>(sector.size())) break;
    const flexkv::SsdDecodedSlot slot = flexkv::DecodeSlotHeader(std::span<const uint8_t, flexkv::kSsdHeaderSector>(sector));
    if (slot.kind == flexkv::SsdSectorKind::kValid && slot.header.id.key == key) {
      found = static_cast<int64_t>(s);
      break;
    }
  }
  ::close(fd);
  return found;
}

}  // namespace

TEST_CASE("ssd tier: evicted blocks come back byte exact through promotion", "[ssd_tier]") {
  Fixture f(32);
  for (uint64_t c = 0; c < 4; ++c) REQUIRE(StoreChain(*f.cache, c, 8));  // the pool is full
  REQUIRE(f.Settled(32));                    // window 1: all of it is written
  for (uint64_t c = 4; c < 8; ++c) REQUIRE(StoreChain(*f.cache, c, 8));  // evicts chains 0..3
  REQUIRE(f.Settled(64));  // and chains 4..7, before the promotions evict them
  const flexkv::SsdTierStatus s = f.tier->GetStatus();
  CHECK(s.evicted_written_blocks == 32);
  CHECK(s.evicted_unwritten_blocks == 0);
  CHECK(s.used_blocks >= 32);
  // (Written blocks go back to the cold end, so blocks of chains 4..7 written early may go before those of chains
  // 0..3: how much of chains 0..3 is out of DRAM depends on how fast the mover ran - under TSan a whole chain may
  // still be there. Whatever is out comes back, byte exact.)
  uint64_t expected = 0;
  for (uint64_t c = 0; c < 4; ++c) {
    INFO("chain " << c);
    const size_t dram = f.cache->Match(Chain(c, 8), false, nullptr);
    if (dram < 8) CHECK(PromoteAndWait(*f.tier, *f.cache, c, 8) == static_cast<int>(8 - dram));
    expected += 8 - dram;
    CHECK(MatchAndCheck(*f.cache, c, 8) == 8);
  }
  CHECK(expected > 0);
  CHECK(f.tier->GetStatus().promoted_blocks == expected);
  // Promoted blocks are on SSD already: evicting them again writes nothing.
  const uint64_t written = f.Written();
  for (uint64_t c = 8; c < 12; ++c) REQUIRE(StoreChain(*f.cache, c, 8));
  CHECK(f.Written() >= written);
  CHECK(f.tier->GetStatus().evicted_unwritten_blocks == 0);
}

TEST_CASE("ssd tier: a promotion continues a DRAM prefix and stops at a missing block", "[ssd_tier]") {
  Fixture f(16);
  REQUIRE(StoreChain(*f.cache, 1, 12));
  REQUIRE(f.Settled(12));
  REQUIRE(StoreChain(*f.cache, 2, 12));  // evicts chain 1's last blocks (leaves first), keeps its prefix
  REQUIRE(f.Settled(24));
  const size_t dram = f.cache->Match(Chain(1, 12), false, nullptr);
  REQUIRE(dram < 12);
  CHECK(PromoteAndWait(*f.tier, *f.cache, 1, 12) == static_cast<int>(12 - dram));
  CHECK(MatchAndCheck(*f.cache, 1, 12) == 12);
  // A key SSD does not hold: nothing to promote, the match is answered from DRAM.
  CHECK(PromoteAndWait(*f.tier, *f.cache, 99, 4) == -1);
}

TEST_CASE("ssd tier: a block that fails verification is never promoted and ends the hit there", "[ssd_tier]") {
  Fixture f(16);
  REQUIRE(StoreChain(*f.cache, 5, 8));
  REQUIRE(f.Settled(8));
  REQUIRE(StoreChain(*f.cache, 6, 16));  // evicts all of chain 5
  REQUIRE(f.Settled(24));                // chain 6 written too: nothing pinned when the promotion reserves
  REQUIRE(f.cache->Match(Chain(5, 8), false, nullptr) == 0);
  // Flip a payload byte of block 3 on disk.
  const std::string file = f.ssd_dir.path() + "/" + flexkv::kSsdFileName;
  const int64_t slot = SlotOnDisk(file, KeyOf(5, 3));
  REQUIRE(slot >= 0);
  {
    const int fd = ::open(file.c_str(), O_RDWR);
    REQUIRE(fd >= 0);
    const off_t at = static_cast<off_t>(flexkv::kSsdHeaderSector + static_cast<uint64_t>(slot) * flexkv::SsdSlotStride(kBlock) +
                                        flexkv::kSsdHeaderSector + 100);
    uint8_t b = 0;
    REQUIRE(::pread(fd, &b, 1, at) == 1);
    b ^= 0x5a;
    REQUIRE(::pwrite(fd, &b, 1, at) == 1);
    ::fsync(fd);
    ::close(fd);
  }
  CHECK(PromoteAndWait(*f.tier, *f.cache, 5, 8) == 3);
  CHECK(MatchAndCheck(*f.cache, 5, 8) == 3);
  const flexkv::SsdTierStatus s = f.tier->GetStatus();
  CHECK(s.promotion_failed_blocks == 1);
  CHECK(s.store.data_loss_blocks == 1);
  // The bad block is gone from SSD: the next match does not try it again.
  CHECK(PromoteAndWait(*f.tier, *f.cache, 5, 8) == -1);
}

TEST_CASE("ssd tier: the write-all policy writes every stored block, not only the cold end", "[ssd_tier]") {
  Fixture f(64, /*write_all=*/true, /*window=*/0.01);
  REQUIRE(StoreChain(*f.cache, 3, 10));
  REQUIRE(f.Settled(10));
  CHECK(f.tier->GetStatus().used_blocks == 10);
  CHECK(f.cache->write_back_stats().writing == 0);
}

TEST_CASE("ssd tier: the cold end is written leaf first, then its ancestors", "[ssd_tier]") {
  // The cache's next-tier marks alone, without a store: what TakeWriteBack hands out, in which order.
  flexkv::testing::TempCache tc(16 * kBlock);
  Cache& cache = tc.cache();
  REQUIRE(cache.RecoverPool(false).ok());
  REQUIRE(cache.Admit("m", SmallGeometry()).ok());
  CHECK(cache.TakeWriteBack(16, 16).empty());  // before AttachNextTier
  cache.AttachNextTier(false);
  REQUIRE(StoreChain(cache, 1, 4));
  std::vector<Cache::WriteBackBlock> taken = cache.TakeWriteBack(16, 16);
  REQUIRE(taken.size() == 4);
  for (size_t i = 0; i < 4; ++i) CHECK(taken[i].key == KeyOf(1, 3 - i));  // leaf first
  CHECK(taken[3].parent == flexkv::kRootParent);
  CHECK(taken[0].parent == KeyOf(1, 2));
  CHECK(cache.TakeWriteBack(16, 16).empty());  // being written: not handed out twice
  CHECK(cache.write_back_stats().writing == 4);
  for (const auto& b : taken) cache.EndWriteBack(b, b.key != KeyOf(1, 0));  // the root's write failed
  // Only the root is left to write.
  taken = cache.TakeWriteBack(16, 16);
  REQUIRE(taken.size() == 1);
  CHECK(taken[0].key == KeyOf(1, 0));
  cache.EndWriteBack(taken[0], true);
  // The window counts the blocks walked, written or not: 5 reach chain 1 (4, the coldest) and chain 2's leaf.
  REQUIRE(StoreChain(cache, 2, 4));
  taken = cache.TakeWriteBack(16, 5);
  REQUIRE(taken.size() == 1);
  CHECK(taken[0].key == KeyOf(2, 3));
  cache.EndWriteBack(taken[0], false);
  taken = cache.TakeWriteBack(16, 16);
  CHECK(taken.size() == 4);
  for (const auto& b : taken) cache.EndWriteBack(b, false);
  // Evictions are counted by whether the block was written: a third chain takes every slot.
  REQUIRE(StoreChain(cache, 3, 16));
  const Cache::WriteBackStats w = cache.write_back_stats();
  CHECK(w.evicted_written == 4);    // chain 1, all written
  CHECK(w.evicted_unwritten == 4);  // chain 2, none written
}

// Issue 29 item 6: a block DRAM always hits is never read from SSD; its SSD copy must still count as used, and DRAM
// must evict blocks SSD holds before the others; a store that could only evict the others waits (bounded).
TEST_CASE("ssd tier: DRAM hits on written blocks are handed to SSD as uses, clean blocks are evicted first, and a "
          "store may wait for the write-back",
          "[ssd_tier]") {
  flexkv::testing::TempCache tc(16 * kBlock);
  Cache& cache = tc.cache();
  REQUIRE(cache.RecoverPool(false).ok());
  REQUIRE(cache.Admit("m", SmallGeometry()).ok());
  cache.AttachNextTier(false, /*store_wait_ms=*/500);
  CHECK(cache.StoreWaitMs() == 500);
  REQUIRE(StoreChain(cache, 1, 4));
  REQUIRE(StoreChain(cache, 2, 4));
  CHECK(cache.Match(Chain(1, 4), false, nullptr) == 4);
  CHECK(cache.TakeTouched().empty());  // nothing of it is on the next tier yet
  // Chain 1 written: its hits are queued once each, in match order.
  std::vector<Cache::WriteBackBlock> taken = cache.TakeWriteBack(16, 16);
  for (const auto& b : taken) cache.EndWriteBack(b, b.key.hi == KeyOf(1, 0).hi);
  CHECK(cache.Match(Chain(1, 4), false, nullptr) == 4);
  CHECK(cache.Match(Chain(1, 2), false, nullptr) == 2);
  std::vector<BlockKey> touched;
  for (const Cache::NextTierKey& t : cache.TakeTouched()) {
    CHECK(t.component == 0);
    touched.push_back(t.key);
  }
  CHECK(touched == Chain(1, 4));
  CHECK(cache.TakeTouched().empty());
  // A full pool (16 slots: chains 1 and 2 and 8 more): clean chain 1 goes first although it was used last.
  REQUIRE(StoreChain(cache, 3, 8));
  CHECK(cache.Match(Chain(2, 4), false, nullptr) == 4);
  CHECK(cache.Match(Chain(1, 4), false, nullptr) == 4);
  REQUIRE(StoreChain(cache, 4, 2));
  CHECK(cache.Match(Chain(1, 4), false, nullptr) == 2);  // its two leaves went, the dirty chains stayed
  CHECK(cache.Match(Chain(2, 4), false, nullptr) == 4);
  // A store that may wait finds only dirty blocks beyond chain 1's last two: it is told to wait, nothing is lost.
  flexkv::PrefixIndex::Reservation r = cache.Reserve(flexkv::kRootParent, Chain(5, 4), /*may_wait=*/true);
  CHECK(r.dirty_only);
  CHECK(r.slots.size() == 2);
  cache.Abort(r.slots);
  CHECK(cache.Match(Chain(2, 4), false, nullptr) == 4);
  CHECK(cache.write_back_stats().evicted_unwritten == 0);
  // While write-back fails, nobody waits.
  cache.SetWriteBackHealthy(false);
  CHECK(cache.StoreWaitMs() == 0);
  r = cache.Reserve(flexkv::kRootParent, Chain(5, 4), /*may_wait=*/true);
  CHECK_FALSE(r.dirty_only);
  CHECK(r.slots.size() == 4);
  cache.Abort(r.slots);
}

TEST_CASE("ssd tier: stores, matches, promotions and write-backs from several threads", "[ssd_tier]") {
  Fixture f(48, /*write_all=*/true, /*window=*/0.5, /*ssd_blocks=*/512);
  std::atomic<bool> failed{false};
  const auto worker = [&](uint64_t first) {
    for (int round = 0; round < 40 && !failed; ++round) {
      const uint64_t chain = first + static_cast<uint64_t>(round % 10);
      const size_t n = 6;
      if (f.cache->Match(Chain(chain, n), false, nullptr) < n) {
        const std::vector<BlockKey> keys = Chain(chain, n);
        const size_t dram = f.cache->Match(keys, false, nullptr);
        auto done = std::make_shared<std::promise<size_t>>();
        std::future<size_t> promoted = done->get_future();
        if (f.tier->Promote(*f.cache, keys, dram, [done](size_t p) { done->set_value(p); })) promoted.wait();
        if (f.cache->Match(keys, false, nullptr) < n) (void)StoreChain(*f.cache, chain, n);
      }
      MatchAndCheck(*f.cache, chain, n);  // whatever is matched has the chain's bytes
    }
  };
  std::thread a(worker, 100), b(worker, 200);
  worker(300);
  a.join();
  b.join();
  f.tier->Stop();
  CHECK(f.cache->write_back_stats().writing == 0);
  CHECK(f.tier->GetStatus().store.data_loss_blocks == 0);
}

TEST_CASE("ssd tier: a promotion never evicts a block SSD does not hold - it waits for the write-back, takes what "
          "fits when pins stand in the way, and a stop answers it",
          "[ssd_tier]") {
  Dir shared("/var/tmp");
  {
    // Chain 2 on SSD only: written by a node whose DRAM pool is gone.
    Fixture a(16, /*write_all=*/true, 1.0, 256, true, shared.path());
    REQUIRE(StoreChain(*a.cache, 2, 8));
    REQUIRE(a.Settled(8));
  }
  {
    // A full pool of 16 blocks, only its cold end written: chain 2's 8 blocks fit by evicting written blocks only;
    // where too few are written yet the promotion waits for the mover.
    Fixture f(16, false, 0.25, 256, true, shared.path(), /*store_wait_ms=*/60000);
    REQUIRE(StoreChain(*f.cache, 1, 16));
    REQUIRE(f.Settled(4));
    CHECK(PromoteAndWait(*f.tier, *f.cache, 2, 8) == 8);
    const flexkv::SsdTierStatus s = f.tier->GetStatus();
    INFO("waits " << s.promotion_waits);
    CHECK(s.promotion_wait_expired == 0);
    CHECK(s.evicted_unwritten_blocks == 0);
    CHECK(s.evicted_written_blocks == 8);
    CHECK(MatchAndCheck(*f.cache, 2, 8) == 8);
    CHECK(MatchAndCheck(*f.cache, 1, 16) == 8);
  }
  {
    // Chain 3's first 12 blocks pinned (an engine's load), its 4 leaves written: no write-back can make more room,
    // so the promotion does not wait - it takes the 4 that fit, at once.
    Fixture f(16, false, 0.25, 256, true, shared.path(), /*store_wait_ms=*/60000);
    REQUIRE(StoreChain(*f.cache, 3, 16));
    REQUIRE(f.Settled(4));
    std::vector<SlotId> pinned;
    REQUIRE(f.cache->Match(Chain(3, 12), true, &pinned) == 12);
    CHECK(PromoteAndWait(*f.tier, *f.cache, 2, 8) == 4);
    f.cache->Unpin(pinned);
    const flexkv::SsdTierStatus s = f.tier->GetStatus();
    CHECK(s.promotion_waits == 0);
    CHECK(s.evicted_unwritten_blocks == 0);
    CHECK(MatchAndCheck(*f.cache, 2, 8) == 4);
    CHECK(MatchAndCheck(*f.cache, 3, 16) == 12);
  }
  // Nothing written (the mover not started): the promotion waits; when the tier stops it is answered with nothing
  // promoted (its match goes on from DRAM), and every unwritten block is still there.
  Fixture g(16, false, 0.25, 256, /*start=*/false, shared.path(), /*store_wait_ms=*/600000);
  REQUIRE(StoreChain(*g.cache, 4, 16));
  auto done = std::make_shared<std::promise<size_t>>();
  std::future<size_t> promoted = done->get_future();
  REQUIRE(g.tier->Promote(*g.cache, Chain(2, 8), 0, [done](size_t p) { done->set_value(p); }));
  CHECK(promoted.wait_for(std::chrono::milliseconds(200)) == std::future_status::timeout);  // waiting
  CHECK(g.tier->GetStatus().promotion_waits == 1);
  g.tier->Stop();
  REQUIRE(promoted.wait_for(std::chrono::seconds(5)) == std::future_status::ready);
  CHECK(promoted.get() == 0);
  CHECK(g.tier->GetStatus().evicted_unwritten_blocks == 0);
  CHECK(MatchAndCheck(*g.cache, 4, 16) == 16);
}

TEST_CASE("ssd tier: a block corrupted in DRAM before its write-back is not served back from SSD", "[ssd_tier]") {
  Fixture f(16, /*write_all=*/false, /*window=*/1.0, /*ssd_blocks=*/256, /*start=*/false);
  REQUIRE(StoreChain(*f.cache, 7, 8));
  {
    // Block 2's DRAM bytes change behind the cache (a bit flip, a stray write) before the mover writes it.
    std::vector<SlotId> slots;
    REQUIRE(f.cache->Match(Chain(7, 8), true, &slots) == 8);
    f.cache->SlotData(slots[2])[17] ^= 0x40;
    f.cache->Unpin(slots);
  }
  f.tier->Start();
  REQUIRE(f.Settled(8));                  // written as it is: the SSD copy carries the bad bytes
  REQUIRE(StoreChain(*f.cache, 8, 16));  // evicts chain 7
  REQUIRE(f.Settled(24));
  CHECK(PromoteAndWait(*f.tier, *f.cache, 7, 8) == 2);  // the content checksum stops it at block 2
  CHECK(MatchAndCheck(*f.cache, 7, 8) == 2);
  CHECK(f.tier->GetStatus().promotion_failed_blocks == 1);
  CHECK(PromoteAndWait(*f.tier, *f.cache, 7, 8) == -1);  // and the SSD copy is gone
}

TEST_CASE("ssd tier: the cold walk does not spend its window climbing a shared prefix", "[ssd_tier]") {
  flexkv::testing::TempCache tc(32 * kBlock);
  Cache& cache = tc.cache();
  REQUIRE(cache.RecoverPool(false).ok());
  REQUIRE(cache.Admit("m", SmallGeometry()).ok());
  cache.AttachNextTier(false);
  // A 10-block system prompt, then 4 one-block branches under its last block.
  REQUIRE(StoreChain(cache, 1, 10));
  for (uint64_t b = 0; b < 4; ++b) {
    const BlockKey key{1000 + b, 77};
    flexkv::PrefixIndex::Reservation r = cache.Reserve(KeyOf(1, 9), std::span<const BlockKey>(&key, 1));
    REQUIRE(r.slots.size() == 1);
    const uint64_t sum = flexkv::BlockChecksum(cache.SlotData(r.slots[0]), kBlock);
    cache.Commit(KeyOf(1, 9), std::span<const BlockKey>(&key, 1), 0, r.slots, std::span<const uint64_t>(&sum, 1));
  }
  // A window of 4 reaches the 4 branch leaves (the next to go); the shared prefix stays while any branch does.
  std::vector<Cache::WriteBackBlock> taken = cache.TakeWriteBack(16, 4);
  REQUIRE(taken.size() == 4);
  for (const auto& b : taken) CHECK(b.parent == KeyOf(1, 9));
  for (const auto& b : taken) cache.EndWriteBack(b, true);
}

// --- Hybrid domains (docs/ssd.md, "Hybrid domains"): the unit moved is (key, component).

namespace {

enum class HybridShape { kGptOssLike, kQwen3NextLike, kAll };

// SmallGeometry's FULL blocks (4 KiB) with, gpt-oss-like, a sliding window of 2 blocks of the same shape;
// Qwen3-Next-like, a 4 KiB state (2 layers x 2 KiB); or both.
flexkv::Geometry HybridGeometry(HybridShape shape) {
  flexkv::Geometry g = SmallGeometry();
  if (shape != HybridShape::kQwen3NextLike) {
    flexkv::ComponentSpec swa;
    swa.kind = flexkv::ComponentKind::kSlidingWindow;
    swa.num_layers = 2;
    swa.kv_planes = 2;
    swa.kv_heads_per_rank = 1;
    swa.head_dim = 32;
    swa.dtype_bytes = 2;
    swa.window_tokens = 32;
    g.components.push_back(swa);
  }
  if (shape != HybridShape::kGptOssLike) {
    flexkv::ComponentSpec state;
    state.kind = flexkv::ComponentKind::kState;
    state.num_layers = 2;
    state.state_bytes_per_layer = 2048;
    g.components.push_back(state);
  }
  return g;
}

const char* ShapeName(HybridShape shape) {
  return shape == HybridShape::kGptOssLike ? "gpt-oss-like" : shape == HybridShape::kQwen3NextLike ? "Qwen3-Next-like"
                                                                                                    : "window and state";
}

// The bytes of component c's entry for chain `chain`'s block j.
uint8_t PieceByte(uint64_t chain, size_t c, size_t j, uint64_t offset) {
  return static_cast<uint8_t>(chain * 31 + c * 101 + j * 7 + offset * 13);
}

// Stores chain `chain`'s blocks [from, to) as an engine's chunk does: under block from - 1, the window right-aligned
// at `to`, the state at `to`. A store that finds slots pinned by write-backs is retried (as engines do), for up to
// 5 s; false when the cache still refuses it.
bool StoreHybridChunk(Cache& cache, uint64_t chain, size_t from, size_t to) {
  const std::vector<BlockKey> all = Chain(chain, to);
  const std::span<const BlockKey> keys = std::span<const BlockKey>(all).subspan(from);
  const BlockKey parent = from == 0 ? flexkv::kRootParent : all[from - 1];
  const std::vector<uint32_t> boundaries{static_cast<uint32_t>(keys.size())};
  Cache::HybridReservation r = cache.ReserveHybrid(parent, keys, boundaries);
  for (int i = 0; i < 1000 && r.shortfall == flexkv::StatusCode::kResourceExhausted; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    r = cache.ReserveHybrid(parent, keys, boundaries);
  }
  if (r.shortfall != flexkv::StatusCode::kOk) return false;
  const auto fill = [&](SlotId slot, size_t c, const BlockKey& key) {
    uint8_t* bytes = cache.SlotData(slot);
    const uint64_t n = cache.SlotBytes(slot);
    for (uint64_t o = 0; o < n; ++o) bytes[o] = PieceByte(chain, c, key.lo - 1, o);  // KeyOf: lo is j + 1
    return flexkv::BlockChecksum(bytes, n);
  };
  std::vector<std::vector<uint64_t>> sums(r.slots.size());
  for (size_t i = 0; i < r.full.slots.size(); ++i) sums[0].push_back(fill(r.full.slots[i], 0, keys[r.full.cached + i]));
  for (size_t c = 1; c < r.slots.size(); ++c) {
    for (size_t i = 0; i < r.slots[c].size(); ++i) {
      if (r.slots[c][i] != flexkv::ComponentIndex::kNoSlot) sums[c].push_back(fill(r.slots[c][i], c, r.keys[c][i]));
    }
  }
  cache.CommitHybrid(parent, keys, r, sums);
  return true;
}

// Stores chain `chain` (n blocks) in chunks of `chunk`: a hit at every chunk boundary.
bool StoreHybridChain(Cache& cache, uint64_t chain, size_t n, size_t chunk = 4) {
  for (size_t from = 0; from < n; from += chunk) {
    if (!StoreHybridChunk(cache, chain, from, std::min(n, from + chunk))) return false;
  }
  return true;
}

// Matches chain `chain` with pins and checks every pinned piece's bytes (FULL [0,e), the window before e, the state
// at e: a Load's id order); returns the hit e.
size_t MatchHybridAndCheck(Cache& cache, const flexkv::Geometry& g, uint64_t chain, size_t n) {
  const std::vector<BlockKey> keys = Chain(chain, n);
  std::vector<SlotId> slots;
  const size_t e = cache.Match(keys, true, &slots);
  if (e == 0) return 0;
  const flexkv::HybridIdLayout layout = flexkv::LayoutIds(g, false, static_cast<uint32_t>(e));
  REQUIRE(slots.size() == layout.total);
  for (size_t c = 0; c < g.component_count(); ++c) {
    const uint64_t count = flexkv::ComponentIdCount(g, c, false, static_cast<uint32_t>(e));
    for (uint64_t i = 0; i < count; ++i) {
      const size_t j = e - count + i;  // FULL: count == e; window: its last blocks; state: the key before e
      const SlotId slot = slots[layout.offset[c] + i];
      const uint8_t* bytes = cache.SlotData(slot);
      bool same = cache.SlotBytes(slot) == g.Component(c).host_block_bytes();
      for (uint64_t o = 0; o < cache.SlotBytes(slot) && same; ++o) same = bytes[o] == PieceByte(chain, c, j, o);
      INFO("chain " << chain << " component " << c << " block " << j);
      CHECK(same);
    }
  }
  cache.Unpin(slots);
  return e;
}

// A CacheSet of one hybrid domain and an SSD tier on it, the mover running. `full`, `window` and `state`: the
// sub-pools' slots (4 KiB each); `ssd_blocks`: the SSD slots.
struct HybridFixture {
  HybridFixture(HybridShape shape, uint64_t full, uint64_t window, uint64_t state, uint64_t ssd_blocks = 512)
      : geometry(HybridGeometry(shape)), pool_dir(PoolRoot()), ssd_dir("/var/tmp") {
    const bool has_window = shape != HybridShape::kQwen3NextLike, has_state = shape != HybridShape::kGptOssLike;
    // One slot more than asked for, a quarter of it to each of the others: the split rounds each down to whole slots.
    const double slots = static_cast<double>(full + (has_window ? window : 0) + (has_state ? state : 0) + 1);
    CacheSetOptions o;
    o.budget_bytes = static_cast<uint64_t>(slots) * kBlock;
    o.pool_path = pool_dir.path() + "/pool";
    o.split.swa_share = has_window ? (static_cast<double>(window) + 0.25) / slots : 0;
    o.split.state_share = has_state ? (static_cast<double>(state) + 0.25) / slots : 0;
    caches = std::make_unique<CacheSet>(o);
    REQUIRE(caches->RecoverPools(false).ok());
    auto admitted = caches->Admit("m", geometry, 0, NeverInUse);
    REQUIRE(admitted.ok());
    cache = *admitted;
    const Cache::Stats stats = cache->GetStats();
    REQUIRE(stats.components.size() == geometry.component_count());
    REQUIRE(stats.components[0].capacity == full);
    for (size_t c = 1; c < geometry.component_count(); ++c) {
      const bool is_state = geometry.component_kind(c) == flexkv::ComponentKind::kState;
      REQUIRE(stats.components[c].capacity == (is_state ? state : window));
    }
    SsdTierOptions t;
    t.store.paths = {ssd_dir.path()};
    t.store.size_bytes = flexkv::kSsdHeaderSector + ssd_blocks * flexkv::SsdSlotStride(kBlock);
    t.writeback_window = 1.0;
    t.mover_idle_ms = 1;
    auto created = SsdTier::Create(t, caches.get());
    REQUIRE(created.ok());
    tier = std::move(*created);
    REQUIRE(tier->open());
    CHECK(tier->capabilities().hybrid);
    tier->Start();
  }
  ~HybridFixture() { tier.reset(); }

  uint64_t Written() const { return tier->GetStatus().written_back_blocks; }
  bool Settled(uint64_t n) const {
    return WaitFor([&] { return Written() >= n && cache->write_back_stats().writing == 0; });
  }

  flexkv::Geometry geometry;
  Dir pool_dir, ssd_dir;
  std::unique_ptr<CacheSet> caches;
  Cache* cache = nullptr;
  std::unique_ptr<SsdTier> tier;
};

// Pieces (FULL blocks, window and state entries) a chain of n blocks stored in chunks of 4 puts in the cache.
uint64_t PiecesOf(const flexkv::Geometry& g, size_t n) {
  uint64_t pieces = n;
  for (size_t c = 1; c < g.component_count(); ++c) {
    for (size_t from = 0; from < n; from += 4) {
      const size_t count = std::min(n, from + 4) - from;
      pieces += g.component_kind(c) == flexkv::ComponentKind::kState ? 1 : std::min<size_t>(g.window_blocks(c), count);
    }
  }
  return pieces;
}

}  // namespace

TEST_CASE("ssd tier: a hybrid domain's FULL blocks, windows and states are written back and promoted byte exact",
          "[ssd_tier][hybrid]") {
  const HybridShape shape = GENERATE(HybridShape::kGptOssLike, HybridShape::kQwen3NextLike, HybridShape::kAll);
  INFO(ShapeName(shape));
  // 24 FULL slots, 8 window and 4 state slots: three chains of 8 blocks fill FULL, four fill the others.
  HybridFixture f(shape, 24, 8, 4);
  const uint64_t per_chain = PiecesOf(f.geometry, 8);
  for (uint64_t c = 0; c < 2; ++c) REQUIRE(StoreHybridChain(*f.cache, c, 8));
  REQUIRE(f.Settled(2 * per_chain));  // window 1: every piece is written, with its component
  const flexkv::SsdTierStatus written = f.tier->GetStatus();
  CHECK(written.used_blocks == 2 * per_chain);
  for (uint64_t c = 2; c < 6; ++c) {  // evict chains 0 and 1 (each written before the next store evicts it)
    REQUIRE(StoreHybridChain(*f.cache, c, 8));
    REQUIRE(f.Settled((c + 1) * per_chain));
  }
  CHECK(f.tier->GetStatus().evicted_unwritten_blocks == 0);
  CHECK(f.tier->GetStatus().evicted_written_blocks > 0);
  // (Written pieces go back to the cold end of their list, so which chains DRAM kept depends on the mover's timing:
  // as for FULL blocks, whatever is out of DRAM comes back, byte exact in every component.)
  size_t promoted_chains = 0;
  for (uint64_t c = 0; c < 6; ++c) {
    INFO("chain " << c);
    if (f.cache->Match(Chain(c, 8), false, nullptr) < 8) {
      ++promoted_chains;
      CHECK(PromoteAndWait(*f.tier, *f.cache, c, 8) > 0);
    }
    CHECK(MatchHybridAndCheck(*f.cache, f.geometry, c, 8) == 8);
  }
  CHECK(promoted_chains >= 3);  // DRAM holds three chains' FULL blocks at most
  const flexkv::SsdTierStatus s = f.tier->GetStatus();
  CHECK(s.promotion_failed_blocks == 0);
  CHECK(s.store.data_loss_blocks == 0);
}

TEST_CASE("ssd tier: the hit rule across tiers - a window or state on SSD and its FULL blocks in DRAM make a hit",
          "[ssd_tier][hybrid]") {
  const HybridShape shape = GENERATE(HybridShape::kGptOssLike, HybridShape::kQwen3NextLike);
  INFO(ShapeName(shape));
  // 32 FULL slots keep every chain's blocks; 4 window slots or 2 state slots keep two chains' windows or states.
  HybridFixture f(shape, 32, 4, 2);
  const uint64_t per_chain = PiecesOf(f.geometry, 4);
  for (uint64_t c = 1; c <= 3; ++c) {  // the third takes the windows or the state of one of the first two
    REQUIRE(StoreHybridChain(*f.cache, c, 4));
    REQUIRE(f.Settled(c * per_chain));
  }
  REQUIRE(f.cache->GetStats().components.at(0).used == 12);  // every FULL block stayed
  // The pieces that went were written (clean) first; whichever chain lost them has no hit of any length in DRAM.
  const uint64_t lost = per_chain - 4;  // the window's two entries, or the state
  CHECK(f.tier->GetStatus().evicted_written_blocks == lost);
  const uint64_t promoted = f.tier->GetStatus().promoted_blocks;
  size_t missing = 0;
  for (uint64_t c = 1; c <= 3; ++c) {
    INFO("chain " << c);
    if (f.cache->Match(Chain(c, 4), false, nullptr) == 4) continue;
    ++missing;
    CHECK(f.cache->Match(Chain(c, 4), false, nullptr) == 0);
    CHECK(PromoteAndWait(*f.tier, *f.cache, c, 4) > 0);
    CHECK(MatchHybridAndCheck(*f.cache, f.geometry, c, 4) == 4);
  }
  CHECK(missing > 0);
  // Only windows or states were read: no FULL block ever left DRAM (a promotion reads only what DRAM lacks). A
  // promotion may take the slot of another chain's clean entry, which that chain's promotion then reads again.
  CHECK(f.cache->GetStats().components.at(0).evicted == 0);
  CHECK(f.tier->GetStatus().promoted_blocks >= promoted + lost);
}

TEST_CASE("ssd tier: a corrupt window or state entry on SSD is dropped and the hit ends at the longest end that holds",
          "[ssd_tier][hybrid]") {
  const HybridShape shape = GENERATE(HybridShape::kGptOssLike, HybridShape::kQwen3NextLike);
  INFO(ShapeName(shape));
  HybridFixture f(shape, 16, 4, 2);
  const uint64_t per_chain = PiecesOf(f.geometry, 8);
  REQUIRE(StoreHybridChain(*f.cache, 5, 8));  // ends at 4 and 8
  REQUIRE(f.Settled(per_chain));
  for (uint64_t c = 6; c < 8; ++c) {  // evict chain 5 (FULL 16 slots), each written before the next store
    REQUIRE(StoreHybridChain(*f.cache, c, 8));
    REQUIRE(f.Settled((c - 4) * per_chain));
  }
  REQUIRE(f.cache->Match(Chain(5, 8), false, nullptr) == 0);
  // Flip a payload byte of the entry the end at 8 needs: the window's last block, or the state at 8 (key of block 7).
  const std::string file = f.ssd_dir.path() + "/" + flexkv::kSsdFileName;
  const int64_t slot = [&] {
    const int fd = ::open(file.c_str(), O_RDONLY);
    REQUIRE(fd >= 0);
    int64_t found = -1;
    alignas(4096) std::array<uint8_t, flexkv::kSsdHeaderSector> sector{};
    for (uint64_t s = 0; found < 0; ++s) {
      const off_t at = static_cast<off_t>(flexkv::kSsdHeaderSector + s * flexkv::SsdSlotStride(kBlock));
      if (::pread(fd, sector.data(), sector.size(), at) != static_cast<ssize_t>(sector.size())) break;
      const flexkv::SsdDecodedSlot d = flexkv::DecodeSlotHeader(std::span<const uint8_t, flexkv::kSsdHeaderSector>(sector));
      if (d.kind == flexkv::SsdSectorKind::kValid && d.header.id.key == KeyOf(5, 7) && d.header.id.component == 1) {
        found = static_cast<int64_t>(s);
      }
    }
    ::close(fd);
    return found;
  }();
  REQUIRE(slot >= 0);
  {
    const int fd = ::open(file.c_str(), O_RDWR);
    REQUIRE(fd >= 0);
    const off_t at = static_cast<off_t>(flexkv::kSsdHeaderSector + static_cast<uint64_t>(slot) * flexkv::SsdSlotStride(kBlock) +
                                        flexkv::kSsdHeaderSector + 100);
    uint8_t b = 0;
    REQUIRE(::pread(fd, &b, 1, at) == 1);
    b ^= 0x5a;
    REQUIRE(::pwrite(fd, &b, 1, at) == 1);
    ::fsync(fd);
    ::close(fd);
  }
  CHECK(PromoteAndWait(*f.tier, *f.cache, 5, 8) > 0);
  CHECK(MatchHybridAndCheck(*f.cache, f.geometry, 5, 8) == 4);  // the end at 4, with its own window or state
  const flexkv::SsdTierStatus s = f.tier->GetStatus();
  CHECK(s.promotion_failed_blocks == 1);
  CHECK(s.store.data_loss_blocks == 1);
  // The bad entry is gone from SSD: the end at 8 is never served, and a match does not read it again.
  CHECK(PromoteAndWait(*f.tier, *f.cache, 5, 8) == -1);
  CHECK(f.cache->Match(Chain(5, 8), false, nullptr) == 4);
}

TEST_CASE("ssd tier: the cache hands out window and state entries for write-back with their component, clean ones "
          "are evicted first",
          "[ssd_tier][hybrid]") {
  // The cache's next-tier port alone, without a store.
  const flexkv::PoolSplit split{0.25, 0.125};  // of 32 slots: 8 window, 4 state, 20 FULL
  flexkv::testing::TempCache tc(32 * kBlock, split);
  Cache& cache = tc.cache();
  REQUIRE(cache.RecoverPool(false).ok());
  const flexkv::Geometry g = HybridGeometry(HybridShape::kAll);
  REQUIRE(cache.Admit("m", g).ok());
  REQUIRE(StoreHybridChain(cache, 1, 4));
  cache.AttachNextTier(false, 0, /*hybrid=*/false);
  CHECK(cache.TakeWriteBack(64, 64).empty());  // a tier that does not take hybrid domains gets nothing
  cache.AttachNextTier(false, 0, /*hybrid=*/true);
  std::vector<Cache::WriteBackBlock> taken = cache.TakeWriteBack(64, 64);
  REQUIRE(taken.size() == 4 + 2 + 1);
  size_t per[3] = {0, 0, 0};
  for (const Cache::WriteBackBlock& b : taken) {
    REQUIRE(b.component < 3);
    ++per[b.component];
    if (b.component != 0) CHECK(b.parent == BlockKey{});  // a window or state entry hangs under nothing
  }
  CHECK(per[0] == 4);
  CHECK(per[1] == 2);
  CHECK(per[2] == 1);
  CHECK(cache.TakeWriteBack(64, 64).empty());  // being written: not handed out twice
  for (const auto& b : taken) cache.EndWriteBack(b, true);
  // Chains 2 to 4 fill the window (8) and state (4) sub-pools with dirty entries; chain 1's (clean) are then used
  // last. A fifth chain needs two window slots and a state slot: it takes chain 1's, not the least recently used.
  for (uint64_t c = 2; c <= 4; ++c) REQUIRE(StoreHybridChain(cache, c, 4));
  std::vector<SlotId> pinned;
  REQUIRE(cache.Match(Chain(1, 4), true, &pinned) == 4);
  cache.Unpin(pinned);
  REQUIRE(StoreHybridChain(cache, 5, 4));
  CHECK(cache.write_back_stats().evicted_written == 3);
  CHECK(cache.write_back_stats().evicted_unwritten == 0);
  for (uint64_t c = 2; c <= 5; ++c) CHECK(cache.Match(Chain(c, 4), false, nullptr) == 4);
  CHECK(cache.Match(Chain(1, 4), false, nullptr) == 0);  // its window and state went (they are on the next tier)
  // Their touch: chain 1's pieces were hit while on the next tier (a pinned hybrid match).
  const std::vector<Cache::NextTierKey> touched = cache.TakeTouched();
  CHECK(touched.size() == 4);  // its FULL blocks (its window and state entries left their slots since)
}

TEST_CASE("ssd tier: a hybrid domain whose state does not fit the block files stays in DRAM, and status names the "
          "component",
          "[ssd_tier][hybrid]") {
  Dir ssd_dir("/var/tmp");
  SsdTierOptions t;
  t.store.paths = {ssd_dir.path()};
  t.store.size_bytes = flexkv::kSsdHeaderSector + 64 * flexkv::SsdSlotStride(kBlock);
  t.mover_idle_ms = 1;
  {  // The block files are made for 4 KiB blocks (a full-attention model ran here before).
    Dir pool_dir(PoolRoot());
    CacheSetOptions o;
    o.budget_bytes = 16 * kBlock;
    o.pool_path = pool_dir.path() + "/pool";
    CacheSet caches(o);
    REQUIRE(caches.RecoverPools(false).ok());
    REQUIRE(caches.Admit("llama", SmallGeometry(), 0, NeverInUse).ok());
    auto tier = SsdTier::Create(t, &caches);
    REQUIRE(tier.ok());
    REQUIRE((*tier)->open());
  }
  // A Qwen3-Next-like model whose state snapshot is 8 KiB: its FULL blocks fit the slots, its states do not.
  flexkv::Geometry g = HybridGeometry(HybridShape::kQwen3NextLike);
  g.components[0].state_bytes_per_layer = 4096;
  REQUIRE(flexkv::LargestSlotBytes(g) == 2 * kBlock);
  Dir pool_dir(PoolRoot());
  CacheSetOptions o;
  o.budget_bytes = 32 * kBlock;
  o.pool_path = pool_dir.path() + "/pool";
  o.split.state_share = 0.25;
  CacheSet caches(o);
  REQUIRE(caches.RecoverPools(false).ok());
  auto admitted = caches.Admit("qwen", g, 0, NeverInUse);
  REQUIRE(admitted.ok());
  Cache& cache = **admitted;
  auto created = SsdTier::Create(t, &caches);
  REQUIRE(created.ok());
  SsdTier& tier = **created;
  REQUIRE(tier.open());  // with the files' 4 KiB slots
  tier.Start();
  REQUIRE(StoreHybridChain(cache, 1, 4));
  REQUIRE(WaitFor([&] { return !tier.GetStatus().notes.empty(); }));
  const std::string note = tier.GetStatus().notes.at(0);
  CHECK_THAT(note, Catch::Contains("namespace 'qwen'") && Catch::Contains("component 1 (state) slots") &&
                       Catch::Contains("do not fit the SSD slots") && Catch::Contains("its blocks stay in DRAM"));
  CHECK(tier.GetStatus().written_back_blocks == 0);
  CHECK(cache.StoreWaitMs() == 0);
  // Nothing of it is on SSD, and a match is not promoted from there.
  const std::vector<BlockKey> keys = Chain(1, 6);
  CHECK(cache.Match(keys, false, nullptr) == 4);
  CHECK_FALSE(tier.Promote(cache, keys, 4, [](size_t) { FAIL("no promotion was started"); }));
  tier.Stop();
}
