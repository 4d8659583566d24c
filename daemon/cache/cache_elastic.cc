// Cache's elastic capacity (see cache.h "Elastic capacity"): Resize and what it needs - announcing grants to the
// pool listener, publishing the active sizes to the lock-free readers, and the size figures. Split from cache.cc,
// which keeps the domain, matching, storing and checking.
#include <fmt/format.h>

#include <algorithm>

#include "common/log.h"
#include "daemon/cache/cache.h"

namespace flexkv {

void Cache::AnnounceGrantsLocked(const std::function<void(const PoolRegion&)>& listener, size_t c, uint32_t from,
                                 uint32_t to) const {
  if (!listener) return;
  const SubPool& p = pool_->sub_pool(c);
  for (uint32_t first = from; first < to; first += p.grant) {
    const uint32_t slots = std::min(p.grant, to - first);
    listener(PoolRegion{p.data + uint64_t{first} * p.slot_bytes, uint64_t{slots} * p.slot_bytes, p.slot_bytes, slots});
  }
}

void Cache::AnnounceAllAddedLocked(size_t c, uint32_t from, uint32_t to) const {
  if (!pool_listener_) return;
  const SubPool& p = pool_->sub_pool(c);
  for (uint32_t first = from; first < to; first += p.grant) {
    const uint32_t slots = std::min(p.grant, to - first);
    (void)pool_listener_(
        PoolRegion{p.data + uint64_t{first} * p.slot_bytes, uint64_t{slots} * p.slot_bytes, p.slot_bytes, slots});
  }
}

Status Cache::AnnounceAddedLocked(size_t c, uint32_t from, uint32_t to, uint32_t* reached) const {
  *reached = from;
  if (!pool_listener_) {
    *reached = to;
    return Status::Ok();
  }
  const SubPool& p = pool_->sub_pool(c);
  for (uint32_t first = from; first < to; first += p.grant) {
    const uint32_t slots = std::min(p.grant, to - first);
    *reached = first + slots;
    FLEXKV_RETURN_IF_ERROR(pool_listener_(
        PoolRegion{p.data + uint64_t{first} * p.slot_bytes, uint64_t{slots} * p.slot_bytes, p.slot_bytes, slots}));
  }
  return Status::Ok();
}

void Cache::PublishActiveLocked() {
  uint32_t total = 0;
  for (size_t c = 0; c < active_slots_.size(); ++c) {
    const uint32_t active = c < pool_->component_count() ? pool_->sub_pool(c).active : 0;
    active_slots_[c].store(active, std::memory_order_release);
    total += active;
  }
  capacity_.store(total, std::memory_order_release);
}

std::optional<PoolRegion> Cache::pool_region(size_t component) const {
  MutexLock lock(&mu_);
  if (!pool_ || component >= pool_->component_count()) return std::nullopt;
  const SubPool& p = pool_->sub_pool(component);
  return PoolRegion{p.data, uint64_t{p.active} * p.slot_bytes, p.slot_bytes, p.active};
}

SlotId Cache::slot_id_end() const {
  MutexLock lock(&mu_);
  return pool_ ? pool_->capacity() : 0;
}

uint32_t Cache::active_slots(size_t component) const {
  return component < active_slots_.size() ? active_slots_[component].load(std::memory_order_acquire) : 0;
}

uint64_t Cache::active_bytes() const {
  MutexLock lock(&mu_);
  return pool_ ? pool_->active_bytes() : 0;
}

uint64_t Cache::max_bytes() const {
  MutexLock lock(&mu_);
  if (!pool_) return 0;
  return pool_->demand_sized() ? std::min(pool_->max_bytes(), budget_bytes()) : pool_->max_bytes();
}

std::vector<uint64_t> Cache::ComponentBytesStored() const {
  MutexLock lock(&mu_);
  return pool_ ? component_bytes_stored_ : std::vector<uint64_t>{};
}

std::vector<SubPoolNeed> Cache::SubPoolNeeds() const {
  MutexLock lock(&mu_);
  std::vector<SubPoolNeed> parts;
  if (!pool_ || !pool_->demand_sized() || pool_->component_count() < 2 || preparation_.preparing) return parts;
  for (size_t c = 0; c < pool_->component_count(); ++c) {
    const SubPool& p = pool_->sub_pool(c);
    const uint32_t limit = c == 0 ? index_->limit() : Part(c).limit();
    const uint32_t active = c == 0 ? index_->active() : Part(c).active();
    if (limit < active) return {};  // a held shrink: the domain's Rebalance continues it first
    parts.push_back(SubPoolNeed{0, p.slot_bytes, p.grant, p.capacity, p.active,
                                static_cast<uint32_t>(c == 0 ? index_->used_slots() : Part(c).used_slots())});
  }
  return parts;
}

uint64_t Cache::min_bytes() const {
  MutexLock lock(&mu_);
  uint64_t bytes = 0;
  for (size_t c = 0; pool_ && c < pool_->component_count(); ++c) {
    bytes += uint64_t{pool_->sub_pool(c).grant} * pool_->sub_pool(c).slot_bytes;
  }
  return bytes;
}

Result<uint64_t> Cache::Resize(uint64_t active_bytes) {
  MutexLock lock(&mu_);
  if (!pool_) return Status::FailedPrecondition("there is no pool to resize yet (the first Attach creates it)");
  if (preparation_.preparing) {
    return Status::FailedPrecondition("the pool is still being prepared (growing to its first share); retry later");
  }
  return ResizeLocked(pool_->ActiveSlotsFor(active_bytes));
}

std::vector<uint32_t> Cache::ActiveSlots() const {
  MutexLock lock(&mu_);
  std::vector<uint32_t> slots;
  for (size_t c = 0; pool_ && c < pool_->component_count(); ++c) slots.push_back(pool_->sub_pool(c).active);
  return slots;
}

Result<uint64_t> Cache::ResizeSlots(const std::vector<uint32_t>& target) {
  MutexLock lock(&mu_);
  if (!pool_) return Status::FailedPrecondition("there is no pool to resize yet (the first Attach creates it)");
  if (preparation_.preparing) {
    return Status::FailedPrecondition("the pool is still being prepared (growing to its first share); retry later");
  }
  if (target.size() != pool_->component_count()) {
    return Status::InvalidArgument(fmt::format("{} active sizes for a pool of {} components", target.size(),
                                               pool_->component_count()));
  }
  for (size_t c = 0; c < target.size(); ++c) {
    const SubPool& p = pool_->sub_pool(c);
    if (target[c] != p.RoundToGrants(target[c])) {
      return Status::InvalidArgument(fmt::format("component {}: {} active slots; expected whole grants of {} (at most {})",
                                                 c, target[c], p.grant, p.capacity));
    }
  }
  return ResizeLocked(target);
}

Result<uint64_t> Cache::ResizeLocked(const std::vector<uint32_t>& target) {
  const auto index_active = [&](size_t c) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return c == 0 ? index_->active() : Part(c).active();
  };
  // Shrinks first, so that the memory they give back is there for the grows.
  Status status;
  for (size_t c = 0; c < target.size(); ++c) {
    if (target[c] > index_active(c)) continue;
    // The index's eviction listener clears each evicted block's slot entry (and unanchors under FULL keys).
    const PrefixIndex::Shrunk shrunk = c == 0 ? index_->Shrink(target[c]) : Part(c).Shrink(target[c]);
    const SubPool& sub = pool_->sub_pool(c);
    const uint32_t from = sub.active, keep = sub.RoundToGrants(shrunk.active);  // a grant partly busy stays
    if (keep >= from) continue;
    AnnounceGrantsLocked(pool_gone_listener_, c, keep, from);
    status = pool_->SetActive(c, keep);
    if (!status.ok()) {  // nothing changed in the pool: its grants stay, registered again
      AnnounceAllAddedLocked(c, keep, from);
      break;
    }
    log::Info("cache", "pool {} component {}: {} -> {} active slots ({} blocks evicted)", pool_path_, c, from, keep,
              shrunk.evicted);
  }
  for (size_t c = 0; status.ok() && c < target.size(); ++c) {
    if (target[c] <= index_active(c)) continue;
    const uint32_t from = pool_->sub_pool(c).active;
    if (target[c] > from) {
      status = pool_->SetActive(c, target[c]);
      if (!status.ok()) break;
      uint32_t reached = from;
      if (Status added = AnnounceAddedLocked(c, from, target[c], &reached); !added.ok()) {
        // Not reachable for copies (e.g. DMA registration failed): its slots are never handed out; every grant
        // told (the refused one too, so that the listener forgets it) is taken back.
        AnnounceGrantsLocked(pool_gone_listener_, c, from, reached);
        if (Status back = pool_->SetActive(c, from); !back.ok()) {
          log::Warning("cache", "pool {}: giving back grants that could not be registered: {}", pool_path_,
                       back.ToString());
        }
        status = added.WithContext(fmt::format("growing pool {} component {} from {} to {} slots", pool_path_, c,
                                               from, target[c]));
        break;
      }
      log::Info("cache", "pool {} component {}: {} -> {} active slots", pool_path_, c, from, target[c]);
    }
    if (c == 0) {
      index_->Grow(target[c]);
    } else {
      Part(c).Grow(target[c]);
    }
  }
  PublishActiveLocked();
  if (!status.ok()) return status;
  return pool_->active_bytes();
}

bool Cache::shrink_held() const {
  MutexLock lock(&mu_);
  if (!pool_) return false;
  bool held = index_->limit() < index_->active();
  for (size_t c = 1; c < pool_->component_count(); ++c) held = held || Part(c).limit() < Part(c).active();
  return held;
}

}  // namespace flexkv
