// PrefixIndex: block key → node, one node per pool slot. Prefix-closed: a block is reachable only through
// its parent. Not thread-safe: the owner (the cache) serializes calls.
//
// Node states: free (slot unused), pending (reserved by a store, bytes being copied, not matchable),
// committed (matchable), unverified (restored from the pool file, bytes not yet checked: neither matchable nor
// evictable), dropped (its bytes failed a check: unmatchable, its slot freed once no pin and no child holds it).
// Eviction takes committed, unpinned leaves, least recently used first, so a cached prefix is never cut in the
// middle; leaves marked clean (the next tier holds them) go before the others.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "flexkv/block_key.h"
#include "flexkv/status.h"

namespace flexkv {

using SlotId = uint32_t;

class PrefixIndex {
 public:
  // All `capacity` slots start free, and all are active.
  explicit PrefixIndex(uint32_t capacity);
  // Slots [0, active) start free and may be handed out; slots [active, capacity) are not until Grow.
  PrefixIndex(uint32_t capacity, uint32_t active);

  // Called when a committed block is evicted (before its slot is reused), e.g. to clear the slot table.
  void SetEvictionListener(std::function<void(SlotId, const BlockKey&)> listener);

  // Length of the longest committed prefix of `keys` (stops at the first miss or pending node). Marks the
  // matched nodes used (LRU). With `pin`, pins each matched node once and appends its slot to `slots`
  // (slots may be null without pin).
  size_t Match(std::span<const BlockKey> keys, bool pin, std::vector<SlotId>* slots);

  // Drops one pin of each slot. Each slot must be pinned. A slot that becomes evictable goes to the most recently
  // used end of the eviction order, or with `cold` to the least recently used end (a block pinned only to be
  // written to the next tier has not been used: once written, it is the cheapest to evict).
  void Unpin(std::span<const SlotId> slots, bool cold = false);

  struct Reservation {
    size_t cached = 0;           // leading keys already committed (not reserved again)
    std::vector<SlotId> slots;   // pending slots for keys[cached .. cached + slots.size())
    // Why fewer than keys.size() - cached were reserved: OK (all reserved), RESOURCE_EXHAUSTED (no free or
    // evictable slot), ABORTED (the next key is pending in another store, or - with parent_refused - the
    // parent is), FAILED_PRECONDITION (only with parent_refused: the parent is not in the index).
    StatusCode shortfall = StatusCode::kOk;
    // Nothing was looked up or reserved because the parent is not committed; shortfall says why.
    bool parent_refused = false;
    // RESOURCE_EXHAUSTED while Reserve was told not to evict dirty nodes: no clean leaf was left (only dirty ones,
    // or pinned ones - e.g. pinned while the next tier writes them). Waiting for the next tier's writes would let the
    // store go on without losing a block.
    bool dirty_only = false;
  };
  // Begins a store of `keys`, keys[0] hanging under the committed node of key `parent` (kRootParent: keys[0]
  // is a prompt's first block). Finds the committed prefix of `keys` under the parent, then reserves pending
  // nodes for the following keys, taking free slots first, then evicting. Never evicts the parent or a node
  // of `keys`' own chain. Pending nodes are not matchable and not evictable until Commit or Abort, and a node
  // with a pending child is not evictable either: the parent and the cached prefix stay until then.
  // A parent that is not committed (evicted, never stored, or pending in a store not yet committed) refuses
  // the whole store: a block stored anywhere else could not be reached by a match from the prompt's start.
  // Eviction takes clean nodes (SetClean) first; dirty ones only with `allow_dirty`.
  Reservation Reserve(const BlockKey& parent, std::span<const BlockKey> keys, bool allow_dirty = true);

  // Marks the committed node in `slot` as clean (the next tier holds its block too: evicting it loses nothing) or
  // dirty (the default for every new node). Eviction takes the least recently used clean leaf before any dirty
  // one, as a page cache reclaims clean pages before dirty ones. No-op for a slot without a committed node.
  void SetClean(SlotId slot, bool clean);
  uint32_t clean_leaves() const;  // evictable clean nodes

  // Makes pending slots committed (matchable), in the order given (parents first).
  void Commit(std::span<const SlotId> slots);
  // Returns pending slots to the free list (children first is not required).
  void Abort(std::span<const SlotId> slots);

  // Rebuild at restart: inserts a committed node. The parent (by key; zero key = root) must already be
  // present. FAILED_PRECONDITION when the parent is missing, the key is present, or the slot is taken.
  Status Restore(SlotId slot, const BlockKey& key, const BlockKey& parent);

  // Rebuild at restart, before the block's bytes are verified: inserts an unverified node, which is neither
  // matchable nor evictable, and whose key a store cannot reserve, until MarkVerified or DropSubtrees. The
  // parent (by key; zero key = root) must be present, committed or unverified. Errors as Restore.
  Status RestoreUnverified(SlotId slot, const BlockKey& key, const BlockKey& parent);
  // An unverified node passed its check and becomes committed. False, changing nothing, when the slot holds no
  // unverified node (dropped meanwhile) or its parent is not committed (verify parents first; a child whose
  // parent failed stays unverified until the parent's DropSubtrees takes it).
  bool MarkVerified(SlotId slot);
  // Pins the committed node in `slot` (Unpin undoes it), so it is neither evicted nor dropped for reuse while
  // its bytes are read. False when the slot holds no committed node.
  bool PinSlot(SlotId slot);
  // Takes the (committed or unverified) nodes in `slots` and all their descendants out of the index: none is
  // matchable from now on, and their keys may be stored again. `on_drop` runs for each such node (roots and
  // descendants) as it goes. A slot is freed at once, or when its last pin (a load reading it) is released and
  // its last child is gone; a pending descendant (a store in flight) is dropped when that store commits or
  // aborts. Returns the number of nodes dropped. O(capacity).
  size_t DropSubtrees(std::span<const SlotId> slots, const std::function<void(SlotId)>& on_drop);
  // Whether `slot` holds a committed node (a store's Commit skips pending nodes dropped meanwhile).
  bool IsCommitted(SlotId slot) const;
  // The slot of the parent of the (pending, committed or unverified) node in `slot`; kNoParent at root level or when
  // the slot holds no such node.
  static constexpr SlotId kNoParent = 0xffffffffu;
  SlotId ParentOf(SlotId slot) const;
  // The pending and committed nodes hanging under the node in `slot` (0 for a free slot).
  uint32_t ChildCount(SlotId slot) const;
  // The evictable slots (committed, unpinned, childless) that will be evicted first - the clean ones least recently
  // used first, then the dirty ones likewise - at most `n`; `visit` returns false to stop early. O(visited).
  void ForEachColdLeaf(size_t n, const std::function<bool(SlotId)>& visit) const;
  // Whether `slot` holds an unverified node (not yet verified, and not dropped with a failed ancestor).
  bool IsUnverified(SlotId slot) const;

  // Elastic capacity. No slot at or above limit() is ever handed out (Reserve), and every slot at or above
  // active() is free; limit() == active() except while a shrink is held up by blocks in the slots it gives back.
  // Grow: slots [limit(), active) become usable (active >= active(), <= capacity()).
  void Grow(uint32_t active);
  // Hands out no slot at or above `limit` (<= active()) from now on and evicts nothing: a re-attached pool whose
  // grants are still being registered for DMA (Cache). A larger LimitTo, up to active(), lifts it again.
  void LimitTo(uint32_t limit);
  struct Shrunk {
    uint32_t active = 0;   // the active capacity reached: >= target, every slot from it up is free
    uint64_t evicted = 0;  // committed blocks evicted (the eviction listener saw each; counted in evicted_blocks)
  };
  // Gives back the slots [target, active()) (target <= active()): no slot from target up is handed out from now
  // on; every committed, unpinned block there is evicted with its descendants (wherever their slots are), unless
  // one of its descendants is pinned, pending, unverified or dropped, and free slots there leave the free list.
  // What stays (pinned, pending, unverified blocks, and their ancestors) holds the shrink there: the answer's
  // active is the smallest value >= target above which every slot is free; a later call continues. O(capacity).
  Shrunk Shrink(uint32_t target);
  uint32_t active() const;
  uint32_t limit() const;

  uint32_t capacity() const;         // slots at most (the pool's sub-pool capacity)
  uint32_t used_slots() const;       // pending + committed
  uint32_t pinned_slots() const;     // slots with at least one pin
  uint32_t committed_blocks() const;
  uint32_t unverified_blocks() const;
  uint64_t evicted_blocks() const;   // total evictions so far
  // Whether a dirty node (not on the next tier) is evictable now: the next tier's write of it would make room
  // without losing it (Reserve's dirty_only says only that no clean one was left).
  bool HasDirtyLeaf() const;

  // Debug and test support; each is O(capacity).
  // Evictable slots (committed, unpinned, childless) in eviction order: clean, then dirty, each least recently used
  // first.
  std::vector<SlotId> EvictionOrder() const;
  // Calls fn(slot, key, parent key) for each committed node in slot order; the parent key is zero at root
  // level.
  void ForEachCommitted(const std::function<void(SlotId, const BlockKey&, const BlockKey&)>& fn) const;
  // Aborts with a message when an internal invariant is broken.
  void CheckInvariants() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;

 public:
  ~PrefixIndex();
  PrefixIndex(const PrefixIndex&) = delete;
  PrefixIndex& operator=(const PrefixIndex&) = delete;
};

}  // namespace flexkv
