// RingSubmitter: the client's end of one session's rings (common/ring_layout.h, docs/protocol.md "Session
// rings"): pushes submissions, rings the doorbell only while the daemon is parked, reaps completions, and waits
// for completions (WaitPolicy below).
#pragma once

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "common/clock.h"
#include "common/ring/ring_memory.h"
#include "common/ring_layout.h"
#include "common/unique_fd.h"
#include "flexkv/status.h"

namespace flexkv::ring {

// How a thread waits for a completion: spin on the completion index (`pause`) for `pure_spin_ns`, then keep
// polling but call sched_yield between polls until `spin_ns`, then sleep on the futex. The yield lets a thread
// that shares the waiter's CPU (the daemon's poller, or the client whose answer is ready) run at once. Kept
// after measuring alternatives on a 2-core VM with 16 engine processes (docs/performance.md, "Ring transport and
// waiting policy"): waiters that sleep at once, or stop spinning after a spin ran out or was preempted, made the
// tail worse (a futex wake-up costs tens of microseconds there), and so did a poller at a higher scheduling
// weight (it then keeps its CPU while it yields, and the yielding clients share the other one).
struct WaitPolicy {
  int64_t pure_spin_ns = 2000;
  int64_t spin_ns = 50000;
};

class RingSubmitter {
 public:
  // Maps the ring memfd the daemon sent and checks its header (magic, version, geometry, size).
  // FAILED_PRECONDITION when the layout is not one this library speaks (kMinRingLayoutVersion..kRingLayoutVersion).
  static Result<std::unique_ptr<RingSubmitter>> Map(UniqueFd ring_memfd, UniqueFd doorbell,
                                                    WaitPolicy policy = {});
  RingSubmitter(const RingSubmitter&) = delete;
  RingSubmitter& operator=(const RingSubmitter&) = delete;

  // Submitting and reaping: not thread-safe; the caller serializes them (one lock around both).
  //
  // Publishes `d` and rings the doorbell when the daemon is parked. False when the submit ring is full.
  bool Push(const SubmitDescriptor& d);
  // Hands every completion the daemon has posted to `on_completion` (a copy, message NUL-terminated) and gives
  // their slots back. Returns how many.
  template <typename OnCompletion>  // void(const CompletionDescriptor&)
  size_t Reap(OnCompletion&& on_completion);
  uint8_t* arena() const { return mapping_.base() + header()->arena_offset; }
  uint64_t arena_bytes() const { return arena_bytes_; }
  uint32_t submit_entries() const { return submit_entries_; }
  uint32_t completion_entries() const { return completion_entries_; }

  // The daemon's pin lease (0: pins never lapse), read once from the header. The client renews it with
  // Heartbeat (any thread) while the process runs: the daemon looks only at whether the value changed.
  uint32_t pin_lease_ms() const { return pin_lease_ms_; }
  // The daemon's ring layout version, read once from the header: what its requests may carry (common/ring_layout.h).
  uint32_t layout_version() const { return layout_version_; }
  void Heartbeat(uint64_t now_ms) { header()->client_heartbeat_ms.store(now_ms, std::memory_order_relaxed); }

  // Wakes every thread sleeping in Wait now, so it re-checks `ready` and `peer_gone` at once (e.g. the session
  // was dropped) instead of at the end of its sleep. Thread-safe.
  void WakeWaiters() { FutexWakeAll(&header()->completion_tail.value); }

  // Waiting: thread-safe, any number of threads.
  enum class WaitEnd { kReady, kDeadline, kPeerGone };
  // Calls `ready` (which reaps and checks, under the caller's lock) until it returns true, the monotonic
  // deadline passes, or `peer_gone` (asked only before sleeping) says the daemon closed the session. Spins, then
  // sleeps on the completion index as the policy says; a sleep never outlasts 20 ms, so `peer_gone` is asked at
  // least that often.
  template <typename Ready, typename PeerGone>  // bool()
  WaitEnd Wait(Ready&& ready, PeerGone&& peer_gone, int64_t deadline_ns);

 private:
  RingSubmitter(RingMapping mapping, UniqueFd doorbell, WaitPolicy policy);
  RingHeader* header() const { return mapping_.header(); }
  static constexpr int64_t kMaxSleepNs = 20'000'000;  // how often a sleeping waiter asks whether the daemon is gone

  const RingMapping mapping_;
  const UniqueFd doorbell_;
  const WaitPolicy policy_;
  uint32_t submit_entries_ = 0;      // copied from the header once checked: the daemon's, but kept constant
  uint32_t completion_entries_ = 0;
  uint64_t arena_bytes_ = 0;
  uint32_t pin_lease_ms_ = 0;
  uint32_t layout_version_ = 0;
  uint32_t submit_tail_ = 0;         // caller-serialized
  uint32_t completion_head_ = 0;     // caller-serialized
};

// Hot path: defined here so that the callbacks inline.
template <typename OnCompletion>
size_t RingSubmitter::Reap(OnCompletion&& on_completion) {
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

template <typename Ready, typename PeerGone>
RingSubmitter::WaitEnd RingSubmitter::Wait(Ready&& ready, PeerGone&& peer_gone, int64_t deadline_ns) {
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
    // peer_gone again: a session dropped (WakeWaiters) between the check above and the announce is seen here
    // instead of after a whole sleep.
    if (h->completion_tail.value.load(std::memory_order_seq_cst) == seen && !peer_gone()) {
      FutexWait(&h->completion_tail.value, seen, std::min(deadline_ns - now, kMaxSleepNs));
    }
    h->client_waiting.value.fetch_sub(1, std::memory_order_seq_cst);
    spin_start = NowNs();
  }
}

}  // namespace flexkv::ring
