// DramTier: tier 0, the DRAM pool (daemon/cache/pool.h, owned by the Cache): the slot addresses the copies use. Engines
// copy only from and to this tier, through the engine-memory backends, at the slot addresses region() gives. (The
// tiers below it are CacheTiers, cache_tier.h, held by the TierSet.)
#pragma once

#include <atomic>
#include <optional>
#include <span>
#include <vector>

#include "common/mutex.h"
#include "daemon/cache/cache.h"
#include "daemon/cache/pool_region.h"
#include "flexkv/status.h"

namespace flexkv {

class DramTier final {
 public:
  // `cache` owns the pool and outlives the tier.
  explicit DramTier(const Cache* cache) : cache_(cache) {}

  // The pool is a named file under /dev/shm (or hugetlbfs) with a slot table: a restarted daemon re-attaches
  // it (a reboot loses it).
  // Slots the pool holds (active), and the bytes of one FULL block; 0 before the pool exists.
  uint32_t capacity_slots() const;
  uint64_t slot_bytes() const;
  // Copy one whole FULL slot out of / into the pool. `bytes.size()` must be slot_bytes() and `slot` below
  // capacity_slots(): otherwise INVALID_ARGUMENT / OUT_OF_RANGE naming the value and what was expected, and nothing
  // is copied. Thread-safe for distinct slots.
  Status ReadSlot(SlotId slot, std::span<uint8_t> bytes) const;
  Status WriteSlot(SlotId slot, std::span<const uint8_t> bytes);

  // Where the slots are in this process, for the engine-memory backends; nullopt before the pool exists. The
  // region changes only when an admin drops the cache domain and a new pool is created (Cache::generation()): it
  // is read from the cache again then, and otherwise kept (it is asked for on every Load and Store).
  std::optional<PoolRegion> region() const { return region(0); }
  // Where component `component`'s sub-pool is (hybrid geometries, docs/hybrid.md); its slot ids are local to it.
  // nullopt before the pool exists or for a component the pool does not have.
  std::optional<PoolRegion> region(size_t component) const;

 private:
  // The region, after checking `slot` and `size` against it.
  Result<PoolRegion> Check(SlotId slot, size_t size) const;

  const Cache* const cache_;
  mutable Mutex mu_;
  mutable uint64_t known_generation_ ABSL_GUARDED_BY(mu_) = 0;  // 0: nothing known yet
  mutable std::vector<PoolRegion> known_regions_ ABSL_GUARDED_BY(mu_);  // per component, of known_generation_
};

}  // namespace flexkv
