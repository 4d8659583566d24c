// Cache: the marks of the blocks the next tier (SSD) also holds, and the write-back queue; see cache.h.
#include <algorithm>
#include <optional>

#include "common/clock.h"
#include "daemon/cache/cache.h"

namespace flexkv {

namespace {
constexpr uint8_t kNotOnNext = 0;
constexpr uint8_t kWriting = 1;
constexpr uint8_t kOnNext = 2;
}  // namespace

void Cache::AttachNextTier(bool queue_commits, int64_t store_wait_ms) {
  MutexLock lock(&mu_);
  next_tier_ = true;
  queue_commits_ = queue_commits;
  store_wait_ms_ = std::max<int64_t>(0, store_wait_ms);
  // Write policy all: blocks committed before the tier was attached (the SSD store opens after the first pool, which
  // an engine may store into at once) are queued too. The cold walk would not reach a prefix many prompts share: it
  // is never a leaf.
  if (queue_commits && index_ && parts_.empty()) {
    index_->ForEachCommitted([this](SlotId s, const BlockKey&, const BlockKey&) ABSL_NO_THREAD_SAFETY_ANALYSIS {
      if (commit_queue_.size() < on_next_.size()) commit_queue_.push_back(s);
    });
  }
}

void Cache::SetWriteBackHealthy(bool healthy) {
  MutexLock lock(&mu_);
  write_back_healthy_ = healthy;
}

void Cache::SetWriteBackServed(bool served) {
  MutexLock lock(&mu_);
  write_back_served_ = served;
}

int64_t Cache::StoreWaitMs() const {
  MutexLock lock(&mu_);
  return StoreWaitMsLocked();
}

int64_t Cache::StoreWaitMsLocked() const {
  // Hybrid domains have no next tier; a failing drive would only make every store wait in vain.
  if (!next_tier_ || !index_ || !parts_.empty() || !write_back_healthy_ || !write_back_served_) return 0;
  return store_wait_ms_;
}

void Cache::CountStoreWait(bool expired) {
  MutexLock lock(&mu_);
  if (expired) ++store_wait_expired_; else ++store_waits_;
}

void Cache::SetMarkLocked(SlotId slot, uint8_t mark) {
  on_next_[slot] = mark;
  index_->SetClean(slot, mark == kOnNext);
}

void Cache::ForgetNextTierLocked(SlotId slot, bool evicted) {
  if (slot >= on_next_.size()) return;
  ++next_tier_epoch_;
  if (evicted && next_tier_ && parts_.empty()) {  // hybrid domains have no next tier: nothing to count
    if (on_next_[slot] == kOnNext) ++evicted_written_; else ++evicted_unwritten_;
  }
  // The node is being evicted or was just reserved (fresh): its clean mark goes with it, not through SetClean.
  on_next_[slot] = kNotOnNext;
  touched_[slot] = 0;
}

void Cache::NoteHitsLocked(std::span<const SlotId> slots) {
  for (SlotId s : slots) {
    if (s >= on_next_.size() || on_next_[s] != kOnNext || touched_[s] != 0) continue;
    if (touch_queue_.size() >= on_next_.size()) return;  // bounded: the mover drains it every round
    touched_[s] = 1;
    touch_queue_.push_back(s);
  }
}

std::vector<BlockKey> Cache::TakeTouched() {
  MutexLock lock(&mu_);
  std::vector<BlockKey> out;
  if (!index_) return out;
  out.reserve(touch_queue_.size());
  for (SlotId s : touch_queue_) {
    if (s >= touched_.size() || touched_[s] == 0) continue;  // evicted or reserved again since
    touched_[s] = 0;
    if (on_next_[s] != kOnNext || !index_->IsCommitted(s)) continue;
    if (const std::optional<Pool::Committed> entry = pool_->Entry(s)) out.push_back(entry->key);
  }
  touch_queue_.clear();
  return out;
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
      SetMarkLocked(s, kNotOnNext);
    }
    if (!index_->PinSlot(s)) return;
    SetMarkLocked(s, kWriting);
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
    SetMarkLocked(block.slot, stored ? kOnNext : kNotOnNext);  // still pinned: listed by the Unpin below
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
    if (s < on_next_.size() && index_ && index_->IsCommitted(s) && on_next_[s] == kNotOnNext) SetMarkLocked(s, kOnNext);
  }
}

Cache::WriteBackStats Cache::write_back_stats() const {
  MutexLock lock(&mu_);
  return WriteBackStats{evicted_written_, evicted_unwritten_, writing_, commit_queue_.size(), store_waits_,
                        store_wait_expired_};
}

}  // namespace flexkv
