// SessionKv: the engine KV buffers one session registered - the backend that opened them (picked by the memory
// kinds the registration needs, among what the backends declared) and its registrations: one holding whole
// blocks, or one per TP rank on a backend that shards by rank. Thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"
#include "daemon/dataplane/copy_scheduler.h"
#include "daemon/transfer/engine_memory_backends.h"
#include "flexkv/geometry.h"

namespace flexkv {

class SessionKv {
 public:
  SessionKv(uint64_t session_id, const Geometry& geometry) : session_id_(session_id), geometry_(geometry) {}

  // Opens `registration` on the backend that serves its memory kinds and keeps it. Returns the bytes the layout
  // needs on one TP rank. Refusals: FAILED_PRECONDITION when no backend serves the kinds (naming them);
  // ALREADY_EXISTS when the session registered whole blocks already, or this TP rank, or buffers of another
  // backend; INVALID_ARGUMENT for a TP rank not below tp_size; the backend's own refusals from Open; a backend's
  // failed registration of the pool at `pool_base` (the session's domain's; null: any pool) (Select).
  Result<uint64_t> Register(EngineMemoryBackends& backends, KvRegistration registration,
                            const uint8_t* pool_base = nullptr);

  // The KV buffers' block count once registered (whole blocks, or the fewest of every TP rank); 0 with the
  // reason in `*missing` otherwise. Registration only goes from nothing to every block, so a count read here
  // still holds when a later copy runs.
  uint32_t RegisteredBlocks(std::string* missing) const;

  // The backend and registrations a copy in `direction` uses: every TP rank, except for a store of MLA KV
  // (identical on every rank: stored once, from rank 0). Sets `request->backend` and `request->targets`.
  void FillTargets(CopyRequest* request) const;

 private:
  // ALREADY_EXISTS / INVALID_ARGUMENT when `backend` may not add a registration for `tp_rank` now.
  Status CheckFreeLocked(const EngineMemoryBackend& backend, uint32_t tp_rank) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint64_t session_id_;
  const Geometry geometry_;
  mutable Mutex mu_;
  EngineMemoryBackend* backend_ ABSL_GUARDED_BY(mu_) = nullptr;
  // Whole blocks: one entry. Per TP rank: tp_size entries, null until that rank registered.
  std::vector<std::shared_ptr<EngineKv>> registrations_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flexkv
