// Pool: the host KV pool, one slot per block, in a file the daemon owns (under /dev/shm or hugetlbfs,
// mode 0600) so that a restarted daemon — after SIGTERM or kill -9 — finds every committed block again.
//
// File layout (docs/protocol.md "Pool file"): header (4 KiB) | slot table (64 B per slot) | data (2 MiB
// aligned, block_bytes per slot). A hybrid geometry (docs/hybrid.md) has one sub-pool per component: slots are
// numbered across them (component c's are [base, base + capacity)), each sub-pool's data starts 2 MiB aligned
// with its own slot size, and the header (layout 3) lists the sub-pools. A full-attention pool is one sub-pool
// and keeps layout 2, byte for byte. A slot-table entry is written only after the slot's bytes are complete
// and cleared before they are overwritten, so a block that was mid-copy at a crash is never restored. The
// entry holds the block's content checksum (common/block_checksum.h), and its own checksum covers the slot
// index, so neither changed bytes nor entries moved to another slot pass a check.
//
// Elastic size: the file is laid out for the pool's maximum, but only each sub-pool's *active* slots
// [base, base + active) have memory behind them; the rest of its data range is a hole in the file. Active capacity
// moves in grants (1/16 of a sub-pool's slots), is recorded in the header page, and changes without moving any
// slot's address (SetActive).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/mapped_region.h"
#include "common/unique_fd.h"
#include "daemon/cache/pool_guard.h"
#include "daemon/cache/prefix_index.h"
#include "flexkv/block_key.h"
#include "flexkv/geometry.h"
#include "flexkv/status.h"

namespace flexkv {

// 2: the header records the uid that created the namespace (who may store in it by default); slot entries hold
//    the block's content checksum and bind the slot index.
inline constexpr uint32_t kPoolLayoutVersion = 2;
// 3: a hybrid geometry's pool: layout 2 plus the sub-pool table (written only for hybrid geometries), each sub-pool
//    laid out for its fixed share of the budget (SplitBudget).
inline constexpr uint32_t kHybridPoolLayoutVersion = 3;
// 4: a hybrid pool whose split follows demand: layout 3's format, but each sub-pool is laid out for the whole budget
//    and moves in finer grants (kDemandGrantsPerSubPool); only the active parts together stay within the budget.
inline constexpr uint32_t kDemandPoolLayoutVersion = 4;
// Added to the layout version (2, 3 or 4) of a pool whose slots have more than one TP shard (common/slot_order.h):
// its slots hold [tp shard][layer][plane][chunk]. Releases before it wrote such pools without the flag, in the
// layer-major order [layer][plane][tp shard][chunk], and refuse a flagged pool as "written by a newer flexkvd" (a
// downgrade never serves the new order as the old). A pool of one shard per slot (TP 1, MLA) has the same bytes in
// both orders and keeps its unflagged version, readable by either release.
inline constexpr uint32_t kRankMajorSlotsFlag = 0x100;

// How a hybrid pool's budget is split between its components (docs/hybrid.md "Pool"): the share of the budget
// for all sliding-window components together, and for all state components; 0 picks the default from the
// geometry (in proportion to what 4096 tokens of cached prefix need of each when a window and a state are stored
// at chunk boundaries that far apart: 4096 tokens of FULL blocks, one window, one snapshot). The FULL layers get the
// rest. Ignored for a full-attention geometry.
// With both shares automatic and `by_demand`, a hybrid pool's split follows demand (layout 4, PlanPoolLayout): the
// default split is only where it starts. Shares the operator sets stay fixed (layout 3).
struct PoolSplit {
  double swa_share = 0;
  double state_share = 0;
  bool by_demand = true;  // false: automatic shares are fixed at the default split too (layout 3)

  bool demand_sized() const { return by_demand && swa_share == 0 && state_share == 0; }
};

// A sub-pool's active capacity moves in grants of ceil(capacity / kGrantsPerSubPool) slots (the last may be shorter);
// in a pool whose split follows demand (layout 4), of ceil(capacity / kDemandGrantsPerSubPool): each sub-pool there is
// laid out for the whole budget, so a sixteenth of it would be far coarser than the default window or state share.
inline constexpr uint32_t kGrantsPerSubPool = 16;
inline constexpr uint32_t kDemandGrantsPerSubPool = 64;

// One component's part of the pool.
struct SubPool {
  ComponentKind kind = ComponentKind::kFull;
  SlotId base = 0;          // its first slot in the pool's numbering
  uint32_t capacity = 0;    // its slots at most (the layout's); slot ids [base, base + capacity)
  uint64_t slot_bytes = 0;  // Geometry::Component(c).host_block_bytes()
  uint8_t* data = nullptr;  // its first slot's bytes
  uint32_t active = 0;      // slots [base, base + active) have memory and may hold blocks; a whole number of grants
  uint32_t grant = 0;       // slots per grant: ceil(capacity / kGrantsPerSubPool), layout 4 kDemandGrantsPerSubPool

  // `slots` rounded up to a whole number of grants, clamped to [grant, capacity].
  uint32_t RoundToGrants(uint64_t slots) const;
};

// The slots of each component for `geometry` at `budget_bytes` (OK: one entry per component, each >= 1).
// INVALID_ARGUMENT naming the component when its share cannot hold one slot, or a share is out of [0, 1) or the
// shares leave nothing for the FULL layers.
Result<std::vector<uint64_t>> SplitBudget(const Geometry& geometry, uint64_t budget_bytes, const PoolSplit& split);

// How a pool for `geometry` at `budget_bytes` is laid out (Create): its layout version, each component's slots at
// most, and its grant. A hybrid geometry with split.demand_sized() gets layout 4: every component laid out for the
// whole budget (budget / its slot bytes, so that demand can move the budget to any of them), active at first in
// proportion to SplitBudget's default split; otherwise SplitBudget's capacities (layout 2 or 3). INVALID_ARGUMENT
// as SplitBudget.
struct PoolLayoutPlan {
  uint32_t version = kPoolLayoutVersion;
  std::vector<uint64_t> capacity;  // per component
  std::vector<uint32_t> grant;     // per component
  std::vector<uint64_t> weights;   // the initial split's bytes per component (what ActiveSlotsFor scales)
};
Result<PoolLayoutPlan> PlanPoolLayout(const Geometry& geometry, uint64_t budget_bytes, const PoolSplit& split);

class Pool {
 public:
  struct Committed {
    SlotId slot;
    BlockKey key;
    BlockKey parent;  // zero for a first block
    uint64_t content_checksum = 0;  // BlockChecksum of the slot's bytes when they were stored
    uint32_t component = 0;         // the sub-pool the slot is in (0: FULL)
    // A slot of more than one shard written in the layer-major order of an older release (the pool was upgraded
    // in place: RewriteInSlotOrder turns it into today's order once its bytes are verified).
    bool layer_major = false;
  };

  static constexpr uint64_t kAllActive = UINT64_MAX;

  // Creates (or replaces) the pool file for `geometry`, laid out for floor(budget / block bytes) slots (per
  // component as SplitBudget gives them), recording `creator_uid`, the uid whose Attach created the namespace.
  // `active_bytes` of it are active at first (per sub-pool ActiveSlotsFor(active_bytes); default: all of it).
  // The active slots' space is allocated up front: a full /dev/shm fails here (RESOURCE_EXHAUSTED), not later;
  // the rest of the file is a hole.
  static Result<std::unique_ptr<Pool>> Create(const std::string& path, const std::string& model_namespace,
                                              const Geometry& geometry, uint64_t budget_bytes, uid_t creator_uid = 0,
                                              const PoolSplit& split = {}, uint64_t active_bytes = kAllActive);

  // The layout version in the header of the pool file at `path` (kRankMajorSlotsFlag included), or nullopt when
  // there is no readable header.
  static std::optional<uint32_t> FileLayoutVersion(const std::string& path);

  // Opens an existing pool file. NOT_FOUND when there is none. FAILED_PRECONDITION (naming the field)
  // when its version, size or budget do not fit, DATA_LOSS when the header is corrupt or the file is shorter
  // than its header says (truncated: the blocks past its end are lost, so none of it is re-attached) or its
  // active-capacity record is corrupt. A hybrid pool must also have the sub-pools that `split` gives at this
  // budget (FAILED_PRECONDITION otherwise). The active capacities are the file's (a file without the record,
  // written before elastic pools, is fully active); space left allocated beyond them (a crash mid-resize) is
  // released.
  static Result<std::unique_ptr<Pool>> Open(const std::string& path, uint64_t budget_bytes,
                                            const PoolSplit& split = {});

  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  const Geometry& geometry() const { return geometry_; }
  const std::string& model_namespace() const { return namespace_; }
  uid_t creator_uid() const { return creator_uid_; }
  const std::string& path() const { return path_; }
  uint64_t block_bytes() const { return block_bytes_; }  // component 0's slot
  uint32_t capacity() const { return capacity_; }         // slots of every component

  size_t component_count() const { return sub_pools_.size(); }
  const SubPool& sub_pool(size_t component) const { return sub_pools_[component]; }
  // The component whose sub-pool holds `slot` (< capacity()).
  size_t ComponentOf(SlotId slot) const;
  // The slot's bytes (SlotBytes of them). Valid for the pool's lifetime.
  uint8_t* SlotData(SlotId slot) const;
  uint64_t SlotBytes(SlotId slot) const { return sub_pools_[ComponentOf(slot)].slot_bytes; }
  // Every sub-pool's data at its maximum, as one range (holes included: only active slots have memory).
  uint8_t* data_begin() const { return data_; }
  uint64_t data_bytes() const { return data_bytes_; }

  // Layout 4: the split between the sub-pools follows demand (each laid out for the whole budget).
  bool demand_sized() const { return demand_sized_; }
  // Σ capacity × slot bytes over the sub-pools: the pool fully active (layout 4: more than its budget; only the
  // active parts together are bounded by it).
  uint64_t max_bytes() const;
  // Σ active × slot bytes over the sub-pools: what the pool's data holds now.
  uint64_t active_bytes() const;
  // The active slots of each sub-pool for `active_bytes` of data: the pool's own split, scaled - capacity ×
  // active_bytes / max_bytes(), or in layout 4 the split the sub-pools' active parts have now - rounded down to whole
  // grants (so that the data stays within active_bytes, a budget share) and clamped to [1 grant, capacity].
  std::vector<uint32_t> ActiveSlotsFor(uint64_t active_bytes) const;
  // The same, split as the pool was at creation (layout 4: the default split it starts from; else ActiveSlotsFor).
  std::vector<uint32_t> DefaultSlotsFor(uint64_t active_bytes) const;
  // Moves component `component`'s active capacity to `slots` (a whole number of grants, or its capacity; at
  // least one grant: INVALID_ARGUMENT otherwise). Growing allocates the new slots' data first
  // (RESOURCE_EXHAUSTED, naming the file, the bytes and the filesystem, with nothing changed when it cannot),
  // then records the new capacity in the file. Shrinking needs every slot leaving to be free with its slot-table
  // entry cleared (asserted: the caller's index released them), records the new capacity first, then returns
  // the slots' memory (a hole punched in the file; on hugetlbfs only whole huge pages; a failed punch is logged).
  // Not thread-safe: the caller serializes it with everything that reads active capacities.
  // `allocated`: a grow whose slots' data AllocateData has allocated already (only the record is written).
  Status SetActive(size_t component, uint32_t slots, bool allocated = false);
  // Allocates the data of component `component`'s slots [from, to) (beyond its active capacity) without making them
  // active: the slow part of a grow (on tmpfs every page is zeroed), done without the caller's lock before
  // SetActive(..., allocated = true) publishes it. RESOURCE_EXHAUSTED as SetActive, with whatever was allocated
  // given back. Thread-safe against readers (it touches only slots no one uses); the caller runs one at a time.
  Status AllocateData(size_t component, uint32_t from, uint32_t to) const;
  // Gives back what AllocateData allocated (slots [from, to) beyond the active capacity; a hole punched).
  void FreeData(size_t component, uint32_t from, uint32_t to) const;

  // Whether this pool's slots have more than one TP shard, and whether it was written by a release before the
  // rank-major slot order (its header then lacked kRankMajorSlotsFlag: entries it committed are layer_major).
  bool sharded_slots() const { return sharded_slots_; }
  bool layer_major_file() const { return layer_major_file_; }
  // A pool opened from a release before the rank-major order (layer_major_file()): flags its header now, before
  // any slot is rewritten or a block stored in today's order, so that the older release refuses the file from
  // here on instead of serving today's bytes in its order. Its entries stay layer_major until rewritten. OK and
  // nothing written otherwise.
  Status AdoptRankMajorSlots();
  // Checks the layer-major block `c` (an entry with layer_major set) against its content checksum and rewrites it in
  // today's slot order with its new checksum, in one pass over the bytes (what is rewritten is what was checked):
  // the entry is cleared first and committed again after, so a crash in between loses the block rather than
  // leaving bytes that do not match their entry. nullopt, with the bytes and the entry untouched, when the bytes do
  // not match (the caller drops the block). The caller keeps the slot from being read or reused meanwhile
  // (unverified). Returns the new content checksum.
  std::optional<uint64_t> RewriteInSlotOrder(const Committed& c);
  // The same for a slot with no entry yet (a reserved slot a promotion filled with a layer-major SSD block): its
  // bytes checked against `layer_major_checksum` and rewritten; their new content checksum, or nullopt (untouched).
  std::optional<uint64_t> RewriteBytesInSlotOrder(SlotId slot, uint64_t layer_major_checksum);

  // Slot-table transitions. MarkCommitted publishes after the bytes are complete, with their content checksum
  // (FinishBlockChecksum of the bytes' term sum), in today's slot order; MarkFree clears before the slot is reused.
  void MarkCommitted(SlotId slot, const BlockKey& key, const BlockKey& parent, uint64_t content_checksum);
  void MarkFree(SlotId slot);

  // The slot's committed entry when its state and entry checksum (which binds the slot index) are valid;
  // nullopt for a free slot or a corrupt entry. Reads the table without synchronisation: call it where the
  // slot cannot change (the cache's lock, or a pin).
  std::optional<Committed> Entry(SlotId slot) const;
  // Whether the slot's bytes still have `content_checksum`: one pass over block_bytes() bytes.
  bool ContentMatches(SlotId slot, uint64_t content_checksum) const;

  // Committed entries of the slot table: FULL blocks parents before children, then the other components' entries.
  // Entries of slots at or beyond their sub-pool's active capacity are cleared and counted in `dropped`.
  // (each must have a nonzero key, unique within its component; its parent field is not used); entries whose checksum fails or whose
  // parent is missing are cleared and counted in `dropped`, and those whose checksum fails (a corrupt or
  // moved entry: its block is lost) also in `corrupt`, when given. Block contents are not read here (see
  // ContentMatches): the caller verifies them before it serves them.
  std::vector<Committed> Recover(uint64_t* dropped, uint64_t* corrupt = nullptr);

 private:
  Pool() = default;
  // Fills sub_pools_ and data_bytes_ from the file layout (map_ and geometry_ set).
  void SetSubPools(const std::vector<uint64_t>& base, const std::vector<uint64_t>& capacity,
                   const std::vector<uint64_t>& data_offset, uint64_t data_end, uint32_t grants_per_sub_pool);
  struct SlotEntry;
  SlotEntry* entry(SlotId slot) const;
  // Whether the entry's checksum holds and its order is one this pool's slots can have.
  bool EntryIntact(SlotId slot, const SlotEntry& e) const;
  // RewriteInSlotOrder (entry given) and RewriteBytesInSlotOrder (none).
  std::optional<uint64_t> Rewrite(SlotId slot, uint64_t layer_major_checksum, const Committed* entry);
  // The file offset of slot `local` of component c's data.
  uint64_t DataOffset(size_t c, uint64_t local) const;
  // Writes the active-capacity record (the sub-pools' active, with `c` at `slots`) with one pwrite.
  Status WriteActiveRecord(size_t c, uint32_t slots);
  // Returns [offset, offset + bytes) of the file to the filesystem (whole pages inside it only). Logs a failure.
  void PunchHole(uint64_t offset, uint64_t bytes) const;

  std::string path_;
  std::string namespace_;
  uid_t creator_uid_ = 0;
  Geometry geometry_;
  uint64_t block_bytes_ = 0;
  uint32_t capacity_ = 0;
  std::vector<SubPool> sub_pools_;  // one per component, component 0 first
  uint64_t data_bytes_ = 0;
  MappedRegion map_;  // the whole file; table_ and data_ point into it
  uint8_t* table_ = nullptr;
  uint8_t* data_ = nullptr;
  UniqueFd fd_;               // the pool file, for fallocate and the active record
  bool demand_sized_ = false;  // layout 4
  bool sharded_slots_ = false;     // HasShardedSlots(geometry_): the header carries kRankMajorSlotsFlag
  bool layer_major_file_ = false;  // opened from a release before the flag (see AdoptRankMajorSlots)
  std::vector<uint64_t> default_weights_;  // bytes per component of the split it was created with (DefaultSlotsFor)
  uint64_t page_bytes_ = 0;   // the filesystem's allocation unit (statfs f_bsize: a huge page on hugetlbfs)
  // Guards map_ against the file shrinking under it (pool_guard.h); declared after map_, so it ends first.
  std::unique_ptr<PoolFileWatch> watch_;
};

}  // namespace flexkv
