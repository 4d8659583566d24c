// See cuda_engine_memory.h.
#include "daemon/transfer/cuda/cuda_engine_memory.h"

#include "common/clock.h"
#include "daemon/transfer/cuda/copy_path_policy.h"

namespace flexkv {
namespace {

EngineMemoryCapabilities CudaCapabilities() {
  EngineMemoryCapabilities caps;
  caps.memory_kinds = {MemoryKind::kCudaIpc, MemoryKind::kCudaVmm};
  caps.to_pool = true;
  caps.from_pool = true;
  caps.layerwise = true;
  caps.per_tp_rank = true;
  caps.store_checksums = true;  // the gather kernel sums as it stores; copy-engine stores by a kernel beside the copy
  caps.layer_events = true;     // loads record the engine's interprocess events per layer (OpenLayerEvents)
  return caps;
}

// An opened GPU registration; the GpuKv (and its IPC/VMM mappings) goes with the last copy holding it.
class CudaKv final : public EngineKv {
 public:
  explicit CudaKv(std::shared_ptr<GpuKv> gpu) : gpu_(std::move(gpu)) {}
  uint32_t num_blocks() const override { return GpuKvNumBlocks(*gpu_); }
  uint32_t tp_rank() const override { return GpuKvTpRank(*gpu_); }
  const std::shared_ptr<GpuKv>& gpu() const { return gpu_; }

 private:
  const std::shared_ptr<GpuKv> gpu_;
};

// One TP rank's layer events opened by the CUDA backend; closed with the last holder.
class OpenedLayerEvents final : public LayerEvents {
 public:
  explicit OpenedLayerEvents(std::shared_ptr<GpuLayerEvents> events) : events_(std::move(events)) {}
  uint32_t tp_rank() const override { return GpuLayerEventsTpRank(*events_); }
  uint32_t num_layers() const override { return GpuLayerEventsCount(*events_); }
  const std::shared_ptr<GpuLayerEvents>& events() const { return events_; }

 private:
  const std::shared_ptr<GpuLayerEvents> events_;
};

}  // namespace

std::unique_ptr<CudaEngineMemory> CudaEngineMemory::Create(const CudaCopyPaths& paths) {
  std::unique_ptr<CudaBackend> cuda = CudaBackend::Create(paths);
  if (cuda == nullptr) return nullptr;
  return std::make_unique<CudaEngineMemory>(std::move(cuda), paths.load_copy_engine);
}

CudaEngineMemory::CudaEngineMemory(std::unique_ptr<CudaBackend> cuda, bool load_copy_engine)
    : load_copy_engine_(load_copy_engine), capabilities_(CudaCapabilities()), cuda_(std::move(cuda)) {}

Result<std::shared_ptr<LayerEvents>> CudaEngineMemory::OpenLayerEvents(const LayerEventsRank& rank) {
  auto events = cuda_->OpenLayerEvents(rank);
  if (!events.ok()) return events.status();
  return std::shared_ptr<LayerEvents>(std::make_shared<OpenedLayerEvents>(std::move(*events)));
}

Status CudaEngineMemory::RegisterPool(const PoolRegion& pool) {
  Status registered = cuda_->RegisterPool(pool.base, pool.bytes, pool.slot_bytes);
  if (registered.ok()) return registered;
  return registered.WithContext("registering the pool for DMA (put --pool-path on /dev/shm or hugetlbfs)");
}

Result<std::shared_ptr<EngineKv>> CudaEngineMemory::Open(KvRegistration registration, const Geometry& geometry) {
  auto* gpu = std::get_if<GpuKvDescription>(&registration.memory);
  if (gpu == nullptr) return Status::Internal("the cuda backend was handed a registration of another memory kind");
  if (Status path = CheckCopyEngineLoad(load_copy_engine_, geometry); !path.ok()) return path;
  auto kv = cuda_->Open(*gpu, geometry);
  if (!kv.ok()) return kv.status();
  return std::shared_ptr<EngineKv>(std::make_shared<CudaKv>(std::move(*kv)));
}

void CudaEngineMemory::Copy(CopyJob job) {
  const int64_t handed_ns = NowNs();  // the device's own queueing counts as transfer time
  const auto& kv = static_cast<const CudaKv&>(*job.kv);  // opened by Open above
  const bool store = job.direction == CopyDirection::kToPool;
  std::shared_ptr<GpuLayerEvents> events;
  if (job.layer_events != nullptr) events = static_cast<const OpenedLayerEvents&>(*job.layer_events).events();
  cuda_->Copy(kv.gpu(), store, job.pool, *job.engine_blocks, *job.slots, store ? std::move(job.term_sums) : nullptr,
              std::move(job.on_layer), [done = std::move(job.done), handed_ns](Status st) { done(st, handed_ns); },
              std::move(events), std::move(job.on_launched), std::move(job.launch_deadline), job.layers);
}

}  // namespace flexkv
