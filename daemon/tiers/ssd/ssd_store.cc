// See ssd_store.h. The store ties its slot index (ssd_slot_index.h: which slot holds which block, which one a write
// overwrites) to its drives (ssd_drive.h: a block file and an io_uring each). Write and Read reserve or pin a slot
// in the index under the store's lock, then hand the slot's I/O to its drive; the drive's completion thread brings
// the outcome back (Finish): the index, the stats and the event listener learn it, then the caller's `done`. Open
// rebuilds the index from the slot headers the drives read back.
#include "daemon/tiers/ssd/ssd_store.h"

#include <fmt/format.h>
#include <sys/uio.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <thread>
#include <utility>

#include "common/log.h"
#include "common/mutex.h"
#include "daemon/tiers/ssd/ssd_drive.h"
#include "daemon/tiers/ssd/ssd_slot_index.h"

namespace flexkv {
namespace {

constexpr uint64_t kMaxFixedPiece = uint64_t{1} << 30;  // the kernel's limit for one registered buffer
constexpr uint32_t kMaxQueueDepth = 4096;

}  // namespace

struct SsdStore::Impl {
  struct Piece {
    uintptr_t begin = 0;
    uintptr_t end = 0;
    int index = 0;  // fixed-buffer index (1..; 0 is each drive's header area)
  };

  SsdStoreOptions options;
  uint64_t payload_capacity = 0;
  uint64_t stride = 0;
  uint64_t per_drive_slots = 0;
  uint64_t queue_limit = 0;  // per drive: queue_depth + max_queued
  std::vector<std::unique_ptr<SsdDrive>> drives;
  SsdRebuildReport report;

  mutable Mutex mu;
  SsdSlotIndex index ABSL_GUARDED_BY(mu);
  std::vector<uint64_t> accepted ABSL_GUARDED_BY(mu);  // per drive: external requests (Write, Read) outstanding
  bool closing ABSL_GUARDED_BY(mu) = false;
  SsdStoreStats stats ABSL_GUARDED_BY(mu);  // but blocks: the index counts them
  std::function<void(SsdStore::BlockEventKind, const SsdEntry&)> event_listener ABSL_GUARDED_BY(mu);
  void ReportLocked(SsdStore::BlockEventKind kind, const SsdEntry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (event_listener) event_listener(kind, e);
  }

  mutable Mutex reg_mu;
  std::vector<Piece> pieces ABSL_GUARDED_BY(reg_mu);  // sorted by begin

  std::vector<uint32_t> pending_clear;  // slots Rebuild found unusable: their headers are cleared once running

  Mutex idle_mu;
  std::condition_variable idle_cv;
  uint64_t outstanding ABSL_GUARDED_BY(idle_mu) = 0;  // accepted requests (and invalidations) not yet finished

  SsdDrive& DriveOf(uint32_t s) const { return *drives[s / per_drive_slots]; }
  bool HasRoom(uint32_t drive) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return accepted[drive] < queue_limit; }

  // The request that clears the header of slot `s` (invalidating in the index) on disk.
  SsdRequest Invalidation(uint32_t s) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    SsdRequest r;
    r.kind = SsdOpKind::kInvalidate;
    r.slot = s;
    r.file_slot = index.file_slot(s);
    r.external = false;
    return r;
  }

  // A Write's or Read's request for slot `s` (its entry filled in): counted against its drive and in the I/O-mode
  // stats (`piece` >= 0: a registered buffer; `buffer` unaligned: a bounce), with the header that slot carries.
  SsdRequest StartRequest(SsdOpKind kind, uint32_t s, int piece, const void* buffer, uint64_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const SsdEntry& e = index.entry(s);
    const SsdDrive& d = DriveOf(s);
    ++accepted[d.index()];
    if (piece >= 0) {
      ++stats.fixed_buffer_ios;
    } else if (!SsdDrive::Aligned(buffer, bytes)) {
      ++stats.bounced_ios;
    }
    SsdRequest r;
    r.kind = kind;
    r.slot = s;
    r.file_slot = index.file_slot(s);
    r.header.file_id = d.file().header().file_id;
    r.header.slot = r.file_slot;
    r.header.generation = e.generation;
    r.header.id = e.id;
    r.header.parent = e.parent;
    r.header.payload_bytes = e.payload_bytes;
    r.header.payload_xxh3 = index.payload_xxh3(s);
    r.header.content_checksum = e.content_checksum;
    r.buf_index = piece;
    return r;
  }

  // --- requests ---
  void AddOutstanding(uint64_t n) {
    MutexLock l(&idle_mu);
    outstanding += n;
  }
  void Push(SsdRequest r) { DriveOf(r.slot).Submit(std::move(r)); }
  int FindPiece(const void* p, uint64_t len) const {
    if (!SsdDrive::Aligned(p, len)) return -1;
    const auto b = reinterpret_cast<uintptr_t>(p);
    MutexLock l(&reg_mu);
    auto it = std::upper_bound(pieces.begin(), pieces.end(), b, [](uintptr_t v, const Piece& x) { return v < x.begin; });
    if (it == pieces.begin()) return -1;
    --it;
    return b + len <= it->end ? it->index : -1;
  }

  // --- drive threads ---
  void Finish(SsdDrive& d, uint32_t op_index);

  // --- open ---
  Status Rebuild();
};

// An operation of drive `d` ended: the index, the stats and the listener learn how, the operation slot takes the
// next queued request, then the caller's `done` runs.
void SsdStore::Impl::Finish(SsdDrive& d, uint32_t op_index) {
  SsdDrive::Completion c = d.Settle(op_index);
  const SsdRequest& r = c.request;
  const Status& st = c.status;
  std::vector<SsdRequest> follow_ups;  // invalidations this completion causes
  switch (r.kind) {
    case SsdOpKind::kInvalidate: {
      MutexLock l(&mu);
      index.FinishClear(r.slot);
      break;
    }
    case SsdOpKind::kWrite: {
      MutexLock l(&mu);
      if (c.io_ok) {
        const SsdEntry& e = index.CommitWrite(r.slot);
        ReportLocked(SsdStore::BlockEventKind::kWritten, e);
        ++stats.writes;
        stats.write_bytes += r.len;
      } else {
        index.AbortWrite(r.slot);
        ++stats.write_errors;
      }
      --accepted[d.index()];
      break;
    }
    case SsdOpKind::kRead: {
      MutexLock l(&mu);
      const SsdSlotIndex::Removal gone = index.EndRead(r.slot, st.ok());
      if (st.ok()) {
        ++stats.reads;
        stats.read_bytes += r.len;
      } else {
        ++stats.data_loss_blocks;
        if (!c.io_ok) ++stats.read_errors;
        if (gone.dropped) ReportLocked(SsdStore::BlockEventKind::kDropped, *gone.dropped);
      }
      if (gone.clear) follow_ups.push_back(Invalidation(r.slot));
      --accepted[d.index()];
      break;
    }
  }
  if (!st.ok() && r.kind == SsdOpKind::kRead) {
    static log::RateLimited failed_reads(10000);  // a failing drive must not flood the journal
    failed_reads.Warning("ssd", "{}", st.message());
  }
  d.Recycle(op_index);
  if (!follow_ups.empty()) {
    AddOutstanding(follow_ups.size());
    for (SsdRequest& f : follow_ups) Push(std::move(f));
  }
  if (r.done) r.done(std::move(c.status));
  MutexLock l(&idle_mu);
  if (--outstanding == 0) idle_cv.notify_all();
}

// Reads every slot header of every drive that was not created fresh and fills the index. Runs before the drive
// threads start, on their rings, one thread per drive.
Status SsdStore::Impl::Rebuild() {
  std::vector<SsdDrive::HeaderScan> scans(drives.size());
  {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < drives.size(); ++i) {
      threads.emplace_back([this, i, &scans] { scans[i] = drives[i]->ScanHeaders(options.rebuild_queue_depth); });
    }
    for (std::thread& t : threads) t.join();
  }
  for (const SsdDrive::HeaderScan& s : scans) FLEXKV_RETURN_IF_ERROR(s.status);

  auto domain_known = [this](const SsdDomain& dom) {
    return options.domains.empty() ||
           std::find(options.domains.begin(), options.domains.end(), dom) != options.domains.end();
  };
  // Refusals first, before anything changes.
  if (options.on_mismatch == SsdMismatchPolicy::kRefuse) {
    for (size_t di = 0; di < drives.size(); ++di) {
      const SsdDrive& d = *drives[di];
      for (const SsdDrive::FoundHeader& f : scans[di].found) {
        std::string what;
        if (f.slot.kind == SsdSectorKind::kOtherVersion) {
          what = fmt::format("a block of format version {} (this flexkvd reads version {})", f.slot.version,
                             kSsdFormatVersion);
        } else if (f.slot.kind == SsdSectorKind::kValid && !domain_known(f.slot.header.id.domain)) {
          what = fmt::format("a block of domain {}, which is not one of the {} configured", f.slot.header.id.domain.ToString(),
                             options.domains.size());
        }
        if (!what.empty()) {
          return Status::FailedPrecondition(fmt::format(
              "ssd file {}: slot {} holds {}; nothing was changed. Point --ssd-path elsewhere, remove the file, or "
              "let flexkvd discard such blocks (--ssd-on-mismatch=discard)", d.file().path(), f.file_slot, what));
        }
      }
    }
  }

  MutexLock l(&mu);
  std::vector<uint32_t> to_clear;
  for (size_t di = 0; di < drives.size(); ++di) {
    const SsdDrive& d = *drives[di];
    const auto drive = static_cast<uint32_t>(di);
    report.truncated += scans[di].cut_total;
    for (uint64_t s : scans[di].cut) to_clear.push_back(index.slot_of(drive, s));
    for (const SsdDrive::FoundHeader& f : scans[di].found) {
      const uint32_t slot = index.slot_of(drive, f.file_slot);
      const SsdSlotHeader& h = f.slot.header;
      if (f.slot.kind == SsdSectorKind::kCorrupt) {
        ++report.corrupt_headers;
        to_clear.push_back(slot);
        continue;
      }
      if (f.slot.kind == SsdSectorKind::kOtherVersion) {
        ++report.other_version;
        to_clear.push_back(slot);
        continue;
      }
      if (h.file_id != d.file().header().file_id || h.slot != f.file_slot || h.payload_bytes == 0 ||
          h.payload_bytes > payload_capacity || h.generation == 0) {
        ++report.corrupt_headers;  // a header copied from elsewhere, or fields no write produces
        to_clear.push_back(slot);
        continue;
      }
      if (!domain_known(h.id.domain)) {
        ++report.other_domain;
        to_clear.push_back(slot);
        continue;
      }
      const SsdEntry entry{h.id, h.parent, h.payload_bytes, h.content_checksum, h.generation};
      if (const std::optional<uint32_t> older = index.Restore(slot, entry, h.payload_xxh3)) {
        ++report.superseded;
        to_clear.push_back(*older);
      }
    }
  }
  // The clearing writes go out once the drive threads run (Open queues them).
  pending_clear = index.FinishRebuild(std::move(to_clear));
  report.blocks = index.blocks();
  return Status::Ok();
}

SsdStore::SsdStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<SsdStore>> SsdStore::Open(const SsdStoreOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  if (options.paths.empty()) return Status::InvalidArgument("ssd store: no --ssd-path given; expected one per drive");
  if (options.payload_capacity == 0 || options.payload_capacity > (uint64_t{1} << 30)) {
    return Status::InvalidArgument(fmt::format("ssd store: blocks of {} bytes; expected 1 byte to 1 GiB",
                                               options.payload_capacity));
  }
  for (const auto& [name, v] : {std::pair<const char*, uint32_t>{"queue depth", options.queue_depth},
                                {"rebuild queue depth", options.rebuild_queue_depth}}) {
    if (v == 0 || v > kMaxQueueDepth) {
      return Status::InvalidArgument(fmt::format("ssd store: {} {}; expected 1..{}", name, v, kMaxQueueDepth));
    }
  }
  for (size_t i = 0; i < options.paths.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      std::error_code e1, e2;
      if (options.paths[i] == options.paths[j] ||
          std::filesystem::equivalent(options.paths[i], options.paths[j], e1)) {
        return Status::InvalidArgument(fmt::format("ssd store: --ssd-path {} is given twice ({}); one per drive",
                                                   options.paths[i], options.paths[j]));
      }
      (void)e2;
    }
  }
  auto impl = std::make_unique<Impl>();
  Impl& m = *impl;
  m.options = options;
  m.payload_capacity = options.payload_capacity;
  m.stride = SsdSlotStride(options.payload_capacity);
  const uint64_t per_path = options.size_bytes / options.paths.size();
  m.per_drive_slots = per_path > kSsdHeaderSector ? (per_path - kSsdHeaderSector) / m.stride : 0;
  if (m.per_drive_slots == 0) {
    return Status::InvalidArgument(fmt::format(
        "ssd store: --ssd-size {} over {} path(s) leaves {} bytes per drive, below one slot ({} bytes for {}-byte "
        "blocks, plus the {}-byte file header)", options.size_bytes, options.paths.size(), per_path, m.stride,
        options.payload_capacity, kSsdHeaderSector));
  }
  if (m.per_drive_slots * options.paths.size() >= SsdSlotIndex::kNoSlot) {
    return Status::InvalidArgument(fmt::format("ssd store: {} slots; at most {} (a larger block size or a smaller "
                                               "--ssd-size)", m.per_drive_slots * options.paths.size(),
                                               SsdSlotIndex::kNoSlot - 1));
  }
  m.queue_limit = uint64_t{options.queue_depth} + options.max_queued;

  SsdFileOptions fo;
  fo.slot_count = m.per_drive_slots;
  fo.payload_capacity = options.payload_capacity;
  fo.allow_buffered = options.allow_buffered;
  fo.sync_writes = options.sync_writes;
  fo.on_mismatch = options.on_mismatch;
  auto warn = [&m](const std::string& w) {
    log::Warning("ssd", "{}", w);
    m.report.warnings.push_back(w);
  };
  for (size_t i = 0; i < options.paths.size(); ++i) {
    std::string warning;
    auto file = SsdBlockFile::Open(options.paths[i], fo, &warning);
    if (!file.ok()) return file.status();
    if (!warning.empty()) warn(warning);
    if ((*file)->fresh() && (*file)->found_bytes() > 0) ++m.report.files_reformatted;
    std::string ring_warning;
    auto drive = SsdDrive::Open(static_cast<uint32_t>(i), std::move(*file), options.queue_depth,
                                options.rebuild_queue_depth, m.stride, &ring_warning);
    if (!drive.ok()) return drive.status();
    if (!ring_warning.empty()) warn(ring_warning);
    m.drives.push_back(std::move(*drive));
  }
  {
    MutexLock l(&m.mu);
    m.index = SsdSlotIndex(static_cast<uint32_t>(options.paths.size()), m.per_drive_slots);
    m.accepted.assign(options.paths.size(), 0);
    m.stats.capacity_slots = m.index.capacity();
  }
  FLEXKV_RETURN_IF_ERROR(m.Rebuild());
  for (auto& d : m.drives) {
    SsdDrive* dp = d.get();
    d->Start([&m, dp](uint32_t op_index) { m.Finish(*dp, op_index); });
  }
  std::vector<uint32_t> clear = std::move(m.pending_clear);
  if (!clear.empty()) {
    std::vector<SsdRequest> reqs;
    {
      MutexLock l(&m.mu);
      for (uint32_t s : clear) reqs.push_back(m.Invalidation(s));
    }
    m.AddOutstanding(reqs.size());
    for (SsdRequest& r : reqs) m.Push(std::move(r));
  }
  m.report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const SsdRebuildReport& rep = m.report;
  log::Info("ssd", "ssd store open: {} path(s), {} slots of {} bytes ({} on disk each); rebuilt {} blocks in {:.3f} s "
            "({} corrupt headers, {} of another version, {} of another domain, {} truncated, {} superseded skipped)",
            options.paths.size(), m.per_drive_slots * options.paths.size(), m.payload_capacity, m.stride, rep.blocks,
            rep.seconds, rep.corrupt_headers, rep.other_version, rep.other_domain, rep.truncated, rep.superseded);
  return std::unique_ptr<SsdStore>(new SsdStore(std::move(impl)));
}

SsdStore::~SsdStore() {
  {
    MutexLock l(&impl_->mu);
    impl_->closing = true;
  }
  WaitIdle();
  for (auto& d : impl_->drives) d->SubmitStop();
  for (auto& d : impl_->drives) d->Join();
}

Status SsdStore::Write(const SsdBlockId& id, const BlockKey& parent, std::span<const uint8_t> payload,
                       uint64_t content_checksum, Done done) {
  Impl& m = *impl_;
  if (payload.empty() || payload.size() > m.payload_capacity) {
    return Status::InvalidArgument(fmt::format("ssd write of block {}: {} bytes; expected 1..{}", id.ToString(),
                                               payload.size(), m.payload_capacity));
  }
  const uint64_t sum = XXH3_64bits(payload.data(), payload.size());
  const int piece = m.FindPiece(payload.data(), payload.size());
  SsdRequest r;
  {
    MutexLock l(&m.mu);
    if (m.closing) return Status::Unavailable("ssd store is closing");
    if (m.index.Contains(id)) {
      return Status::AlreadyExists(fmt::format("ssd block {} is already stored or being written", id.ToString()));
    }
    const SsdSlotIndex::Reservation slot = m.index.ReserveForWrite(
        SsdEntry{id, parent, payload.size(), content_checksum, 0}, sum,
        [&m](uint32_t drive) ABSL_NO_THREAD_SAFETY_ANALYSIS { return m.HasRoom(drive); });  // mu is held
    if (slot.evicted) {
      m.ReportLocked(SsdStore::BlockEventKind::kEvicted, *slot.evicted);
      ++m.stats.evictions;
    }
    if (slot.slot == SsdSlotIndex::kNoSlot) {
      ++m.stats.refused;
      return Status::ResourceExhausted(
          slot.queue_full ? fmt::format("ssd write of block {}: the drive's queue is full ({} requests outstanding); "
                                        "try again later", id.ToString(), m.queue_limit)
                          : fmt::format("ssd write of block {}: every SSD slot is being written or read", id.ToString()));
    }
    r = m.StartRequest(SsdOpKind::kWrite, slot.slot, piece, payload.data(), payload.size());
  }
  r.src = payload.data();
  r.len = payload.size();
  r.done = std::move(done);
  m.AddOutstanding(1);
  m.Push(std::move(r));
  return Status::Ok();
}

Status SsdStore::Read(const SsdBlockId& id, std::span<uint8_t> payload, Done done) {
  Impl& m = *impl_;
  const int piece = m.FindPiece(payload.data(), payload.size());
  SsdRequest r;
  {
    MutexLock l(&m.mu);
    if (m.closing) return Status::Unavailable("ssd store is closing");
    const uint32_t slot = m.index.Find(id);
    if (slot == SsdSlotIndex::kNoSlot) return Status::NotFound(fmt::format("ssd block {} is not stored", id.ToString()));
    if (!m.index.committed(slot)) {
      return Status::NotFound(fmt::format("ssd block {} is being written, not readable yet", id.ToString()));
    }
    const uint64_t bytes = m.index.entry(slot).payload_bytes;
    if (payload.size() != bytes) {
      return Status::InvalidArgument(fmt::format("ssd read of block {}: a {}-byte buffer; the block has {} bytes",
                                                 id.ToString(), payload.size(), bytes));
    }
    if (!m.HasRoom(m.index.drive_of(slot))) {
      ++m.stats.refused;
      return Status::ResourceExhausted(fmt::format("ssd read of block {}: the drive's queue is full ({} requests "
                                                   "outstanding); try again later", id.ToString(), m.queue_limit));
    }
    m.index.Pin(slot);
    r = m.StartRequest(SsdOpKind::kRead, slot, piece, payload.data(), payload.size());
  }
  r.dst = payload.data();
  r.len = payload.size();
  r.done = std::move(done);
  m.AddOutstanding(1);
  m.Push(std::move(r));
  return Status::Ok();
}

std::optional<SsdEntry> SsdStore::Lookup(const SsdBlockId& id) const {
  MutexLock l(&impl_->mu);
  return impl_->index.Lookup(id);
}

std::vector<SsdEntry> SsdStore::Entries() const {
  MutexLock l(&impl_->mu);
  return impl_->index.Entries();
}

void SsdStore::Touch(std::span<const SsdBlockId> ids) {
  MutexLock l(&impl_->mu);
  impl_->index.Touch(ids);
}

void SsdStore::SetEventListener(std::function<void(BlockEventKind, const SsdEntry&)> listener) {
  MutexLock l(&impl_->mu);
  impl_->event_listener = std::move(listener);
}

void SsdStore::SnapshotBlocks(const std::function<void()>& mark, const std::function<void(const SsdEntry&)>& each) const {
  MutexLock l(&impl_->mu);
  mark();
  impl_->index.ForEachCommitted(each);
}

bool SsdStore::Erase(const SsdBlockId& id) {
  Impl& m = *impl_;
  std::optional<SsdRequest> clear;
  {
    MutexLock l(&m.mu);
    const SsdSlotIndex::Removal gone = m.index.Erase(id);
    if (!gone.dropped) return false;
    m.ReportLocked(SsdStore::BlockEventKind::kDropped, *gone.dropped);
    if (gone.clear) clear = m.Invalidation(gone.slot);  // else cleared when its last read ends
  }
  if (clear) {
    m.AddOutstanding(1);
    m.Push(std::move(*clear));
  }
  return true;
}

Status SsdStore::RegisterBuffers(std::span<const SsdRegion> regions) {
  Impl& m = *impl_;
  WaitIdle();  // no request may use a buffer index while the table changes
  std::vector<Impl::Piece> pieces;
  std::vector<iovec> iovs(1);  // [0]: the drive's header area, filled in per drive
  for (const SsdRegion& r : regions) {
    auto b = reinterpret_cast<uintptr_t>(r.base);
    for (uint64_t off = 0; off < r.bytes; off += kMaxFixedPiece) {
      const uint64_t len = std::min(kMaxFixedPiece, r.bytes - off);
      pieces.push_back(Impl::Piece{b + off, b + off + len, static_cast<int>(iovs.size())});
      iovs.push_back(iovec{reinterpret_cast<void*>(b + off), len});
    }
  }
  Status result;
  for (auto& d : m.drives) {
    if (!d->header_fixed() && regions.empty()) continue;
    const int r = d->RegisterFixedBuffers(iovs);
    if (r != 0 && result.ok()) {
      std::string hint;
      if (-r == ENOMEM) hint = "; raise the locked-memory limit (LimitMEMLOCK=infinity in the unit, ulimit -l)";
      else if (-r == EFAULT || -r == EOPNOTSUPP) hint = "; io_uring cannot pin this memory (it must be anonymous, shmem or hugetlbfs)";
      result = SsdErrnoStatus(-r, fmt::format("register {} region(s) ({} pieces) with the io_uring of {}",
                                              regions.size(), pieces.size(), d->file().path()))
                   .WithContext("payloads go through unregistered buffers" + hint);
    }
  }
  if (!result.ok()) {
    // Back to the header areas alone, everywhere.
    for (auto& d : m.drives) d->RegisterHeadersOnly();
    pieces.clear();
  } else {
    for (auto& d : m.drives) d->MarkHeaderFixed();
  }
  std::sort(pieces.begin(), pieces.end(), [](const Impl::Piece& a, const Impl::Piece& b) { return a.begin < b.begin; });
  MutexLock l(&m.reg_mu);
  m.pieces = std::move(pieces);
  return result;
}

void SsdStore::WaitIdle() {
  Impl& m = *impl_;
  MutexLock l(&m.idle_mu);
  while (m.outstanding != 0) m.idle_mu.Wait(&m.idle_cv);
}

SsdStoreStats SsdStore::stats() const {
  MutexLock l(&impl_->mu);
  SsdStoreStats s = impl_->stats;
  s.blocks = impl_->index.blocks();
  return s;
}

const SsdRebuildReport& SsdStore::rebuild_report() const { return impl_->report; }
uint64_t SsdStore::capacity_slots() const { return impl_->per_drive_slots * impl_->drives.size(); }
uint64_t SsdStore::payload_capacity() const { return impl_->payload_capacity; }
uint64_t SsdStore::slot_stride() const { return impl_->stride; }

std::vector<SsdStore::FileInfo> SsdStore::files() const {
  std::vector<FileInfo> out;
  for (const auto& d : impl_->drives) {
    out.push_back(FileInfo{d->file().path(), d->file().filesystem(), d->file().direct(), impl_->per_drive_slots});
  }
  return out;
}

}  // namespace flexkv
