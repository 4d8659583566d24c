// SsdStore: the SSD tier's block store. Blocks (a DRAM pool slot's bytes, named by key, domain and component) are
// written to and read from preallocated block files, one per --ssd-path (one per drive), with io_uring and
// O_DIRECT, straight from and into the caller's memory (registered as io_uring fixed buffers when the caller
// registers it). Each slot on disk carries a header with the block's identity and the XXH3-64 of its bytes; a
// read is reported OK only once both were checked, and the index is rebuilt from the headers when the store opens
// (docs/ssd.md). Not wired into the cache yet: the cache's eviction write-back and promotion are the next step.
//
// Threading: every method is thread-safe. Each drive has one io_uring; Write and Read submit their I/O from the
// caller's thread when the drive has a free operation slot (else the request is queued), and one completion thread
// per drive reaps, verifies and runs the `done` callbacks: they must not block, and may call the store again.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "daemon/tiers/ssd/ssd_block_file.h"
#include "daemon/tiers/ssd/ssd_format.h"
#include "flexkv/block_key.h"
#include "flexkv/status.h"

namespace flexkv {

struct SsdStoreOptions {
  std::vector<std::string> paths;   // --ssd-path: one directory per drive (each gets one block file)
  uint64_t size_bytes = 0;          // --ssd-size: on-disk bytes over all paths, split evenly between them
  uint64_t payload_capacity = 0;    // the largest block (the DRAM pool's largest slot); slots are
                                    // SsdSlotStride(payload_capacity) bytes on disk: 4 KiB header + payload
                                    // rounded up to 4 KiB
  uint32_t queue_depth = 32;        // per drive: requests in flight in its io_uring
  uint32_t max_queued = 4096;       // per drive: requests accepted beyond those in flight; past that, Write and
                                    // Read refuse at once with RESOURCE_EXHAUSTED
  uint32_t rebuild_queue_depth = 64;  // per drive: header reads in flight while the index is rebuilt at Open
  bool allow_buffered = false;      // a path whose filesystem refuses O_DIRECT (or is tmpfs): buffered I/O with a
                                    // warning instead of failing Open
  bool sync_writes = false;         // O_DSYNC: a write completes once on stable media (survives power loss; slower
                                    // on drives with a volatile write cache). Off: survives kill -9 and SIGTERM;
                                    // a power cut may lose the last writes, which the checksums then catch
  SsdMismatchPolicy on_mismatch = SsdMismatchPolicy::kRefuse;  // files of another version or geometry, blocks of
                                                               // a domain not listed below
  std::vector<SsdDomain> domains;   // the domains whose blocks are kept at rebuild; empty: every domain
};

// One memory range the caller reads from and writes into (e.g. the DRAM pool's data).
struct SsdRegion {
  const void* base = nullptr;
  uint64_t bytes = 0;
};

// A committed block, as Lookup and Entries report it.
struct SsdEntry {
  SsdBlockId id;
  BlockKey parent;
  uint64_t payload_bytes = 0;
  uint64_t content_checksum = 0;  // what Write was given
  uint64_t generation = 0;
};

struct SsdStoreStats {
  uint64_t capacity_slots = 0;
  uint64_t blocks = 0;            // committed (readable) blocks
  uint64_t writes = 0, write_bytes = 0;       // completed OK
  uint64_t reads = 0, read_bytes = 0;         // completed OK (verified)
  uint64_t write_errors = 0;      // writes that failed (the block was not stored; the caller's bytes untouched)
  uint64_t read_errors = 0;       // reads the drive or filesystem failed (EIO, short read: file truncated)
  uint64_t data_loss_blocks = 0;  // blocks dropped because a read failed or did not verify (never served)
  uint64_t evictions = 0;         // committed blocks overwritten (least recently used first) to make room
  uint64_t refused = 0;           // Write/Read answered RESOURCE_EXHAUSTED (queue full, or every slot busy)
  uint64_t fixed_buffer_ios = 0;  // requests whose payload moved through a registered (fixed) buffer
  uint64_t bounced_ios = 0;       // requests copied through an aligned bounce buffer (caller's memory unaligned)
};

// What Open found on disk.
struct SsdRebuildReport {
  uint64_t blocks = 0;            // indexed
  uint64_t corrupt_headers = 0;   // header magic with a bad checksum or impossible fields: torn or damaged; skipped
  uint64_t other_version = 0;     // slot headers of another format version, discarded
  uint64_t other_domain = 0;      // blocks of a domain not in SsdStoreOptions::domains, discarded
  uint64_t truncated = 0;         // slots past the end of a truncated file, or past a smaller --ssd-size: lost
  uint64_t superseded = 0;        // an older generation of a key found again in another slot: dropped
  uint64_t files_reformatted = 0; // files discarded whole (another version or geometry, or not block files)
  double seconds = 0;             // Open's wall time, files and headers
  std::vector<std::string> warnings;  // one line each, already logged
};

class SsdStore {
 public:
  using Done = std::function<void(Status)>;

  // Opens (creating where missing) one block file per path, sized to size_bytes / paths.size() rounded down to
  // whole slots, and rebuilds the index from the slot headers. Errors name the path and what to do:
  // INVALID_ARGUMENT (options: no path, a size below one slot per path, queue depths 0 or above 4096),
  // FAILED_PRECONDITION (O_DIRECT refused and allow_buffered off; a file of another version or geometry, a block of
  // another domain, under kRefuse; a file locked by another process), NOT_FOUND (a path missing), PERMISSION_DENIED,
  // RESOURCE_EXHAUSTED (a drive cannot hold its file), UNAVAILABLE (I/O errors). Nothing is left open on error.
  static Result<std::unique_ptr<SsdStore>> Open(const SsdStoreOptions& options);

  // Stops accepting requests, waits until every accepted one has completed (its `done` has returned), closes.
  ~SsdStore();
  SsdStore(const SsdStore&) = delete;
  SsdStore& operator=(const SsdStore&) = delete;

  // Queues a write of `payload` (1..payload_capacity bytes) as block `id`, hanging under `parent`, with the DRAM
  // pool's `content_checksum` of the bytes (0: none; it is stored and given back by Lookup, for promotion). Returns
  // OK when accepted: `done` is then called exactly once, with OK once header and payload are on the drive (the
  // block is readable from then on, and only then), or with the error (the block is not stored). Otherwise
  // returns the refusal and never calls `done`: ALREADY_EXISTS (the block is stored or being written),
  // RESOURCE_EXHAUSTED (the drive's queue is full, or every slot is being written or read: nothing waits),
  // INVALID_ARGUMENT (size), UNAVAILABLE (closing). Makes room by overwriting the least recently used
  // leaf: a block no other committed block hangs under (the least recently used block of all only when there is
  // no leaf), so a prefix outlives its descendants on SSD as in DRAM.
  // The store only reads `payload`, which must stay valid and unchanged until `done` runs.
  Status Write(const SsdBlockId& id, const BlockKey& parent, std::span<const uint8_t> payload,
               uint64_t content_checksum, Done done);

  // Queues a read of block `id` into `payload` (exactly the block's size). Returns OK when accepted: `done` is
  // called once, with OK when the bytes are in `payload` and verified (header fields and XXH3 of the bytes), or
  // DATA_LOSS when the drive failed the read or the block did not verify: the block is then dropped and counted
  // (data_loss_blocks), and `payload` holds unspecified bytes. Refusals (no `done`): NOT_FOUND (not stored, or
  // still being written), INVALID_ARGUMENT (size), RESOURCE_EXHAUSTED (queue full), UNAVAILABLE (closing). The
  // block cannot be evicted while its read is in flight.
  Status Read(const SsdBlockId& id, std::span<uint8_t> payload, Done done);

  // The committed block `id`, or nullopt. Counts as a use for the LRU order only through Read.
  std::optional<SsdEntry> Lookup(const SsdBlockId& id) const;
  // Marks committed blocks as used now (most recently used), as a Read does: the cache calls it for the blocks
  // DRAM hits that SSD holds too, so a hot block's SSD copy is not the next overwritten. Ids not committed (or
  // being read) are skipped.
  void Touch(std::span<const SsdBlockId> ids);
  // Every committed block, in eviction order: the leaves least recently used first, then the blocks others hang
  // under (after Open: oldest generation first).
  std::vector<SsdEntry> Entries() const;
  // Drops a committed block (its slot header is cleared on disk, so it does not come back at the next Open).
  // False when it is not committed. A read in flight still completes.
  bool Erase(const SsdBlockId& id);

  // The KV event stream's view (daemon/events/): `listener` is told, under the store's lock, each block that becomes
  // readable (kWritten) and each committed block that leaves (kEvicted: overwritten to make room; kDropped: a read
  // failed or did not verify, or Erase). It must be quick and must not call the store. Set it once, before traffic.
  enum class BlockEventKind : uint8_t { kWritten, kEvicted, kDropped };
  void SetEventListener(std::function<void(BlockEventKind, const SsdEntry&)> listener);
  // Under the store's lock: `mark()`, then `each` for every committed block.
  void SnapshotBlocks(const std::function<void()>& mark, const std::function<void(const SsdEntry&)>& each) const;

  // Registers `regions` with every drive's io_uring as fixed buffers (split into 1 GiB pieces, the kernel's
  // limit), replacing what was registered: requests whose payload lies inside one piece, 4 KiB aligned, then skip
  // the kernel's per-I/O page pinning. Waits until no request is outstanding first (WaitIdle); must not be called
  // concurrently with Write or Read, nor from a `done` callback. On error (e.g. RESOURCE_EXHAUSTED: the locked-
  // memory limit, LimitMEMLOCK=) nothing stays registered and I/O goes on through unregistered buffers. An empty
  // span unregisters.
  Status RegisterBuffers(std::span<const SsdRegion> regions);

  // Blocks until no accepted request is outstanding (requests accepted meanwhile are waited for too).
  void WaitIdle();

  SsdStoreStats stats() const;
  const SsdRebuildReport& rebuild_report() const;
  uint64_t capacity_slots() const;
  uint64_t payload_capacity() const;
  uint64_t slot_stride() const;  // on-disk bytes per slot
  // Per path: the block file, its filesystem, and whether it does direct I/O.
  struct FileInfo {
    std::string path;
    std::string filesystem;
    bool direct = true;
    uint64_t slots = 0;
  };
  std::vector<FileInfo> files() const;

  struct Impl;

 private:
  explicit SsdStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace flexkv
