// GPU KV registration helpers for engines whose KV cache lives in GPU memory. Needs a libflexkv built
// with CUDA; elsewhere DescribeGpuKv returns UNIMPLEMENTED. No CUDA header is included here.
#pragma once

#include <cstdint>
#include <span>

#include "flexkv/client.h"

namespace flexkv {

// Describes KV buffers at device pointers for RegisterGpuKv: finds the GPU's UUID, exports a CUDA IPC
// handle of the allocation holding each region and the region's offset in it.
//   kLayerFirst: one pointer per layer, each region [planes][num_blocks][chunk] (vLLM's per-layer tensors);
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

}  // namespace flexkv
