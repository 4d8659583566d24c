// GPU KV registration helpers for engines whose KV cache lives in GPU memory. Needs a libflexkv built
// with CUDA; elsewhere DescribeGpuKv returns UNIMPLEMENTED. No CUDA header is included here.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "flexkv/client.h"

namespace flexkv {

// Describes KV buffers at device pointers for RegisterGpuKv: finds the GPU's UUID, exports a CUDA IPC
// handle of the allocation holding each region and the region's offset in it.
//   kLayerFirst: one pointer per layer, each region [planes][num_blocks][chunk] (vLLM FLASH_ATTN's per-layer tensors);
//   kLayerBlockRegions: one pointer per layer, each region [num_blocks][planes][chunk] (FlashInfer's / Triton's);
//   kBlockFirst / kLayerBlock: one pointer to the whole cache.
// `region_bytes`: bytes of each region. Two kinds of memory are understood:
//   cudaMalloc (PyTorch's default caching allocator): a CUDA IPC handle of the allocation and the offset in it;
//   cuMem/VMM (PyTorch with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): every physical allocation backing
//   the region is exported as a POSIX fd (the allocation must allow CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
//   PyTorch's default); the registration owns those fds, so register it from this process.
// Hybrid geometries: describe each component's buffers (in its copy geometry, Geometry::Component) separately and
// set the result's `component` before RegisterGpuKv.
// INVALID_ARGUMENT for pointers that are not device memory or regions on different GPUs; FAILED_PRECONDITION
// for memory that cannot be exported.
Result<GpuKvRegistration> DescribeGpuKv(KvLayout layout, std::span<void* const> regions, uint64_t region_bytes,
                                        uint32_t num_blocks, uint32_t tp_rank);

// One TP rank's per-layer CUDA interprocess events (cudaEventInterprocess | cudaEventDisableTiming), made by the
// engine on the current CUDA device (the GPU of this rank's KV buffers), for Client::RegisterLayerEvents. RAII:
// the events are destroyed with this object, which must outlive every load naming a set made from them (the
// daemon holds them open until the load that records them ended; destroy them after its Wait). Move-only.
//
// Why the engine creates them (and not the daemon): the waits run on the engine's streams, in the engine's CUDA
// context, so the events belong to the engine's lifetime and device; the daemon only opens them
// (cudaIpcOpenEventHandle) and records. A daemon restart then costs the engine nothing but a new registration, and a
// set never outlives the engine that waits on it.
class CudaLayerEvents {
 public:
  // UNIMPLEMENTED in a libflexkv built without CUDA; the CUDA error (naming the call and layer) otherwise.
  static Result<CudaLayerEvents> Create(uint32_t num_layers, uint32_t tp_rank = 0);
  CudaLayerEvents() = default;
  ~CudaLayerEvents();
  CudaLayerEvents(CudaLayerEvents&& other) noexcept;
  CudaLayerEvents& operator=(CudaLayerEvents&& other) noexcept;
  CudaLayerEvents(const CudaLayerEvents&) = delete;
  CudaLayerEvents& operator=(const CudaLayerEvents&) = delete;

  // What RegisterLayerEvents takes for this rank (the GPU's UUID, one IPC handle per layer).
  const LayerEventHandles& handles() const { return handles_; }
  uint32_t num_layers() const { return static_cast<uint32_t>(events_.size()); }
  // The cudaEvent_t of `layer` (nullptr past the end).
  void* event(uint32_t layer) const { return layer < events_.size() ? events_[layer] : nullptr; }
  // Makes `stream` (a cudaStream_t; nullptr: the legacy default stream) wait for `layer`'s copy:
  // cudaStreamWaitEvent. Call it only after Client::WaitLaunched of the load naming the set returned OK (the
  // contract in flexkv/client.h); INVALID_ARGUMENT past the last layer; the CUDA error otherwise.
  Status StreamWait(uint32_t layer, void* stream) const;

 private:
  void Destroy();
  int device_ = -1;
  std::vector<void*> events_;  // cudaEvent_t, by layer
  LayerEventHandles handles_;
};

}  // namespace flexkv
