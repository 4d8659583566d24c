// GPU <-> host-pool block copies: gather/scatter kernels that touch every byte once with
// 16-byte accesses, writing to / reading from the registered pool over PCIe, and a copy-engine batch.
#include "kv_copy.h"

#include <algorithm>
#include <vector>

#include "common/block_checksum.h"

namespace flexkv::cuda {
namespace {

// Defaults from launch-shape sweeps on an H200 (PCIe Gen5 x16 host link), docs/performance.md. One direction
// alone, every shape from 8 CTAs x 256 threads x 8 loads in flight up reached the same plateau (stores ~52.5
// GB/s, loads ~51 GB/s; the bulk-copy variant too), 5-7% under the copy engine's contiguous copies: a limit of
// SM-issued PCIe traffic, not of the launch shape. Loads with fewer bytes in flight fell off (8 x 256 threads
// x 1: 21 GB/s). A store and a load at once reached ~75-79 GB/s together only when both sides had the same
// weight (32 x 512 x 8 each); with a lighter store side (16 x 256 x 8) the store finished last and the pair
// fell to ~64 GB/s.
constexpr LaunchShape kDefaultGather{32, 512, 8, 1, 0, 0};
constexpr LaunchShape kDefaultScatter{32, 512, 8, 1, 0, 0};
// Sums only (LaunchChecksumTerms): reads from HBM, no PCIe, so one CTA per SM with 8 loads in flight per thread.
constexpr LaunchShape kDefaultSums{132, 512, 8, 1, 0, 0};
constexpr int kMaxStages = 8;
// Chunks are split into pieces only when the request has fewer chunks than the grid has thread groups (a state
// component's ~2 MiB per-layer chunks, of which a load has one per layer; a load of one block): into pieces of
// about 16 KiB (at least, and a multiple of 1 KiB), so that the groups running at once work on a window of
// neighbouring pieces, as with 16 KiB chunks (0.95 / 0.92 of a contiguous copy on an H200, docs/performance.md).
// One piece per group instead (~140 KiB each for a Qwen3-Next snapshot) spread the reads in flight over the whole
// snapshot, and such loads reached 0.80.
constexpr uint32_t kMinPieceUnits = 1024;
constexpr uint32_t kPieceAlignUnits = 64;

struct CopyParams {
  const uint64_t* layer_base;
  uint64_t plane_stride;
  uint64_t block_stride;
  uint8_t* pool_base;
  uint64_t block_bytes;
  const uint32_t* gpu_blocks;
  const uint32_t* slots;
  uint64_t items;         // count * layers * planes * pieces
  uint32_t layer_begin;
  uint32_t layers;        // layer_end - layer_begin
  uint32_t planes;
  // The rank's part of a slot starts at this chunk: tp_rank * num_layers * planes (common/slot_order.h). The
  // checksum's unit index counts from the slot's start; the address from `host_first_chunk` (0 for a rank region,
  // HostPoolView::rank_region, whose "slot" is the rank's part alone).
  uint64_t rank_first_chunk;
  uint64_t host_first_chunk;
  uint32_t chunk16;       // chunk bytes / 16
  uint32_t pieces;        // pieces per chunk, each of piece16 units (the last may be shorter); 1: whole chunks
  uint32_t piece16;
  uint32_t group_threads; // threads copying one chunk (warps_per_chunk * 32)
  uint64_t* term_sums;    // checksummed gathers: one per pair, in device memory; else null
};

// The piece `item` (pair, layer, plane, piece) of a chunk on both sides, its length in 16-byte units, its pair,
// and the slot-relative index of its first 16-byte unit (the checksum's unit index; block_checksum.h).
template <bool kToHost>
__device__ __forceinline__ void ChunkAddrs(const CopyParams& p, uint64_t item, const uint8_t*& src, uint8_t*& dst,
                                           uint32_t& units, uint64_t& pair, uint32_t& first_unit) {
  uint32_t skip = 0;  // units of the chunk before this piece
  if (p.pieces > 1) {
    skip = static_cast<uint32_t>(item % p.pieces) * p.piece16;
    item /= p.pieces;
  }
  units = min(p.piece16, p.chunk16 - skip);
  const uint32_t plane = static_cast<uint32_t>(item % p.planes);
  const uint64_t rest = item / p.planes;
  const uint32_t layer = p.layer_begin + static_cast<uint32_t>(rest % p.layers);
  pair = rest / p.layers;
  const uint64_t block = __ldg(p.gpu_blocks + pair);
  const uint64_t slot = __ldg(p.slots + pair);
  uint8_t* gpu = reinterpret_cast<uint8_t*>(__ldg(reinterpret_cast<const unsigned long long*>(p.layer_base) + layer)) +
                 plane * p.plane_stride + block * p.block_stride + static_cast<uint64_t>(skip) * 16;
  // The slot order of common/slot_order.h: [tp shard][layer][plane][chunk]. The checksum's unit index is always
  // the chunk's place in the whole slot; a rank region (staged copies) leaves the other ranks' parts out.
  const uint64_t in_rank = static_cast<uint64_t>(layer) * p.planes + plane;
  const uint64_t chunk_in_slot = p.rank_first_chunk + in_rank;
  uint8_t* host = p.pool_base + slot * p.block_bytes + (p.host_first_chunk + in_rank) * (static_cast<uint64_t>(p.chunk16) * 16) +
                  static_cast<uint64_t>(skip) * 16;
  first_unit = static_cast<uint32_t>(chunk_in_slot * p.chunk16) + skip;  // modulo 2^32, as on the host
  src = kToHost ? gpu : host;
  dst = kToHost ? host : gpu;
}

template <bool kToHost>
__device__ __forceinline__ void ChunkAddrs(const CopyParams& p, uint64_t item, const uint8_t*& src, uint8_t*& dst,
                                           uint32_t& units) {
  uint64_t pair;
  uint32_t first_unit;
  ChunkAddrs<kToHost>(p, item, src, dst, units, pair, first_unit);
}

__device__ __forceinline__ uint64_t Term(const int4& v, uint32_t unit) {
  return ChecksumTerm(static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                      static_cast<uint32_t>(v.w), unit);
}

// Adds the warp's partial sums into *sum with one atomic. Every lane of the warp must call it.
__device__ __forceinline__ void AddWarpSum(uint64_t* sum, uint64_t v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if ((threadIdx.x & 31) == 0) atomicAdd(reinterpret_cast<unsigned long long*>(sum), static_cast<unsigned long long>(v));
}

// What a gather/scatter kernel does with each 16-byte unit it reads.
enum class UnitWork {
  kCopy,         // store it on the other side
  kCopyAndSum,   // store it and add its checksum term to its pair's sum (gathers)
  kSum,          // only add its term: the GPU side's sums for a copy the copy engine makes
};

// One group of `group_threads` threads per chunk (or piece of one), grid-stride over chunks ordered (pair, layer,
// plane, piece), so
// groups running at the same time write neighbouring parts of the same pool slot. Each thread keeps
// `kUnroll` 16-byte loads in flight before it stores them. Summing, each thread keeps its partial sum while
// its chunks belong to one pair and its warp adds it to the pair's sum with one atomic when the pair changes
// (so once per chunk with the default shapes, less with few CTAs); the loop is the same for every lane of a
// group, so the shuffles see the whole warp.
template <bool kToHost, int kUnroll, UnitWork kWork>
__global__ void __launch_bounds__(1024) CopyChunks(const CopyParams p) {
  constexpr bool kStore = kWork != UnitWork::kSum;
  constexpr bool kSums = kWork != UnitWork::kCopy;
  const uint64_t tid = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint32_t lane = static_cast<uint32_t>(tid % p.group_threads);
  const uint64_t groups = (static_cast<uint64_t>(gridDim.x) * blockDim.x) / p.group_threads;
  const uint32_t step = p.group_threads * kUnroll;
  uint64_t sum = 0, sum_pair = ~uint64_t{0};
  for (uint64_t item = tid / p.group_threads; item < p.items; item += groups) {
    const uint8_t* src_bytes;
    uint8_t* dst_bytes;
    uint64_t pair;
    uint32_t n, first_unit;
    ChunkAddrs<kToHost>(p, item, src_bytes, dst_bytes, n, pair, first_unit);
    if constexpr (kSums) {
      if (pair != sum_pair) {
        if (sum_pair != ~uint64_t{0}) AddWarpSum(p.term_sums + sum_pair, sum);
        sum = 0;
        sum_pair = pair;
      }
    }
    const int4* src = reinterpret_cast<const int4*>(src_bytes);
    int4* dst = reinterpret_cast<int4*>(dst_bytes);
    uint32_t k = lane;
    // Full rounds: no bounds checks, all loads issued before the first store.
    for (; k + (kUnroll - 1) * p.group_threads < n; k += step) {
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = __ldg(src + k + u * p.group_threads);
      if constexpr (kStore) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) __stcs(dst + k + u * p.group_threads, v[u]);
      }
      if constexpr (kSums) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) sum += Term(v[u], first_unit + k + u * p.group_threads);
      }
    }
    // Tail of a chunk that is not a multiple of one round.
    for (; k < n; k += p.group_threads) {
      const int4 v = __ldg(src + k);
      if constexpr (kStore) __stcs(dst + k, v);
      if constexpr (kSums) sum += Term(v, first_unit + k);
    }
  }
  if constexpr (kSums) {
    if (sum_pair != ~uint64_t{0}) AddWarpSum(p.term_sums + sum_pair, sum);
  }
}

__device__ __forceinline__ uint32_t SharedAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Bulk-copy variant: thread 0 of each CTA streams its chunks or pieces (grid-stride) through `stages` shared-memory
// buffers of `piece` bytes: bulk load global -> shared completing on an mbarrier, then bulk store
// shared -> global; a buffer is refilled once the store has read it.
template <bool kToHost>
__global__ void __launch_bounds__(32) BulkCopyChunks(const CopyParams p, uint32_t piece, uint32_t stages) {
  extern __shared__ __align__(128) uint8_t buffers[];
  __shared__ __align__(8) uint64_t bars[kMaxStages];
  if (threadIdx.x != 0) return;
  for (uint32_t s = 0; s < stages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(SharedAddr(&bars[s])));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");

  uint64_t item = blockIdx.x;
  uint32_t off = 0, units = 0;
  const uint8_t* csrc = nullptr;
  uint8_t* cdst = nullptr;
  if (item < p.items) ChunkAddrs<kToHost>(p, item, csrc, cdst, units);
  auto next = [&](const uint8_t*& src, uint8_t*& dst, uint32_t& n) {
    if (item >= p.items) return false;
    n = min(piece, units * 16 - off);
    src = csrc + off;
    dst = cdst + off;
    off += n;
    if (off == units * 16) {
      off = 0;
      item += gridDim.x;
      if (item < p.items) ChunkAddrs<kToHost>(p, item, csrc, cdst, units);
    }
    return true;
  };
  auto load = [&](uint32_t stage, const uint8_t* src, uint32_t n) {
    const uint32_t bar = SharedAddr(&bars[stage]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(n) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     SharedAddr(buffers + stage * piece)),
                 "l"(__cvta_generic_to_global(src)), "r"(n), "r"(bar)
                 : "memory");
  };

  uint8_t* dsts[kMaxStages];
  uint32_t sizes[kMaxStages];
  uint32_t head = 0, tail = 0;
  const uint8_t* src;
  uint8_t* dst;
  uint32_t n;
  while (head < stages && next(src, dst, n)) {
    load(head, src, n);
    dsts[head] = dst;
    sizes[head] = n;
    ++head;
  }
  while (tail < head) {
    const uint32_t stage = tail % stages;
    const uint32_t parity = (tail / stages) & 1;
    uint32_t done = 0;
    do {
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(SharedAddr(&bars[stage])), "r"(parity)
          : "memory");
    } while (!done);
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(__cvta_generic_to_global(dsts[stage])),
                 "r"(SharedAddr(buffers + stage * piece)), "r"(sizes[stage])
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    ++tail;
    if (next(src, dst, n)) {
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      load(stage, src, n);
      dsts[stage] = dst;
      sizes[stage] = n;
      ++head;
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

bool ValidShape(const LaunchShape& s) {
  if (s.bulk_kib != 0)
    return s.ctas > 0 && s.bulk_kib > 0 && s.bulk_kib <= 64 && s.stages > 0 && s.stages <= kMaxStages &&
           s.bulk_kib * s.stages <= 224;
  if (s.ctas <= 0 || s.threads <= 0 || s.threads > 1024 || s.threads % 32 != 0) return false;
  if (s.unroll != 1 && s.unroll != 2 && s.unroll != 4 && s.unroll != 8) return false;
  if (s.warps_per_chunk <= 0 || (s.threads / 32) % s.warps_per_chunk != 0) return false;
  return true;
}

LaunchShape ResolveWith(LaunchShape s, const LaunchShape& d) {
  if (s.ctas == 0) s.ctas = d.ctas;
  if (s.threads == 0) s.threads = d.threads;
  if (s.unroll == 0) s.unroll = d.unroll;
  if (s.warps_per_chunk == 0) s.warps_per_chunk = d.warps_per_chunk;
  if (s.bulk_kib != 0 && s.stages == 0) s.stages = 4;
  return s;
}

LaunchShape Resolve(const LaunchShape& s, bool to_host) { return ResolveWith(s, to_host ? kDefaultGather : kDefaultScatter); }

bool Aligned16(uint64_t v) { return v % 16 == 0; }

// How many pieces to cut each of `chunks` chunks of `chunk16` units into when `groups` thread groups copy them
// (see kMinPieceUnits); 1 when there are chunks enough for every group.
uint32_t PiecesPerChunk(uint64_t chunks, uint64_t groups, uint32_t chunk16) {
  if (chunks == 0 || chunks >= groups) return 1;
  return std::max<uint32_t>(1, chunk16 / kMinPieceUnits);
}

// Checks what can be checked on the host (device arrays are not read here).
cudaError_t Validate(const GpuKvView& gpu, const HostPoolView& pool, uint32_t layer_begin, uint32_t layer_end) {
  if (gpu.num_planes == 0 || gpu.chunk_bytes == 0 || !Aligned16(gpu.chunk_bytes) ||
      gpu.chunk_bytes / 16 > 0x7fffffffu || !Aligned16(gpu.plane_stride) || !Aligned16(gpu.block_stride))
    return cudaErrorInvalidValue;
  if (pool.base == nullptr || !Aligned16(reinterpret_cast<uintptr_t>(pool.base)) || !Aligned16(pool.block_bytes) ||
      pool.tp_shards == 0 || pool.tp_rank >= pool.tp_shards)
    return cudaErrorInvalidValue;
  if (layer_begin > layer_end || layer_end > gpu.num_layers) return cudaErrorInvalidValue;
  const uint64_t needed = static_cast<uint64_t>(gpu.num_layers) * gpu.num_planes * gpu.chunk_bytes *
                          (pool.rank_region ? 1 : pool.tp_shards);
  if (pool.block_bytes < needed) return cudaErrorInvalidValue;
  return cudaSuccess;
}

template <bool kToHost, UnitWork kWork = UnitWork::kCopy>
cudaError_t Launch(const GpuKvView& gpu, const HostPoolView& pool, const BlockPairs& pairs, cudaStream_t stream,
                   const LaunchShape& requested, uint64_t* term_sums = nullptr) {
  if (cudaError_t e = Validate(gpu, pool, pairs.layer_begin, pairs.layer_end); e != cudaSuccess) return e;
  LaunchShape s = requested;
  if constexpr (kWork != UnitWork::kCopy) {
    if (term_sums == nullptr || reinterpret_cast<uintptr_t>(term_sums) % alignof(uint64_t) != 0)
      return cudaErrorInvalidValue;
    // Summing needs every thread to see its units: the 16-byte kernel, in the requested shape's CTAs or the
    // summing default.
    if (s.bulk_kib != 0) s = LaunchShape{s.ctas, 0, 0, 0, 0, 0};
  }
  s = kWork == UnitWork::kSum ? ResolveWith(s, kDefaultSums) : Resolve(s, kToHost);
  if (!ValidShape(s)) return cudaErrorInvalidValue;
  if (pairs.count == 0 || pairs.layer_begin == pairs.layer_end) return cudaSuccess;
  if (gpu.layer_base == nullptr || pairs.gpu_blocks == nullptr || pairs.slots == nullptr) return cudaErrorInvalidValue;

  CopyParams p{};
  p.layer_base = gpu.layer_base;
  p.plane_stride = gpu.plane_stride;
  p.block_stride = gpu.block_stride;
  p.pool_base = pool.base;
  p.block_bytes = pool.block_bytes;
  p.gpu_blocks = pairs.gpu_blocks;
  p.slots = pairs.slots;
  p.layer_begin = pairs.layer_begin;
  p.layers = pairs.layer_end - pairs.layer_begin;
  p.planes = gpu.num_planes;
  p.rank_first_chunk = static_cast<uint64_t>(pool.tp_rank) * gpu.num_layers * gpu.num_planes;
  p.host_first_chunk = pool.rank_region ? 0 : p.rank_first_chunk;
  p.chunk16 = static_cast<uint32_t>(gpu.chunk_bytes / 16);
  p.group_threads = static_cast<uint32_t>(s.warps_per_chunk) * 32;
  p.term_sums = term_sums;
  const bool bulk = kWork == UnitWork::kCopy && s.bulk_kib != 0;
  const uint64_t chunks = static_cast<uint64_t>(pairs.count) * p.layers * p.planes;
  const uint64_t groups =
      bulk ? static_cast<uint64_t>(s.ctas) : static_cast<uint64_t>(s.ctas) * (static_cast<uint32_t>(s.threads) / p.group_threads);
  p.pieces = PiecesPerChunk(chunks, groups, p.chunk16);
  p.piece16 = (p.chunk16 + p.pieces - 1) / p.pieces;
  if (p.pieces > 1) {
    p.piece16 = (p.piece16 + kPieceAlignUnits - 1) / kPieceAlignUnits * kPieceAlignUnits;
    p.pieces = (p.chunk16 + p.piece16 - 1) / p.piece16;
  }
  p.items = chunks * p.pieces;

  // No more CTAs than there are chunks (pieces) to give their groups.
  if (bulk) {
    const uint32_t piece = static_cast<uint32_t>(s.bulk_kib) * 1024;
    const size_t smem = static_cast<size_t>(piece) * static_cast<uint32_t>(s.stages);
    const unsigned grid = static_cast<unsigned>(std::min<uint64_t>(static_cast<uint64_t>(s.ctas), p.items));
    if (smem > 48 * 1024) {
      const cudaError_t e = cudaFuncSetAttribute(BulkCopyChunks<kToHost>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(smem));
      if (e != cudaSuccess) return e;
    }
    BulkCopyChunks<kToHost><<<grid, 32, smem, stream>>>(p, piece, static_cast<uint32_t>(s.stages));
    return cudaGetLastError();
  }
  const uint64_t groups_per_cta = static_cast<uint64_t>(s.threads) / p.group_threads;
  const uint64_t useful = (p.items + groups_per_cta - 1) / groups_per_cta;
  const unsigned grid = static_cast<unsigned>(std::min<uint64_t>(static_cast<uint64_t>(s.ctas), useful));
  const dim3 block(static_cast<unsigned>(s.threads));
  switch (s.unroll) {
    case 1: CopyChunks<kToHost, 1, kWork><<<grid, block, 0, stream>>>(p); break;
    case 2: CopyChunks<kToHost, 2, kWork><<<grid, block, 0, stream>>>(p); break;
    case 4: CopyChunks<kToHost, 4, kWork><<<grid, block, 0, stream>>>(p); break;
    default: CopyChunks<kToHost, 8, kWork><<<grid, block, 0, stream>>>(p); break;
  }
  return cudaGetLastError();
}

// One cudaMemcpyBatchAsync of the copies (dsts[i] <- srcs[i], sizes[i] bytes) on `stream`. The batch API refuses the
// legacy default stream and older drivers lack it: then one cudaMemcpyAsync per copy.
cudaError_t CopyBatch(std::vector<void*>& dsts, std::vector<const void*>& srcs, std::vector<size_t>& sizes,
                      unsigned flags, cudaStream_t stream) {
  if (stream != nullptr && stream != cudaStreamLegacy) {
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = flags;
    size_t attr_idx = 0;
    const cudaError_t e =
        cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), dsts.size(), &attr, &attr_idx, 1, stream);
    if (e != cudaErrorNotSupported) return e;
    (void)cudaGetLastError();  // clear the refusal before falling back
  }
  for (size_t i = 0; i < dsts.size(); ++i) {
    if (cudaError_t c = cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault, stream); c != cudaSuccess) return c;
  }
  return cudaSuccess;
}

}  // namespace

LaunchShape DefaultLaunchShape(bool to_host) { return to_host ? kDefaultGather : kDefaultScatter; }

cudaError_t LaunchGather(const GpuKvView& gpu, const HostPoolView& pool, const BlockPairs& pairs, cudaStream_t stream,
                         int ctas) {
  LaunchShape s;
  s.ctas = ctas;
  return Launch<true>(gpu, pool, pairs, stream, s);
}

cudaError_t LaunchScatter(const GpuKvView& gpu, const HostPoolView& pool, const BlockPairs& pairs, cudaStream_t stream,
                          int ctas) {
  LaunchShape s;
  s.ctas = ctas;
  return Launch<false>(gpu, pool, pairs, stream, s);
}

cudaError_t LaunchGatherShaped(const GpuKvView& gpu, const HostPoolView& pool, const BlockPairs& pairs,
                               cudaStream_t stream, const LaunchShape& shape) {
  return Launch<true>(gpu, pool, pairs, stream, shape);
}

cudaError_t LaunchScatterShaped(const GpuKvView& gpu, const HostPoolView& pool, const BlockPairs& pairs,
                                cudaStream_t stream, const LaunchShape& shape) {
  return Launch<false>(gpu, pool, pairs, stream, shape);
}

cudaError_t LaunchGatherChecksummed(const GpuKvView& gpu, const HostPoolView& pool, const BlockPairs& pairs,
                                    uint64_t* term_sums, cudaStream_t stream, const LaunchShape& shape) {
  return Launch<true, UnitWork::kCopyAndSum>(gpu, pool, pairs, stream, shape, term_sums);
}

cudaError_t LaunchChecksumTerms(const GpuKvView& gpu, const HostPoolView& pool, const BlockPairs& pairs,
                                uint64_t* term_sums, cudaStream_t stream, const LaunchShape& shape) {
  return Launch<true, UnitWork::kSum>(gpu, pool, pairs, stream, shape, term_sums);
}

cudaError_t CopyEngineBatch(const uint64_t* layer_base_host, const GpuKvView& gpu, const HostPoolView& pool,
                            const uint32_t* gpu_blocks_host, const uint32_t* slots_host, uint32_t count,
                            uint32_t layer_begin, uint32_t layer_end, bool to_host, cudaStream_t stream,
                            const uint8_t* follows_host) {
  if (cudaError_t e = Validate(gpu, pool, layer_begin, layer_end); e != cudaSuccess) return e;
  if (pool.rank_region) return cudaErrorInvalidValue;  // the staged copies' buffers are the kernels' alone
  if (count == 0 || layer_begin == layer_end) return cudaSuccess;
  if (layer_base_host == nullptr || gpu_blocks_host == nullptr || slots_host == nullptr) return cudaErrorInvalidValue;

  // One entry per chunk in (pair, layer, plane) order; an entry contiguous on both sides with the one before it
  // (BLOCKFIRST GPU layouts, any TP rank: a rank's part of a slot is one run) is merged into it, unless that would
  // cross from one layer's allocation into another's (LAYERFIRST tensors that happen to be adjacent: a layer holding
  // one block or state snapshot in a small cudaMalloc each) or from one pool slot into the next (the pool is
  // registered for DMA grant by grant: neighbouring slots may lie in two registrations, which one copy must not span)
  // - except where the caller marked the slot as following the last one in the same registration (slot runs).
  const size_t chunks = static_cast<size_t>(count) * (layer_end - layer_begin) * gpu.num_planes;
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  dsts.reserve(chunks);
  srcs.reserve(chunks);
  sizes.reserve(chunks);
  uint32_t last_layer = ~0u;  // the layer of the last entry's chunks
  uint32_t last_pair = ~0u;   // the (GPU block, slot) pair of the last entry's chunks
  for (uint32_t i = 0; i < count; ++i) {
    uint8_t* slot = pool.base + static_cast<uint64_t>(slots_host[i]) * pool.block_bytes;
    for (uint32_t l = layer_begin; l < layer_end; ++l) {
      for (uint32_t p = 0; p < gpu.num_planes; ++p) {
        // The GPU address is an integer here; it is only ever handed to the copy API.
        uint8_t* g = reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(layer_base_host[l] + p * gpu.plane_stride +
                                                                       gpu_blocks_host[i] * gpu.block_stride));
        uint8_t* h = slot + ((static_cast<uint64_t>(pool.tp_rank) * gpu.num_layers + l) * gpu.num_planes + p) *
                                gpu.chunk_bytes;
        uint8_t* d = to_host ? h : g;
        const uint8_t* s = to_host ? g : h;
        const bool same_allocation = gpu.layers_in_one_allocation || last_layer == l;
        const bool same_run = last_pair == i || (i > 0 && last_pair + 1 == i && follows_host != nullptr && follows_host[i] != 0 &&
                                                 slots_host[i] == slots_host[i - 1] + 1);
        if (same_allocation && same_run && !sizes.empty() &&
            static_cast<uint8_t*>(dsts.back()) + sizes.back() == d &&
            static_cast<const uint8_t*>(srcs.back()) + sizes.back() == s) {
          sizes.back() += gpu.chunk_bytes;
        } else {
          dsts.push_back(d);
          srcs.push_back(s);
          sizes.push_back(gpu.chunk_bytes);
          last_layer = l;
          last_pair = i;
        }
      }
    }
  }

  return CopyBatch(dsts, srcs, sizes, cudaMemcpyFlagDefault, stream);
}

bool CanStage(const GpuKvView& gpu, const HostPoolView& pool, uint32_t layer_begin, uint32_t layer_end) {
  return !pool.rank_region && layer_begin == 0 && layer_end == gpu.num_layers && gpu.num_layers > 0 &&
         Validate(gpu, pool, layer_begin, layer_end) == cudaSuccess;
}

uint64_t StagedSlotBytes(const GpuKvView& gpu) {
  return static_cast<uint64_t>(gpu.num_layers) * gpu.num_planes * gpu.chunk_bytes;
}

cudaError_t StagingRing::Create(uint64_t bytes, uint32_t buffers, std::unique_ptr<StagingRing>* out) {
  out->reset();
  if (buffers < 2 || bytes / buffers < 16) return cudaErrorInvalidValue;
  std::unique_ptr<StagingRing> ring(new StagingRing());
  ring->buffers_ = buffers;
  ring->buffer_bytes_ = bytes / buffers / 16 * 16;
  void* memory = nullptr;
  if (cudaError_t e = cudaMalloc(&memory, ring->buffer_bytes_ * buffers); e != cudaSuccess) return e;
  ring->memory_ = static_cast<uint8_t*>(memory);
  void* indices = nullptr;
  if (cudaError_t e = cudaMalloc(&indices, sizeof(uint32_t) * kMaxSlotsPerBuffer); e != cudaSuccess) return e;
  ring->indices_ = static_cast<uint32_t*>(indices);
  std::vector<uint32_t> iota(kMaxSlotsPerBuffer);
  for (uint32_t i = 0; i < kMaxSlotsPerBuffer; ++i) iota[i] = i;
  if (cudaError_t e = cudaMemcpy(ring->indices_, iota.data(), sizeof(uint32_t) * kMaxSlotsPerBuffer, cudaMemcpyHostToDevice);
      e != cudaSuccess)
    return e;
  if (cudaError_t e = cudaStreamCreateWithFlags(&ring->copy_stream_, cudaStreamNonBlocking); e != cudaSuccess) return e;
  if (cudaError_t e = cudaEventCreateWithFlags(&ring->done_, cudaEventDisableTiming); e != cudaSuccess) return e;
  if (cudaError_t e = cudaEventCreateWithFlags(&ring->last_use_, cudaEventDisableTiming); e != cudaSuccess) return e;
  for (auto* v : {&ring->ready_, &ring->free_}) {
    for (uint32_t i = 0; i < buffers; ++i) {
      cudaEvent_t ev = nullptr;
      if (cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming); e != cudaSuccess) return e;
      v->push_back(ev);
    }
  }
  *out = std::move(ring);
  return cudaSuccess;
}

StagingRing::~StagingRing() {
  // Whatever a call enqueued must finish before the memory goes (its caller waits on its stream; this is the
  // guard for a ring dropped after an error).
  if (copy_stream_ != nullptr) cudaStreamSynchronize(copy_stream_);
  if (last_use_ != nullptr) {
    cudaEventSynchronize(last_use_);  // the callers' kernels (a never-recorded event returns at once)
    cudaEventDestroy(last_use_);
  }
  for (cudaEvent_t e : ready_) cudaEventDestroy(e);
  for (cudaEvent_t e : free_) cudaEventDestroy(e);
  if (done_ != nullptr) cudaEventDestroy(done_);
  if (copy_stream_ != nullptr) cudaStreamDestroy(copy_stream_);
  if (indices_ != nullptr) cudaFree(indices_);
  if (memory_ != nullptr) cudaFree(memory_);
}

uint32_t StagingRing::SlotsPerBuffer(uint64_t slot_bytes) const {
  if (slot_bytes == 0) return 0;
  return static_cast<uint32_t>(std::min<uint64_t>(buffer_bytes_ / slot_bytes, kMaxSlotsPerBuffer));
}


// StagedCopy's batches (a friend of StagingRing, declared there).
cudaError_t EnqueueStaged(const GpuKvView& gpu, const HostPoolView& pool, const uint32_t* gpu_blocks_dev,
                          const uint32_t* slots_host, uint32_t count, bool to_host, StagingRing& ring,
                          cudaStream_t stream, uint64_t* term_sums, unsigned copy_flags, uint64_t slot_bytes,
                          uint32_t per_buffer, const uint8_t* follows_host);

cudaError_t StagedCopy(const GpuKvView& gpu, const HostPoolView& pool, const uint32_t* gpu_blocks_dev,
                       const uint32_t* slots_host, uint32_t count, bool to_host, StagingRing& ring, cudaStream_t stream,
                       uint64_t* term_sums, unsigned copy_flags, const uint8_t* follows_host) {
  if (!CanStage(gpu, pool, 0, gpu.num_layers)) return cudaErrorInvalidValue;
  const uint64_t slot_bytes = StagedSlotBytes(gpu);
  const uint32_t per_buffer = ring.SlotsPerBuffer(slot_bytes);
  if (per_buffer == 0 || pool.block_bytes < slot_bytes * pool.tp_shards) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  if (gpu_blocks_dev == nullptr || slots_host == nullptr || stream == nullptr) return cudaErrorInvalidValue;

  const cudaError_t e = EnqueueStaged(gpu, pool, gpu_blocks_dev, slots_host, count, to_host, ring, stream, term_sums,
                                      copy_flags, slot_bytes, per_buffer, follows_host);
  // On an error part of the copies may be in flight on the ring's stream, which the caller does not wait for: they
  // must end before the caller hands the slots or the GPU blocks to anyone else.
  if (e != cudaSuccess) cudaStreamSynchronize(ring.copy_stream_);
  (void)cudaEventRecord(ring.last_use_, stream);
  return e;
}

cudaError_t EnqueueStaged(const GpuKvView& gpu, const HostPoolView& pool, const uint32_t* gpu_blocks_dev,
                          const uint32_t* slots_host, uint32_t count, bool to_host, StagingRing& ring,
                          cudaStream_t stream, uint64_t* term_sums, unsigned copy_flags, uint64_t slot_bytes,
                          uint32_t per_buffer, const uint8_t* follows_host) {
  // Slot runs travel as one copy where a rank's part is the whole slot (else other ranks' parts lie between).
  const bool runs = follows_host != nullptr && pool.block_bytes == slot_bytes;
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  dsts.reserve(per_buffer);
  srcs.reserve(per_buffer);
  sizes.reserve(per_buffer);
  for (uint64_t first64 = 0; first64 < count; first64 += per_buffer) {
    const uint32_t first = static_cast<uint32_t>(first64);
    const uint32_t n = std::min(per_buffer, count - first);
    const uint32_t buf = ring.next_;
    ring.next_ = (ring.next_ + 1) % ring.buffers_;
    uint8_t* staging = ring.memory_ + static_cast<uint64_t>(buf) * ring.buffer_bytes_;
    // The staging buffer holds each pair's rank part alone; its checksum units are counted where the part lies in
    // the pool's slot (rank_region).
    const HostPoolView stage{staging, slot_bytes, pool.tp_shards, pool.tp_rank, /*rank_region=*/true};
    const uint64_t part_offset = static_cast<uint64_t>(pool.tp_rank) * slot_bytes;
    const BlockPairs pairs{gpu_blocks_dev + first, ring.indices_, n, 0, gpu.num_layers};
    dsts.clear();
    srcs.clear();
    sizes.clear();
    for (uint32_t j = 0; j < n; ++j) {
      uint8_t* slot = pool.base + static_cast<uint64_t>(slots_host[first + j]) * pool.block_bytes + part_offset;
      uint8_t* staged = staging + static_cast<uint64_t>(j) * slot_bytes;
      if (runs && j > 0 && follows_host[first + j] != 0 && slots_host[first + j] == slots_host[first + j - 1] + 1) {
        sizes.back() += slot_bytes;  // both sides go on where the last copy ends
        continue;
      }
      dsts.push_back(to_host ? slot : staged);
      srcs.push_back(to_host ? staged : slot);
      sizes.push_back(slot_bytes);
    }
    if (to_host) {
      // Pack once the copy engine has copied this buffer's last batch out; copy once packed.
      if (cudaError_t e = cudaStreamWaitEvent(stream, ring.free_[buf], 0); e != cudaSuccess) return e;
      const cudaError_t packed = term_sums != nullptr
                                     ? LaunchGatherChecksummed(gpu, stage, pairs, term_sums + first, stream)
                                     : LaunchGather(gpu, stage, pairs, stream);
      if (packed != cudaSuccess) return packed;
      if (cudaError_t e = cudaEventRecord(ring.ready_[buf], stream); e != cudaSuccess) return e;
      if (cudaError_t e = cudaStreamWaitEvent(ring.copy_stream_, ring.ready_[buf], 0); e != cudaSuccess) return e;
      if (cudaError_t e = CopyBatch(dsts, srcs, sizes, copy_flags, ring.copy_stream_); e != cudaSuccess) return e;
      if (cudaError_t e = cudaEventRecord(ring.free_[buf], ring.copy_stream_); e != cudaSuccess) return e;
    } else {
      // Land once this buffer's last batch was unpacked (and after what `stream` ran before this call: the
      // ring's copies must not pass a caller's earlier work on the buffers); unpack once landed.
      if (first == 0) {
        if (cudaError_t e = cudaEventRecord(ring.done_, stream); e != cudaSuccess) return e;
        if (cudaError_t e = cudaStreamWaitEvent(ring.copy_stream_, ring.done_, 0); e != cudaSuccess) return e;
      }
      if (cudaError_t e = cudaStreamWaitEvent(ring.copy_stream_, ring.free_[buf], 0); e != cudaSuccess) return e;
      if (cudaError_t e = CopyBatch(dsts, srcs, sizes, copy_flags, ring.copy_stream_); e != cudaSuccess) return e;
      if (cudaError_t e = cudaEventRecord(ring.ready_[buf], ring.copy_stream_); e != cudaSuccess) return e;
      if (cudaError_t e = cudaStreamWaitEvent(stream, ring.ready_[buf], 0); e != cudaSuccess) return e;
      if (cudaError_t e = LaunchScatter(gpu, stage, pairs, stream); e != cudaSuccess) return e;
      if (cudaError_t e = cudaEventRecord(ring.free_[buf], stream); e != cudaSuccess) return e;
    }
  }
  if (to_host) {
    // The stores end on the copy stream: join it back.
    if (cudaError_t e = cudaEventRecord(ring.done_, ring.copy_stream_); e != cudaSuccess) return e;
    if (cudaError_t e = cudaStreamWaitEvent(stream, ring.done_, 0); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace flexkv::cuda
