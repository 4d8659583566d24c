// See ring_submitter.h.
#include "common/ring/ring_submitter.h"

#include <fmt/format.h>
#include <sched.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/clock.h"
#include "common/uds.h"

namespace flexkv::ring {
namespace {

constexpr int64_t kMaxSleepNs = 20'000'000;  // how often a sleeping waiter asks whether the daemon is gone

}  // namespace

Result<std::unique_ptr<RingSubmitter>> RingSubmitter::Map(UniqueFd ring_memfd, UniqueFd doorbell,
                                                          WaitPolicy policy) {
  struct stat st {};
  if (fstat(ring_memfd.get(), &st) != 0 || static_cast<uint64_t>(st.st_size) < sizeof(RingHeader)) {
    return Status::Internal("the daemon's ring memfd is too small for a ring header");
  }
  const auto bytes = static_cast<uint64_t>(st.st_size);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, ring_memfd.get(), 0);
  if (p == MAP_FAILED) return Status::ResourceExhausted(fmt::format("mmap rings: {}", ErrnoText(errno)));
  RingMapping mapping(static_cast<uint8_t*>(p), bytes);
  const RingHeader& h = *mapping.header();
  const RingGeometry rg{h.submit_entries, h.completion_entries, h.arena_bytes};
  if (h.magic != kRingMagic || h.layout_version != kRingLayoutVersion || h.submit_entries == 0 ||
      (h.submit_entries & (h.submit_entries - 1)) != 0 || h.completion_entries == 0 ||
      (h.completion_entries & (h.completion_entries - 1)) != 0 || h.submit_offset != rg.submit_offset() ||
      h.completion_offset != rg.completion_offset() || h.arena_offset != rg.arena_offset() ||
      rg.total_bytes() > bytes) {
    return Status::FailedPrecondition(fmt::format(
        "the daemon's ring layout (magic 0x{:x}, version {}) is not what this libflexkv speaks (version {})", h.magic,
        h.layout_version, kRingLayoutVersion));
  }
  std::unique_ptr<RingSubmitter> r(new RingSubmitter(std::move(mapping), std::move(doorbell), policy));
  return r;
}

RingSubmitter::RingSubmitter(RingMapping mapping, UniqueFd doorbell, WaitPolicy policy)
    : mapping_(std::move(mapping)), doorbell_(std::move(doorbell)), policy_(policy) {
  const RingHeader& h = *header();
  submit_entries_ = h.submit_entries;
  completion_entries_ = h.completion_entries;
  arena_bytes_ = h.arena_bytes;
  submit_tail_ = h.submit_tail.value.load(std::memory_order_acquire);
  completion_head_ = h.completion_head.value.load(std::memory_order_acquire);
}

bool RingSubmitter::Push(const SubmitDescriptor& d) {
  RingHeader* h = header();
  const uint32_t head = h->submit_head.value.load(std::memory_order_acquire);
  if (submit_tail_ - head >= submit_entries_) return false;
  auto* ring = reinterpret_cast<SubmitDescriptor*>(mapping_.base() + h->submit_offset);
  ring[submit_tail_ & (submit_entries_ - 1)] = d;
  ++submit_tail_;
  // Pairs with RingConsumer::Park (flag store, then tail load): both seq_cst, so either the daemon's re-check
  // sees this submission or this load sees the flag and the doorbell wakes the daemon.
  h->submit_tail.value.store(submit_tail_, std::memory_order_seq_cst);
  if (h->daemon_parked.value.load(std::memory_order_seq_cst) != 0) {
    const uint64_t one = 1;
    ssize_t ignored = write(doorbell_.get(), &one, sizeof(one));
    (void)ignored;
  }
  return true;
}

size_t RingSubmitter::Reap(const std::function<void(const CompletionDescriptor&)>& on_completion) {
  RingHeader* h = header();
  const uint32_t tail = h->completion_tail.value.load(std::memory_order_acquire);
  if (tail == completion_head_) return 0;
  const auto* ring = reinterpret_cast<const CompletionDescriptor*>(mapping_.base() + h->completion_offset);
  size_t n = 0;
  while (completion_head_ != tail) {
    CompletionDescriptor c = ring[completion_head_ & (completion_entries_ - 1)];
    ++completion_head_;
    c.message[sizeof(c.message) - 1] = '\0';
    on_completion(c);
    ++n;
  }
  h->completion_head.value.store(completion_head_, std::memory_order_release);
  return n;
}

RingSubmitter::WaitEnd RingSubmitter::Wait(const std::function<bool()>& ready, const std::function<bool()>& peer_gone,
                                           int64_t deadline_ns) {
  RingHeader* h = header();
  int64_t spin_start = NowNs();
  for (;;) {
    // Loaded before `ready` reaps: a completion posted after the reap moves the tail past `seen`, so the futex
    // below does not sleep through it.
    const uint32_t seen = h->completion_tail.value.load(std::memory_order_acquire);
    if (ready()) return WaitEnd::kReady;
    const int64_t now = NowNs();
    if (now >= deadline_ns) return WaitEnd::kDeadline;
    if (now - spin_start < policy_.pure_spin_ns) {
      CpuRelax();
      continue;
    }
    if (now - spin_start < policy_.spin_ns) {
      sched_yield();
      continue;
    }
    if (peer_gone()) return ready() ? WaitEnd::kReady : WaitEnd::kPeerGone;
    // Announce, then re-check (pairs with RingConsumer::Post: tail store, then this counter's load; both
    // seq_cst): either the daemon sees us waiting and wakes us, or we see its new tail and do not sleep.
    h->client_waiting.value.fetch_add(1, std::memory_order_seq_cst);
    if (h->completion_tail.value.load(std::memory_order_seq_cst) == seen) {
      FutexWait(&h->completion_tail.value, seen, std::min(deadline_ns - now, kMaxSleepNs));
    }
    h->client_waiting.value.fetch_sub(1, std::memory_order_seq_cst);
    spin_start = NowNs();
  }
}

}  // namespace flexkv::ring
