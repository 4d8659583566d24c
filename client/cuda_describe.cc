// DescribeGpuKv and CudaLayerEvents; see flexkv/cuda.h.
#include <fmt/format.h>

#include "flexkv/cuda.h"

#if FLEXKV_HAVE_CUDA
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <map>

#include "common/cuda_driver.h"
#endif

namespace flexkv {

#if FLEXKV_HAVE_CUDA

namespace {

std::string UuidOf(const cudaDeviceProp& prop) {
  const auto* b = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
  std::string hex;
  for (int i = 0; i < 16; ++i) hex += fmt::format("{:02x}", b[i]);
  return fmt::format("GPU-{}-{}-{}-{}-{}", hex.substr(0, 8), hex.substr(8, 4), hex.substr(12, 4), hex.substr(16, 4),
                     hex.substr(20, 12));
}

std::shared_ptr<const int> OwnFd(int fd) {
  fcntl(fd, F_SETFD, FD_CLOEXEC);  // a child the engine spawns must not keep the GPU memory alive
  return std::shared_ptr<const int>(new int(fd), [](const int* p) {
    close(*p);
    delete p;
  });
}

// A region in cuMem/VMM memory: walks the mappings that back [ptr, ptr + bytes), exporting each physical
// allocation once (shared across regions through `exported`, keyed by mapping base address).
Status DescribeVmmRegion(const CudaDriver& drv, size_t i, CUdeviceptr ptr, uint64_t bytes, GpuKvRegistration& reg,
                         GpuKvRegistration::Region& region, std::map<CUdeviceptr, uint32_t>& exported) {
  if (bytes > ~CUdeviceptr{0} - ptr) {
    return Status::InvalidArgument(fmt::format("region {}: {} bytes from {:#x} wrap the address space", i, bytes, ptr));
  }
  const CUdeviceptr end = ptr + bytes;
  CUdeviceptr cur = ptr;
  while (cur < end) {
    CUdeviceptr base = 0;
    unsigned long long size = 0;
    if (drv.pointer_get_attribute(&base, CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR, cur) != CUDA_SUCCESS ||
        drv.pointer_get_attribute(&size, CU_POINTER_ATTRIBUTE_MAPPING_SIZE, cur) != CUDA_SUCCESS || size == 0) {
      return Status::InvalidArgument(fmt::format("region {}: no memory is mapped at byte {} of its {} bytes", i, cur - ptr, bytes));
    }
    if (cur == ptr) {
      region.offset = ptr - base;
    } else if (base != cur) {
      return Status::InvalidArgument(fmt::format("region {}: the mapping at byte {} starts inside an earlier one", i, cur - ptr));
    }
    auto it = exported.find(base);
    if (it == exported.end()) {
      CUmemGenericAllocationHandle h = 0;
      CUresult e = drv.mem_retain_allocation_handle(&h, reinterpret_cast<void*>(base));
      if (e != CUDA_SUCCESS) {
        return Status::InvalidArgument(fmt::format("region {}: cuMemRetainAllocationHandle: {}", i, drv.ErrorText(e)));
      }
      int fd = -1;
      e = drv.mem_export_to_shareable_handle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
      drv.mem_release(h);
      if (e != CUDA_SUCCESS) {
        return Status::FailedPrecondition(fmt::format(
            "region {}: cuMemExportToShareableHandle: {}; the allocation must be created with requestedHandleTypes "
            "including CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (PyTorch: expandable_segments with the default posix_fd "
            "handle type)", i, drv.ErrorText(e)));
      }
      it = exported.emplace(base, static_cast<uint32_t>(reg.vmm_allocations.size())).first;
      reg.vmm_allocations.push_back({OwnFd(fd), size});
    }
    region.vmm_allocations.push_back(it->second);
    cur = base + size;
  }
  return Status::Ok();
}

}  // namespace

Result<GpuKvRegistration> DescribeGpuKv(KvLayout layout, std::span<void* const> regions, uint64_t region_bytes,
                                        uint32_t num_blocks, uint32_t tp_rank) {
  if (regions.empty()) return Status::InvalidArgument("regions is empty; expected the KV cache's device pointers");
  if (region_bytes == 0) return Status::InvalidArgument("region_bytes is 0; expected the bytes of each region");
  const CudaDriver& drv = CudaDriver::Get();
  if (drv.mem_get_address_range == nullptr || drv.pointer_get_attribute == nullptr) {
    return Status::Unavailable("the CUDA driver does not provide cuMemGetAddressRange / cuPointerGetAttribute");
  }
  GpuKvRegistration reg;
  reg.layout = layout;
  reg.num_blocks = num_blocks;
  reg.tp_rank = tp_rank;
  int device = -1;
  std::map<CUdeviceptr, uint32_t> exported;
  for (size_t i = 0; i < regions.size(); ++i) {
    cudaPointerAttributes attr{};
    if (regions[i] == nullptr || cudaPointerGetAttributes(&attr, regions[i]) != cudaSuccess ||
        attr.type != cudaMemoryTypeDevice) {
      cudaGetLastError();  // clear the error cudaPointerGetAttributes recorded for a bad pointer
      return Status::InvalidArgument(fmt::format("region {} ({}) is not device memory", i, regions[i]));
    }
    if (device >= 0 && attr.device != device) {
      return Status::InvalidArgument(fmt::format("region {} is on device {}, region 0 on {}; one rank, one GPU", i,
                                                 attr.device, device));
    }
    device = attr.device;
    GpuKvRegistration::Region r;
    r.bytes = region_bytes;
    const auto ptr = reinterpret_cast<CUdeviceptr>(regions[i]);
    // cuMem/VMM memory (PyTorch expandable segments) has an allocation handle; cudaMalloc memory has none.
    CUmemGenericAllocationHandle probe = 0;
    const bool vmm = drv.mem_retain_allocation_handle != nullptr &&
                     drv.mem_retain_allocation_handle(&probe, regions[i]) == CUDA_SUCCESS;
    if (vmm) {
      drv.mem_release(probe);
      if (!drv.complete) return Status::Unimplemented("the CUDA driver lacks the cuMem entry points VMM memory needs");
      FLEXKV_RETURN_IF_ERROR(DescribeVmmRegion(drv, i, ptr, region_bytes, reg, r, exported));
    } else {
      CUdeviceptr base = 0;
      size_t size = 0;
      if (drv.mem_get_address_range(&base, &size, ptr) != CUDA_SUCCESS) {
        return Status::InvalidArgument(fmt::format("region {}: cuMemGetAddressRange failed", i));
      }
      if (region_bytes > size || ptr - base > size - region_bytes) {
        return Status::OutOfRange(fmt::format("region {}: {} bytes from offset {} exceed its {}-byte allocation", i,
                                              region_bytes, ptr - base, size));
      }
      cudaIpcMemHandle_t handle;
      const cudaError_t e = cudaIpcGetMemHandle(&handle, regions[i]);
      if (e != cudaSuccess) {
        return Status::FailedPrecondition(fmt::format("region {}: cudaIpcGetMemHandle: {}", i, cudaGetErrorString(e)));
      }
      r.ipc_handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
      r.offset = ptr - base;
    }
    reg.regions.push_back(std::move(r));
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) return Status::Internal("cudaGetDeviceProperties failed");
  reg.gpu_uuid = UuidOf(prop);
  return reg;
}

Result<CudaLayerEvents> CudaLayerEvents::Create(uint32_t num_layers, uint32_t tp_rank) {
  // A hybrid geometry's set has every component's layers: up to kMaxComponents x 1024.
  constexpr uint32_t kMaxEvents = Geometry::kMaxComponents * 1024;
  if (num_layers == 0 || num_layers > kMaxEvents) {
    return Status::InvalidArgument(fmt::format(
        "num_layers is {}; expected 1..{} (the geometry's total_layers(): every component's layers)", num_layers,
        kMaxEvents));
  }
  CudaLayerEvents out;
  cudaError_t e = cudaGetDevice(&out.device_);
  if (e != cudaSuccess) return Status::FailedPrecondition(fmt::format("cudaGetDevice: {}", cudaGetErrorString(e)));
  cudaDeviceProp prop{};
  e = cudaGetDeviceProperties(&prop, out.device_);
  if (e != cudaSuccess) {
    return Status::FailedPrecondition(fmt::format("cudaGetDeviceProperties({}): {}", out.device_, cudaGetErrorString(e)));
  }
  out.handles_.gpu_uuid = UuidOf(prop);
  out.handles_.tp_rank = tp_rank;
  for (uint32_t l = 0; l < num_layers; ++l) {
    cudaEvent_t ev = nullptr;
    e = cudaEventCreateWithFlags(&ev, cudaEventInterprocess | cudaEventDisableTiming);
    if (e != cudaSuccess) {
      return Status::ResourceExhausted(fmt::format("cudaEventCreateWithFlags(interprocess) for layer {}: {}", l,
                                                   cudaGetErrorString(e)));  // `out` destroys the earlier ones
    }
    out.events_.push_back(ev);
    cudaIpcEventHandle_t h;
    e = cudaIpcGetEventHandle(&h, ev);
    if (e != cudaSuccess) {
      return Status::FailedPrecondition(fmt::format("cudaIpcGetEventHandle for layer {}: {}", l, cudaGetErrorString(e)));
    }
    out.handles_.handles.emplace_back(reinterpret_cast<const char*>(&h), sizeof(h));
  }
  return out;
}

void CudaLayerEvents::Destroy() {
  if (events_.empty()) return;
  int current = -1;
  const bool restore = cudaGetDevice(&current) == cudaSuccess && current != device_;
  if (restore) cudaSetDevice(device_);
  for (void* ev : events_) cudaEventDestroy(static_cast<cudaEvent_t>(ev));
  if (restore) cudaSetDevice(current);
  events_.clear();
  handles_ = {};
}

Status CudaLayerEvents::StreamWait(uint32_t layer, void* stream) const {
  if (layer >= events_.size()) {
    return Status::InvalidArgument(fmt::format("layer {} is past the set's {} layers", layer, events_.size()));
  }
  const cudaError_t e = cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(events_[layer]), 0);
  if (e != cudaSuccess) {
    return Status::Internal(fmt::format("cudaStreamWaitEvent(layer {}): {}", layer, cudaGetErrorString(e)));
  }
  return Status::Ok();
}

#else

Result<GpuKvRegistration> DescribeGpuKv(KvLayout, std::span<void* const>, uint64_t, uint32_t, uint32_t) {
  return Status::Unimplemented("this libflexkv was built without CUDA");
}

Result<CudaLayerEvents> CudaLayerEvents::Create(uint32_t, uint32_t) {
  return Status::Unimplemented("this libflexkv was built without CUDA: no layer events");
}
void CudaLayerEvents::Destroy() { events_.clear(); }
Status CudaLayerEvents::StreamWait(uint32_t, void*) const {
  return Status::Unimplemented("this libflexkv was built without CUDA: no layer events");
}

#endif

CudaLayerEvents::~CudaLayerEvents() { Destroy(); }

CudaLayerEvents::CudaLayerEvents(CudaLayerEvents&& other) noexcept
    : device_(other.device_), events_(std::move(other.events_)), handles_(std::move(other.handles_)) {
  other.events_.clear();
}

CudaLayerEvents& CudaLayerEvents::operator=(CudaLayerEvents&& other) noexcept {
  if (this != &other) {
    Destroy();
    device_ = other.device_;
    events_ = std::move(other.events_);
    handles_ = std::move(other.handles_);
    other.events_.clear();
  }
  return *this;
}

}  // namespace flexkv
