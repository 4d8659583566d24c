// ComponentIndex: the entries of one non-FULL component of a hybrid cache domain (docs/hybrid.md) - a sliding
// window's blocks, or state snapshots - by block key, one entry per sub-pool slot. Unlike FULL blocks (the
// PrefixIndex) these are not prefix-closed: an entry is useful only while the FULL block of its key is cached.
// The cache tells the index when that block goes (Unanchor): an unanchored entry serves no prefix end, and
// eviction takes unanchored entries first, then the least recently used anchored ones the next tier holds too (clean:
// SetClean), then the least recently used others. Not thread-safe: the
// owner (the cache) serializes calls. Slots are the component's own, 0..capacity-1.
//
// Entry states: free, pending (reserved by a store, bytes being copied: not findable, not evictable), committed
// (findable), unverified (restored at start, bytes not yet checked: not findable, not evictable), and a dropped
// entry is free again once no pin holds it. Every operation is O(1) per slot or key it is given, except the
// O(capacity) debug and test support at the end.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "daemon/cache/prefix_index.h"
#include "flexkv/block_key.h"
#include "flexkv/status.h"

namespace flexkv {

class ComponentIndex {
 public:
  static constexpr SlotId kNoSlot = ~SlotId{0};

  // All `capacity` slots start free, and all are active.
  explicit ComponentIndex(uint32_t capacity);
  // Slots [0, active) start free and may be handed out; slots [active, capacity) are not until Grow.
  ComponentIndex(uint32_t capacity, uint32_t active);
  ~ComponentIndex();
  ComponentIndex(const ComponentIndex&) = delete;
  ComponentIndex& operator=(const ComponentIndex&) = delete;

  // Called when a committed entry is evicted or dropped, or an unverified one dropped, before its slot is reused
  // (the cache clears its slot-table entry). It must not call back into the index.
  void SetEvictionListener(std::function<void(SlotId, const BlockKey&)> listener);

  // The slot of `key`'s committed entry, or nullopt (none, pending or unverified). Does not touch the LRU order.
  std::optional<SlotId> Find(const BlockKey& key) const;
  // Pins the committed entry in `slot` (Find's answer) and marks it used (LRU). Unpin undoes one pin; each slot
  // given to Unpin must be pinned. A pinned entry is neither evicted nor freed; a dropped pinned entry's slot is
  // freed with its last Unpin. An entry that becomes evictable goes to the most recently used end, or with `cold`
  // to the end evicted first (an entry pinned only to be written to the next tier has not been used).
  void Pin(SlotId slot);
  void Unpin(std::span<const SlotId> slots, bool cold = false);

  // Marks the committed entry in `slot` clean (the next tier holds it too: evicting it loses nothing) or dirty (the
  // default for every new entry). Anchored clean entries are evicted before anchored dirty ones. No-op for a slot
  // without a committed entry.
  void SetClean(SlotId slot, bool clean);
  uint32_t clean_entries() const;  // evictable, anchored and clean
  // The evictable entries that will be evicted first, in that order (unanchored, clean, then dirty), at most `n`;
  // `visit` returns false to stop early, and must not change the index. O(visited).
  void ForEachCold(size_t n, const std::function<bool(SlotId)>& visit) const;

  struct Reservation {
    // One per key: a pending slot, or kNoSlot where the key already has a committed entry (nothing to store).
    // Empty when shortfall is not OK: all or none.
    std::vector<SlotId> slots;
    // OK; RESOURCE_EXHAUSTED when free + evictable slots are fewer than the keys that need one (nothing
    // reserved, nothing evicted); ABORTED when a key is pending in another store or unverified (nothing reserved).
    StatusCode shortfall = StatusCode::kOk;
  };
  // Reserves pending entries for the keys of `keys` without a committed entry, all or none: free slots first,
  // then evicting (unanchored entries first, then least recently used; never pinned, pending or unverified
  // entries, and never an entry of `keys` itself). The committed entries of `keys` are marked used. New entries
  // are anchored. `keys` must not repeat a key; if it does, the answer is RESOURCE_EXHAUSTED or ABORTED with
  // nothing reserved (entries may have been evicted meanwhile).
  Reservation Reserve(std::span<const BlockKey> keys);
  // What Reserve(keys) would answer (OK, RESOURCE_EXHAUSTED or ABORTED), changing nothing: lets a caller check
  // every part of an all-or-none store before any part evicts. `found` (optional) gets each key's slot or kNoSlot.
  StatusCode Feasible(std::span<const BlockKey> keys, std::vector<SlotId>* found = nullptr) const;
  // Whether Reserve(keys) would evict only entries the next tier holds (clean), anchored or not: the evictions it
  // would make, in eviction order after the free slots, are walked (O(evictions + entries passed by)).
  bool FitsWithoutDirty(std::span<const BlockKey> keys) const;
  // Whether an evictable entry may be dirty (an anchored dirty one, or any unanchored one): the next tier's writes
  // could then make room without losing an entry.
  bool MayHaveDirtyEvictable() const;
  // Makes pending slots committed (findable). A slot dropped while pending (Drop) is freed instead: check
  // IsCommitted afterwards before publishing it. The first `cold` of `slots` join the eviction order at its cold
  // end, evicted before every other entry of their list (slots[0] first), the rest at its most recently used end:
  // window blocks a store carried beyond its trailing window serve only the prefix ends inside the store, which no
  // request has asked for yet; a hit (Pin) moves them like any other entry.
  void Commit(std::span<const SlotId> slots, size_t cold = 0);
  // Returns pending slots (dropped meanwhile or not) to the free list.
  void Abort(std::span<const SlotId> slots);

  // The FULL block of `key` left the cache (evicted or dropped): its entry becomes unanchored (once committed,
  // evicted before every anchored entry, after the entries unanchored earlier). Applies to a pending or
  // unverified entry too, which is then unanchored when it becomes committed. No-op without an entry.
  void Unanchor(const BlockKey& key);
  // The FULL block of `key` is cached again (a store committed it): its unanchored entry is anchored again (and,
  // when evictable, goes to the most recently used end).
  void Anchor(const BlockKey& key);

  // Rebuild at restart: inserts an unverified entry (not findable, not evictable) until MarkVerified or Drop.
  // FAILED_PRECONDITION when the key is present or the slot is taken or out of range.
  Status RestoreUnverified(SlotId slot, const BlockKey& key);
  // An unverified entry passed its check: committed. False, changing nothing, when the slot holds no unverified
  // entry.
  bool MarkVerified(SlotId slot);
  // Pins the committed entry in `slot` for a check (Unpin undoes it). False when the slot holds no committed entry.
  bool PinSlot(SlotId slot);
  // Takes the (committed or unverified) entries in `slots` out: not findable from now on, their keys may be stored
  // again; each slot is freed at once, or with its last Unpin. The eviction listener runs for each. Returns how
  // many entries were dropped. A pending slot in `slots` loses its key at once too, and is freed by its store's
  // Commit or Abort (not counted, no listener: it was never published). Other slots are ignored.
  size_t Drop(std::span<const SlotId> slots);
  // Whether `slot` holds a committed / unverified entry.
  bool IsCommitted(SlotId slot) const;
  bool IsUnverified(SlotId slot) const;

  // Elastic capacity, as PrefixIndex's: no slot at or above limit() is ever handed out, every slot at or above
  // active() is free. Grow: slots [limit(), active) become usable (active >= active(), <= capacity()). Shrink
  // (target <= active()): no slot from target up is handed out from now on; every committed, unpinned entry there
  // is evicted (the listener sees each; counted in evicted_entries) and free slots there leave the free list;
  // pinned, pending and unverified entries stay and hold the shrink: the answer's active is the smallest value
  // >= target above which every slot is free; a later call continues. O(active() - target).
  void Grow(uint32_t active);
  PrefixIndex::Shrunk Shrink(uint32_t target);
  uint32_t active() const;
  uint32_t limit() const;
  // As PrefixIndex::LimitTo: no slot at or above `limit` (<= active()) is handed out, nothing is evicted.
  void LimitTo(uint32_t limit);

  uint32_t capacity() const;      // slots at most (the pool's sub-pool capacity)
  uint32_t used_slots() const;    // pending + committed + unverified + dropped-but-pinned
  uint32_t pinned_slots() const;  // slots with at least one pin
  uint32_t committed_entries() const;
  uint32_t unverified_entries() const;
  uint32_t unanchored_entries() const;  // committed and unanchored
  uint64_t evicted_entries() const;     // total evictions so far

  // Debug and test support, O(capacity): evictable slots in eviction order; committed entries in slot order;
  // aborts with a message when an internal invariant is broken.
  std::vector<SlotId> EvictionOrder() const;
  void ForEachCommitted(const std::function<void(SlotId, const BlockKey&)>& fn) const;
  void CheckInvariants() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The hit rule of a hybrid geometry (docs/hybrid.md "Match"): the longest prefix end e in [0, full_prefix]
// (full_prefix: the committed FULL prefix of the keys) at which every other component is usable - for a
// sliding-window component with window w, entries for the blocks [max(0, e - w), e) all exist; for a state
// component, an entry for the snapshot at e (block e - 1's key) exists. 0 when no end is usable.
// `has(c, j)`: whether component c (1..rules.size(); rules[c - 1] is its rule) has a committed entry for keys[j].
// A window of 0 blocks needs nothing. Calls has() at most once per (c, j), and needs only w calls for a window
// and one for a state when the longest end is usable: O(full_prefix x components) at worst.
struct ComponentRule {
  bool state = false;           // a state component; else a sliding window of `window_blocks`
  uint32_t window_blocks = 0;
};
size_t LongestUsableEnd(size_t full_prefix, std::span<const ComponentRule> rules,
                        const std::function<bool(size_t component, size_t j)>& has);

}  // namespace flexkv
