// RingConsumer: the daemon's end of one session's rings (common/ring_layout.h, docs/protocol.md "Session
// rings"): takes submissions, posts completions (queueing them while the completion ring is full), wakes the
// client threads that sleep on the completion index, and parks/unparks with the doorbell handshake.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"
#include "common/ring/ring_memory.h"
#include "common/ring_layout.h"
#include "common/unique_fd.h"
#include "flexkv/status.h"

namespace flexkv::ring {

// Everything the consumer reads from the mapping is untrusted: the client maps it writable and may scribble
// on any of it. Indices the client writes are checked against the ring's size; the consumer's own indices
// (submit head, completion tail) are kept here and only ever written to the mapping, never read back.
//
// Threads: Take, Park, Unpark, DrainDoorbell and PendingSubmissions belong to one polling thread. Post, Flush,
// Close, HasBacklog and inflight() may be called from any thread. Post never blocks on the client.
class RingConsumer {
 public:
  struct Created {
    std::unique_ptr<RingConsumer> consumer;
    UniqueFd memfd;     // sealed (no shrink, grow or more seals): send it to the client
    UniqueFd doorbell;  // a dup of the consumer's eventfd: send it to the client
  };
  // Creates, sizes, seals and maps the ring memfd and writes its header. The consumer starts parked (the
  // client rings the doorbell) until the poller first calls Unpark. `pin_lease_ms` goes into the header for the
  // client's heartbeat (0: pins never lapse). RESOURCE_EXHAUSTED or INTERNAL with the failing call when the
  // kernel refuses.
  static Result<Created> Create(const RingGeometry& geometry, uint32_t pin_lease_ms = 0);
  ~RingConsumer() = default;
  RingConsumer(const RingConsumer&) = delete;
  RingConsumer& operator=(const RingConsumer&) = delete;

  // One step of Take.
  struct Taken {
    enum Kind {
      kNone,        // nothing to take now (ring empty, or as many requests in flight as completions fit)
      kDescriptor,  // `descriptor` is a private copy, not yet validated; it counts as in flight
      kCorrupt,     // the client's submit tail is beyond what the ring holds; `error` says how. Everything
                    // queued was skipped. When `counted`, one request is in flight for the caller to fail
                    // (user_data 0); otherwise the client has that many failures unread already.
    };
    Kind kind = kNone;
    SubmitDescriptor descriptor{};
    Status error;
    bool counted = false;
  };
  // Takes the next submission. Back-pressure: never more requests in flight than the completion ring holds,
  // so that every accepted request's final completion fits once the client reaps.
  Taken Take();
  // True when a submission is waiting that Take would hand out.
  bool PendingSubmissions() const;

  // Posts a completion: to the ring, or to the overflow queue behind earlier ones while the ring is full
  // (Flush retries). A final completion (not kCompletionFlagLayerDone) ends one request in flight when it
  // reaches the ring. Wakes a client that announced itself waiting. Dropped after Close.
  // Memory a client can make the daemon hold is bounded: final completions by the in-flight limit (one per
  // completion slot), layer-progress completions by kMaxQueuedProgressPerSlot per slot; progress beyond that is
  // dropped while the client does not reap (it only ever delays layer news: the final completion tells every layer
  // landed, and a later progress completion supersedes an earlier one).
  void Post(const CompletionDescriptor& completion) ABSL_LOCKS_EXCLUDED(mu_);
  // Moves queued completions into the ring as far as the client has made room. Returns whether it moved any.
  bool Flush() ABSL_LOCKS_EXCLUDED(mu_);
  // Completions waiting for ring space (the client is not reaping, e.g. it is stopped).
  bool HasBacklog() const ABSL_LOCKS_EXCLUDED(mu_);
  size_t backlog() const ABSL_LOCKS_EXCLUDED(mu_);
  // Layer-progress completions dropped because the client did not make room for them.
  uint64_t dropped_progress() const ABSL_LOCKS_EXCLUDED(mu_);
  static constexpr size_t kMaxQueuedProgressPerSlot = 4;
  // The session ended: the overflow queue is dropped and later Posts too. The mapping stays until destruction.
  void Close() ABSL_LOCKS_EXCLUDED(mu_);

  // Parking. The poller calls Park before it sleeps on the doorbell: it sets the flag that makes the client
  // ring the doorbell, then looks at the submit tail once more. Returns false when a submission slipped in
  // before the client could have seen the flag: then the poller must not sleep. Unpark clears the flag
  // (clients stop ringing); DrainDoorbell empties the eventfd after a wake-up.
  bool Park();
  void Unpark();
  void DrainDoorbell();
  int doorbell_fd() const { return doorbell_.get(); }

  // The client's heartbeat (RingHeader::client_heartbeat_ms), read once: untrusted, compare it only for change.
  uint64_t client_heartbeat() const { return header()->client_heartbeat_ms.load(std::memory_order_relaxed); }

  // Requests taken and not yet answered by a final completion in the ring.
  uint64_t inflight() const { return inflight_.load(std::memory_order_acquire); }
  const RingGeometry& geometry() const { return geometry_; }
  // The payload arena: the client writes it; read each range once, then validate (DescriptorPayload).
  std::span<const uint8_t> arena() const {
    return {mapping_.base() + geometry_.arena_offset(), geometry_.arena_bytes};
  }

 private:
  RingConsumer(RingMapping mapping, const RingGeometry& geometry, UniqueFd doorbell);
  bool FlushLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  RingHeader* header() const { return mapping_.header(); }

  const RingMapping mapping_;
  const RingGeometry geometry_;
  const UniqueFd doorbell_;
  uint32_t submit_head_ = 0;  // polling thread only; published, never read back from the mapping
  std::atomic<uint64_t> inflight_{0};

  mutable Mutex mu_;
  std::deque<CompletionDescriptor> overflow_ ABSL_GUARDED_BY(mu_);
  uint32_t completion_tail_ ABSL_GUARDED_BY(mu_) = 0;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  size_t queued_progress_ ABSL_GUARDED_BY(mu_) = 0;  // layer-progress entries in overflow_
  uint64_t dropped_progress_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace flexkv::ring
