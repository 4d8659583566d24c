// RingSubmitter: the client's end of one session's rings (common/ring_layout.h, docs/protocol.md "Session
// rings"): pushes submissions, rings the doorbell only while the daemon is parked, reaps completions, and waits
// for completions with the waiting policy (WaitPolicy below).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include "common/ring/ring_memory.h"
#include "common/ring_layout.h"
#include "common/unique_fd.h"
#include "flexkv/status.h"

namespace flexkv::ring {

// How a thread waits for a completion. Spinning answers in well under a microsecond when the waiter and the
// daemon's poller each have a core; when more threads want the CPUs than there are cores, a spinning waiter
// takes a core from the poller or from the client whose answer is ready, and the tail grows to the scheduler's
// time slices. So the waiter spins only while spinning pays: a spin that was preempted (a poll that came back
// much later than the previous one) or that ran out without an answer turns spinning off for this ring, and
// waits then sleep on the futex at once; spinning is tried again after `probe_every` sleeping waits.
// Thread-safe (atomics only).
class WaitPolicy {
 public:
  struct Options {
    int64_t spin_ns = 20000;        // longest spin before sleeping
    int64_t preempted_ns = 5000;    // a gap this long between two polls means another thread had our CPU
    uint32_t probe_every = 64;      // while spinning is off: one wait in this many spins again
    int64_t pure_spin_ns = 2000;    // then spin with sched_yield between polls
  };
  WaitPolicy() = default;
  explicit WaitPolicy(const Options& options) : options_(options) {}

  // How long the next wait may spin (0: sleep at once).
  int64_t SpinBudgetNs();
  // After a wait: whether its spin got the answer, and whether it was preempted while spinning.
  void Record(bool answered_while_spinning, bool preempted);
  const Options& options() const { return options_; }

 private:
  Options options_;
  std::atomic<uint32_t> sleeping_waits_{0};  // > 0: spinning is off; counts the waits since it was turned off
};

class RingSubmitter {
 public:
  // Maps the ring memfd the daemon sent and checks its header (magic, version, geometry, size).
  // FAILED_PRECONDITION when the layout is not the one this library speaks.
  static Result<std::unique_ptr<RingSubmitter>> Map(UniqueFd ring_memfd, UniqueFd doorbell,
                                                    WaitPolicy::Options policy = {});
  RingSubmitter(const RingSubmitter&) = delete;
  RingSubmitter& operator=(const RingSubmitter&) = delete;

  // Submitting and reaping: not thread-safe; the caller serializes them (one lock around both).
  //
  // Publishes `d` and rings the doorbell when the daemon is parked. False when the submit ring is full.
  bool Push(const SubmitDescriptor& d);
  // Hands every completion the daemon has posted to `on_completion` (a copy, message NUL-terminated) and gives
  // their slots back. Returns how many.
  size_t Reap(const std::function<void(const CompletionDescriptor&)>& on_completion);
  uint8_t* arena() const { return mapping_.base() + header()->arena_offset; }
  uint64_t arena_bytes() const { return arena_bytes_; }
  uint32_t submit_entries() const { return submit_entries_; }
  uint32_t completion_entries() const { return completion_entries_; }

  // Waiting: thread-safe, any number of threads.
  enum class WaitEnd { kReady, kDeadline, kPeerGone };
  // Calls `ready` (which reaps and checks, under the caller's lock) until it returns true, the monotonic
  // deadline passes, or `peer_gone` (asked only before sleeping) says the daemon closed the session. Spins or
  // sleeps on the completion index as the policy says; a sleep never outlasts 20 ms, so `peer_gone` is asked
  // at least that often.
  WaitEnd Wait(const std::function<bool()>& ready, const std::function<bool()>& peer_gone, int64_t deadline_ns);

 private:
  RingSubmitter(RingMapping mapping, UniqueFd doorbell, WaitPolicy::Options policy);
  RingHeader* header() const { return mapping_.header(); }

  const RingMapping mapping_;
  const UniqueFd doorbell_;
  WaitPolicy policy_;
  uint32_t submit_entries_ = 0;      // copied from the header once checked: the daemon's, but kept constant
  uint32_t completion_entries_ = 0;
  uint64_t arena_bytes_ = 0;
  uint32_t submit_tail_ = 0;         // caller-serialized
  uint32_t completion_head_ = 0;     // caller-serialized
};

}  // namespace flexkv::ring
