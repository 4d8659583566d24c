// EngineMemoryBackends: the engine-memory backends this daemon runs, and the choice among them by what they
// declared. Filled at startup (daemon/daemon.cc: one Add line per backend), then read by the data plane.
#pragma once

#include <map>
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
  // backend serves when none does. A backend whose RegisterPool failed for the region holding `pool_base` (the
  // session's domain's pool; null: for any region) answers that error instead. Thread-safe.
  Result<EngineMemoryBackend*> Select(std::span<const MemoryKind> kinds, const uint8_t* pool_base = nullptr) const;

  // A pool region announced itself: every backend registers it, once per region (by its base). A failure is
  // logged, kept (Select answers it for that backend and that region) and returned (the first backend's), so that
  // a pool growing into the region can give it back; UnregisterPool forgets it. Thread-safe.
  Status RegisterPool(const PoolRegion& pool);
  // The region goes (see EngineMemoryBackend::UnregisterPool): every backend that registered it undoes exactly
  // that registration; other regions stay registered.
  void UnregisterPool(const PoolRegion& pool);

  // The first backend that declared layer_events (records CUDA layer events); FAILED_PRECONDITION naming the
  // backends there are when none did. Thread-safe.
  Result<EngineMemoryBackend*> SelectLayerEvents() const;

  // In the order they were added.
  std::vector<const EngineMemoryBackend*> List() const;

 private:
  struct Entry {
    std::unique_ptr<EngineMemoryBackend> backend;
    // Each registered region by its base: the region and how its RegisterPool went.
    std::map<const uint8_t*, std::pair<PoolRegion, Status>> pools;
  };
  mutable Mutex mu_;
  std::vector<Entry> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flexkv
