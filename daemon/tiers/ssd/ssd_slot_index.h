// SsdSlotIndex: the SSD store's index of which slot holds which block - the slot table, the key map, the LRU lists
// that pick the slot a write overwrites, and each drive's free slots. No I/O: the store (ssd_store.cc) moves the
// bytes through its drives (ssd_drive.h) and tells the index when an I/O starts and how it ended, so the index is
// tested and fuzzed on its own (tests/unit/daemon/tiers/ssd/ssd_slot_index_test.cc, tests/fuzz/fuzz_ssd_slot_index.cc).
//
// Slots are numbered over all drives: slot s is on drive s / per_drive_slots, at s % per_drive_slots in its file.
// A slot is free (on its drive's free list), writing (reserved by a write: in the key map, so a second write of the
// id is refused, but not readable), committed (readable; on an LRU list while no read pins it), dropped (out of the
// key map while reads of it were in flight; cleared on disk when the last one ends) or invalidating (its header is
// being cleared on disk; free once that completes).
//
// Threading: not thread-safe. The store serializes every call under its lock (SsdStore::Impl::mu).
#pragma once

#include <absl/container/flat_hash_map.h>
#include <absl/functional/function_ref.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <vector>

#include "daemon/tiers/ssd/ssd_format.h"
#include "daemon/tiers/ssd/ssd_store.h"

namespace flexkv {

class SsdSlotIndex {
 public:
  static constexpr uint32_t kNoSlot = std::numeric_limits<uint32_t>::max();

  // No slots: a placeholder until the store knows its geometry.
  SsdSlotIndex() = default;
  // `drives` drives of `per_drive_slots` slots each, all free; drives * per_drive_slots must be below kNoSlot. The
  // free lists are filled by FinishRebuild, which must run (after any Restore) before the index is used.
  SsdSlotIndex(uint32_t drives, uint64_t per_drive_slots);

  // --- rebuild at Open, from the slot headers found on disk ---

  // Indexes the committed block `entry` (a slot header that verified; generation > 0) in free `slot`, with the
  // XXH3-64 of its payload. When the id is indexed already, in another slot, the newer generation stays (on a tie,
  // the one restored last) and the slot of the other is returned: its header is to be cleared on disk (the caller
  // passes it to FinishRebuild). nullopt when the id was new.
  std::optional<uint32_t> Restore(uint32_t slot, const SsdEntry& entry, uint64_t payload_xxh3);
  // Ends the rebuild: the committed blocks are listed for eviction (oldest generation least recently used), the
  // slots in `to_clear` (not indexed: Restore's answers, slots with unusable headers) become invalidating, and the
  // remaining free slots fill the free lists (the lowest slot of a drive taken first). Returns `to_clear` sorted,
  // without repeats: the slots whose headers the store clears (FinishClear frees each once that is done). Called
  // once, also for a store with nothing on disk.
  std::vector<uint32_t> FinishRebuild(std::vector<uint32_t> to_clear);

  // --- writes ---

  // Whether `id` is indexed: committed or being written.
  bool Contains(const SsdBlockId& id) const;

  struct Reservation {
    uint32_t slot = kNoSlot;          // reserved (writing) for the block; kNoSlot: none could be given
    bool queue_full = false;          // with kNoSlot: a drive that had a slot to give had no room in its queue
    std::optional<SsdEntry> evicted;  // the committed block overwritten to make room (out of the index now)
  };
  // Reserves a slot for block `entry` (an id not Contained), which the index gives the next generation: a free slot
  // of a drive `has_room` accepts, taking the drives round robin; else the least recently used leaf's slot - a block
  // no other committed block hangs under - or, when every committed unpinned block has a child, the least recently
  // used block's, so a prefix outlives its descendants on SSD as in DRAM. The victim's drive must have room too.
  // No slot when no drive with a free slot has room and the victim's (if any) has none.
  Reservation ReserveForWrite(const SsdEntry& entry, uint64_t payload_xxh3,
                              absl::FunctionRef<bool(uint32_t drive)> has_room);
  // The write into `slot` (writing) reached the drive: the block is committed, most recently used. Returns it.
  const SsdEntry& CommitWrite(uint32_t slot);
  // The write into `slot` (writing) failed: the id is no longer indexed and the slot is free.
  void AbortWrite(uint32_t slot);

  // --- reads ---

  // The slot `id` is in (committed or writing), or kNoSlot.
  uint32_t Find(const SsdBlockId& id) const;
  // The block in `slot`, for a committed or writing slot (what the slot header carries: the entry and the XXH3-64
  // of the payload).
  const SsdEntry& entry(uint32_t slot) const;
  uint64_t payload_xxh3(uint32_t slot) const;
  bool committed(uint32_t slot) const;
  // A read of committed `slot` starts: it stays in its slot (not evicted, not cleared) until its EndRead.
  void Pin(uint32_t slot);

  // What a block leaving the index did: the committed block that left (nullopt: none did), its slot, and whether
  // the slot is now invalidating - its header to be cleared on disk, then FinishClear.
  struct Removal {
    std::optional<SsdEntry> dropped;
    uint32_t slot = kNoSlot;
    bool clear = false;
  };
  // A read of `slot` (pinned) ended; `verified`: the bytes read are the block's. Verified, the block is most recently
  // used again once no read pins it; otherwise a committed block is dropped (a failing slot is never served again).
  Removal EndRead(uint32_t slot, bool verified);
  // Drops committed block `id` (nothing when it is not committed). A read in flight keeps its slot until it ends.
  Removal Erase(const SsdBlockId& id);
  // The header of `slot` (invalidating) is cleared on disk: the slot is free.
  void FinishClear(uint32_t slot);

  // --- views ---

  // The committed block `id`, or nullopt.
  std::optional<SsdEntry> Lookup(const SsdBlockId& id) const;
  // Marks committed, unpinned blocks used now (most recently used); other ids are skipped.
  void Touch(std::span<const SsdBlockId> ids);
  // Every committed block, in eviction order: the leaves least recently used first, then the blocks others hang
  // under, then those pinned by reads.
  std::vector<SsdEntry> Entries() const;
  // `each` for every committed block, in no particular order.
  void ForEachCommitted(const std::function<void(const SsdEntry&)>& each) const;

  uint32_t drive_of(uint32_t slot) const { return static_cast<uint32_t>(slot / per_drive_slots_); }
  uint64_t file_slot(uint32_t slot) const { return slot % per_drive_slots_; }
  uint32_t slot_of(uint32_t drive, uint64_t file_slot) const {
    return static_cast<uint32_t>(drive * per_drive_slots_ + file_slot);
  }
  uint64_t capacity() const { return slots_.size(); }
  uint64_t blocks() const { return blocks_; }  // committed

  // Aborts (SSD_CHECK) on a broken invariant: states, key map, LRU lists, child counts, free lists, generations.
  // For tests and the fuzz target; O(slots). Only after FinishRebuild.
  void CheckInvariants() const;

 private:
  static constexpr uint32_t kNil = kNoSlot;

  enum class SlotState : uint8_t {
    kFree,          // on its drive's free list
    kWriting,       // reserved by a write: in the key map (a second write is refused), not readable
    kCommitted,     // readable; on the LRU list while unpinned
    kDropped,       // out of the key map while reads were in flight; its header is cleared when the last one ends
    kInvalidating,  // its header is being cleared on disk; free when that completes
  };

  struct SlotEntry {
    SsdEntry e;
    uint64_t payload_xxh3 = 0;
    uint32_t prev = kNil;  // its LRU list (committed and unpinned only)
    uint32_t next = kNil;
    uint32_t pins = 0;     // reads in flight
    SlotState state = SlotState::kFree;
    bool interior = false; // on the interior list (a committed block hangs under it), not the leaves'
  };

  // The LRU lists of committed, unpinned blocks: head least recently used.
  struct LruList {
    uint32_t head = kNil;
    uint32_t tail = kNil;
  };

  // Seeded per process (absl), so keys chosen by a client cannot pile up in one place of the map.
  struct IdHash {
    size_t operator()(const SsdBlockId& id) const;
  };

  LruList& ListOf(uint32_t s) { return slots_[s].interior ? interior_ : leaves_; }
  void LruUnlink(uint32_t s);
  void LruPush(uint32_t s, bool lru_end = false);
  void LruPushMru(uint32_t s) { LruPush(s); }
  static bool Listed(const SlotEntry& e) { return e.state == SlotState::kCommitted && e.pins == 0; }
  bool HasChildren(const SsdBlockId& id) const;
  static std::optional<SsdBlockId> ParentId(const SsdEntry& e);
  void AddChild(const SsdEntry& e);
  void RemoveChild(const SsdEntry& e);
  // The block a write overwrites: the least recently used leaf, or the least recently used block when every
  // committed block has a child (a cycle of keys in a damaged or forged file cannot make SSD unwritable).
  uint32_t Victim() const { return leaves_.head != kNil ? leaves_.head : interior_.head; }
  void FreeSlot(uint32_t s);
  // The committed block in `s` leaves the index (overwritten, dropped, erased); its slot entry stays as it is.
  SsdEntry Unindex(uint32_t s);

  uint64_t per_drive_slots_ = 1;
  std::vector<SlotEntry> slots_;
  absl::flat_hash_map<SsdBlockId, uint32_t, IdHash> map_;
  std::vector<std::vector<uint32_t>> free_slots_;  // per drive, a stack
  // Eviction takes leaves first, as DRAM does: a block another committed block hangs under (its parent key, same
  // domain and component) is on `interior_` and is overwritten only when no leaf is left, so a prompt's prefix - a
  // hot system prompt that DRAM always hits and SSD never reads - is not overwritten while its descendants stay,
  // unreachable behind it. `children_` counts the committed blocks under each parent id (present or not).
  LruList leaves_;
  LruList interior_;
  absl::flat_hash_map<SsdBlockId, uint32_t, IdHash> children_;
  uint64_t next_generation_ = 1;
  uint32_t next_drive_ = 0;
  uint64_t blocks_ = 0;
  bool rebuilt_ = false;
};

}  // namespace flexkv
