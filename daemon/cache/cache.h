// Cache: the cache domain, the host pool and the prefix index behind one lock, plus the counters of
// DESIGN §4.2. Thread-safe. The pool is created when the first session fixes the geometry, or re-attached
// at start when a pool file from an earlier run exists.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "common/unique_fd.h"
#include "daemon/cache/cache_domain.h"
#include "daemon/cache/pool.h"
#include "daemon/cache/pool_lock.h"
#include "daemon/cache/prefix_index.h"
#include "daemon/transfer/cuda_backend.h"

namespace flexkv {

struct CacheCounters {
  std::atomic<uint64_t> match_requests{0}, match_blocks{0}, hit_blocks{0}, load_blocks{0}, store_blocks{0},
      bytes_loaded{0}, bytes_stored{0};
};

class Cache {
 public:
  Cache(uint64_t budget_bytes, std::string pool_path);

  // Locks the pool (PoolLock: `<pool>.lock` and the pool file itself; a second daemon on the same pool is
  // refused naming the holder's pid), then
  // re-attaches the pool file of an earlier run, if any, and rebuilds the index from its slot table.
  // With `discard`, a pool file that cannot be used is replaced (its blocks are lost) instead of refused.
  Status RecoverPool(bool discard);

  // Validates a session's cache domain; the first one creates the pool.
  Status Admit(const std::string& model_namespace, const Geometry& geometry);

  bool has_pool() const;
  uint64_t block_bytes() const;
  uint8_t* SlotData(SlotId slot) const;  // has_pool() must hold
  CacheDomain::View Domain() const { return domain_.Snapshot(); }

  // See PrefixIndex. Keys are the request's; slots and reservations refer to this cache's pool.
  size_t Match(std::span<const BlockKey> keys, bool pin, std::vector<SlotId>* pinned);
  void Unpin(std::span<const SlotId> slots);
  PrefixIndex::Reservation Reserve(std::span<const BlockKey> keys);
  // Publishes reserved slots after their bytes are complete. `keys` are the full request keys and
  // `first` the index of reservation.slots[0] in them.
  void Commit(std::span<const BlockKey> keys, size_t first, std::span<const SlotId> slots);
  void Abort(std::span<const SlotId> slots);

  // With a CUDA backend, the pool is registered for DMA as soon as it exists (created or re-attached), so
  // that registering GPU buffers later is quick. Call before RecoverPool.
  void SetCudaBackend(CudaBackend* cuda) { cuda_ = cuda; }
  // Registers the pool's data for DMA with the CUDA backend (once); the error of the first attempt sticks.
  Status RegisterPoolForDma(CudaBackend& cuda);

  struct Stats {
    uint64_t capacity = 0, used = 0, pinned = 0, blocks = 0, evicted = 0;
    std::string backing;
  };
  Stats GetStats() const;
  CacheCounters& counters() { return counters_; }

 private:
  // RESOURCE_EXHAUSTED (naming the pool file and what to do) when the pool's filesystem cannot hold the budget.
  Status CheckPoolSpace() const;
  Status CreatePoolLocked(const std::string& model_namespace, const Geometry& geometry);

  const uint64_t budget_bytes_;
  const std::string pool_path_;
  CacheDomain domain_;
  CacheCounters counters_;
  mutable std::mutex mu_;
  std::unique_ptr<Pool> pool_;          // guarded by mu_ (set once)
  std::unique_ptr<PrefixIndex> index_;  // guarded by mu_
  std::atomic<bool> has_pool_{false};
  PoolLock pool_lock_;  // taken by RecoverPool (at start, before any Attach), then used under mu_
  CudaBackend* cuda_ = nullptr;
  Status dma_status_;  // guarded by mu_; the outcome of registering the pool for DMA
  bool dma_tried_ = false;
  void RegisterForDmaLocked();
};

}  // namespace flexkv
