// GPU <-> host-pool block copies for the CUDA backend. Compiled only with a CUDA toolkit.
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
  // Every layer lies in one allocation (BLOCKFIRST, LAYERBLOCK: one region), so a copy may span a layer boundary.
  // False for a region per layer (LAYERFIRST): separate allocations may sit back to back in the address space,
  // yet one copy must not run from one into the next (the copy engine refuses it).
  bool layers_in_one_allocation = false;
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

// All launches are asynchronous on `stream` and return the launch error (cudaErrorInvalidValue, with nothing
// enqueued, for a view that breaks the rules above: chunk_bytes, strides and pool.base 16-byte aligned,
// tp_rank < tp_shards, layer_end <= num_layers, block_bytes >= num_layers * num_planes * tp_shards * chunk_bytes).
// An empty request (count 0 or an empty layer range) enqueues nothing and succeeds. Block ids and slots are
// not bounds-checked on the device: the caller validates them against the KV cache and the pool.
//
// A request with fewer chunks than the launch has thread groups (a state component's ~2 MiB per-layer snapshots,
// a one-block load) has its chunks split into pieces of about 16 KiB, so that the whole grid copies; results,
// checksums included, do not depend on it.
//
// Store direction: GPU blocks -> pool slots, one pass, 16-byte accesses. `ctas` 0 picks a default.
cudaError_t LaunchGather(const GpuKvView& gpu, const HostPoolView& pool, const BlockPairs& pairs, cudaStream_t stream,
                         int ctas = 0);
// Load direction: pool slots -> GPU blocks.
cudaError_t LaunchScatter(const GpuKvView& gpu, const HostPoolView& pool, const BlockPairs& pairs, cudaStream_t stream,
                          int ctas = 0);

// Launch shape of the gather/scatter kernels. Zero fields take the direction's default (DefaultLaunchShape),
// which was picked from measurements on an H200 (docs/performance.md, "GPU <-> host copies").
struct LaunchShape {
  int ctas = 0;             // CTAs in the (grid-stride) grid
  int threads = 0;          // threads per CTA: a multiple of 32, at most 1024
  int unroll = 0;           // 16-byte loads each thread has in flight before its stores: 1, 2, 4 or 8
  int warps_per_chunk = 0;  // warps that copy one chunk together: 1, 2 or 4, dividing threads / 32
  // > 0: instead of 16-byte loads and stores, one thread per CTA moves each chunk through shared memory
  // with the bulk-copy (TMA) engine, in pieces of this many KiB (1..64), `stages` pieces in flight (1..8);
  // threads, unroll and warps_per_chunk are then ignored.
  int bulk_kib = 0;
  int stages = 0;
};
LaunchShape DefaultLaunchShape(bool to_host);

// As LaunchGather / LaunchScatter with an explicit shape (benchmarks and tests sweep it).
cudaError_t LaunchGatherShaped(const GpuKvView& gpu, const HostPoolView& pool, const BlockPairs& pairs,
                               cudaStream_t stream, const LaunchShape& shape);
cudaError_t LaunchScatterShaped(const GpuKvView& gpu, const HostPoolView& pool, const BlockPairs& pairs,
                                cudaStream_t stream, const LaunchShape& shape);

// Content checksums of stored blocks (common/block_checksum.h). `term_sums` is a device array (cudaMalloc:
// the kernels add with device atomics) of pairs.count entries, 8-byte aligned; entry i receives the sum of the
// ChecksumTerms of the units of slot pairs.slots[i] that the request covers, the unit index being the unit's
// byte offset in the slot / 16. The kernels add to what the entries hold, so the caller zeroes them first, and
// requests for other TP ranks or layer ranges of the same slots may add into the same entries; a slot's
// checksum is FinishBlockChecksum(entry, block_bytes) once every byte of it was written. Null term_sums:
// cudaErrorInvalidValue.
//
// A store that sums what it writes, as it writes it: LaunchGatherShaped's copy plus, per thread, the terms of
// the units it stored, reduced per warp and added with one atomic per warp and chunk (fewer when a warp's
// consecutive chunks belong to one pair); on an H200 it stored within 0.33 % of the plain gather's rate
// (docs/performance.md). A bulk-copy shape (bulk_kib > 0) is replaced by the 16-byte kernel's default shape with
// the same CTA count: its single copying thread per CTA never sees the bytes.
cudaError_t LaunchGatherChecksummed(const GpuKvView& gpu, const HostPoolView& pool, const BlockPairs& pairs,
                                    uint64_t* term_sums, cudaStream_t stream, const LaunchShape& shape = {});
// The sums a store of `pairs` adds, read from the GPU blocks (HBM) alone; writes nothing to the pool. For
// stores by the copy engine (CopyEngineBatch), which cannot sum, on another stream at the same time as the copy:
// it reads HBM at about 80 times the PCIe store rate, so beside the copy it costs next to nothing
// (docs/performance.md). The GPU blocks must not change until both are done. Zero shape fields take 132 CTAs x 512 threads x 8 loads in flight, one warp per
// chunk; a bulk-copy shape is replaced as above.
cudaError_t LaunchChecksumTerms(const GpuKvView& gpu, const HostPoolView& pool, const BlockPairs& pairs,
                                uint64_t* term_sums, cudaStream_t stream, const LaunchShape& shape = {});

// Copy-engine alternative (SM-free): one batched cudaMemcpyBatchAsync over all chunks (chunks contiguous on
// both sides are merged, across layers only when gpu.layers_in_one_allocation). `gpu_blocks_host` / `slots_host` and `layer_base_host` must be host-readable; they are
// read before the call returns. `to_host` selects the direction. Falls back to one cudaMemcpyAsync per chunk
// when the driver answers cudaErrorNotSupported or `stream` is the legacy default stream (which the batch API
// refuses).
cudaError_t CopyEngineBatch(const uint64_t* layer_base_host, const GpuKvView& gpu, const HostPoolView& pool,
                            const uint32_t* gpu_blocks_host, const uint32_t* slots_host, uint32_t count,
                            uint32_t layer_begin, uint32_t layer_end, bool to_host, cudaStream_t stream);

}  // namespace flexkv::cuda
