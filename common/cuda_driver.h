// The few CUDA driver API entry points flexkv needs (cuMem/VMM, pointer attributes), reached through the
// runtime's cudaGetDriverEntryPointByVersion so no binary links libcuda (absent on machines without a GPU,
// where flexkvd must still start with the host backend). Include only in CUDA builds.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

namespace flexkv {

struct CudaDriver {
  CUresult (*mem_get_address_range)(CUdeviceptr*, size_t*, CUdeviceptr) = nullptr;
  CUresult (*pointer_get_attribute)(void*, CUpointer_attribute, CUdeviceptr) = nullptr;
  CUresult (*mem_retain_allocation_handle)(CUmemGenericAllocationHandle*, void*) = nullptr;
  CUresult (*mem_export_to_shareable_handle)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                                             unsigned long long) = nullptr;
  CUresult (*mem_import_from_shareable_handle)(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType) = nullptr;
  CUresult (*mem_address_reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long) = nullptr;
  CUresult (*mem_address_free)(CUdeviceptr, size_t) = nullptr;
  CUresult (*mem_map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long) = nullptr;
  CUresult (*mem_unmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*mem_set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*mem_release)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*mem_create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*, unsigned long long) = nullptr;
  CUresult (*mem_get_allocation_granularity)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags) = nullptr;
  CUresult (*get_error_string)(CUresult, const char**) = nullptr;

  // True when every entry point above was found.
  bool complete = false;

  // Loaded once per process (thread-safe). Entry points the driver lacks stay null and `complete` is false.
  static const CudaDriver& Get() {
    static const CudaDriver driver = Load();
    return driver;
  }

  // "CUDA_ERROR_INVALID_VALUE"-style text for a driver result.
  const char* ErrorText(CUresult r) const {
    const char* s = nullptr;
    if (get_error_string == nullptr || get_error_string(r, &s) != CUDA_SUCCESS || s == nullptr) return "unknown CUDA driver error";
    return s;
  }

 private:
  template <typename Fn>
  static bool Find(const char* name, Fn* out) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return false;
    }
    *out = reinterpret_cast<Fn>(fn);
    return true;
  }
  static CudaDriver Load() {
    CudaDriver d;
    bool all = true;
    all &= Find("cuMemGetAddressRange", &d.mem_get_address_range);
    all &= Find("cuPointerGetAttribute", &d.pointer_get_attribute);
    all &= Find("cuMemRetainAllocationHandle", &d.mem_retain_allocation_handle);
    all &= Find("cuMemExportToShareableHandle", &d.mem_export_to_shareable_handle);
    all &= Find("cuMemImportFromShareableHandle", &d.mem_import_from_shareable_handle);
    all &= Find("cuMemAddressReserve", &d.mem_address_reserve);
    all &= Find("cuMemAddressFree", &d.mem_address_free);
    all &= Find("cuMemMap", &d.mem_map);
    all &= Find("cuMemUnmap", &d.mem_unmap);
    all &= Find("cuMemSetAccess", &d.mem_set_access);
    all &= Find("cuMemRelease", &d.mem_release);
    all &= Find("cuMemCreate", &d.mem_create);
    all &= Find("cuMemGetAllocationGranularity", &d.mem_get_allocation_granularity);
    all &= Find("cuGetErrorString", &d.get_error_string);
    d.complete = all;
    return d;
  }
};

}  // namespace flexkv
