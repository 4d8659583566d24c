// Cache: the marks of the blocks the next tier (SSD) also holds, and the write-back queue; see cache.h.
#include <algorithm>

#include "common/clock.h"
#include "daemon/cache/cache.h"

namespace flexkv {

namespace {
constexpr uint8_t kNotOnNext = 0;
constexpr uint8_t kWriting = 1;
constexpr uint8_t kOnNext = 2;
}  // namespace

void Cache::AttachNextTier(bool queue_commits) {
  MutexLock lock(&mu_);
  next_tier_ = true;
  queue_commits_ = queue_commits;
}

void Cache::ForgetNextTierLocked(SlotId slot, bool evicted) {
  if (slot >= on_next_.size()) return;
  ++next_tier_epoch_;
  if (evicted && next_tier_ && parts_.empty()) {  // hybrid domains have no next tier: nothing to count
    if (on_next_[slot] == kOnNext) ++evicted_written_; else ++evicted_unwritten_;
  }
  on_next_[slot] = kNotOnNext;
}

std::vector<Cache::WriteBackBlock> Cache::TakeWriteBack(size_t max_blocks, size_t window,
                                                       const std::function<bool(const BlockKey&)>& still_on_next) {
  MutexLock lock(&mu_);
  std::vector<WriteBackBlock> out;
  if (!next_tier_ || !index_ || !parts_.empty() || max_blocks == 0) return out;
  // Pins `s` and appends it, when it is committed, not on the next tier and not being written. A block marked as on
  // the next tier is checked there when it is a cold leaf (the next to go): it may have been dropped there to make
  // room, and is then written again.
  const auto take = [&](SlotId s, bool cold, bool leaf) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (s >= on_next_.size() || on_next_[s] == kWriting) return;
    if (on_next_[s] == kOnNext && !(leaf && still_on_next)) return;
    const std::optional<Pool::Committed> entry = pool_->Entry(s);
    if (!entry) return;  // a corrupt entry is the verifier's business, not written
    if (on_next_[s] == kOnNext) {
      if (still_on_next(entry->key)) return;
      on_next_[s] = kNotOnNext;
    }
    if (!index_->PinSlot(s)) return;
    on_next_[s] = kWriting;
    ++writing_;
    out.push_back(WriteBackBlock{s, entry->key, entry->parent, entry->content_checksum, cold});
  };
  size_t queued = 0;
  for (; queued < commit_queue_.size() && out.size() < max_blocks; ++queued) {
    const SlotId s = commit_queue_[queued];
    if (index_->IsCommitted(s)) take(s, false, false);
  }
  commit_queue_.erase(commit_queue_.begin(), commit_queue_.begin() + static_cast<ptrdiff_t>(queued));
  if (out.size() >= max_blocks || window == 0) return out;
  // The cold end, in the order it will be evicted: each cold leaf, then the ancestors that become cold leaves when it
  // goes (up to the first that has other children: it stays while they do), within `window` blocks and at most
  // kWalkBudget nodes in all (the walk holds the cache's lock). A block on the next tier is reachable there through
  // the DRAM prefix above it, which eviction keeps longest. The walk runs when the index changed since one found
  // nothing, or every kWalkIntervalMs all the same (pins released, blocks verified at a restart).
  constexpr size_t kWalkBudget = 16384;
  constexpr int64_t kWalkIntervalMs = 100;
  const int64_t now_ms = MonotonicMs();
  if (next_tier_epoch_ == idle_epoch_ && now_ms - last_walk_ms_ < kWalkIntervalMs) return out;
  last_walk_ms_ = now_ms;
  const size_t limit = std::min(window, kWalkBudget);
  size_t seen = 0;
  index_->ForEachColdLeaf(limit, [&](SlotId leaf) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    ++seen;
    take(leaf, true, true);
    for (SlotId s = index_->ParentOf(leaf); s != PrefixIndex::kNoParent && index_->ChildCount(s) == 1 &&
                                            seen < limit && out.size() < max_blocks;
         s = index_->ParentOf(s)) {
      ++seen;
      take(s, true, false);  // a leaf by the time it is unpinned if its child went meanwhile: cold
    }
    return out.size() < max_blocks && seen < limit;
  });
  if (out.empty()) idle_epoch_ = next_tier_epoch_;
  return out;
}

void Cache::EndWriteBack(const WriteBackBlock& block, bool stored) {
  MutexLock lock(&mu_);
  if (!index_ || block.slot >= on_next_.size()) return;  // DropDomain refuses while blocks are pinned
  ++next_tier_epoch_;  // a leaf is back on the eviction list: the walk may find more behind it
  if (on_next_[block.slot] == kWriting) {
    on_next_[block.slot] = stored ? kOnNext : kNotOnNext;
    --writing_;
    if (!stored) {  // to be taken again
      if (queue_commits_ && commit_queue_.size() < on_next_.size()) commit_queue_.push_back(block.slot);
    }
  }
  index_->Unpin(std::span<const SlotId>(&block.slot, 1), block.cold);
}

void Cache::MarkOnNextTier(std::span<const SlotId> slots) {
  MutexLock lock(&mu_);
  for (SlotId s : slots) {
    if (s < on_next_.size() && index_ && index_->IsCommitted(s) && on_next_[s] == kNotOnNext) on_next_[s] = kOnNext;
  }
}

Cache::WriteBackStats Cache::write_back_stats() const {
  MutexLock lock(&mu_);
  return WriteBackStats{evicted_written_, evicted_unwritten_, writing_, commit_queue_.size()};
}

}  // namespace flexkv
