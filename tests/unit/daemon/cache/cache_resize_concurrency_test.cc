// Resizes beside the data path: a thread that grows and shrinks the pool (as CacheSet::Rebalance does) while others
// store, match with pins and read pinned blocks. A shrink must never take a pinned, pending or unverified slot, nor
// punch out or hand out memory a block still uses: every pinned block's bytes are checked against its key. Runs
// under ThreadSanitizer in CI (scripts/test.sh).
#include <atomic>
#include <chrono>
#include <catch2/catch.hpp>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "common/block_checksum.h"
#include "tests/unit/daemon/cache/temp_cache.h"

namespace flexkv {
namespace {

constexpr uint64_t kBlock = 4096;

// The bytes a block of `key` holds.
void Fill(uint8_t* bytes, const BlockKey& key) {
  for (uint64_t i = 0; i < kBlock; i += 8) {
    const uint64_t word = key.lo * 0x9E3779B97F4A7C15ULL + key.hi + i;
    std::memcpy(bytes + i, &word, 8);
  }
}

bool Holds(const uint8_t* bytes, const BlockKey& key) {
  uint8_t want[kBlock];
  Fill(want, key);
  return std::memcmp(bytes, want, kBlock) == 0;
}

// A chain of `n` keys for prompt `p`: prompts share their first blocks in groups, so stores meet cached prefixes.
std::vector<BlockKey> Prompt(uint64_t p, size_t n) {
  std::vector<BlockKey> keys;
  for (size_t i = 0; i < n; ++i) keys.push_back(BlockKey{(i < 2 ? p % 5 : p) * 1000 + i + 1, 7});
  return keys;
}

TEST_CASE("cache: resizes beside stores, pinned matches and reads never touch a block in use", "[unit][cache]") {
  testing::TempCache t(256 * kBlock);
  Cache& cache = t.cache();
  REQUIRE(cache.RecoverPool(false).ok());
  REQUIRE(cache.Admit("ns", testing::SmallGeometry()).ok());
  REQUIRE(cache.block_bytes() == kBlock);
  const uint64_t max = cache.max_bytes();

  std::atomic<bool> stop{false};
  std::atomic<uint64_t> wrong{0}, checked{0}, stored{0}, resizes{0};
  auto worker = [&](uint64_t seed) {
    std::mt19937_64 rng(seed);
    for (int round = 0; round < 5000; ++round) {
      const std::vector<BlockKey> keys = Prompt(rng() % 200, 1 + rng() % 12);
      PrefixIndex::Reservation r = cache.Reserve(kRootParent, keys);
      if (!r.slots.empty()) {
        std::vector<uint64_t> sums;
        for (size_t i = 0; i < r.slots.size(); ++i) {
          uint8_t* bytes = cache.SlotData(r.slots[i]);
          Fill(bytes, keys[r.cached + i]);
          sums.push_back(BlockChecksum(bytes, kBlock));
        }
        cache.Commit(kRootParent, keys, r.cached, r.slots, sums);
        stored += r.slots.size();
      }
      std::vector<SlotId> pinned;
      const size_t hit = cache.Match(keys, true, &pinned);
      if (pinned.size() != hit) ++wrong;  // (Catch2's assertions are for the test's own thread)
      for (size_t i = 0; i < hit && i < pinned.size(); ++i) {
        // Pinned: its slot stays active and its bytes stay, whatever the resizer does meanwhile.
        if (!Holds(cache.SlotData(pinned[i]), keys[i])) ++wrong;
        ++checked;
      }
      std::this_thread::yield();
      for (size_t i = 0; i < hit && i < pinned.size(); ++i) {
        if (!Holds(cache.SlotData(pinned[i]), keys[i])) ++wrong;
      }
      cache.Unpin(pinned);
    }
  };
  std::thread resizer([&] {
    std::mt19937_64 rng(99);
    while (!stop.load()) {
      const uint64_t to = max / 16 + rng() % max;
      auto reached = cache.Resize(to);
      if (!reached.ok()) {
        ++wrong;
        break;
      }
      ++resizes;
      std::this_thread::sleep_for(std::chrono::microseconds(300));  // a pace, not a measurement
    }
  });
  std::thread a(worker, 1), b(worker, 2);
  a.join();
  b.join();
  stop = true;
  resizer.join();

  INFO(stored.load() << " blocks stored, " << checked.load() << " pinned blocks checked, " << resizes.load()
                     << " resizes");
  CHECK(wrong.load() == 0);
  CHECK(checked.load() > 0);
  CHECK(resizes.load() > 0);
  // Nothing is left pinned or pending, and a full-size pool serves what it kept with the right bytes.
  REQUIRE(cache.Resize(max).ok());
  const Cache::Stats stats = cache.GetStats();
  CHECK(stats.pinned == 0);
  CHECK(stats.capacity == max / kBlock);
  for (uint64_t p = 0; p < 200; ++p) {
    const std::vector<BlockKey> keys = Prompt(p, 12);
    std::vector<SlotId> pinned;
    const size_t hit = cache.Match(keys, true, &pinned);
    for (size_t i = 0; i < hit; ++i) CHECK(Holds(cache.SlotData(pinned[i]), keys[i]));
    cache.Unpin(pinned);
  }
}

}  // namespace
}  // namespace flexkv
