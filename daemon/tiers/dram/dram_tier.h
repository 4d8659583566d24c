// DramTier: tier 0, the DRAM pool (daemon/cache/pool.h, owned by the Cache) as a CacheTier. Engines copy only
// from and to this tier, through the engine-memory backends, at the slot addresses region() gives.
#pragma once

#include <atomic>
#include <optional>
#include <vector>

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
