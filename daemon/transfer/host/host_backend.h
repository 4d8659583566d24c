// HostBackend: the engine-memory backend for KV buffers in host memory (a sealed memfd the engine shares with the
// daemon): CPU-only engines and every CI test. Copies run on its own worker threads, a request's blocks split
// over them.
#pragma once

#include <memory>

#include "daemon/transfer/engine_memory.h"
#include "daemon/transfer/host/worker_pool.h"

namespace flexkv {

class HostBackend final : public EngineMemoryBackend {
 public:
  // `copy_threads` 0: one per core, at least 2.
  explicit HostBackend(unsigned copy_threads);
  // Runs every copy already handed over (each calls its `done`), then joins the workers.
  ~HostBackend() override;

  std::string_view name() const override { return "host"; }
  const EngineMemoryCapabilities& capabilities() const override { return capabilities_; }
  Status RegisterPool(const PoolRegion& pool) override;  // nothing to do: the pool is host memory already
  // HostKvMemory only: maps the memfd (see HostKv::Map for the refusals).
  Result<std::shared_ptr<EngineKv>> Open(KvRegistration registration, const Geometry& geometry) override;
  void Copy(CopyJob job) override;

 private:
  const EngineMemoryCapabilities capabilities_;
  WorkerPool workers_;
};

}  // namespace flexkv
