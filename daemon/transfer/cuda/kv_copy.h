// GPU <-> host-pool block copies for the CUDA backend (DESIGN §4.6). Compiled only with a CUDA toolkit.
//
// A GPU KV cache is described per layer: chunk (layer l, plane p, block b) of one TP rank lives at
//   layer_base[l] + p * plane_stride + b * block_stride
// which covers LAYERFIRST with one tensor per layer (vLLM: plane_stride = num_blocks * chunk,
// block_stride = chunk), BLOCKFIRST and LAYERBLOCK. A host pool slot holds the block as
//   [layer][plane][tp shard][chunk]   (MLA: one shard)
// and is reached through its device-visible address (the pool is cudaHostRegister'ed; UVA).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace flexkv::cuda {

struct GpuKvView {
  const uint64_t* layer_base;  // device array of num_layers device addresses
  uint64_t plane_stride;       // bytes
  uint64_t block_stride;       // bytes
  uint32_t num_layers;
  uint32_t num_planes;
  uint64_t chunk_bytes;        // multiple of 16
};

struct HostPoolView {
  uint8_t* base;               // device-visible address of slot 0
  uint64_t block_bytes;        // bytes per slot
  uint32_t tp_shards;          // shards per (layer, plane) in a slot: tp_size for K/V, 1 for MLA
  uint32_t tp_rank;            // which shard this GPU's chunk is
};

// The blocks of one request: pairs (gpu_blocks[i], slots[i]) in device-visible memory (e.g. pinned host
// or device arrays), and the layer range to copy.
struct BlockPairs {
  const uint32_t* gpu_blocks;
  const uint32_t* slots;
  uint32_t count;
  uint32_t layer_begin;
  uint32_t layer_end;  // exclusive
};

// Store direction: GPU blocks -> pool slots, one pass, 16-byte accesses. `ctas` 0 picks a default.
cudaError_t LaunchGather(const GpuKvView& gpu, const HostPoolView& pool, const BlockPairs& pairs, cudaStream_t stream,
                         int ctas = 0);
// Load direction: pool slots -> GPU blocks.
cudaError_t LaunchScatter(const GpuKvView& gpu, const HostPoolView& pool, const BlockPairs& pairs, cudaStream_t stream,
                          int ctas = 0);

// Copy-engine alternative (SM-free): one batched cudaMemcpyBatchAsync over all chunks. `host_pairs` arrays
// must be host-readable. `to_host` selects the direction. Uses host-side layer_base (`layer_base_host`).
cudaError_t CopyEngineBatch(const uint64_t* layer_base_host, const GpuKvView& gpu, const HostPoolView& pool,
                            const uint32_t* gpu_blocks_host, const uint32_t* slots_host, uint32_t count,
                            uint32_t layer_begin, uint32_t layer_end, bool to_host, cudaStream_t stream);

}  // namespace flexkv::cuda
