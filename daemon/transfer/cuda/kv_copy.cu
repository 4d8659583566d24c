// GPU <-> host-pool block copies (DESIGN §4.6): gather/scatter kernels that touch every byte once with
// 16-byte accesses, writing to / reading from the registered pool over PCIe, and a copy-engine batch.
#include "kv_copy.h"

#include <algorithm>
#include <vector>

namespace flexkv::cuda {
namespace {

// Defaults measured on an H200 (sm_90, PCIe Gen5 host link), see docs/performance.md. D2H stores to the
// pool are posted writes: a few SMs keep the link full. H2D loads from the pool wait ~1-2 us on the link,
// so the load side wants more bytes in flight (more CTAs, deeper unroll).
constexpr LaunchShape kDefaultGather{16, 512, 4, 1};
constexpr LaunchShape kDefaultScatter{32, 512, 4, 1};

struct CopyParams {
  const uint64_t* layer_base;
  uint64_t plane_stride;
  uint64_t block_stride;
  uint8_t* pool_base;
  uint64_t block_bytes;
  const uint32_t* gpu_blocks;
  const uint32_t* slots;
  uint64_t items;         // count * layers * planes
  uint32_t layer_begin;
  uint32_t layers;        // layer_end - layer_begin
  uint32_t planes;
  uint32_t tp_shards;
  uint32_t tp_rank;
  uint32_t chunk16;       // chunk bytes / 16
  uint32_t group_threads; // threads copying one chunk (warps_per_chunk * 32)
};

// One group of `group_threads` threads per chunk, grid-stride over chunks ordered (pair, layer, plane), so
// groups running at the same time write neighbouring parts of the same pool slot. Each thread keeps
// `kUnroll` 16-byte loads in flight before it stores them.
template <bool kToHost, int kUnroll>
__global__ void __launch_bounds__(1024) CopyChunks(const CopyParams p) {
  const uint64_t tid = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint32_t lane = static_cast<uint32_t>(tid % p.group_threads);
  const uint64_t groups = (static_cast<uint64_t>(gridDim.x) * blockDim.x) / p.group_threads;
  const uint32_t step = p.group_threads * kUnroll;
  for (uint64_t item = tid / p.group_threads; item < p.items; item += groups) {
    const uint32_t plane = static_cast<uint32_t>(item % p.planes);
    const uint64_t rest = item / p.planes;
    const uint32_t layer = p.layer_begin + static_cast<uint32_t>(rest % p.layers);
    const uint64_t pair = rest / p.layers;
    const uint64_t block = __ldg(p.gpu_blocks + pair);
    const uint64_t slot = __ldg(p.slots + pair);
    uint8_t* gpu = reinterpret_cast<uint8_t*>(__ldg(reinterpret_cast<const unsigned long long*>(p.layer_base) + layer)) +
                   plane * p.plane_stride + block * p.block_stride;
    uint8_t* host = p.pool_base + slot * p.block_bytes +
                    ((static_cast<uint64_t>(layer) * p.planes + plane) * p.tp_shards + p.tp_rank) *
                        (static_cast<uint64_t>(p.chunk16) * 16);
    const int4* src = reinterpret_cast<const int4*>(kToHost ? gpu : host);
    int4* dst = reinterpret_cast<int4*>(kToHost ? host : gpu);
    const uint32_t n = p.chunk16;
    uint32_t k = lane;
    // Full rounds: no bounds checks, all loads issued before the first store.
    for (; k + (kUnroll - 1) * p.group_threads < n; k += step) {
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = __ldg(src + k + u * p.group_threads);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) __stcs(dst + k + u * p.group_threads, v[u]);
    }
    // Tail of a chunk that is not a multiple of one round.
    for (; k < n; k += p.group_threads) __stcs(dst + k, __ldg(src + k));
  }
}

bool ValidShape(const LaunchShape& s) {
  if (s.ctas <= 0 || s.threads <= 0 || s.threads > 1024 || s.threads % 32 != 0) return false;
  if (s.unroll != 1 && s.unroll != 2 && s.unroll != 4 && s.unroll != 8) return false;
  if (s.warps_per_chunk <= 0 || (s.threads / 32) % s.warps_per_chunk != 0) return false;
  return true;
}

LaunchShape Resolve(LaunchShape s, bool to_host) {
  const LaunchShape d = to_host ? kDefaultGather : kDefaultScatter;
  if (s.ctas == 0) s.ctas = d.ctas;
  if (s.threads == 0) s.threads = d.threads;
  if (s.unroll == 0) s.unroll = d.unroll;
  if (s.warps_per_chunk == 0) s.warps_per_chunk = d.warps_per_chunk;
  return s;
}

bool Aligned16(uint64_t v) { return v % 16 == 0; }

// Checks what can be checked on the host (device arrays are not read here).
cudaError_t Validate(const GpuKvView& gpu, const HostPoolView& pool, uint32_t layer_begin, uint32_t layer_end) {
  if (gpu.num_planes == 0 || gpu.chunk_bytes == 0 || !Aligned16(gpu.chunk_bytes) ||
      gpu.chunk_bytes / 16 > 0x7fffffffu || !Aligned16(gpu.plane_stride) || !Aligned16(gpu.block_stride))
    return cudaErrorInvalidValue;
  if (pool.base == nullptr || !Aligned16(reinterpret_cast<uintptr_t>(pool.base)) || !Aligned16(pool.block_bytes) ||
      pool.tp_shards == 0 || pool.tp_rank >= pool.tp_shards)
    return cudaErrorInvalidValue;
  if (layer_begin > layer_end || layer_end > gpu.num_layers) return cudaErrorInvalidValue;
  const uint64_t needed = static_cast<uint64_t>(gpu.num_layers) * gpu.num_planes * pool.tp_shards * gpu.chunk_bytes;
  if (pool.block_bytes < needed) return cudaErrorInvalidValue;
  return cudaSuccess;
}

template <bool kToHost>
cudaError_t Launch(const GpuKvView& gpu, const HostPoolView& pool, const BlockPairs& pairs, cudaStream_t stream,
                   const LaunchShape& requested) {
  if (cudaError_t e = Validate(gpu, pool, pairs.layer_begin, pairs.layer_end); e != cudaSuccess) return e;
  const LaunchShape s = Resolve(requested, kToHost);
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
  p.items = static_cast<uint64_t>(pairs.count) * p.layers * p.planes;
  p.tp_shards = pool.tp_shards;
  p.tp_rank = pool.tp_rank;
  p.chunk16 = static_cast<uint32_t>(gpu.chunk_bytes / 16);
  p.group_threads = static_cast<uint32_t>(s.warps_per_chunk) * 32;

  // No more CTAs than there are chunks to give their groups.
  const uint64_t groups_per_cta = static_cast<uint64_t>(s.threads) / p.group_threads;
  const uint64_t useful = (p.items + groups_per_cta - 1) / groups_per_cta;
  const unsigned grid = static_cast<unsigned>(std::min<uint64_t>(static_cast<uint64_t>(s.ctas), useful));
  const dim3 block(static_cast<unsigned>(s.threads));
  switch (s.unroll) {
    case 1: CopyChunks<kToHost, 1><<<grid, block, 0, stream>>>(p); break;
    case 2: CopyChunks<kToHost, 2><<<grid, block, 0, stream>>>(p); break;
    case 4: CopyChunks<kToHost, 4><<<grid, block, 0, stream>>>(p); break;
    default: CopyChunks<kToHost, 8><<<grid, block, 0, stream>>>(p); break;
  }
  return cudaGetLastError();
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

cudaError_t CopyEngineBatch(const uint64_t* layer_base_host, const GpuKvView& gpu, const HostPoolView& pool,
                            const uint32_t* gpu_blocks_host, const uint32_t* slots_host, uint32_t count,
                            uint32_t layer_begin, uint32_t layer_end, bool to_host, cudaStream_t stream) {
  if (cudaError_t e = Validate(gpu, pool, layer_begin, layer_end); e != cudaSuccess) return e;
  if (count == 0 || layer_begin == layer_end) return cudaSuccess;
  if (layer_base_host == nullptr || gpu_blocks_host == nullptr || slots_host == nullptr) return cudaErrorInvalidValue;

  // One entry per chunk in (pair, layer, plane) order; an entry contiguous on both sides with the one before
  // it (BLOCKFIRST GPU layouts with one TP shard) is merged into it.
  const size_t chunks = static_cast<size_t>(count) * (layer_end - layer_begin) * gpu.num_planes;
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  dsts.reserve(chunks);
  srcs.reserve(chunks);
  sizes.reserve(chunks);
  for (uint32_t i = 0; i < count; ++i) {
    uint8_t* slot = pool.base + static_cast<uint64_t>(slots_host[i]) * pool.block_bytes;
    for (uint32_t l = layer_begin; l < layer_end; ++l) {
      for (uint32_t p = 0; p < gpu.num_planes; ++p) {
        // The GPU address is an integer here; it is only ever handed to the copy API.
        uint8_t* g = reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(layer_base_host[l] + p * gpu.plane_stride +
                                                                       gpu_blocks_host[i] * gpu.block_stride));
        uint8_t* h = slot + ((static_cast<uint64_t>(l) * gpu.num_planes + p) * pool.tp_shards + pool.tp_rank) *
                                gpu.chunk_bytes;
        uint8_t* d = to_host ? h : g;
        const uint8_t* s = to_host ? g : h;
        if (!sizes.empty() && static_cast<uint8_t*>(dsts.back()) + sizes.back() == d &&
            static_cast<const uint8_t*>(srcs.back()) + sizes.back() == s) {
          sizes.back() += gpu.chunk_bytes;
        } else {
          dsts.push_back(d);
          srcs.push_back(s);
          sizes.push_back(gpu.chunk_bytes);
        }
      }
    }
  }

  // The batch API refuses the legacy default stream; such callers get per-chunk copies, as do drivers
  // without the batch entry point.
  if (stream != nullptr && stream != cudaStreamLegacy) {
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagDefault;
    size_t attr_idx = 0;
    const cudaError_t e =
        cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), dsts.size(), &attr, &attr_idx, 1, stream);
    if (e != cudaErrorNotSupported) return e;
    (void)cudaGetLastError();  // clear the refusal before falling back
  }
  for (size_t i = 0; i < dsts.size(); ++i) {
    const cudaError_t e = cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault, stream);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace flexkv::cuda
