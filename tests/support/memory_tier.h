// MemoryTier: a cache tier that keeps copies of blocks in this process's heap - the test tier of docs/architecture.md
// "Adding a tier". It plugs into a TierSet exactly as the SSD and cluster tiers do (declared capabilities, Promote
// through the one lookup path, write-backs through the cache's write-back port, block reports, its own status entry
// and metric families), with nothing of the daemon's parts changed. Header-only, for tests.
//
// Single-domain and deliberately simple: write-backs run when the test calls WriteBack() (a production tier runs them
// on a thread of its own, as SsdTier's mover does); promotions run on a thread of their own, so that the lookup path's
// asynchronous answer is exercised.
#pragma once

#include <xxhash.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <unordered_map>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/block_checksum.h"
#include "common/mutex.h"
#include "daemon/cache/cache.h"
#include "daemon/cache/cache_set.h"
#include "daemon/tiers/cache_tier.h"
#include "flexkv/v1/control.pb.h"

namespace flexkv::testing {

class MemoryTier final : public CacheTier {
 public:
  // Attaches itself to every cache of `caches` as their next tier (write-backs of every committed block).
  explicit MemoryTier(CacheSet* caches) : caches_(caches) {
    for (size_t i = 0; i < caches_->max_domains(); ++i) caches_->cache(i).AttachNextTier(/*queue_commits=*/true);
  }
  ~MemoryTier() override { Stop(); }

  std::string_view name() const override { return "memory"; }
  TierCapabilities capabilities() const override {
    TierCapabilities c;
    c.promotes_on_match = c.takes_write_back = c.reports_blocks = true;
    return c;
  }

  void Stop() override {
    stopping_.store(true);
    std::vector<std::thread> threads;
    {
      MutexLock lock(&mu_);
      threads.swap(threads_);
    }
    for (std::thread& t : threads) t.join();
  }

  // Copies every block the caches hand out for write-back; returns how many.
  size_t WriteBack() {
    size_t written = 0;
    for (size_t i = 0; i < caches_->max_domains(); ++i) {
      Cache& cache = caches_->cache(i);
      if (!cache.has_pool()) continue;
      for (const Cache::WriteBackBlock& b : cache.TakeWriteBack(1024, cache.capacity_slots())) {
        const uint8_t* bytes = cache.SlotData(b.slot);
        Held held{b.parent, std::vector<uint8_t>(bytes, bytes + cache.SlotBytes(b.slot)), b.content_checksum};
        {
          MutexLock lock(&mu_);
          blocks_[b.key] = std::move(held);
          TierBlockEvent e;
          e.key = b.key;
          e.parent = b.parent;
          e.namespace_hash = XXH3_64bits(cache.Domain().model_namespace.data(), cache.Domain().model_namespace.size());
          if (observer_) observer_(e);
        }
        cache.EndWriteBack(b, /*stored=*/true);
        ++written;
      }
    }
    written_.fetch_add(written);
    return written;
  }

  // The run of blocks held after DRAM's prefix, each under the previous one, copied in on a thread of this tier.
  bool Promote(Cache& cache, std::span<const BlockKey> keys, size_t dram_hit, PromotionDone done) override {
    if (stopping_.load() || dram_hit >= keys.size()) return false;
    const BlockKey parent = dram_hit == 0 ? kRootParent : keys[dram_hit - 1];
    std::vector<BlockKey> run;
    std::vector<Held> copies;
    {
      MutexLock lock(&mu_);
      BlockKey expected = parent;
      for (size_t i = dram_hit; i < keys.size(); ++i) {
        auto it = blocks_.find(keys[i]);
        if (it == blocks_.end() || it->second.parent != expected) break;
        run.push_back(keys[i]);
        copies.push_back(it->second);
        expected = keys[i];
      }
    }
    if (run.empty()) return false;
    const PrefixIndex::Reservation r = cache.Reserve(parent, run);
    if (r.slots.empty()) return false;
    MutexLock lock(&mu_);
    threads_.emplace_back([this, &cache, parent, run = std::move(run), copies = std::move(copies), r,
                           done = std::move(done)] {
      std::vector<uint64_t> sums;
      for (size_t k = 0; k < r.slots.size(); ++k) {
        const Held& h = copies[r.cached + k];
        std::memcpy(cache.SlotData(r.slots[k]), h.bytes.data(), h.bytes.size());
        sums.push_back(h.content_checksum);
      }
      cache.Commit(parent, run, r.cached, r.slots, sums, Cache::BlockEvent::kPromoted);
      cache.MarkOnNextTier(r.slots);
      promoted_.fetch_add(r.slots.size());
      done(r.slots.size());
    });
    return true;
  }

  void SetBlockObserver(BlockObserver observer) override {
    MutexLock lock(&mu_);
    observer_ = std::move(observer);
  }
  void SnapshotBlocks(const std::function<void()>& mark,
                      const std::function<void(const TierBlockEvent&)>& each) const override {
    MutexLock lock(&mu_);
    mark();
    for (const auto& [key, held] : blocks_) {
      TierBlockEvent e;
      e.key = key;
      e.parent = held.parent;
      each(e);
    }
  }

  void ReportStatus(v1::GetStatusResponse* status) const override {
    v1::TierStatus* t = status->add_tiers();
    t->set_name(std::string(name()));
    t->set_state(stopping_.load() ? "stopped" : "serving");
    t->set_used_blocks(held_blocks());
    t->set_promoted_blocks(promoted_.load());
    t->set_written_back_blocks(written_.load());
  }
  void CollectMetrics(MetricFamilies* out) const override {
    AddGauge(out, "flexkv_memory_blocks", "Blocks the memory tier holds", static_cast<double>(held_blocks()));
    AddCounter(out, "flexkv_memory_promoted_blocks_total", "Blocks promoted from the memory tier", promoted_.load());
  }

  size_t held_blocks() const {
    MutexLock lock(&mu_);
    return blocks_.size();
  }

 private:
  struct Held {
    BlockKey parent;
    std::vector<uint8_t> bytes;
    uint64_t content_checksum = 0;
  };

  CacheSet* const caches_;
  mutable Mutex mu_;
  std::unordered_map<BlockKey, Held, BlockKeyHash> blocks_ ABSL_GUARDED_BY(mu_);
  BlockObserver observer_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> promoted_{0}, written_{0};
};

}  // namespace flexkv::testing
