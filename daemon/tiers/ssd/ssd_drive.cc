// See ssd_drive.h.
#include "daemon/tiers/ssd/ssd_drive.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>

#include "daemon/tiers/ssd/ssd_check.h"

namespace flexkv {
namespace {

constexpr uint64_t kDriveStopTag = std::numeric_limits<uint64_t>::max();  // a NOP that ends the completion thread

std::span<uint8_t, kSsdHeaderSector> Sector(uint8_t* p) { return std::span<uint8_t, kSsdHeaderSector>(p, kSsdHeaderSector); }
std::span<const uint8_t, kSsdHeaderSector> ConstSector(const uint8_t* p) {
  return std::span<const uint8_t, kSsdHeaderSector>(p, kSsdHeaderSector);
}

io_uring_sqe* Sqe(io_uring* ring) {
  io_uring_sqe* sqe = io_uring_get_sqe(ring);
  SSD_CHECK(sqe != nullptr, "the submission queue holds every operation slot's I/O");
  return sqe;
}

}  // namespace

SsdDrive::AlignedBuffer SsdDrive::AllocAligned(uint64_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, kSsdAlign, bytes) != 0) return nullptr;
  std::memset(p, 0, bytes);
  return AlignedBuffer(static_cast<uint8_t*>(p));
}

Result<std::unique_ptr<SsdDrive>> SsdDrive::Open(uint32_t index, std::unique_ptr<SsdBlockFile> file,
                                                 uint32_t queue_depth, uint32_t rebuild_queue_depth, uint64_t stride,
                                                 std::string* warning) {
  std::unique_ptr<SsdDrive> d(new SsdDrive(index, std::move(file), stride));
  const unsigned entries = std::max(2 * queue_depth + 4, rebuild_queue_depth);
  FLEXKV_RETURN_IF_ERROR(d->ring_.Init(entries));
  d->header_area_ = AllocAligned(uint64_t{queue_depth} * kSsdHeaderSector);
  if (!d->header_area_) return Status::ResourceExhausted("ssd store: no memory for the header buffers");
  d->ops_.resize(queue_depth);
  iovec iov = d->HeaderArea();
  const int r = io_uring_register_buffers(d->ring_.get(), &iov, 1);
  if (r != 0) {
    *warning = fmt::format("ssd {}: registering the header buffers with io_uring failed ({}); headers go through "
                           "unregistered buffers and payloads cannot use fixed buffers",
                           d->file_->path(), std::strerror(-r));
  }
  {
    MutexLock l(&d->sq_mu_);
    d->header_fixed_ = r == 0;
    for (uint32_t k = 0; k < queue_depth; ++k) {
      d->ops_[k].header = d->header_area_.get() + uint64_t{k} * kSsdHeaderSector;
      d->free_ops_.push_back(queue_depth - 1 - k);
    }
  }
  return d;
}

SsdDrive::~SsdDrive() {
  SubmitStop();
  Join();
}

// --- Open: the slot headers ---

SsdDrive::HeaderScan SsdDrive::ScanHeaders(uint32_t depth) {
  HeaderScan out;
  const SsdFileHeader& fh = file_->header();
  if (file_->fresh()) return out;
  const uint64_t found = file_->found_bytes();
  uint64_t readable = 0;  // slots wholly inside the file as found
  if (found > kSsdHeaderSector) readable = std::min<uint64_t>(fh.slot_count, (found - kSsdHeaderSector) / stride_);
  // Slots lost: cut off by a truncation, or past the end of a smaller --ssd-size.
  const uint64_t old_count = file_->found_slot_count();
  out.cut_total = (std::min(old_count, fh.slot_count) > readable ? std::min(old_count, fh.slot_count) - readable : 0) +
                  (old_count > fh.slot_count ? old_count - fh.slot_count : 0);
  for (uint64_t s = readable; s < fh.slot_count && fh.SlotOffset(s) < found; ++s) out.cut.push_back(s);
  // Small slots: read runs of them (1 MiB) and pick the headers out; large ones: one header sector each.
  const uint64_t per_read = stride_ <= 65536 ? std::max<uint64_t>(1, (uint64_t{1} << 20) / stride_) : 1;
  const uint64_t read_bytes = per_read == 1 ? kSsdHeaderSector : per_read * stride_;
  AlignedBuffer buf = AllocAligned(read_bytes * depth);
  if (!buf) {
    out.status = Status::ResourceExhausted("no memory for the rebuild's read buffers");
    return out;
  }
  io_uring* ring = ring_.get();
  std::vector<uint64_t> first(depth, 0), count(depth, 0);
  std::vector<uint32_t> idle;
  for (uint32_t i = 0; i < depth; ++i) idle.push_back(depth - 1 - i);
  uint64_t next = 0;
  uint32_t inflight = 0;
  while (next < readable || inflight > 0) {
    while (next < readable && !idle.empty()) {
      const uint32_t i = idle.back();
      idle.pop_back();
      first[i] = next;
      count[i] = std::min(per_read, readable - next);
      const uint64_t len = per_read == 1 ? kSsdHeaderSector : count[i] * stride_;
      io_uring_sqe* sqe = Sqe(ring);
      io_uring_prep_read(sqe, file_->fd(), buf.get() + i * read_bytes, static_cast<unsigned>(len),
                         fh.SlotOffset(next));
      io_uring_sqe_set_data64(sqe, i);
      next += count[i];
      ++inflight;
    }
    const int r = io_uring_submit_and_wait(ring, 1);
    if (r < 0 && r != -EINTR) {
      out.status = SsdErrnoStatus(-r, "io_uring_submit_and_wait (ssd rebuild)");
      return out;
    }
    io_uring_cqe* cqe = nullptr;
    while (io_uring_peek_cqe(ring, &cqe) == 0) {
      const auto i = static_cast<uint32_t>(io_uring_cqe_get_data64(cqe));
      const int res = cqe->res;
      io_uring_cqe_seen(ring, cqe);
      --inflight;
      const uint64_t want = per_read == 1 ? kSsdHeaderSector : count[i] * stride_;
      if (res < 0 || static_cast<uint64_t>(res) != want) {
        if (out.status.ok()) {
          const std::string what = fmt::format("ssd rebuild: read the slot headers of {} at offset {}",
                                               file_->path(), fh.SlotOffset(first[i]));
          out.status = res < 0 ? SsdErrnoStatus(-res, what)
                               : Status::Unavailable(fmt::format("{}: short read ({} of {} bytes)", what, res, want));
        }
        continue;
      }
      for (uint64_t k = 0; k < count[i]; ++k) {
        const uint8_t* sec = buf.get() + i * read_bytes + (per_read == 1 ? 0 : k * stride_);
        SsdDecodedSlot dec = DecodeSlotHeader(ConstSector(sec));
        if (dec.kind != SsdSectorKind::kEmpty) out.found.push_back(FoundHeader{first[i] + k, dec});
      }
      idle.push_back(i);
    }
    if (!out.status.ok()) {
      next = readable;  // drain what is in flight, then stop
    }
  }
  return out;
}

// --- submission ---

void SsdDrive::Submit(SsdRequest r) {
  MutexLock l(&sq_mu_);
  if (queue_.empty() && !free_ops_.empty()) {
    Prepare(std::move(r));
    SubmitPrepared();
  } else {
    queue_.push_back(std::move(r));
  }
}

void SsdDrive::SubmitPrepared() {
  io_uring* ring = ring_.get();
  while (io_uring_sq_ready(ring) > 0) {
    const int r = io_uring_submit(ring);
    if (r >= 0 || r == -EINTR) continue;
    if (r == -EAGAIN || r == -EBUSY) {  // the kernel is short of request memory or completions are backed up
      std::this_thread::yield();
      continue;
    }
    SSD_CHECK(false, "io_uring_submit failed on a valid ring");
  }
}

void SsdDrive::Prepare(SsdRequest req) {
  SSD_CHECK(!free_ops_.empty(), "a request is taken off the queue only for a free operation slot");
  const uint32_t oi = free_ops_.back();
  free_ops_.pop_back();
  Op& op = ops_[oi];
  op.req = std::move(req);
  op.err = 0;
  op.short_part = -1;
  op.bounced = false;
  io_uring* ring = ring_.get();
  const int fd = file_->fd();
  const SsdRequest& r = op.req;
  const uint64_t off = file_->header().SlotOffset(r.file_slot);
  auto tag = [oi](io_uring_sqe* sqe, int part) { io_uring_sqe_set_data64(sqe, (uint64_t{oi} << 2) | static_cast<uint64_t>(part)); };
  const bool header_fixed = header_fixed_;
  auto header_io = [&](io_uring_sqe* sqe, bool write) {
    if (header_fixed) {
      if (write) io_uring_prep_write_fixed(sqe, fd, op.header, kSsdHeaderSector, off, 0);
      else io_uring_prep_read_fixed(sqe, fd, op.header, kSsdHeaderSector, off, 0);
    } else {
      if (write) io_uring_prep_write(sqe, fd, op.header, kSsdHeaderSector, off);
      else io_uring_prep_read(sqe, fd, op.header, kSsdHeaderSector, off);
    }
  };
  const uint64_t padded = SsdRoundUp(r.len);
  auto bounce = [&]() -> uint8_t* {
    if (!op.bounce) {
      op.bounce = AllocAligned(stride_);
      SSD_CHECK(op.bounce != nullptr, "bounce buffer allocation");
    }
    op.bounced = true;
    return op.bounce.get();
  };

  switch (r.kind) {
    case SsdOpKind::kInvalidate: {
      std::memset(op.header, 0, kSsdHeaderSector);
      io_uring_sqe* sqe = Sqe(ring);
      header_io(sqe, true);
      tag(sqe, 0);
      op.parts_left = 1;
      op.expected[0] = kSsdHeaderSector;
      break;
    }
    case SsdOpKind::kWrite: {
      EncodeSlotHeader(r.header, Sector(op.header));
      if (r.buf_index >= 0 && header_fixed) {
        io_uring_sqe* p = Sqe(ring);
        io_uring_prep_write_fixed(p, fd, r.src, static_cast<unsigned>(r.len), off + kSsdHeaderSector, r.buf_index);
        p->flags |= IOSQE_IO_LINK;  // the header only after the payload
        tag(p, 0);
        io_uring_sqe* h = Sqe(ring);
        header_io(h, true);
        tag(h, 1);
        op.parts_left = 2;
        op.expected[0] = r.len;
        op.expected[1] = kSsdHeaderSector;
      } else if (Aligned(r.src, r.len)) {
        op.iov[0] = {op.header, kSsdHeaderSector};
        op.iov[1] = {const_cast<uint8_t*>(r.src), r.len};
        io_uring_sqe* sqe = Sqe(ring);
        io_uring_prep_writev(sqe, fd, op.iov, 2, off);
        tag(sqe, 0);
        op.parts_left = 1;
        op.expected[0] = kSsdHeaderSector + r.len;
      } else {
        uint8_t* b = bounce();
        std::memcpy(b, op.header, kSsdHeaderSector);
        std::memcpy(b + kSsdHeaderSector, r.src, r.len);
        std::memset(b + kSsdHeaderSector + r.len, 0, padded - r.len);
        io_uring_sqe* sqe = Sqe(ring);
        io_uring_prep_write(sqe, fd, b, static_cast<unsigned>(kSsdHeaderSector + padded), off);
        tag(sqe, 0);
        op.parts_left = 1;
        op.expected[0] = kSsdHeaderSector + padded;
      }
      break;
    }
    case SsdOpKind::kRead: {
      // The payload alone: the index holds the XXH3 its header gave (at the write, or read back at open), which is
      // what VerifyRead checks; reading the header sector too would make every request 4 KiB longer than the block
      // (a second request where the block layer splits at the block size).
      if (r.buf_index >= 0) {
        io_uring_sqe* p = Sqe(ring);
        io_uring_prep_read_fixed(p, fd, r.dst, static_cast<unsigned>(r.len), off + kSsdHeaderSector, r.buf_index);
        tag(p, 0);
        op.expected[0] = r.len;
      } else if (Aligned(r.dst, r.len)) {
        io_uring_sqe* sqe = Sqe(ring);
        io_uring_prep_read(sqe, fd, r.dst, static_cast<unsigned>(r.len), off + kSsdHeaderSector);
        tag(sqe, 0);
        op.expected[0] = r.len;
      } else {
        uint8_t* b = bounce();
        io_uring_sqe* sqe = Sqe(ring);
        io_uring_prep_read(sqe, fd, b, static_cast<unsigned>(padded), off + kSsdHeaderSector);
        tag(sqe, 0);
        op.expected[0] = padded;
      }
      op.parts_left = 1;
      break;
    }
  }
}

// --- completion ---

void SsdDrive::Start(std::function<void(uint32_t op_index)> finished) {
  finished_ = std::move(finished);
  thread_ = std::thread([this] { Run(); });
}

// The completion thread: reaps, finishes operations (which submits queued requests), until the stop NOP.
void SsdDrive::Run() {
  io_uring* ring = ring_.get();
  std::vector<std::pair<uint64_t, int>> done;
  for (;;) {
    io_uring_cqe* cqe = nullptr;
    const int r = io_uring_wait_cqe(ring, &cqe);
    if (r == -EINTR || r == -EAGAIN) continue;
    SSD_CHECK(r == 0, "io_uring_wait_cqe failed on a valid ring");
    unsigned head = 0;
    unsigned seen = 0;
    done.clear();
    io_uring_for_each_cqe(ring, head, cqe) {
      done.emplace_back(cqe->user_data, cqe->res);
      ++seen;
    }
    io_uring_cq_advance(ring, seen);
    // The operations were prepared under sq_mu_ by other threads and handed over through the kernel, which no
    // race detector (and no C++ rule) sees: taking the lock once per batch orders their preparation before this.
    { MutexLock l(&sq_mu_); }
    bool stop = false;
    for (const auto& [tag, res] : done) {
      if (tag == kDriveStopTag) {
        stop = true;
        continue;
      }
      Complete(static_cast<uint32_t>(tag >> 2), static_cast<int>(tag & 3), res);
    }
    if (stop) return;  // sent once idle: nothing else is in flight
  }
}

void SsdDrive::Complete(uint32_t op_index, int part, int res) {
  Op& op = ops_[op_index];
  if (res < 0) {
    // A linked header cancelled after its payload failed reports ECANCELED: keep the payload's error.
    if (op.err == 0 || op.err == ECANCELED) op.err = -res;
  } else if (static_cast<uint64_t>(res) != op.expected[part] && op.short_part < 0) {
    op.short_part = res;
  }
  if (--op.parts_left == 0) finished_(op_index);
}

Status SsdDrive::WriteStatus(const Op& op) const {
  const SsdRequest& r = op.req;
  const std::string what =
      fmt::format("ssd write of block {} to {} at offset {} ({} bytes)", r.header.id.ToString(), file_->path(),
                  file_->header().SlotOffset(r.file_slot), kSsdHeaderSector + r.len);
  if (op.err != 0) return SsdErrnoStatus(op.err, what).WithContext("not stored, the block stays in DRAM only");
  return Status::ResourceExhausted(fmt::format("{}: short write ({} bytes of a part written): the drive or the "
                                               "filesystem is full; not stored, the block stays in DRAM only",
                                               what, op.short_part));
}

// Empty when the block read into `op` verifies; otherwise what did not. Copies a bounced payload out when it does.
// The payload is checked against the XXH3 its slot header carried when the index learnt of it (the write's own, or
// the header read back at open): a payload changed, torn or overwritten behind the store fails it.
std::string SsdDrive::VerifyRead(Op& op) const {
  const SsdRequest& r = op.req;
  const uint8_t* payload = op.bounced ? op.bounce.get() : r.dst;
  const uint64_t sum = XXH3_64bits(payload, r.len);
  if (sum != r.header.payload_xxh3) {
    return fmt::format("its bytes fail their checksum (XXH3 {:016x}, its header {:016x}): corrupted, torn or "
                       "overwritten behind the store", sum, r.header.payload_xxh3);
  }
  if (op.bounced) std::memcpy(r.dst, payload, r.len);
  return {};
}

SsdDrive::Completion SsdDrive::Settle(uint32_t op_index) {
  Op& op = ops_[op_index];
  Completion c;
  const bool io_ok = op.err == 0 && op.short_part < 0;
  c.io_ok = io_ok;
  switch (op.req.kind) {
    case SsdOpKind::kInvalidate:
      break;
    case SsdOpKind::kWrite:
      if (!io_ok) c.status = WriteStatus(op);
      break;
    case SsdOpKind::kRead: {
      const SsdRequest& r = op.req;
      const uint64_t off = file_->header().SlotOffset(r.file_slot);
      if (!io_ok) {
        const std::string why = op.err != 0
                                    ? fmt::format("{} ({})", std::strerror(op.err), strerrorname_np(op.err))
                                    : fmt::format("short read ({} bytes of a part): the file was truncated", op.short_part);
        c.status = Status::DataLoss(fmt::format("ssd read of block {} from {} at offset {} failed: {}; the block is "
                                                "dropped (data_loss_blocks); check dmesg and the drive",
                                                r.header.id.ToString(), file_->path(), off, why));
      } else if (std::string bad = VerifyRead(op); !bad.empty()) {
        c.status = Status::DataLoss(fmt::format("ssd block {} in {} at offset {} did not verify: {}; it is dropped, "
                                                "never served (data_loss_blocks)", r.header.id.ToString(),
                                                file_->path(), off, bad));
      }
      break;
    }
  }
  c.request = std::move(op.req);
  return c;
}

void SsdDrive::Recycle(uint32_t op_index) {
  ops_[op_index].req = SsdRequest{};
  MutexLock l(&sq_mu_);
  free_ops_.push_back(op_index);
  while (!queue_.empty() && !free_ops_.empty()) {
    Prepare(std::move(queue_.front()));
    queue_.pop_front();
  }
  SubmitPrepared();
}

void SsdDrive::SubmitStop() {
  if (!thread_.joinable()) return;
  MutexLock l(&sq_mu_);
  io_uring_sqe* sqe = Sqe(ring_.get());
  io_uring_prep_nop(sqe);
  io_uring_sqe_set_data64(sqe, kDriveStopTag);
  SubmitPrepared();
}

void SsdDrive::Join() {
  if (thread_.joinable()) thread_.join();
}

// --- fixed buffers ---

bool SsdDrive::header_fixed() const {
  MutexLock l(&sq_mu_);
  return header_fixed_;
}

int SsdDrive::RegisterFixedBuffers(std::vector<iovec> iovs) {
  (void)io_uring_unregister_buffers(ring_.get());
  iovs[0] = HeaderArea();
  return io_uring_register_buffers(ring_.get(), iovs.data(), static_cast<unsigned>(iovs.size()));
}

void SsdDrive::RegisterHeadersOnly() {
  (void)io_uring_unregister_buffers(ring_.get());
  iovec h = HeaderArea();
  const bool fixed = io_uring_register_buffers(ring_.get(), &h, 1) == 0;
  MutexLock l(&sq_mu_);
  header_fixed_ = fixed;
}

void SsdDrive::MarkHeaderFixed() {
  MutexLock l(&sq_mu_);
  header_fixed_ = true;
}

}  // namespace flexkv
