// Helpers of the [gpu] tests that go through the CUDA engine-memory backend: the skip without a GPU, cuMem/VMM
// allocations exported as fds (one process cannot open its own CUDA IPC handles), and a copy run to completion.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <future>
#include <memory>

#include "common/cuda_driver.h"
#include "daemon/transfer/cuda/cuda_engine_memory.h"

namespace flexkv::gpu_test {

inline bool HaveGpu() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  (void)cudaGetLastError();
  return ok;
}

#define SKIP_WITHOUT_GPU()                          \
  do {                                              \
    if (!::flexkv::gpu_test::HaveGpu()) {           \
      WARN("no GPU visible; skipped");              \
      return;                                       \
    }                                               \
  } while (0)

#define CU_OK(expr)                                                 \
  do {                                                              \
    const CUresult r_ = (expr);                                     \
    INFO(#expr << ": " << ::flexkv::CudaDriver::Get().ErrorText(r_)); \
    REQUIRE(r_ == CUDA_SUCCESS);                                    \
  } while (0)

#define CUDA_OK(expr)                                  \
  do {                                                 \
    const cudaError_t e_ = (expr);                     \
    INFO(#expr << ": " << cudaGetErrorString(e_));     \
    REQUIRE(e_ == cudaSuccess);                        \
  } while (0)

// One physical cuMem allocation on device 0, exportable as a POSIX fd and mapped into this process for filling.
class VmmAllocation {
 public:
  explicit VmmAllocation(uint64_t at_least) {
    const CudaDriver& drv = CudaDriver::Get();
    REQUIRE(drv.complete);
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    size_t granule = 0;
    CU_OK(drv.mem_get_allocation_granularity(&granule, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    bytes_ = (at_least + granule - 1) / granule * granule;
    CU_OK(drv.mem_create(&handle_, bytes_, &prop, 0));
    CU_OK(drv.mem_address_reserve(&va_, bytes_, 0, 0, 0));
    CU_OK(drv.mem_map(va_, bytes_, 0, handle_, 0));
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = 0;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CU_OK(drv.mem_set_access(va_, bytes_, &access, 1));
  }
  ~VmmAllocation() {
    const CudaDriver& drv = CudaDriver::Get();
    if (va_ != 0) {
      (void)drv.mem_unmap(va_, bytes_);
      (void)drv.mem_address_free(va_, bytes_);
    }
    if (handle_ != 0) (void)drv.mem_release(handle_);
  }
  VmmAllocation(const VmmAllocation&) = delete;
  VmmAllocation& operator=(const VmmAllocation&) = delete;

  int ExportFd() const {
    int fd = -1;
    CU_OK(CudaDriver::Get().mem_export_to_shareable_handle(&fd, handle_, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    return fd;
  }
  void* data() const { return reinterpret_cast<void*>(va_); }
  uint64_t bytes() const { return bytes_; }

 private:
  CUmemGenericAllocationHandle handle_ = 0;
  CUdeviceptr va_ = 0;
  uint64_t bytes_ = 0;
};

// Runs `job` on `backend` and returns its status once `done` ran.
inline Status RunCopy(CudaEngineMemory& backend, CopyJob job) {
  auto finished = std::make_shared<std::promise<Status>>();
  auto result = finished->get_future();
  job.done = [finished](Status st, int64_t) { finished->set_value(std::move(st)); };
  backend.Copy(std::move(job));
  return result.get();
}

}  // namespace flexkv::gpu_test
