// Pool: the host KV pool, one slot per block, in a file the daemon owns (under /dev/shm or hugetlbfs,
// mode 0600) so that a restarted daemon — after SIGTERM or kill -9 — finds every committed block again.
//
// File layout (docs/protocol.md "Pool file"): header (4 KiB) | slot table (64 B per slot) | data (2 MiB
// aligned, block_bytes per slot). A slot-table entry is written only after the slot's bytes are complete
// and cleared before they are overwritten, so a block that was mid-copy at a crash is never restored. The
// entry holds the block's content checksum (common/block_checksum.h), and its own checksum covers the slot
// index, so neither changed bytes nor entries moved to another slot pass a check.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/mapped_region.h"
#include "daemon/cache/pool_guard.h"
#include "daemon/cache/prefix_index.h"
#include "flexkv/block_key.h"
#include "flexkv/geometry.h"
#include "flexkv/status.h"

namespace flexkv {

// 2: the header records the uid that created the namespace (who may store in it by default); slot entries hold
//    the block's content checksum and bind the slot index.
inline constexpr uint32_t kPoolLayoutVersion = 2;

class Pool {
 public:
  struct Committed {
    SlotId slot;
    BlockKey key;
    BlockKey parent;  // zero for a first block
    uint64_t content_checksum = 0;  // BlockChecksum of the slot's bytes when they were stored
  };

  // Creates (or replaces) the pool file for `geometry`, sized to floor(budget / block bytes) slots, recording
  // `creator_uid`, the uid whose Attach created the namespace. The file's space is allocated up front: a full
  // /dev/shm fails here (RESOURCE_EXHAUSTED), not later.
  static Result<std::unique_ptr<Pool>> Create(const std::string& path, const std::string& model_namespace,
                                              const Geometry& geometry, uint64_t budget_bytes, uid_t creator_uid = 0);

  // The layout version in the header of the pool file at `path`, or nullopt when there is no readable header.
  static std::optional<uint32_t> FileLayoutVersion(const std::string& path);

  // Opens an existing pool file. NOT_FOUND when there is none. FAILED_PRECONDITION (naming the field)
  // when its version, size or budget do not fit, DATA_LOSS when the header is corrupt or the file is shorter
  // than its header says (truncated: the blocks past its end are lost, so none of it is re-attached).
  static Result<std::unique_ptr<Pool>> Open(const std::string& path, uint64_t budget_bytes);

  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  const Geometry& geometry() const { return geometry_; }
  const std::string& model_namespace() const { return namespace_; }
  uid_t creator_uid() const { return creator_uid_; }
  const std::string& path() const { return path_; }
  uint64_t block_bytes() const { return block_bytes_; }
  uint32_t capacity() const { return capacity_; }

  // The slot's bytes. Valid for the pool's lifetime.
  uint8_t* SlotData(SlotId slot) const { return data_ + uint64_t{slot} * block_bytes_; }

  // Slot-table transitions. MarkCommitted publishes after the bytes are complete, with their content checksum
  // (FinishBlockChecksum of the bytes' term sum); MarkFree clears before the slot is reused.
  void MarkCommitted(SlotId slot, const BlockKey& key, const BlockKey& parent, uint64_t content_checksum);
  void MarkFree(SlotId slot);

  // The slot's committed entry when its state and entry checksum (which binds the slot index) are valid;
  // nullopt for a free slot or a corrupt entry. Reads the table without synchronisation: call it where the
  // slot cannot change (the cache's lock, or a pin).
  std::optional<Committed> Entry(SlotId slot) const;
  // Whether the slot's bytes still have `content_checksum`: one pass over block_bytes() bytes.
  bool ContentMatches(SlotId slot, uint64_t content_checksum) const;

  // Committed entries of the slot table, parents before children; entries whose checksum fails or whose
  // parent is missing are cleared and counted in `dropped`, and those whose checksum fails (a corrupt or
  // moved entry: its block is lost) also in `corrupt`, when given. Block contents are not read here (see
  // ContentMatches): the caller verifies them before it serves them.
  std::vector<Committed> Recover(uint64_t* dropped, uint64_t* corrupt = nullptr);

 private:
  Pool() = default;
  struct SlotEntry;
  SlotEntry* entry(SlotId slot) const;

  std::string path_;
  std::string namespace_;
  uid_t creator_uid_ = 0;
  Geometry geometry_;
  uint64_t block_bytes_ = 0;
  uint32_t capacity_ = 0;
  MappedRegion map_;  // the whole file; table_ and data_ point into it
  uint8_t* table_ = nullptr;
  uint8_t* data_ = nullptr;
  // Guards map_ against the file shrinking under it (pool_guard.h); declared after map_, so it ends first.
  std::unique_ptr<PoolFileWatch> watch_;
};

}  // namespace flexkv
