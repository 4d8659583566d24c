// SessionRings: a session's rings as libflexkv uses them — tickets and what state each is in, the payload arena's
// allocator, results by ticket — over the ring transport's client end (common/ring/ring_submitter.h), which owns
// the protocol and the waiting policy. Thread-safe. Internal to libflexkv.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"
#include "common/ring/ring_submitter.h"
#include "common/ring_layout.h"
#include "common/unique_fd.h"
#include "flexkv/client.h"

namespace flexkv {

// Renews a session's pin lease while the process runs (docs/protocol.md "Pins"): a thread that calls `beat` at
// once and then every `interval` until Stop or destruction. A stopped process stops beating, and the daemon
// releases its pins once the lease runs out. Thread-safe.
class LeaseRenewer {
 public:
  LeaseRenewer(std::chrono::milliseconds interval, std::function<void()> beat);
  ~LeaseRenewer() { Stop(); }
  LeaseRenewer(const LeaseRenewer&) = delete;
  LeaseRenewer& operator=(const LeaseRenewer&) = delete;
  // Ends and joins the thread; idempotent. After it returns, `beat` is not called again.
  void Stop();

 private:
  Mutex mu_;
  std::condition_variable wake_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_ ABSL_GUARDED_BY(mu_);  // moved out by the first Stop
};

// Whether a daemon of ring layout `layout_version` takes a Load's launch deadline (layout 6 added it: an older daemon
// ignores the word, and could start the copies after the client gave up on them). OK for a deadline of 0 or a daemon
// of layout 6 on; else FAILED_PRECONDITION naming both layouts, for the caller to return before it sends anything.
Status CheckLaunchDeadlineLayout(uint32_t layout_version, int64_t launch_deadline_ns);

class SessionRings {
 public:
  // Maps the ring memfd the daemon sent and checks its header. `channel` is this session's channel (a dup of it:
  // the rings own it, so the fd a wait polls for hang-up stays this session's for as long as the rings live).
  static Result<std::unique_ptr<SessionRings>> Map(UniqueFd ring_memfd, UniqueFd doorbell, UniqueFd channel);
  ~SessionRings();
  SessionRings(const SessionRings&) = delete;
  SessionRings& operator=(const SessionRings&) = delete;

  // Copies `payload` into the arena (keys at offset 0 of it, then ids), fills the descriptor's offsets
  // and submits. `parent` is a Store's (kRootParent for every other opcode). The descriptor's last two words
  // (common/ring_layout.h): `word56` a hybrid Store's state_count or a Load's first_block, `word60` a Load's
  // event_set or a hybrid Store's window_keys (ids laid out by LayoutIds, common/hybrid_ids.h; 0 otherwise).
  // `launch_deadline_ns`: a Load's (layout 6; 0: none), in the word a keyed request's keys_offset is in. RESOURCE_EXHAUSTED when the rings or
  // the arena are full. The ticket's id counts from 1 per rings; its generation is left 0 (the Client stamps its
  // session's generation and checks it before it hands a ticket back here: these calls look at ticket.id only).
  Result<Ticket> Submit(RingOp op, uint16_t flags, uint32_t count, std::span<const BlockKey> keys,
                        std::span<const uint32_t> ids, uint64_t match_handle, const BlockKey& parent,
                        uint32_t word56 = 0, uint32_t word60 = 0, int64_t launch_deadline_ns = 0)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The daemon's ring layout version (kMinRingLayoutVersion..kRingLayoutVersion): a layout-4 daemon takes no
  // first_block and no window_keys, a layout-4 or -5 one no launch deadline.
  uint32_t layout_version() const { return ring_->layout_version(); }
  // The request's result, handed out once. Errors: NOT_FOUND for an id these rings never issued or whose
  // result an earlier Wait/TryWait already took (the message says which); DEADLINE_EXCEEDED when it has not
  // ended in time (still in flight); UNAVAILABLE when the daemon closed the session; the Abandon status.
  Result<OpResult> Wait(Ticket ticket, std::chrono::microseconds timeout) ABSL_LOCKS_EXCLUDED(mu_);
  // Layers landed of a layer-wise load (all of them once it ended, also when its result was taken); errors as
  // Wait's, NOT_FOUND only for an id never issued.
  Result<uint32_t> WaitLayers(Ticket ticket, uint32_t layers, std::chrono::microseconds timeout)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A Load naming a layer-event set: OK once the daemon reported every copy and event record enqueued
  // (kCompletionFlagLaunched), or once the request ended OK (also when its result was taken: the caller saw it);
  // the request's own error when it ended with one (its result stays for Wait); errors as WaitLayers'.
  Status WaitLaunched(Ticket ticket, std::chrono::microseconds timeout) ABSL_LOCKS_EXCLUDED(mu_);
  // Wait without waiting: the result, or nullopt while the request is in flight; errors as Wait's.
  Result<std::optional<OpResult>> TryWait(Ticket ticket) ABSL_LOCKS_EXCLUDED(mu_);
  // The Client dropped this session (Detach, or re-Attach after the daemon lost it): waits running on these
  // rings, and calls made on them later, end with `why` (not OK) unless their result is already here. The pin
  // lease is no longer renewed.
  void Abandon(Status why) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // The whole arena free, nothing issued yet.
  SessionRings(std::unique_ptr<ring::RingSubmitter> ring, UniqueFd channel);
  // Takes the completions the daemon posted (OnCompletionLocked each).
  void ReapLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnCompletionLocked(const CompletionDescriptor& c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::optional<uint64_t> AllocLocked(uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreeLocked(uint64_t offset, uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool DaemonGone() const;
  enum class TicketState { kInFlight, kEnded, kTaken, kNeverIssued };
  TicketState StateLocked(uint64_t id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // NOT_FOUND naming why `id` has no result to wait for (kTaken or kNeverIssued).
  Status NoResultLocked(uint64_t id, TicketState state) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves an ended request's result out of done_ (state kEnded).
  OpResult TakeLocked(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The status to end a call with once the session is abandoned or gone.
  Status GoneStatus() ABSL_LOCKS_EXCLUDED(mu_);
  // Waits (the transport's policy) until `ready` (called under mu_ after a reap: a lambda annotated
  // ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_)) returns true or the deadline passes; then OK, DEADLINE_EXCEEDED, or
  // GoneStatus() when the daemon closed the session.
  template <typename Ready>
  Status WaitUntil(Ready&& ready, std::chrono::steady_clock::time_point deadline, uint64_t ticket)
      ABSL_LOCKS_EXCLUDED(mu_);

  std::unique_ptr<ring::RingSubmitter> ring_;
  // Beats while the rings live and are not abandoned; after ring_, so it stops before the mapping goes.
  std::unique_ptr<LeaseRenewer> renewer_;
  UniqueFd channel_;  // a dup of the session channel, watched for hang-up
  std::atomic<bool> abandoned_{false};
  Status abandon_status_ ABSL_GUARDED_BY(mu_);  // set once, before abandoned_

  Mutex mu_;
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, uint64_t> free_ ABSL_GUARDED_BY(mu_);  // offset → bytes
  // ticket → (offset, bytes)
  std::unordered_map<uint64_t, std::pair<uint64_t, uint64_t>> arena_of_ ABSL_GUARDED_BY(mu_);
  // Every ticket issued whose result was not taken yet: nullopt while in flight (its final completion not reaped),
  // then its result.
  std::unordered_map<uint64_t, std::optional<OpResult>> done_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<uint64_t, uint32_t> layers_landed_ ABSL_GUARDED_BY(mu_);  // layer-wise loads
  std::unordered_set<uint64_t> launched_ ABSL_GUARDED_BY(mu_);                 // event-set loads launched
  size_t inflight_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace flexkv
