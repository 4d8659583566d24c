// CudaEngineMemory: the engine-memory backend for KV buffers in GPU memory (CUDA IPC handles, cuMem/VMM fds),
// over CudaBackend (cuda_backend.h). This file builds with or without a CUDA toolkit; without one, or without a
// visible GPU, Create returns nullptr and the daemon runs the host backend only.
#pragma once

#include <memory>

#include "daemon/transfer/cuda/cuda_backend.h"
#include "daemon/transfer/engine_memory.h"

namespace flexkv {

class CudaEngineMemory final : public EngineMemoryBackend {
 public:
  // nullptr when there is no CUDA backend (the reason is logged). `paths`: how bytes move per direction
  // (cuda_backend.h).
  static std::unique_ptr<CudaEngineMemory> Create(const CudaCopyPaths& paths);
  // `load_copy_engine`: loads run on the copy engine, which Open refuses for chunks where it is known slow
  // (copy_path_policy.h).
  explicit CudaEngineMemory(std::unique_ptr<CudaBackend> cuda, bool load_copy_engine = false);

  std::string_view name() const override { return "cuda"; }
  const EngineMemoryCapabilities& capabilities() const override { return capabilities_; }
  std::vector<std::string> devices() const override { return cuda_->DeviceUuids(); }
  // Registers a pool for DMA on every GPU: `pool` spans one pool file's whole data range (every component's
  // sub-pool); only its base and bytes are used. Each CopyJob's `pool` names the sub-pool of its component, inside
  // one registered region.
  Status RegisterPool(const PoolRegion& pool) override;
  void UnregisterPool(const PoolRegion& pool) override { cuda_->UnregisterPool(pool.base); }
  // GpuKvDescription only: one TP rank's buffers. FAILED_PRECONDITION (CheckCopyEngineLoad) when the daemon loads
  // by the copy engine and the geometry's chunks are too small for it.
  Result<std::shared_ptr<EngineKv>> Open(KvRegistration registration, const Geometry& geometry) override;
  Result<std::shared_ptr<LayerEvents>> OpenLayerEvents(const LayerEventsRank& rank) override;
  void Copy(CopyJob job) override;

 private:
  const bool load_copy_engine_;
  const EngineMemoryCapabilities capabilities_;
  const std::unique_ptr<CudaBackend> cuda_;
};

}  // namespace flexkv
