// SsdDrive: one drive of the SSD store (ssd_store.h) - its block file and the io_uring engine that moves slots in
// and out of it with direct I/O. It knows slots only as offsets in its file: which slot holds which block is the
// store's slot index (ssd_slot_index.h).
//
// The drive owns an io_uring, a completion thread, a bounded request queue and `queue_depth` operation slots, each
// with its header sector (registered with the ring as fixed buffer 0) and, when needed, a bounce buffer.
//
// Submission is inline: the caller's thread prepares its request's I/O and submits it (one io_uring_enter) when an
// operation slot is free, under the drive's submission lock; otherwise the request waits in the queue and the
// completion thread submits it when an operation ends. The completion thread only reaps (the ring's completion side
// has that one reader). Measured against a submission thread woken through an eventfd (docs/performance.md, "SSD
// tier"): the hand-off cost a wake-up per request, which showed at small blocks.
//
// A request's I/O, by where its payload is:
//   registered (inside a piece RegisterBuffers gave, 4 KiB aligned): two fixed-buffer operations, payload and
//     header; a write links them so that the header goes to the drive only after the payload did (IOSQE_IO_LINK:
//     a failed payload cancels the header);
//   4 KiB aligned, not registered: one vectored operation, [header sector, payload];
//   unaligned: one operation through the op's bounce buffer, [header sector, payload padded to 4 KiB].
// Whatever the order reaches the platter in, a torn slot fails its read: the header's checksum covers the header,
// and the header carries the XXH3-64 of the payload, which is checked on every read.
//
// Threading: Submit may be called from any thread. Start's `finished` runs on the completion thread, which is
// where Settle and Recycle are called. ScanHeaders runs before Start, on the ring alone. The fixed-buffer calls
// must not overlap I/O (the store waits until idle).
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <cstdlib>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "daemon/tiers/ssd/io_uring_ring.h"
#include "daemon/tiers/ssd/ssd_block_file.h"
#include "daemon/tiers/ssd/ssd_format.h"
#include "flexkv/status.h"

namespace flexkv {

enum class SsdOpKind : uint8_t { kWrite, kRead, kInvalidate };

// One slot's I/O, as the store hands it to the slot's drive.
struct SsdRequest {
  SsdOpKind kind = SsdOpKind::kWrite;
  uint32_t slot = 0;       // global slot
  uint64_t file_slot = 0;  // the slot in its drive's file
  SsdSlotHeader header;    // write: the header to write; read: the header expected
  const uint8_t* src = nullptr;
  uint8_t* dst = nullptr;
  uint64_t len = 0;
  int buf_index = -1;      // registered piece holding the payload (fixed-buffer index), -1: none
  bool external = true;    // counts against the drive's queue bound
  std::function<void(Status)> done;
};

class SsdDrive {
 public:
  // Drive `index` of the store, on `file`, with slots of `stride` bytes: sets up its io_uring (room for
  // `queue_depth` operations, or `rebuild_queue_depth` header reads at Open) and `queue_depth` operation slots.
  // Errors: UNAVAILABLE (io_uring: its errno named), RESOURCE_EXHAUSTED (no memory for the header sectors). When
  // the kernel refuses to register the header sectors as a fixed buffer, I/O goes on through unregistered buffers
  // and `*warning` says so.
  static Result<std::unique_ptr<SsdDrive>> Open(uint32_t index, std::unique_ptr<SsdBlockFile> file,
                                                uint32_t queue_depth, uint32_t rebuild_queue_depth, uint64_t stride,
                                                std::string* warning);
  // Stops the completion thread if it still runs (SubmitStop, Join).
  ~SsdDrive();
  SsdDrive(const SsdDrive&) = delete;
  SsdDrive& operator=(const SsdDrive&) = delete;

  uint32_t index() const { return index_; }
  const SsdBlockFile& file() const { return *file_; }
  // Whether `len` bytes at `p` can move with O_DIRECT as they are (4 KiB aligned address and length); otherwise
  // they go through the operation's bounce buffer.
  static bool Aligned(const void* p, uint64_t len) {
    return reinterpret_cast<uintptr_t>(p) % kSsdAlign == 0 && len % kSsdAlign == 0;
  }

  // --- Open: the slot headers, before Start ---

  struct FoundHeader {
    uint64_t file_slot = 0;
    SsdDecodedSlot slot;
  };
  struct HeaderScan {
    std::vector<FoundHeader> found;  // every slot with a header magic
    std::vector<uint64_t> cut;  // slots with bytes on disk but cut off by a truncation (their headers are cleared)
    uint64_t cut_total = 0;
    Status status;
  };
  // Reads every slot header of a file that was not created fresh, `depth` reads in flight (small slots: runs of
  // them, 1 MiB a read). On the calling thread, through the ring; before Start.
  HeaderScan ScanHeaders(uint32_t depth);

  // --- I/O ---

  // Starts the completion thread: it reaps the ring and, once every part of an operation completed, calls
  // `finished(op_index)`, which takes the operation's outcome (Settle) and must end it with Recycle.
  void Start(std::function<void(uint32_t op_index)> finished);
  // Submits `r` now when the drive has a free operation slot (and nothing queued before it), else queues it.
  void Submit(SsdRequest r);

  // What an operation came to: its request, moved out; whether the drive moved all its bytes (io_ok); and its
  // status - OK; a write's error (the block is not stored); DATA_LOSS for a read the drive failed or whose payload
  // did not match the XXH3 of its header (io_ok true). An invalidation's is always OK (its errors are not
  // reported). A verified read that went through the bounce buffer has its payload copied to the request's dst.
  struct Completion {
    SsdRequest request;
    Status status;
    bool io_ok = true;
  };
  Completion Settle(uint32_t op_index);
  // Frees the operation slot and submits the queued requests it makes room for.
  void Recycle(uint32_t op_index);

  // Once idle (nothing in flight): a NOP that ends the completion thread (none before Start); Join waits for it.
  void SubmitStop();
  void Join();

  // --- fixed buffers ---

  bool header_fixed() const;
  // Replaces the ring's fixed buffers by `iovs`, whose [0] is set to this drive's header sectors. 0, or the
  // negative errno of the registration (then nothing is registered, and header_fixed() is unchanged).
  int RegisterFixedBuffers(std::vector<iovec> iovs);
  // Registers the header sectors alone (header_fixed() says whether the kernel took them).
  void RegisterHeadersOnly();
  void MarkHeaderFixed();

 private:
  struct FreeDeleter {
    void operator()(void* p) const { std::free(p); }
  };
  using AlignedBuffer = std::unique_ptr<uint8_t, FreeDeleter>;
  static AlignedBuffer AllocAligned(uint64_t bytes);

  struct Op {
    SsdRequest req;
    uint8_t* header = nullptr;  // its sector in the drive's header area
    AlignedBuffer bounce;       // stride bytes, allocated the first time an unaligned payload needs it
    bool bounced = false;
    int parts_left = 0;
    uint64_t expected[2] = {0, 0};
    int err = 0;                // first errno of a failed part
    int64_t short_part = -1;    // bytes a short transfer moved, -1: none
    iovec iov[2] = {};
  };

  SsdDrive(uint32_t index, std::unique_ptr<SsdBlockFile> file, uint64_t stride)
      : index_(index), file_(std::move(file)), stride_(stride) {}
  iovec HeaderArea() const { return iovec{header_area_.get(), ops_.size() * kSsdHeaderSector}; }
  void Run();
  void Prepare(SsdRequest req) ABSL_EXCLUSIVE_LOCKS_REQUIRED(sq_mu_);
  void SubmitPrepared() ABSL_EXCLUSIVE_LOCKS_REQUIRED(sq_mu_);
  void Complete(uint32_t op_index, int part, int res);
  Status WriteStatus(const Op& op) const;
  std::string VerifyRead(Op& op) const;

  const uint32_t index_;
  const std::unique_ptr<SsdBlockFile> file_;
  const uint64_t stride_;
  IoUringRing ring_;
  AlignedBuffer header_area_;
  std::function<void(uint32_t)> finished_;
  mutable Mutex sq_mu_;  // the ring's submission side, the free operation slots and the queue
  bool header_fixed_ ABSL_GUARDED_BY(sq_mu_) = false;  // the header area is registered as fixed buffer 0
  // An operation slot is prepared under sq_mu_ while free, then belongs to the completion thread until it is
  // freed again (under sq_mu_).
  std::vector<Op> ops_;
  std::vector<uint32_t> free_ops_ ABSL_GUARDED_BY(sq_mu_);
  std::deque<SsdRequest> queue_ ABSL_GUARDED_BY(sq_mu_);
  std::thread thread_;
};

}  // namespace flexkv
