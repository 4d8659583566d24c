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
// `region_bytes`: bytes of each region. Allocations made with cuMem/VMM (PyTorch expandable segments) cannot
// be exported this way and are refused with UNIMPLEMENTED.
Result<GpuKvRegistration> DescribeGpuKv(KvLayout layout, std::span<void* const> regions, uint64_t region_bytes,
                                        uint32_t num_blocks, uint32_t tp_rank);

}  // namespace flexkv
