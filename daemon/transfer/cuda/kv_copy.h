// GPU <-> host-pool block copies for the CUDA backend. Compiled only with a CUDA toolkit.
//
// A GPU KV cache is described per layer: chunk (layer l, plane p, block b) of one TP rank lives at
//   layer_base[l] + p * plane_stride + b * block_stride
// which covers LAYERFIRST with one tensor per layer (vLLM: plane_stride = num_blocks * chunk,
// block_stride = chunk), LAYERBLOCKREGIONS (a tensor per layer, plane_stride = chunk, block_stride = planes * chunk),
// BLOCKFIRST and LAYERBLOCK (gpu_kv_layout.h computes them from a registration). A host pool slot holds the block as
//   [tp shard][layer][plane][chunk]   (MLA: one shard; common/slot_order.h)
// so each rank's part of a slot is one run of bytes, and is reached through its device-visible address (the pool is
// cudaHostRegister'ed; UVA).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace flexkv::cuda {

struct GpuKvView {
  const uint64_t* layer_base;  // device array of num_layers device addresses
  uint64_t plane_stride;       // bytes
  uint64_t block_stride;       // bytes
  uint32_t num_layers;
  uint32_t num_planes;
  uint64_t chunk_bytes;        // multiple of 16
  // Every layer lies in one allocation (BLOCKFIRST, LAYERBLOCK: one region), so a copy may span a layer boundary.
  // False for a region per layer (LAYERFIRST, LAYERBLOCKREGIONS): separate allocations may sit back to back in the
  // address space, yet one copy must not run from one into the next (the copy engine refuses it).
  bool layers_in_one_allocation = false;
};

struct HostPoolView {
  uint8_t* base;               // device-visible address of slot 0
  uint64_t block_bytes;        // bytes per slot
  uint32_t tp_shards;          // shards per (layer, plane) in a slot: tp_size for K/V, 1 for MLA
  uint32_t tp_rank;            // which shard this GPU's chunk is
  // The staged copies' buffers: each "slot" of `base` (block_bytes apart) holds only rank tp_rank's part
  // [layer][plane][chunk] of a pool slot. Addresses skip the other ranks; checksum unit indices are those of the
  // pool's slot, so the sums a packing gather adds are the pool slot's.
  bool rank_region = false;
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
// tp_rank < tp_shards, layer_end <= num_layers, block_bytes >= num_layers * num_planes * tp_shards * chunk_bytes,
// or without tp_shards for a rank_region view).
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
// refuses). A rank_region view (the staged copies' buffers) is refused with cudaErrorInvalidValue.
// `follows_host` (optional, host-readable, `count` entries: slot runs, below) lets one copy go on from a pair's
// last chunk into the next pair's first where both sides are contiguous (BLOCKFIRST blocks in a row).
cudaError_t CopyEngineBatch(const uint64_t* layer_base_host, const GpuKvView& gpu, const HostPoolView& pool,
                            const uint32_t* gpu_blocks_host, const uint32_t* slots_host, uint32_t count,
                            uint32_t layer_begin, uint32_t layer_end, bool to_host, cudaStream_t stream,
                            const uint8_t* follows_host = nullptr);

// Slot runs: an allocator hands out consecutive slots (a fresh pool's, a prefix evicted together), and one copy of
// a run moves small slots at the rate of large ones. `follows[i]` != 0 says that slot slots[i] directly follows
// slots[i - 1] (slots[i] == slots[i - 1] + 1) inside one DMA registration (one cudaHostRegister call: a copy must
// not span two). Only the caller knows the registrations (CudaBackend computes the marks as it checks a job), so
// null - never merge across slots - is always correct. The copies still check the addresses on both sides.

// ---- Whole slots staged through GPU memory -----------------------------------------------------------------
// SM-issued PCIe traffic (the kernels above) moves ~0.95 (stores) / ~0.92 (loads) of a contiguous copy one way,
// but a store and a load at once only ~0.67 of the two-way ceiling on an H200 (65 of 97 GB/s, whatever the block map,
// page size or launch shapes: the SMs' PCIe traffic goes in 128-byte requests, and its loads' reads stall behind
// the stores' writes). The copy engine with one copy per slot (>= 2 MiB) moved 0.977-0.989 each way and
// 0.988-0.999 both ways at once (docs/performance.md, "Both directions at once"). A staged copy uses each for what it is good
// at: the kernels pack a batch of whole slots into a GPU staging buffer (HBM to HBM, ~10x the PCIe rate) and the
// copy engine moves each slot as one copy (stores); or the copy engine lands each slot in a buffer and the kernels
// unpack it (loads). Batches alternate between the ring's buffers, so packing and copying overlap.

// Whether a request can be staged: the request covers every layer (a layer-wise load needs each layer on its own)
// of a valid view. Any TP rank can: its part of a slot is one run of bytes (the rank-major slot order).
bool CanStage(const GpuKvView& gpu, const HostPoolView& pool, uint32_t layer_begin, uint32_t layer_end);
// The bytes of a slot a staged copy moves: num_layers * num_planes * chunk_bytes, the rank's part of the slot (at
// tp_rank times that in it).
uint64_t StagedSlotBytes(const GpuKvView& gpu);

// GPU memory whole slots travel through: `buffers` buffers of bytes / buffers each on the current device, an event
// pair per buffer, the copy engine's stream and a device array of staging indices. RAII; one ring per copy worker:
// StagedCopy calls on one ring must not run at the same time (they may follow one another without waiting).
class StagingRing {
 public:
  // cudaErrorInvalidValue for fewer than 2 buffers or a buffer under 16 bytes; the allocation's error when the
  // device has no room (nothing is kept then).
  static cudaError_t Create(uint64_t bytes, uint32_t buffers, std::unique_ptr<StagingRing>* out);
  ~StagingRing();
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;
  uint64_t bytes() const { return buffer_bytes_ * buffers_; }
  // Staged slots of `slot_bytes` one buffer holds (at most kMaxSlotsPerBuffer); 0: too large for this ring.
  uint32_t SlotsPerBuffer(uint64_t slot_bytes) const;
  static constexpr uint32_t kMaxSlotsPerBuffer = 4096;

 private:
  StagingRing() = default;
  friend cudaError_t StagedCopy(const GpuKvView&, const HostPoolView&, const uint32_t*, const uint32_t*, uint32_t,
                                bool, StagingRing&, cudaStream_t, uint64_t*, unsigned, const uint8_t*);
  friend cudaError_t EnqueueStaged(const GpuKvView&, const HostPoolView&, const uint32_t*, const uint32_t*, uint32_t,
                                   bool, StagingRing&, cudaStream_t, uint64_t*, unsigned, uint64_t, uint32_t,
                                   const uint8_t*);
  uint8_t* memory_ = nullptr;
  uint64_t buffer_bytes_ = 0;
  uint32_t buffers_ = 0;
  uint32_t* indices_ = nullptr;         // 0 .. kMaxSlotsPerBuffer-1, the pack/unpack kernels' "slots"
  cudaStream_t copy_stream_ = nullptr;  // the copy engine's copies
  std::vector<cudaEvent_t> ready_;      // per buffer: packed (stores) / landed (loads)
  std::vector<cudaEvent_t> free_;       // per buffer: copied out (stores) / unpacked (loads): reusable after it
  cudaEvent_t done_ = nullptr;          // the copy stream's last copy of a call (stores)
  cudaEvent_t last_use_ = nullptr;      // recorded on the caller's stream after a call's last kernel: the destructor
                                        // waits for it before freeing the buffers those kernels read or write
  uint32_t next_ = 0;                   // the buffer the next batch uses
};

// Copies `count` pairs (gpu_blocks_dev[i] <-> slot slots_host[i]) as whole slots through `ring`: kernels on `stream`,
// the copy engine's copies (one cudaMemcpyBatchAsync per batch, `copy_flags` as cudaMemcpyAttributes::flags) on the
// ring's stream, joined back into `stream`: once `stream` has run what this call enqueued, every byte is in place.
// gpu_blocks_dev is a device array; slots_host a host array, read before the call returns; both are validated by the
// caller. Stores with `term_sums` (device memory, one entry per pair, as LaunchGatherChecksummed) add each slot's
// checksum terms as they pack: the packed bytes are the bytes the pool receives. cudaErrorInvalidValue, nothing
// enqueued, when !CanStage(gpu, pool, 0, gpu.num_layers) or the ring holds no slot of this size.
// `follows_host` (optional, slot runs above, read before the call returns): where a rank's part is its whole slot
// (TP 1, MLA; slots of exactly the staged bytes), consecutive slots of one batch travel as one copy.
cudaError_t StagedCopy(const GpuKvView& gpu, const HostPoolView& pool, const uint32_t* gpu_blocks_dev,
                       const uint32_t* slots_host, uint32_t count, bool to_host, StagingRing& ring, cudaStream_t stream,
                       uint64_t* term_sums = nullptr, unsigned copy_flags = 0, const uint8_t* follows_host = nullptr);

}  // namespace flexkv::cuda
