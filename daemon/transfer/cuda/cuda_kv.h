// Internal to the CUDA backend (cuda_backend.cc, copy_worker.cc; CUDA builds only): an opened registration
// (GpuKv, declared in cuda_backend.h), one TP rank's opened layer events (GpuLayerEvents), and the CUDA error helpers.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "common/cuda_driver.h"
#include "common/log.h"
#include "daemon/transfer/cuda/cuda_backend.h"
#include "daemon/transfer/cuda/kv_copy.h"

namespace flexkv {

inline Status CudaError(cudaError_t e, const char* what, const char* file, int line) {
  return Status::Internal(fmt::format("{}: {} ({}:{})", what, cudaGetErrorString(e), file, line));
}

// Returns the error as a Status naming the expression, file and line from the enclosing function.
#define FLEXKV_CUDA_TRY(expr)                                                      \
  do {                                                                             \
    const cudaError_t flexkv_cuda_e_ = (expr);                                     \
    if (flexkv_cuda_e_ != cudaSuccess) return CudaError(flexkv_cuda_e_, #expr, __FILE__, __LINE__); \
  } while (0)

// One TP rank's KV buffers opened from the engine's CUDA IPC handles or VMM fds: the device, the geometry and
// description it was opened with, the mappings it owns (closed by its destructor, on the last copy's release) and the
// per-layer base addresses the copy kernels index (host and device copies, and the view built from them).
class GpuKv {
 public:
  GpuKv() = default;
  GpuKv(const GpuKv&) = delete;  // owns mappings: a copy would unmap them twice
  GpuKv& operator=(const GpuKv&) = delete;
  int device = 0;
  Geometry geometry;
  GpuKvDescription description;
  std::map<std::string, void*> opened;  // ipc handle bytes → mapped base of that allocation
  // VMM regions: a reserved address range per region with the client's allocations mapped in it.
  struct VmmSpan {
    CUdeviceptr base = 0;
    size_t reserved = 0;
    std::vector<std::pair<CUdeviceptr, size_t>> mapped;
  };
  std::vector<VmmSpan> vmm_spans;
  std::vector<uint64_t> layer_base_host;
  uint64_t* layer_base_dev = nullptr;
  cuda::GpuKvView view{};

  ~GpuKv() {
    cudaSetDevice(device);
    if (layer_base_dev != nullptr) cudaFree(layer_base_dev);
    for (auto& [handle, ptr] : opened) cudaIpcCloseMemHandle(ptr);
    const CudaDriver& drv = CudaDriver::Get();
    for (const VmmSpan& span : vmm_spans) {
      for (const auto& [va, bytes] : span.mapped) drv.mem_unmap(va, bytes);
      if (span.base != 0) drv.mem_address_free(span.base, span.reserved);
    }
    log::Debug("cuda", "closed IPC/VMM mappings of tp rank {} on {}", description.tp_rank, description.gpu_uuid);
  }
};


// One TP rank's per-layer interprocess events, opened from the engine's handles; destroyed with the last holder.
class GpuLayerEvents {
 public:
  GpuLayerEvents(int on_device, uint32_t of_tp_rank) : device(on_device), tp_rank(of_tp_rank) {}
  GpuLayerEvents(const GpuLayerEvents&) = delete;  // owns the opened events: a copy would close them twice
  GpuLayerEvents& operator=(const GpuLayerEvents&) = delete;
  ~GpuLayerEvents() {
    if (events.empty()) return;
    cudaSetDevice(device);
    // An event opened from an IPC handle is closed with cudaEventDestroy; a record still pending completes first.
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    log::Debug("cuda", "closed {} layer events of tp rank {} on device {}", events.size(), tp_rank, device);
  }
  const int device;
  const uint32_t tp_rank;
  std::vector<cudaEvent_t> events;  // by layer
};


}  // namespace flexkv
