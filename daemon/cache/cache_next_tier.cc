// Cache: the marks of the blocks the next tier (SSD) also holds, the write-back queue, and the promotion of a hybrid
// domain's pieces from the next tier; see cache.h.
#include <algorithm>
#include <optional>

#include "common/clock.h"
#include "common/hybrid_ids.h"
#include "daemon/cache/cache.h"

namespace flexkv {

namespace {
constexpr uint8_t kNotOnNext = 0;
constexpr uint8_t kWriting = 1;
constexpr uint8_t kOnNext = 2;
}  // namespace

void Cache::AttachNextTier(bool queue_commits, int64_t store_wait_ms, bool hybrid) {
  MutexLock lock(&mu_);
  next_tier_ = true;
  next_tier_hybrid_ = hybrid;
  queue_commits_ = queue_commits;
  store_wait_ms_ = std::max<int64_t>(0, store_wait_ms);
  // Write policy all: blocks committed before the tier was attached (the SSD store opens after the first pool, which
  // an engine may store into at once) are queued too. The cold walk would not reach a prefix many prompts share: it
  // is never a leaf.
  if (queue_commits && index_ && NextTierLocked()) {
    index_->ForEachCommitted([this](SlotId s, const BlockKey&, const BlockKey&) ABSL_NO_THREAD_SAFETY_ANALYSIS {
      if (commit_queue_.size() < on_next_.size()) commit_queue_.push_back(s);
    });
    for (size_t c = 1; c <= parts_.size(); ++c) {
      const SlotId base = pool_->sub_pool(c).base;
      Part(c).ForEachCommitted([this, base](SlotId local, const BlockKey&) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        if (commit_queue_.size() < on_next_.size()) commit_queue_.push_back(base + local);
      });
    }
  }
}

void Cache::QueueCommitLocked(SlotId slot) {
  if (queue_commits_ && NextTierLocked() && commit_queue_.size() < on_next_.size()) commit_queue_.push_back(slot);
}

bool Cache::CommittedLocked(SlotId slot) const {
  if (slot >= pool_->capacity()) return false;
  const size_t c = ComponentOfLocked(slot);
  return c == 0 ? index_->IsCommitted(slot) : Part(c).IsCommitted(LocalLocked(c, slot));
}

bool Cache::PinCommittedLocked(SlotId slot) {
  if (slot >= pool_->capacity()) return false;
  const size_t c = ComponentOfLocked(slot);
  return c == 0 ? index_->PinSlot(slot) : Part(c).PinSlot(LocalLocked(c, slot));
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
  // A failing drive would only make every store wait in vain. A hybrid domain waits only when its tier takes every
  // component (ReserveHybrid).
  if (!next_tier_ || !index_ || !write_back_healthy_ || !write_back_served_) return 0;
  if (!parts_.empty() && !next_tier_hybrid_) return 0;
  return store_wait_ms_;
}

bool Cache::WriteBackMayMakeRoom() const {
  MutexLock lock(&mu_);
  return WriteBackMayMakeRoomLocked();
}

bool Cache::WriteBackMayMakeRoomLocked() const {
  if (!index_) return false;
  if (writing_ > 0 || index_->HasDirtyLeaf()) return true;
  for (const auto& part : parts_) {
    if (part->MayHaveDirtyEvictable()) return true;
  }
  return false;
}

void Cache::CountStoreWait(bool expired) {
  MutexLock lock(&mu_);
  if (expired) ++store_wait_expired_; else ++store_waits_;
}

void Cache::SetMarkLocked(SlotId slot, uint8_t mark) {
  on_next_[slot] = mark;
  const size_t c = ComponentOfLocked(slot);
  if (c == 0) {
    index_->SetClean(slot, mark == kOnNext);
  } else {
    Part(c).SetClean(LocalLocked(c, slot), mark == kOnNext);
  }
}

void Cache::ForgetNextTierLocked(SlotId slot, bool evicted) {
  if (slot >= on_next_.size()) return;
  ++next_tier_epoch_;
  if (evicted && NextTierLocked()) {
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

std::vector<Cache::NextTierKey> Cache::TakeTouched() {
  MutexLock lock(&mu_);
  std::vector<NextTierKey> out;
  if (!index_) return out;
  out.reserve(touch_queue_.size());
  for (SlotId s : touch_queue_) {
    if (s >= touched_.size() || touched_[s] == 0) continue;  // evicted or reserved again since
    touched_[s] = 0;
    if (on_next_[s] != kOnNext || !CommittedLocked(s)) continue;
    if (const std::optional<Pool::Committed> entry = pool_->Entry(s)) {
      out.push_back(NextTierKey{entry->key, static_cast<uint32_t>(ComponentOfLocked(s))});
    }
  }
  touch_queue_.clear();
  return out;
}

std::vector<Cache::WriteBackBlock> Cache::TakeWriteBack(
    size_t max_blocks, size_t window, const std::function<bool(const BlockKey&, uint32_t)>& still_on_next) {
  MutexLock lock(&mu_);
  std::vector<WriteBackBlock> out;
  if (!index_ || !NextTierLocked() || max_blocks == 0) return out;
  // Pins `s` and appends it, when it is committed, not on the next tier and not being written. A block marked as on
  // the next tier is checked there when it is next to be evicted (a cold leaf, or a window or state entry at its
  // sub-pool's cold end): it may have been dropped there to make room, and is then written again.
  const auto take = [&](SlotId s, bool cold, bool next_to_go) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (s >= on_next_.size() || on_next_[s] == kWriting) return;
    if (on_next_[s] == kOnNext && !(next_to_go && still_on_next)) return;
    const std::optional<Pool::Committed> entry = pool_->Entry(s);
    if (!entry) return;  // a corrupt entry is the verifier's business, not written
    const auto component = static_cast<uint32_t>(ComponentOfLocked(s));
    if (on_next_[s] == kOnNext) {
      if (still_on_next(entry->key, component)) return;
      SetMarkLocked(s, kNotOnNext);
    }
    if (!PinCommittedLocked(s)) return;
    SetMarkLocked(s, kWriting);
    ++writing_;
    out.push_back(WriteBackBlock{s, entry->key, entry->parent, entry->content_checksum, cold, component});
  };
  size_t queued = 0;
  for (; queued < commit_queue_.size() && out.size() < max_blocks; ++queued) {
    const SlotId s = commit_queue_[queued];
    if (CommittedLocked(s)) take(s, false, false);
  }
  commit_queue_.erase(commit_queue_.begin(), commit_queue_.begin() + static_cast<ptrdiff_t>(queued));
  if (out.size() >= max_blocks || window == 0) return out;
  // The cold ends, in the order they will be evicted, within each component's share of `window` and of `max_blocks`
  // (a FULL-only domain: all of both), and at most kWalkBudget nodes in all (the walk holds the cache's lock). The
  // walk runs when the index changed since one found nothing, or every kWalkIntervalMs all the same (pins released,
  // blocks verified at a restart).
  constexpr size_t kWalkBudget = 16384;
  constexpr int64_t kWalkIntervalMs = 100;
  const int64_t now_ms = MonotonicMs();
  if (next_tier_epoch_ == idle_epoch_ && now_ms - last_walk_ms_ < kWalkIntervalMs) return out;
  last_walk_ms_ = now_ms;
  const uint64_t total = std::max<uint64_t>(1, capacity_.load(std::memory_order_relaxed));  // every component's
  const auto share = [&](size_t n, size_t c) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (parts_.empty()) return n;
    const uint64_t active = pool_->sub_pool(c).active;
    return static_cast<size_t>(std::max<uint64_t>(1, (uint64_t{n} * active + total - 1) / total));
  };
  size_t budget = std::min(window, kWalkBudget);
  // FULL: each cold leaf, then the ancestors that become cold leaves when it goes (up to the first that has other
  // children: it stays while they do). A block on the next tier is reachable there through the DRAM prefix above it,
  // which eviction keeps longest.
  {
    const size_t limit = std::min(budget, share(window, 0));
    const size_t cap = std::min(max_blocks, out.size() + share(max_blocks, 0));
    size_t seen = 0;
    if (out.size() < cap) {
      index_->ForEachColdLeaf(limit, [&](SlotId leaf) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        ++seen;
        take(leaf, true, true);
        for (SlotId s = index_->ParentOf(leaf); s != PrefixIndex::kNoParent && index_->ChildCount(s) == 1 &&
                                                seen < limit && out.size() < cap;
             s = index_->ParentOf(s)) {
          ++seen;
          take(s, true, false);  // a leaf by the time it is unpinned if its child went meanwhile: cold
        }
        return out.size() < cap && seen < limit;
      });
    }
    budget -= std::min(budget, seen);
  }
  // Windows and states: their sub-pool's eviction order (unanchored, clean, dirty).
  for (size_t c = 1; c <= parts_.size() && budget > 0 && out.size() < max_blocks; ++c) {
    const size_t limit = std::min(budget, share(window, c));
    const size_t cap = std::min(max_blocks, out.size() + share(max_blocks, c));
    const SlotId base = pool_->sub_pool(c).base;
    std::vector<SlotId> cold;  // collected first: taking one pins it, which changes the lists walked
    Part(c).ForEachCold(limit, [&](SlotId local) {
      cold.push_back(base + local);
      return true;
    });
    budget -= std::min(budget, cold.size());
    for (size_t i = 0; i < cold.size() && out.size() < cap; ++i) take(cold[i], true, true);
  }
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
    if (!stored) QueueCommitLocked(block.slot);  // to be taken again
  }
  const size_t c = ComponentOfLocked(block.slot);
  if (c == 0) {
    index_->Unpin(std::span<const SlotId>(&block.slot, 1), block.cold);
  } else {
    const SlotId local = LocalLocked(c, block.slot);
    Part(c).Unpin(std::span<const SlotId>(&local, 1), block.cold);
  }
}

void Cache::MarkOnNextTier(std::span<const SlotId> slots) {
  MutexLock lock(&mu_);
  if (!index_) return;
  for (SlotId s : slots) {
    if (s < on_next_.size() && CommittedLocked(s) && on_next_[s] == kNotOnNext) SetMarkLocked(s, kOnNext);
  }
}

Cache::WriteBackStats Cache::write_back_stats() const {
  MutexLock lock(&mu_);
  return WriteBackStats{evicted_written_, evicted_unwritten_, writing_, commit_queue_.size(), store_waits_,
                        store_wait_expired_};
}

size_t Cache::HybridPromotion::pieces() const {
  size_t n = 0;
  for (const auto& c : slots) n += c.size();
  return n;
}

Cache::HybridPromotion Cache::ReservePromotion(std::span<const BlockKey> keys,
                                               const std::function<bool(size_t, size_t)>& on_next) {
  MutexLock lock(&mu_);
  HybridPromotion p;
  if (!index_ || parts_.empty() || keys.empty()) return p;
  const Geometry& g = pool_->geometry();
  const size_t components = g.component_count();
  // What DRAM serves now, and how far FULL goes over DRAM and the next tier (a chain: each under the one before).
  const size_t dram_hit = HybridMatchLocked(keys, false, nullptr);
  const size_t full_dram = index_->Match(keys, false, nullptr);
  size_t full_end = full_dram;
  while (full_end < keys.size() && on_next(0, full_end)) ++full_end;
  std::vector<ComponentRule> rules;
  for (size_t c = 1; c < components; ++c) {
    rules.push_back(ComponentRule{g.component_kind(c) == ComponentKind::kState, g.window_blocks(c)});
  }
  const auto in_dram = [&](size_t c, size_t j) ABSL_NO_THREAD_SAFETY_ANALYSIS { return Part(c).Find(keys[j]); };
  const size_t e = LongestUsableEnd(full_end, rules, [&](size_t c, size_t j) {
    return in_dram(c, j).has_value() || on_next(c, j);
  });
  if (e <= dram_hit) return p;
  // The pieces of e: what DRAM holds is pinned (held), the rest is read.
  p.keys.resize(components);
  p.at.resize(components);
  p.slots.resize(components);
  for (size_t j = full_dram; j < e; ++j) {
    p.keys[0].push_back(keys[j]);
    p.at[0].push_back(j);
  }
  p.full_from = std::min(full_dram, e);
  std::vector<SlotId> held;
  index_->Match(keys.first(p.full_from), true, &held);
  for (size_t c = 1; c < components; ++c) {
    const uint64_t n = ComponentIdCount(g, c, false, static_cast<uint32_t>(e));
    for (size_t j = e - n; j < e; ++j) {
      if (const std::optional<SlotId> local = in_dram(c, j)) {
        Part(c).Pin(*local);
        held.push_back(pool_->sub_pool(c).base + *local);
      } else {
        p.keys[c].push_back(keys[j]);
        p.at[c].push_back(j);
      }
    }
  }
  const auto refuse = [&](HybridPromotion& r) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    UnpinLocked(held);
    HybridPromotion none;
    for (const auto& k : r.keys) none.refused += k.size();
    return none;
  };
  // While the write-back serves, evictions take only what the next tier holds (as a store's that waits): a promotion
  // that would lose an unwritten block or entry waits for the write-back instead (nothing pinned or reserved).
  const bool clean_only = StoreWaitMsLocked() > 0;
  // Waiting helps only where a write in flight or an evictable unwritten piece can become room; where pins alone
  // stand in the way (engines' loads) the promotion is refused now, as it always was.
  // `short_of`: the component that lacks room (0: FULL).
  const auto wait = [&](size_t short_of) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    const bool helps = writing_ > 0 || (short_of == 0 ? index_->HasDirtyLeaf() : Part(short_of).MayHaveDirtyEvictable());
    if (!helps) return refuse(p);
    UnpinLocked(held);
    HybridPromotion w;
    w.wait_for_write_back = true;
    return w;
  };
  // All or none, evicting nothing before every part is known to fit (as ReserveHybrid).
  for (size_t c = 1; c < components; ++c) {
    const StatusCode feasible = Part(c).Feasible(p.keys[c]);
    if (clean_only && feasible == StatusCode::kResourceExhausted && writing_ > 0) return wait(c);
    if (feasible != StatusCode::kOk) return refuse(p);
    if (clean_only && !Part(c).FitsWithoutDirty(p.keys[c])) return wait(c);
  }
  if (!p.keys[0].empty()) {
    const BlockKey parent = p.full_from == 0 ? kRootParent : keys[p.full_from - 1];
    PrefixIndex::Reservation r = index_->Reserve(parent, p.keys[0], /*allow_dirty=*/!clean_only);
    if (clean_only && (r.dirty_only || (r.shortfall == StatusCode::kResourceExhausted && writing_ > 0))) {
      index_->Abort(r.slots);  // the blocks it evicted were on the next tier: nothing lost
      return wait(0);
    }
    if (r.cached != 0 || r.slots.size() != p.keys[0].size()) {
      index_->Abort(r.slots);
      return refuse(p);
    }
    for (SlotId s : r.slots) ForgetNextTierLocked(s, /*evicted=*/false);
    p.slots[0] = std::move(r.slots);
    // The FULL evictions unanchored entries (they go first at eviction): checked again.
    for (size_t c = 1; clean_only && c < components; ++c) {
      if (!Part(c).FitsWithoutDirty(p.keys[c])) {
        index_->Abort(p.slots[0]);
        return wait(c);
      }
    }
  }
  for (size_t c = 1; c < components; ++c) {
    ComponentIndex::Reservation r = Part(c).Reserve(p.keys[c]);
    // Cannot fail now: nothing in between took their slots (FULL evictions only unanchor entries).
    if (r.shortfall != StatusCode::kOk || r.slots.size() != p.keys[c].size()) {
      index_->Abort(p.slots[0]);
      for (size_t d = 1; d < c; ++d) {
        std::vector<SlotId> local;
        for (SlotId s : p.slots[d]) local.push_back(LocalLocked(d, s));
        Part(d).Abort(local);
      }
      if (r.shortfall == StatusCode::kOk) Part(c).Abort(r.slots);
      return refuse(p);
    }
    const SlotId base = pool_->sub_pool(c).base;
    for (SlotId local : r.slots) {
      p.slots[c].push_back(base + local);
      ForgetNextTierLocked(base + local, /*evicted=*/false);
    }
  }
  p.end = e;
  p.held = std::move(held);
  ++next_tier_epoch_;
  return p;
}

size_t Cache::CommitPromoted(std::span<const BlockKey> keys, const HybridPromotion& p,
                             const std::vector<std::vector<uint8_t>>& ok,
                             const std::vector<std::vector<uint64_t>>& checksums) {
  MutexLock lock(&mu_);
  if (!index_ || p.end == 0) return 0;  // DropDomain refuses while slots are pending or pinned
  size_t committed = 0;
  std::vector<SlotId> on_next;
  // FULL: the verified prefix of the pieces (a block after a failed one would hang under nothing).
  size_t full_ok = 0;
  const auto verified = [](uint8_t v) { return v == kPieceVerified || v == kPieceRewritten; };
  while (full_ok < p.slots[0].size() && verified(ok[0][full_ok])) ++full_ok;
  const std::span<const SlotId> full(p.slots[0]);
  index_->Commit(full.first(full_ok));
  index_->Abort(full.subspan(full_ok));
  size_t full_end = p.full_from;  // FULL [0, full_end) is in DRAM now
  for (size_t i = 0; i < full_ok; ++i) {
    const SlotId s = full[i];
    if (!index_->IsCommitted(s)) continue;  // dropped with a failed ancestor meanwhile (and so is the rest)
    const size_t k = p.at[0][i];
    const BlockKey parent = k == 0 ? kRootParent : keys[k - 1];
    pool_->MarkCommitted(s, keys[k], parent, checksums[0][i]);
    for (const auto& part : parts_) part->Anchor(keys[k]);
    ReportBlockLocked(BlockEvent::kCommitted, keys[k], k + 1 == p.end, BlockEvent::kPromoted, parent);
    if (ok[0][i] != kPieceRewritten) on_next.push_back(s);
    full_end = k + 1;
    ++committed;
  }
  // Windows and states: each piece that verified; anchored only where its FULL block is in DRAM.
  for (size_t c = 1; c < p.slots.size(); ++c) {
    std::vector<SlotId> good, bad;
    for (size_t i = 0; i < p.slots[c].size(); ++i) {
      (verified(ok[c][i]) ? good : bad).push_back(LocalLocked(c, p.slots[c][i]));
    }
    Part(c).Commit(good);
    Part(c).Abort(bad);
    for (size_t i = 0; i < p.slots[c].size(); ++i) {
      const SlotId s = p.slots[c][i];
      if (!verified(ok[c][i]) || !Part(c).IsCommitted(LocalLocked(c, s))) continue;
      pool_->MarkCommitted(s, p.keys[c][i], BlockKey{}, checksums[c][i]);
      if (p.at[c][i] >= full_end) Part(c).Unanchor(p.keys[c][i]);
      if (ok[c][i] != kPieceRewritten) on_next.push_back(s);
      ++committed;
    }
  }
  for (SlotId s : on_next) {
    if (on_next_[s] == kNotOnNext) SetMarkLocked(s, kOnNext);
  }
  UnpinLocked(p.held);
  ++next_tier_epoch_;
  return committed;
}

}  // namespace flexkv
