// DescribeGpuKv; see flexkv/cuda.h.
#include <fmt/format.h>

#include "flexkv/cuda.h"

#if FLEXKV_HAVE_CUDA
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstring>
#endif

namespace flexkv {

#if FLEXKV_HAVE_CUDA

Result<GpuKvRegistration> DescribeGpuKv(KvLayout layout, std::span<void* const> regions, uint64_t region_bytes,
                                        uint32_t num_blocks, uint32_t tp_rank) {
  if (regions.empty()) return Status::InvalidArgument("regions is empty; expected the KV cache's device pointers");
  using MemGetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    return Status::Unavailable("the CUDA driver does not provide cuMemGetAddressRange");
  }
  auto address_range = reinterpret_cast<MemGetAddressRange>(fn);
  GpuKvRegistration reg;
  reg.layout = layout;
  reg.num_blocks = num_blocks;
  reg.tp_rank = tp_rank;
  int device = -1;
  for (size_t i = 0; i < regions.size(); ++i) {
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, regions[i]) != cudaSuccess || attr.type != cudaMemoryTypeDevice) {
      return Status::InvalidArgument(fmt::format("region {} is not device memory", i));
    }
    if (device >= 0 && attr.device != device) {
      return Status::InvalidArgument(fmt::format("region {} is on device {}, region 0 on {}; one rank, one GPU", i,
                                                 attr.device, device));
    }
    device = attr.device;
    CUdeviceptr base = 0;
    size_t size = 0;
    if (address_range(&base, &size, reinterpret_cast<CUdeviceptr>(regions[i])) != CUDA_SUCCESS) {
      return Status::InvalidArgument(fmt::format("region {}: cuMemGetAddressRange failed", i));
    }
    cudaIpcMemHandle_t handle;
    const cudaError_t e = cudaIpcGetMemHandle(&handle, regions[i]);
    if (e != cudaSuccess) {
      return Status::Unimplemented(fmt::format(
          "region {}: cudaIpcGetMemHandle: {} (cuMem/VMM allocations, e.g. PyTorch expandable segments, need the "
          "shareable-fd path, not supported yet)", i, cudaGetErrorString(e)));
    }
    GpuKvRegistration::Region r;
    r.ipc_handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
    r.offset = reinterpret_cast<uint64_t>(regions[i]) - base;
    r.bytes = region_bytes;
    reg.regions.push_back(std::move(r));
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) return Status::Internal("cudaGetDeviceProperties failed");
  const auto* b = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
  std::string hex;
  for (int i = 0; i < 16; ++i) hex += fmt::format("{:02x}", b[i]);
  reg.gpu_uuid = fmt::format("GPU-{}-{}-{}-{}-{}", hex.substr(0, 8), hex.substr(8, 4), hex.substr(12, 4),
                             hex.substr(16, 4), hex.substr(20, 12));
  return reg;
}

#else

Result<GpuKvRegistration> DescribeGpuKv(KvLayout, std::span<void* const>, uint64_t, uint32_t, uint32_t) {
  return Status::Unimplemented("this libflexkv was built without CUDA");
}

#endif

}  // namespace flexkv
