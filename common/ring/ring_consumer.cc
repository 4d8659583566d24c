// See ring_consumer.h.
#include "common/ring/ring_consumer.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/eventfd.h>

#include <cerrno>
#include <cstring>
#include <new>

#include "common/uds.h"

namespace flexkv::ring {

Result<RingConsumer::Created> RingConsumer::Create(const RingGeometry& geometry, uint32_t pin_lease_ms) {
  UniqueFd memfd(static_cast<int>(syscall(SYS_memfd_create, "flexkv-rings", MFD_CLOEXEC | MFD_ALLOW_SEALING)));
  if (!memfd) return Status::ResourceExhausted(fmt::format("memfd_create: {}", ErrnoText(errno)));
  const uint64_t bytes = geometry.total_bytes();
  if (ftruncate(memfd.get(), static_cast<off_t>(bytes)) != 0) {
    return Status::ResourceExhausted(fmt::format("sizing the ring memfd to {} bytes: {}", bytes, ErrnoText(errno)));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd.get(), 0);
  if (p == MAP_FAILED) return Status::ResourceExhausted(fmt::format("mmap rings: {}", ErrnoText(errno)));
  RingMapping mapping(static_cast<uint8_t*>(p), bytes);
  RingHeader* h = new (p) RingHeader{};
  h->magic = kRingMagic;
  h->layout_version = kRingLayoutVersion;
  h->submit_entries = geometry.submit_entries;
  h->completion_entries = geometry.completion_entries;
  h->submit_offset = geometry.submit_offset();
  h->completion_offset = geometry.completion_offset();
  h->arena_offset = geometry.arena_offset();
  h->arena_bytes = geometry.arena_bytes;
  h->total_bytes = bytes;
  h->pin_lease_ms = pin_lease_ms;
  // The poller may be asleep with a session list that lacks this one: until it picks the session up and calls
  // Unpark, the client must ring the doorbell (which the poller already watches). Starting unparked made a new
  // session's first request wait out the poller's whole park.
  h->daemon_parked.value.store(1, std::memory_order_seq_cst);
  // The client can neither shrink nor grow the mapping under the daemon, nor remove these seals.
  if (fcntl(memfd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return Status::Internal(fmt::format("sealing the ring memfd: {}", ErrnoText(errno)));
  }
  UniqueFd doorbell(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!doorbell) return Status::ResourceExhausted(fmt::format("eventfd: {}", ErrnoText(errno)));
  UniqueFd client_doorbell(fcntl(doorbell.get(), F_DUPFD_CLOEXEC, 0));
  if (!client_doorbell) return Status::ResourceExhausted(fmt::format("dup of the doorbell: {}", ErrnoText(errno)));
  Created out;
  out.consumer.reset(new RingConsumer(std::move(mapping), geometry, std::move(doorbell)));
  out.memfd = std::move(memfd);
  out.doorbell = std::move(client_doorbell);
  return out;
}

RingConsumer::RingConsumer(RingMapping mapping, const RingGeometry& geometry, UniqueFd doorbell)
    : mapping_(std::move(mapping)), geometry_(geometry), doorbell_(std::move(doorbell)) {}

RingConsumer::Taken RingConsumer::Take() {
  Taken out;
  RingHeader* h = header();
  const uint32_t entries = geometry_.submit_entries;
  const uint32_t tail = h->submit_tail.value.load(std::memory_order_acquire);
  if (tail == submit_head_) return out;
  if (tail - submit_head_ > entries) {
    // Nothing in the ring can be trusted. Say so once per completion slot; a client that keeps doing it
    // without reading its completions gets no more (bounded memory).
    out.kind = Taken::kCorrupt;
    out.error = Status::InvalidArgument(fmt::format("submit_tail {} is {} entries past head {}; the ring holds {}",
                                                    tail, tail - submit_head_, submit_head_, entries));
    submit_head_ = tail;
    h->submit_head.value.store(tail, std::memory_order_release);
    if (inflight_.load(std::memory_order_acquire) < geometry_.completion_entries) {
      inflight_.fetch_add(1, std::memory_order_acq_rel);
      out.counted = true;
    }
    return out;
  }
  if (inflight_.load(std::memory_order_acquire) >= geometry_.completion_entries) return out;
  const auto* ring = reinterpret_cast<const SubmitDescriptor*>(mapping_.base() + geometry_.submit_offset());
  std::memcpy(&out.descriptor, &ring[submit_head_ & (entries - 1)], sizeof(SubmitDescriptor));
  ++submit_head_;
  h->submit_head.value.store(submit_head_, std::memory_order_release);
  inflight_.fetch_add(1, std::memory_order_acq_rel);
  out.kind = Taken::kDescriptor;
  return out;
}

bool RingConsumer::PendingSubmissions() const {
  if (inflight_.load(std::memory_order_acquire) >= geometry_.completion_entries) return false;
  return header()->submit_tail.value.load(std::memory_order_seq_cst) != submit_head_;
}

bool RingConsumer::FlushLocked() {
  if (overflow_.empty()) return false;
  const uint32_t entries = geometry_.completion_entries;
  // The client's head is untrusted: a head "ahead" of our tail reads as a huge distance, i.e. a full ring, so a
  // scribbled head can only hold completions back, never overwrite unread ones.
  const uint32_t head = header()->completion_head.value.load(std::memory_order_acquire);
  auto* ring = reinterpret_cast<CompletionDescriptor*>(mapping_.base() + geometry_.completion_offset());
  bool wrote = false;
  while (!overflow_.empty() && completion_tail_ - head < entries) {
    const CompletionDescriptor& c = overflow_.front();
    ring[completion_tail_ & (entries - 1)] = c;
    if ((c.flags & kCompletionFlagLayerDone) == 0) {
      inflight_.fetch_sub(1, std::memory_order_acq_rel);
    } else {
      --queued_progress_;
    }
    overflow_.pop_front();
    ++completion_tail_;
    wrote = true;
  }
  if (wrote) header()->completion_tail.value.store(completion_tail_, std::memory_order_seq_cst);
  return wrote;
}

void RingConsumer::Post(const CompletionDescriptor& completion) {
  bool wrote;
  {
    MutexLock lock(&mu_);
    if (closed_) return;
    if ((completion.flags & kCompletionFlagLayerDone) != 0) {
      if (queued_progress_ >= kMaxQueuedProgressPerSlot * geometry_.completion_entries) {
        ++dropped_progress_;
        return;
      }
      ++queued_progress_;
    }
    overflow_.push_back(completion);
    wrote = FlushLocked();
  }
  // Pairs with the client's announce-then-recheck (RingSubmitter::Wait): the tail store above and this load
  // are both seq_cst, so either the client sees the new tail or we see it waiting.
  if (wrote && header()->client_waiting.value.load(std::memory_order_seq_cst) != 0) {
    FutexWakeAll(&header()->completion_tail.value);
  }
}

bool RingConsumer::Flush() {
  bool wrote;
  {
    MutexLock lock(&mu_);
    wrote = FlushLocked();
  }
  if (wrote && header()->client_waiting.value.load(std::memory_order_seq_cst) != 0) {
    FutexWakeAll(&header()->completion_tail.value);
  }
  return wrote;
}

bool RingConsumer::HasBacklog() const {
  MutexLock lock(&mu_);
  return !overflow_.empty();
}

void RingConsumer::Close() {
  MutexLock lock(&mu_);
  closed_ = true;
  overflow_.clear();
  queued_progress_ = 0;
}

size_t RingConsumer::backlog() const {
  MutexLock lock(&mu_);
  return overflow_.size();
}

uint64_t RingConsumer::dropped_progress() const {
  MutexLock lock(&mu_);
  return dropped_progress_;
}

bool RingConsumer::Park() {
  // Pairs with the client's store of its tail and load of this flag (RingSubmitter::Push): either the client
  // sees the flag and rings the doorbell, or this re-check sees its submission.
  header()->daemon_parked.value.store(1, std::memory_order_seq_cst);
  return !PendingSubmissions();
}

void RingConsumer::Unpark() { header()->daemon_parked.value.store(0, std::memory_order_seq_cst); }

void RingConsumer::DrainDoorbell() {
  uint64_t rung;
  ssize_t ignored = read(doorbell_.get(), &rung, sizeof(rung));
  (void)ignored;
}

}  // namespace flexkv::ring
