// Cache: a hybrid prefix pulled from a peer (cache.h, ReservePulledHybrid / CommitPulledHybrid). A pull names each
// component's entries itself (the peer's hit end decides them, and a window may reach back into the prefix held
// here), and its set is published only once every byte of it verified: all or none, as a hybrid store.
#include <algorithm>

#include "daemon/cache/cache.h"

namespace flexkv {

Cache::HybridReservation Cache::ReservePulledHybrid(const BlockKey& parent, std::span<const BlockKey> keys,
                                                    const std::vector<std::vector<BlockKey>>& entry_keys) {
  MutexLock lock(&mu_);
  HybridReservation r;
  const auto refuse = [&r](StatusCode code, size_t component) {
    r.keys.clear();
    r.slots.clear();
    r.full.slots.clear();
    r.shortfall = code;
    r.component = component;
    return r;
  };
  if (!index_ || parts_.empty() || entry_keys.size() != parts_.size() + 1) {
    r.full.shortfall = StatusCode::kFailedPrecondition;
    return refuse(StatusCode::kFailedPrecondition, 0);
  }
  r.keys = entry_keys;
  r.keys[0].clear();
  r.slots.resize(r.keys.size());
  // All or none, and a refused pull evicts nothing: the components are checked first (changing nothing), then the
  // FULL part is reserved (which may evict), then the components (which cannot fail now: FULL evictions only
  // unanchor their entries).
  // While a next tier's write-back serves, a pull evicts only what that tier holds (as a promotion): a read never
  // costs a block or entry the node accepted; one that would is refused (RESOURCE_EXHAUSTED), having evicted at most
  // blocks that tier holds.
  const bool clean_only = StoreWaitMsLocked() > 0;
  for (size_t c = 1; c < r.keys.size(); ++c) {
    const StatusCode feasible = Part(c).Feasible(r.keys[c]);
    if (feasible != StatusCode::kOk) return refuse(feasible, c);
    if (clean_only && !Part(c).FitsWithoutDirty(r.keys[c])) return refuse(StatusCode::kResourceExhausted, c);
  }
  r.full = index_->Reserve(parent, keys, /*allow_dirty=*/!clean_only);
  if (r.full.parent_refused || r.full.shortfall != StatusCode::kOk) {
    // The prefix held here went, or the pool (or another store of these keys) cut the FULL part short: a part of a
    // hybrid prefix serves no hit.
    const StatusCode why = r.full.shortfall != StatusCode::kOk ? r.full.shortfall : StatusCode::kResourceExhausted;
    const bool parent_refused = r.full.parent_refused;
    index_->Abort(r.full.slots);
    refuse(why, 0);
    r.full.parent_refused = parent_refused;
    r.full.shortfall = why;
    return r;
  }
  for (SlotId s : r.full.slots) ForgetNextTierLocked(s, /*evicted=*/false);
  // The FULL evictions unanchored entries (they go first at eviction): checked again.
  for (size_t c = 1; clean_only && c < r.keys.size(); ++c) {
    if (!Part(c).FitsWithoutDirty(r.keys[c])) {
      index_->Abort(r.full.slots);
      return refuse(StatusCode::kResourceExhausted, c);
    }
  }
  for (size_t c = 1; c < r.keys.size(); ++c) {
    ComponentIndex::Reservation part = Part(c).Reserve(r.keys[c]);
    if (part.shortfall != StatusCode::kOk) {  // a repeated key: give back what was taken
      for (size_t d = 1; d < c; ++d) {
        std::vector<SlotId> local;
        for (SlotId s : r.slots[d]) {
          if (s != ComponentIndex::kNoSlot) local.push_back(LocalLocked(d, s));
        }
        Part(d).Abort(local);
      }
      index_->Abort(r.full.slots);
      return refuse(part.shortfall, c);
    }
    const SlotId base = pool_->sub_pool(c).base;
    for (SlotId& s : part.slots) {
      if (s != ComponentIndex::kNoSlot) s += base;
    }
    r.slots[c] = std::move(part.slots);
  }
  return r;
}

void Cache::CommitPulledHybrid(const BlockKey& parent, std::span<const BlockKey> keys, const HybridReservation& r,
                               const std::vector<std::vector<uint64_t>>& checksums) {
  MutexLock lock(&mu_);
  if (!index_) return;  // DropDomain waits for copies in flight
  const size_t first = r.full.cached;
  index_->Commit(r.full.slots);
  // Each sub-pool's demand (ComponentBytesStored): a pull adds to the sub-pools as a store does.
  component_bytes_stored_[0] += r.full.slots.size() * pool_->sub_pool(0).slot_bytes;
  for (size_t c = 1; c < r.slots.size(); ++c) {
    const auto added = std::count_if(r.slots[c].begin(), r.slots[c].end(),
                                     [](SlotId s) { return s != ComponentIndex::kNoSlot; });
    component_bytes_stored_[c] += static_cast<uint64_t>(added) * pool_->sub_pool(c).slot_bytes;
  }
  std::vector<BlockKey> gone;  // FULL blocks dropped while they were read: their entries serve nothing
  for (size_t i = 0; i < r.full.slots.size(); ++i) {
    const SlotId slot = r.full.slots[i];
    const size_t k = first + i;
    if (!index_->IsCommitted(slot)) {  // dropped with a failed ancestor meanwhile
      gone.push_back(keys[k]);
      continue;
    }
    const BlockKey& up = k == 0 ? parent : keys[k - 1];
    pool_->MarkCommitted(slot, keys[k], up, checksums[0][i]);
    for (const auto& part : parts_) part->Anchor(keys[k]);
    ReportBlockLocked(BlockEvent::kCommitted, keys[k], k + 1 == keys.size(), BlockEvent::kPulled, up);
    QueueCommitLocked(slot);  // the SSD tier's write policy all: written like a stored block
  }
  for (size_t c = 1; c < r.slots.size(); ++c) {
    std::vector<SlotId> local;
    for (SlotId s : r.slots[c]) {
      if (s != ComponentIndex::kNoSlot) local.push_back(LocalLocked(c, s));
    }
    Part(c).Commit(local);  // at the most recently used end: a prefetch pulls what an engine is about to load
    size_t n = 0;
    for (size_t i = 0; i < r.slots[c].size(); ++i) {
      const SlotId s = r.slots[c][i];
      if (s == ComponentIndex::kNoSlot) continue;
      const uint64_t sum = checksums[c][n++];
      if (!Part(c).IsCommitted(LocalLocked(c, s))) continue;
      pool_->MarkCommitted(s, r.keys[c][i], BlockKey{}, sum);
      ReportBlockLocked(BlockEvent::kCommitted, r.keys[c][i], false, BlockEvent::kPulled, BlockKey{},
                        static_cast<uint8_t>(c));
      QueueCommitLocked(s);
    }
  }
  for (const BlockKey& key : gone) UnanchorLocked(key);
  ++next_tier_epoch_;
}

}  // namespace flexkv
