// DramTier: tier 0, the DRAM pool (daemon/cache/pool.h, owned by the Cache) as a CacheTier. Engines copy only
// from and to this tier, through the engine-memory backends, at the slot addresses region() gives.
#pragma once

#include <atomic>
#include <optional>

#include "common/mutex.h"
#include "daemon/cache/cache.h"
#include "daemon/cache/pool_region.h"
#include "daemon/tiers/cache_tier.h"

namespace flexkv {

class DramTier final : public CacheTier {
 public:
  // `cache` owns the pool and outlives the tier.
  explicit DramTier(const Cache* cache) : cache_(cache) {}

  std::string_view name() const override { return "dram"; }
  // The pool is a named file under /dev/shm (or hugetlbfs) with a slot table: a restarted daemon re-attaches
  // it (a reboot loses it).
  bool survives_restart() const override { return true; }
  uint32_t capacity_slots() const override;
  uint64_t slot_bytes() const override;
  Status ReadSlot(SlotId slot, std::span<uint8_t> bytes) const override;
  Status WriteSlot(SlotId slot, std::span<const uint8_t> bytes) override;

  // Where the slots are in this process, for the engine-memory backends; nullopt before the pool exists. Once it
  // exists the region never changes: it is read from the cache once and then without a lock (it is asked for
  // on every Load and Store).
  std::optional<PoolRegion> region() const;

 private:
  // The region, after checking `slot` and `size` against it.
  Result<PoolRegion> Check(SlotId slot, size_t size) const;

  const Cache* const cache_;
  mutable Mutex mu_;                     // serializes filling `known_region_`
  mutable std::atomic<bool> region_known_{false};
  mutable PoolRegion known_region_;            // written once, under mu_, before region_known_ turns true
};

}  // namespace flexkv
