// SessionRings: a session's rings as libflexkv uses them — tickets, the payload arena's allocator, results
// by ticket — over the ring transport's client end (common/ring/ring_submitter.h), which owns the protocol and
// the waiting policy. Thread-safe. Internal to libflexkv.
#pragma once

#include <atomic>

#include <chrono>
#include <functional>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <unordered_map>

#include "common/ring/ring_submitter.h"
#include "common/ring_layout.h"
#include "common/unique_fd.h"
#include "flexkv/client.h"

namespace flexkv {

class SessionRings {
 public:
  // Maps the ring memfd the daemon sent and checks its header.
  static Result<std::unique_ptr<SessionRings>> Map(UniqueFd ring_memfd, UniqueFd doorbell, int channel_fd);
  ~SessionRings();
  SessionRings(const SessionRings&) = delete;
  SessionRings& operator=(const SessionRings&) = delete;

  // Copies `payload` into the arena (keys at offset 0 of it, then ids), fills the descriptor's offsets
  // and submits. RESOURCE_EXHAUSTED when the rings or the arena are full.
  Result<Ticket> Submit(RingOp op, uint16_t flags, uint32_t count, std::span<const BlockKey> keys,
                        std::span<const uint32_t> ids, uint64_t match_handle);
  Result<OpResult> Wait(Ticket ticket, std::chrono::microseconds timeout);
  Result<uint32_t> WaitLayers(Ticket ticket, uint32_t layers, std::chrono::microseconds timeout);
  std::optional<OpResult> TryWait(Ticket ticket);
  // The Client dropped this session (Detach, or re-Attach after the daemon lost it) and is about to close the
  // channel fd: waits still running on these rings end with UNAVAILABLE instead of polling that fd.
  void Abandon() { abandoned_.store(true); }

 private:
  SessionRings() = default;
  void ReapLocked();
  std::optional<uint64_t> AllocLocked(uint64_t bytes);
  void FreeLocked(uint64_t offset, uint64_t bytes);
  bool DaemonGone() const;
  // Waits (the transport's policy) until `ready` (called under mu_ after a reap) returns true or the deadline
  // passes.
  Status WaitUntil(const std::function<bool()>& ready, std::chrono::steady_clock::time_point deadline,
                   uint64_t ticket);

  std::unique_ptr<ring::RingSubmitter> ring_;
  int channel_fd_ = -1;  // owned by the Client; watched for hang-up until Abandon
  std::atomic<bool> abandoned_{false};

  std::mutex mu_;
  uint64_t next_ticket_ = 1;                                         // guarded by mu_
  std::map<uint64_t, uint64_t> free_;                                // offset → bytes; guarded by mu_
  std::unordered_map<uint64_t, std::pair<uint64_t, uint64_t>> arena_of_;  // ticket → (offset, bytes)
  std::unordered_map<uint64_t, OpResult> done_;                      // guarded by mu_
  std::unordered_map<uint64_t, uint32_t> layers_landed_;             // layer-wise loads; guarded by mu_
  size_t inflight_ = 0;                                              // guarded by mu_
};

}  // namespace flexkv
