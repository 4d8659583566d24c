// SsdTier (daemon/tiers/ssd/ssd_tier.h) in process: a real CacheSet on a pool file, a real SsdStore on a disk
// filesystem (/var/tmp), the mover thread running. Write-back of the cold end, eviction of written blocks,
// promotion back byte-exact, a promotion cut at a block that fails verification, the write-all policy, the next-tier
// marks of the cache (TakeWriteBack's order), and stores, matches, promotions and write-backs from several threads
// at once (this file also runs under TSan).
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <catch2/catch.hpp>

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
  explicit Fixture(uint64_t pool_blocks, bool write_all = false, double window = 1.0, uint64_t ssd_blocks = 256,
                   bool start = true)
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
    t.store.paths = {ssd_dir.path()};
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
  CHECK(cache.TakeTouched() == Chain(1, 4));
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
