// See dram_tier.h.
#include "daemon/tiers/dram/dram_tier.h"

#include <fmt/format.h>

#include <cstring>

namespace flexkv {

std::optional<PoolRegion> DramTier::region(size_t component) const {
  const uint64_t generation = cache_->generation();
  MutexLock lock(&mu_);
  if (known_generation_ != generation || generation == 0) {
    // First use, or the domain was dropped and a new pool (another address, slot size and count) replaced it.
    known_regions_.clear();
    for (size_t c = 0;; ++c) {
      const std::optional<PoolRegion> r = cache_->pool_region(c);
      if (!r) break;
      known_regions_.push_back(*r);
    }
    if (known_regions_.empty()) return std::nullopt;
    known_generation_ = cache_->generation();
  }
  if (component >= known_regions_.size()) return std::nullopt;
  // The slot addresses stay for the generation; the active slots move with Cache::Resize.
  PoolRegion r = known_regions_[component];
  r.slots = cache_->active_slots(component);
  r.bytes = uint64_t{r.slots} * r.slot_bytes;
  return r;
}

uint32_t DramTier::capacity_slots() const {
  const std::optional<PoolRegion> r = region();
  return r ? r->slots : 0;
}

uint64_t DramTier::slot_bytes() const {
  const std::optional<PoolRegion> r = region();
  return r ? r->slot_bytes : 0;
}

Result<PoolRegion> DramTier::Check(SlotId slot, size_t size) const {
  const std::optional<PoolRegion> r = region();
  if (!r) return Status::FailedPrecondition("the DRAM pool does not exist yet (the first Attach creates it)");
  if (slot >= r->slots) {
    return Status::OutOfRange(fmt::format("slot {} is not below the DRAM pool's {} slots", slot, r->slots));
  }
  if (size != r->slot_bytes) {
    return Status::InvalidArgument(fmt::format("{} bytes for a slot; expected the slot size, {}", size, r->slot_bytes));
  }
  return *r;
}

Status DramTier::ReadSlot(SlotId slot, std::span<uint8_t> bytes) const {
  Result<PoolRegion> r = Check(slot, bytes.size());
  if (!r.ok()) return r.status();
  std::memcpy(bytes.data(), r->SlotData(slot), bytes.size());
  return Status::Ok();
}

Status DramTier::WriteSlot(SlotId slot, std::span<const uint8_t> bytes) {
  Result<PoolRegion> r = Check(slot, bytes.size());
  if (!r.ok()) return r.status();
  std::memcpy(r->SlotData(slot), bytes.data(), bytes.size());
  return Status::Ok();
}

}  // namespace flexkv
