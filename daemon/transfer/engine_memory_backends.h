// EngineMemoryBackends: the engine-memory backends this daemon runs, and the choice among them by what they
// declared. Filled at startup (daemon/daemon.cc: one Add line per backend), then read by the data plane.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"
#include "daemon/cache/pool_region.h"
#include "daemon/transfer/engine_memory.h"
#include "flexkv/status.h"

namespace flexkv {

class EngineMemoryBackends {
 public:
  EngineMemoryBackends() = default;
  EngineMemoryBackends(const EngineMemoryBackends&) = delete;
  EngineMemoryBackends& operator=(const EngineMemoryBackends&) = delete;

  // Adds a backend; earlier ones are preferred when several serve the same kinds. Startup only: not safe against
  // concurrent lookups. Backends live as long as this set.
  void Add(std::unique_ptr<EngineMemoryBackend> backend);

  // The first backend that declared every kind in `kinds`. FAILED_PRECONDITION naming the kinds and what each
  // backend serves when none does. A backend whose RegisterPool failed answers that error instead. Thread-safe.
  Result<EngineMemoryBackend*> Select(std::span<const MemoryKind> kinds) const;

  // The pool announced itself: every backend registers it, once. A failure is logged and kept (Select answers
  // it for that backend). Thread-safe.
  void RegisterPool(const PoolRegion& pool);
  // The pool goes (see EngineMemoryBackend::UnregisterPool): every backend forgets it, and registers the next one.
  void UnregisterPool();

  // In the order they were added.
  std::vector<const EngineMemoryBackend*> List() const;

 private:
  struct Entry {
    std::unique_ptr<EngineMemoryBackend> backend;
    bool pool_registered = false;
    Status pool_status;
  };
  mutable Mutex mu_;
  std::vector<Entry> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flexkv
