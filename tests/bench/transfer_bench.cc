// flexkv-bench transfer: block copies between a vLLM-shaped GPU KV cache and a registered host pool
// (the daemon's CUDA backend path), for the gather/scatter kernels and the copy-engine batch, each next to the contiguous
// pinned-copy ceiling measured in the same run.
// Over 700 lines: one experiment (fixture, byte checks, measurements, sweep, report) around one Bench object; the parts
// that stand alone already have files of their own (transfer_geometry, transfer_layer_events, transfer_two_way).
//
//   GPU KV cache: LAYERFIRST, one cudaMalloc'ed tensor per layer of [2][blocks][chunk] (vLLM).
//   Host pool:    `blocks` slots of layers*2*chunk bytes in anonymous page-aligned memory (like the daemon's
//                 /dev/shm pool), cudaHostRegister'ed (portable) in pieces of at most 64 GiB.
//   Map:          GPU block i <-> slot perm[i], perm a random permutation.
//   store = gather (GPU -> pool), load = scatter (pool -> GPU),
//   kernel = the gather/scatter kernels alone; staged = the daemon's default path for whole-slot copies (kv_copy.h
//           StagedCopy: the kernels pack/unpack slots in a --staging-mib GPU ring per direction, the copy engine moves
//           one copy per slot); copy engine = one cudaMemcpyBatchAsync over all chunks.
//   both  = a store of GPU blocks [0, blocks/2) and a load of blocks [blocks/2, blocks) at once on two streams
//           (disjoint halves of the same KV cache and pool); its bytes are the sum of both directions, and its
//           ceiling is a contiguous D2H of half the bytes and an H2D of the other half at once.
//   GB/s = 1e9 bytes per second, bytes = blocks * layers * 2 * chunk; each figure is the median of --iters
//   timed runs (CUDA events) after --warmup runs.
//   Store checksums (--store-checksums on, the default): the store again with each slot's content checksum
//   term sums (common/block_checksum.h), by the checksummed gather kernel, and for the copy engine by the
//   sums-only kernel on a second stream beside the batch (as the daemon does) or after it on the same stream;
//   the sums are checked against the CPU's before timing.
// --geometry NAME instead: one cache hit of a geometry preset, per component and for the hybrid block set
// (transfer_geometry.h).
// Then (--daemon-layers on, the default) a layer-wise load through a flexkvd this bench starts: the time until the
// engine's stream may run layer 0 and the last layer of --daemon-blocks Llama-3-8B blocks, with progress completions
// and with CUDA layer events, beside each other (transfer_layer_events.h).
#include "transfer_bench.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench_json.h"
#include "transfer_cuda.h"
#include "transfer_geometry.h"
#include "transfer_layer_events.h"
#include "common/block_checksum.h"
#include "daemon/transfer/cuda/kv_copy.h"

namespace {

namespace kv = flexkv::cuda;
using namespace flexkv::bench::transfer;  // NOLINT(google-build-using-namespace): transfer_cuda.h
using flexkv::bench::DumpLine;
using flexkv::bench::Json;
using flexkv::bench::Rounded;

struct TransferBenchOptions {
  bool json = false;
  std::vector<uint32_t> chunk_kib{8, 16, 32, 64, 128};
  uint32_t layers = 32;
  uint32_t blocks = 1024;
  int iters = 7;
  int warmup = 2;
  bool sweep = false;
  std::vector<uint32_t> sweep_chunk_kib{8, 32, 128};
  std::vector<int> sweep_ctas{8, 16, 32, 66, 132};
  std::vector<int> sweep_threads{256, 512, 1024};
  std::vector<int> sweep_unroll{1, 2, 4, 8};
  std::vector<int> sweep_bulk_ctas{8, 16, 32, 66, 132, 264};
  std::vector<int> sweep_bulk_kib{4, 8, 16, 32};
  std::vector<int> sweep_bulk_stages{2, 4};
  uint32_t sweep_mib = 1024;  // bytes per swept copy
  int sweep_iters = 3;
  std::vector<int> alt_store, alt_load;  // optional second kernel shape per direction (LaunchShape fields)
  bool store_checksums = true;
  bool daemon_layers = true;
  uint32_t daemon_blocks = 1024;
  uint32_t staging_mib = 64;  // the daemon's --copy-staging-mib default
};

// ---- the experiment -----------------------------------------------------------------------------------

struct Triple {
  double store = 0, load = 0, both = 0;              // GB/s
  double both_store_ms = 0, both_load_ms = 0;        // when each half of `both` finished
};

struct LayerWise {
  double first_ms = 0, all_ms = 0, oneshot_ms = 0;
};

// Stores that also compute the slots' checksum term sums (GB/s of stored bytes).
struct ChecksummedStores {
  double kernel_store = 0;                       // checksummed gather kernel
  double plain_again = 0;                        // the plain gather right after it: the run's own spread
  double kernel_both = 0;                        // ... with a load at once (as Triple::both)
  double both_store_ms = 0, both_load_ms = 0;
  double copy_engine_beside = 0;                 // batch on one stream, sums-only kernel on another
  double copy_engine_after = 0;                  // batch, then the sums-only kernel, one stream
  double sums_only = 0;                          // the sums-only kernel alone (GB/s read from the GPU)
};

struct ChunkResult {
  uint32_t chunk_kib = 0;
  uint64_t bytes = 0;
  Triple ceiling, kernel, staged, copy_engine, kernel_alt;
  bool has_alt = false;
  LayerWise lw_kernel, lw_copy_engine;
  bool has_sums = false;
  ChecksummedStores sums;
};

struct SweepRow {
  uint32_t chunk_kib;
  std::string dir;         // store, load, both
  kv::LaunchShape shape;   // store / load shape; for both the store half's
  kv::LaunchShape shape2;  // both: the load half's
  double gbps;
  double ceiling;
  double store_ms = 0, load_ms = 0;  // both: when each half finished
};

class Bench {
 public:
  explicit Bench(const TransferBenchOptions& o) : o_(o) {
    auto shape = [](const std::vector<int>& v) {
      kv::LaunchShape s;
      int* f[] = {&s.ctas, &s.threads, &s.unroll, &s.warps_per_chunk, &s.bulk_kib, &s.stages};
      for (size_t i = 0; i < v.size() && i < 6; ++i) *f[i] = v[i];
      return s;
    };
    alt_ = !o.alt_store.empty() || !o.alt_load.empty();
    alt_store_ = shape(o.alt_store);
    alt_load_ = shape(o.alt_load);
    max_chunk_ = *std::max_element(o.chunk_kib.begin(), o.chunk_kib.end()) * kKiB;
    if (o.sweep) max_chunk_ = std::max<uint64_t>(max_chunk_, *std::max_element(o.sweep_chunk_kib.begin(), o.sweep_chunk_kib.end()) * kKiB);
    layer_bytes_max_ = 2ull * o.blocks * max_chunk_;
    total_max_ = layer_bytes_max_ * o.layers;

    CK(cudaStreamCreateWithFlags(&st_.s1, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&st_.s2, cudaStreamNonBlocking));
    CK(cudaEventCreate(&st_.start));
    CK(cudaEventCreate(&st_.stop));
    CK(cudaEventCreate(&st_.joined));
    CK(cudaEventCreate(&st_.s1_done));
    layer_events_.resize(o.layers);
    for (auto& e : layer_events_) CK(cudaEventCreate(&e));

    // KV cache A (timed): one allocation per layer, as vLLM does. KV cache B: one contiguous allocation cut
    // into per-layer tensors; it is the round-trip destination and the GPU side of the ceiling copies.
    a_layers_.resize(o.layers);
    for (auto& p : a_layers_) CK(cudaMalloc(&p, layer_bytes_max_));
    CK(cudaMalloc(&b_, total_max_));
    std::vector<uint64_t> a_bases(o.layers), b_bases(o.layers);
    for (uint32_t l = 0; l < o.layers; ++l) {
      a_bases[l] = reinterpret_cast<uint64_t>(a_layers_[l]);
      b_bases[l] = reinterpret_cast<uint64_t>(static_cast<uint8_t*>(b_) + l * layer_bytes_max_);
    }
    a_bases_host_ = a_bases;
    b_bases_host_ = b_bases;
    CK(DeviceAlloc(&a_bases_dev_, o.layers * sizeof(uint64_t)));
    CK(DeviceAlloc(&b_bases_dev_, o.layers * sizeof(uint64_t)));
    CK(cudaMemcpy(a_bases_dev_, a_bases.data(), o.layers * sizeof(uint64_t), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(b_bases_dev_, b_bases.data(), o.layers * sizeof(uint64_t), cudaMemcpyHostToDevice));

    pool_ = std::make_unique<RegisteredPool>(total_max_, 2ull * o.layers * max_chunk_);

    // GPU block i <-> slot perm[i].
    blocks_host_.resize(o.blocks);
    std::iota(blocks_host_.begin(), blocks_host_.end(), 0u);
    slots_host_ = blocks_host_;
    std::mt19937_64 rng(20261202);
    std::shuffle(slots_host_.begin(), slots_host_.end(), rng);
    CK(DeviceAlloc(&blocks_dev_, o.blocks * sizeof(uint32_t)));
    CK(DeviceAlloc(&slots_dev_, o.blocks * sizeof(uint32_t)));
    CK(cudaMemcpy(blocks_dev_, blocks_host_.data(), o.blocks * sizeof(uint32_t), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(slots_dev_, slots_host_.data(), o.blocks * sizeof(uint32_t), cudaMemcpyHostToDevice));
    CK(DeviceAlloc(&sums_dev_, o.blocks * sizeof(uint64_t)));
    CK(kv::StagingRing::Create(uint64_t{o.staging_mib} << 20, 2, &store_ring_));
    CK(kv::StagingRing::Create(uint64_t{o.staging_mib} << 20, 2, &load_ring_));
  }

  ~Bench() {
    for (auto* p : a_layers_) (void)cudaFree(p);
    (void)cudaFree(b_);
    (void)cudaFree(a_bases_dev_);
    (void)cudaFree(b_bases_dev_);
    (void)cudaFree(blocks_dev_);
    (void)cudaFree(slots_dev_);
    (void)cudaFree(sums_dev_);
    pool_.reset();
  }
  Bench(const Bench&) = delete;
  Bench& operator=(const Bench&) = delete;

  const kv::LaunchShape& AltStore() const { return alt_store_; }
  const kv::LaunchShape& AltLoad() const { return alt_load_; }

  kv::GpuKvView View(bool a, uint64_t chunk) const {
    return kv::GpuKvView{a ? a_bases_dev_ : b_bases_dev_, static_cast<uint64_t>(o_.blocks) * chunk, chunk, o_.layers, 2, chunk};
  }
  kv::HostPoolView Pool(uint64_t chunk) const { return kv::HostPoolView{pool_->base(), 2ull * o_.layers * chunk, 1, 0}; }
  kv::BlockPairs Pairs(uint32_t first, uint32_t count, uint32_t lb, uint32_t le) const {
    return kv::BlockPairs{blocks_dev_ + first, slots_dev_ + first, count, lb, le};
  }

  // Correctness before timing: random data in A, poisoned pool, gather, check every pool byte against where it
  // came from; poisoned B, scatter, check every byte of B equals A. For the kernels and the copy engine.
  void CheckRoundTrip(uint64_t chunk, bool copy_engine, bool staged = false) {
    const uint64_t layer_bytes = 2ull * o_.blocks * chunk;
    const uint64_t total = layer_bytes * o_.layers;
    const uint64_t seed = Mix(chunk * 4 + (copy_engine ? 1 : 0) + (staged ? 2 : 0));
    const char* path = copy_engine ? "copy-engine" : staged ? "staged" : "kernel";
    uint64_t* words = reinterpret_cast<uint64_t*>(pool_->base());
    const uint64_t nwords = total / 8;
    // Logical GPU offset o = layer * layer_bytes + plane * blocks * chunk + block * chunk holds Mix(seed + o/8).
    ParallelFor(nwords, [&](uint64_t b, uint64_t e) {
      for (uint64_t w = b; w < e; ++w) words[w] = Mix(seed + w);
    });
    for (uint32_t l = 0; l < o_.layers; ++l)
      CK(cudaMemcpyAsync(a_layers_[l], pool_->base() + l * layer_bytes, layer_bytes, cudaMemcpyHostToDevice, st_.s1));
    CK(cudaStreamSynchronize(st_.s1));
    ParallelFor(total, [&](uint64_t b, uint64_t e) { std::memset(pool_->base() + b, 0xA5, e - b); });

    const kv::GpuKvView a = View(true, chunk), bview = View(false, chunk);
    const kv::HostPoolView pool = Pool(chunk);
    if (copy_engine) {
      CK(kv::CopyEngineBatch(a_bases_host_.data(), a, pool, blocks_host_.data(), slots_host_.data(), o_.blocks, 0,
                             o_.layers, true, st_.s1));
    } else if (staged) {
      CK(kv::StagedCopy(a, pool, blocks_dev_, slots_host_.data(), o_.blocks, true, *store_ring_, st_.s1));
    } else {
      CK(kv::LaunchGather(a, pool, Pairs(0, o_.blocks, 0, o_.layers), st_.s1));
    }
    CK(cudaStreamSynchronize(st_.s1));
    const uint64_t chunk_words = chunk / 8;
    std::atomic<uint64_t> bad{0};
    ParallelFor(o_.blocks, [&](uint64_t b, uint64_t e) {
      uint64_t wrong = 0;
      for (uint64_t i = b; i < e; ++i) {
        const uint64_t* slot = words + slots_host_[i] * (2ull * o_.layers * chunk) / 8;
        for (uint32_t l = 0; l < o_.layers; ++l)
          for (uint32_t p = 0; p < 2; ++p) {
            const uint64_t* got = slot + (l * 2ull + p) * chunk_words;
            const uint64_t first = (l * layer_bytes + p * o_.blocks * chunk + blocks_host_[i] * chunk) / 8;
            for (uint64_t w = 0; w < chunk_words; ++w) wrong += got[w] != Mix(seed + first + w);
          }
      }
      bad += wrong;
    });
    if (bad) Die(fmt::format("{} gather to the pool: {} of {} words wrong at chunk {} KiB", path, bad.load(), nwords,
                             chunk / kKiB));

    CK(cudaMemsetAsync(b_, 0x5A, total_max_, st_.s1));
    if (copy_engine) {
      CK(kv::CopyEngineBatch(b_bases_host_.data(), bview, pool, blocks_host_.data(), slots_host_.data(), o_.blocks, 0,
                             o_.layers, false, st_.s1));
    } else if (staged) {
      CK(kv::StagedCopy(bview, pool, blocks_dev_, slots_host_.data(), o_.blocks, false, *load_ring_, st_.s1));
    } else {
      CK(kv::LaunchScatter(bview, pool, Pairs(0, o_.blocks, 0, o_.layers), st_.s1));
    }
    for (uint32_t l = 0; l < o_.layers; ++l)
      CK(cudaMemcpyAsync(pool_->base() + l * layer_bytes, static_cast<uint8_t*>(b_) + l * layer_bytes_max_, layer_bytes,
                         cudaMemcpyDeviceToHost, st_.s1));
    CK(cudaStreamSynchronize(st_.s1));
    bad = 0;
    ParallelFor(nwords, [&](uint64_t b, uint64_t e) {
      uint64_t wrong = 0;
      for (uint64_t w = b; w < e; ++w) wrong += words[w] != Mix(seed + w);
      bad += wrong;
    });
    if (bad) Die(fmt::format("{} round trip: {} of {} words wrong at chunk {} KiB", path, bad.load(), nwords,
                             chunk / kKiB));
  }

  // The checksummed gather's and the sums-only kernel's per-slot sums against the CPU's BlockChecksum of every
  // slot the checksummed gather wrote (whose bytes the plain gather's check above has vouched for).
  void CheckSums(uint64_t chunk) {
    const uint64_t block_bytes = 2ull * o_.layers * chunk;
    const kv::GpuKvView a = View(true, chunk);
    const kv::HostPoolView pool = Pool(chunk);
    const auto pairs = Pairs(0, o_.blocks, 0, o_.layers);
    std::vector<uint64_t> gathered(o_.blocks), summed(o_.blocks);
    CK(cudaMemsetAsync(sums_dev_, 0, o_.blocks * sizeof(uint64_t), st_.s1));
    CK(kv::LaunchGatherChecksummed(a, pool, pairs, sums_dev_, st_.s1));
    CK(cudaMemcpyAsync(gathered.data(), sums_dev_, o_.blocks * sizeof(uint64_t), cudaMemcpyDeviceToHost, st_.s1));
    CK(cudaMemsetAsync(sums_dev_, 0, o_.blocks * sizeof(uint64_t), st_.s1));
    CK(kv::LaunchChecksumTerms(a, pool, pairs, sums_dev_, st_.s1));
    CK(cudaMemcpyAsync(summed.data(), sums_dev_, o_.blocks * sizeof(uint64_t), cudaMemcpyDeviceToHost, st_.s1));
    CK(cudaStreamSynchronize(st_.s1));
    std::atomic<uint64_t> bad{0};
    ParallelFor(o_.blocks, [&](uint64_t b, uint64_t e) {
      uint64_t wrong = 0;
      for (uint64_t i = b; i < e; ++i) {
        const uint64_t want = flexkv::BlockChecksum(pool_->base() + slots_host_[i] * block_bytes, block_bytes);
        wrong += flexkv::FinishBlockChecksum(gathered[i], block_bytes) != want;
        wrong += flexkv::FinishBlockChecksum(summed[i], block_bytes) != want;
      }
      bad += wrong;
    });
    if (bad) Die(fmt::format("store checksums: {} of {} sums wrong at chunk {} KiB", bad.load(), 2 * o_.blocks, chunk / kKiB));
  }

  ChunkResult Measure(uint32_t chunk_kib) {
    const uint64_t chunk = chunk_kib * kKiB;
    ChunkResult r;
    r.chunk_kib = chunk_kib;
    r.bytes = 2ull * o_.blocks * o_.layers * chunk;
    const uint64_t half_bytes = r.bytes / 2;
    const uint32_t n = o_.blocks, h = o_.blocks / 2;
    const kv::GpuKvView a = View(true, chunk);
    const kv::HostPoolView pool = Pool(chunk);
    uint8_t* host = pool_->base();
    uint8_t* dev = static_cast<uint8_t*>(b_);
    auto time = [&](bool two, const std::function<void()>& op, double* s1 = nullptr, double* s2 = nullptr) {
      return TimeMs(st_, o_.warmup, o_.iters, two, op, s1, s2);
    };

    // Ceiling: one contiguous copy of the same bytes each way; both: half of them each way at once.
    r.ceiling.store = Gbps(r.bytes, time(false, [&] { CK(cudaMemcpyAsync(host, dev, r.bytes, cudaMemcpyDeviceToHost, st_.s1)); }));
    r.ceiling.load = Gbps(r.bytes, time(false, [&] { CK(cudaMemcpyAsync(dev, host, r.bytes, cudaMemcpyHostToDevice, st_.s1)); }));
    r.ceiling.both = Gbps(r.bytes, time(true, [&] {
      CK(cudaMemcpyAsync(host, dev, half_bytes, cudaMemcpyDeviceToHost, st_.s1));
      CK(cudaMemcpyAsync(dev + half_bytes, host + half_bytes, r.bytes - half_bytes, cudaMemcpyHostToDevice, st_.s2));
    }, &r.ceiling.both_store_ms, &r.ceiling.both_load_ms));

    r.kernel.store = Gbps(r.bytes, time(false, [&] { CK(kv::LaunchGather(a, pool, Pairs(0, n, 0, o_.layers), st_.s1)); }));
    r.kernel.load = Gbps(r.bytes, time(false, [&] { CK(kv::LaunchScatter(a, pool, Pairs(0, n, 0, o_.layers), st_.s1)); }));
    r.kernel.both = Gbps(r.bytes, time(true, [&] {
      CK(kv::LaunchGather(a, pool, Pairs(0, h, 0, o_.layers), st_.s1));
      CK(kv::LaunchScatter(a, pool, Pairs(h, n - h, 0, o_.layers), st_.s2));
    }, &r.kernel.both_store_ms, &r.kernel.both_load_ms));

    const uint32_t* slots = slots_host_.data();
    r.staged.store = Gbps(r.bytes, time(false, [&] { CK(kv::StagedCopy(a, pool, blocks_dev_, slots, n, true, *store_ring_, st_.s1)); }));
    r.staged.load = Gbps(r.bytes, time(false, [&] { CK(kv::StagedCopy(a, pool, blocks_dev_, slots, n, false, *load_ring_, st_.s1)); }));
    r.staged.both = Gbps(r.bytes, time(true, [&] {
      CK(kv::StagedCopy(a, pool, blocks_dev_, slots, h, true, *store_ring_, st_.s1));
      CK(kv::StagedCopy(a, pool, blocks_dev_ + h, slots + h, n - h, false, *load_ring_, st_.s2));
    }, &r.staged.both_store_ms, &r.staged.both_load_ms));

    const uint64_t* ab = a_bases_host_.data();
    const uint32_t* bh = blocks_host_.data();
    const uint32_t* sh = slots_host_.data();
    if (alt_) {
      r.has_alt = true;
      const kv::LaunchShape gs = alt_store_, ss = alt_load_;
      r.kernel_alt.store = Gbps(r.bytes, time(false, [&] { CK(kv::LaunchGatherShaped(a, pool, Pairs(0, n, 0, o_.layers), st_.s1, gs)); }));
      r.kernel_alt.load = Gbps(r.bytes, time(false, [&] { CK(kv::LaunchScatterShaped(a, pool, Pairs(0, n, 0, o_.layers), st_.s1, ss)); }));
      r.kernel_alt.both = Gbps(r.bytes, time(true, [&] {
        CK(kv::LaunchGatherShaped(a, pool, Pairs(0, h, 0, o_.layers), st_.s1, gs));
        CK(kv::LaunchScatterShaped(a, pool, Pairs(h, n - h, 0, o_.layers), st_.s2, ss));
      }, &r.kernel_alt.both_store_ms, &r.kernel_alt.both_load_ms));
    }
    r.copy_engine.store = Gbps(r.bytes, time(false, [&] { CK(kv::CopyEngineBatch(ab, a, pool, bh, sh, n, 0, o_.layers, true, st_.s1)); }));
    r.copy_engine.load = Gbps(r.bytes, time(false, [&] { CK(kv::CopyEngineBatch(ab, a, pool, bh, sh, n, 0, o_.layers, false, st_.s1)); }));
    r.copy_engine.both = Gbps(r.bytes, time(true, [&] {
      CK(kv::CopyEngineBatch(ab, a, pool, bh, sh, h, 0, o_.layers, true, st_.s1));
      CK(kv::CopyEngineBatch(ab, a, pool, bh + h, sh + h, n - h, 0, o_.layers, false, st_.s2));
    }, &r.copy_engine.both_store_ms, &r.copy_engine.both_load_ms));

    if (o_.store_checksums) {
      r.has_sums = true;
      ChecksummedStores& cs = r.sums;
      const size_t sums_bytes = n * sizeof(uint64_t);
      cs.kernel_store = Gbps(r.bytes, time(false, [&] {
        CK(cudaMemsetAsync(sums_dev_, 0, sums_bytes, st_.s1));
        CK(kv::LaunchGatherChecksummed(a, pool, Pairs(0, n, 0, o_.layers), sums_dev_, st_.s1));
      }));
      cs.plain_again = Gbps(r.bytes, time(false, [&] { CK(kv::LaunchGather(a, pool, Pairs(0, n, 0, o_.layers), st_.s1)); }));
      cs.kernel_both = Gbps(r.bytes, time(true, [&] {
        CK(cudaMemsetAsync(sums_dev_, 0, sums_bytes, st_.s1));
        CK(kv::LaunchGatherChecksummed(a, pool, Pairs(0, h, 0, o_.layers), sums_dev_, st_.s1));
        CK(kv::LaunchScatter(a, pool, Pairs(h, n - h, 0, o_.layers), st_.s2));
      }, &cs.both_store_ms, &cs.both_load_ms));
      cs.copy_engine_beside = Gbps(r.bytes, time(true, [&] {
        CK(cudaMemsetAsync(sums_dev_, 0, sums_bytes, st_.s2));
        CK(kv::LaunchChecksumTerms(a, pool, Pairs(0, n, 0, o_.layers), sums_dev_, st_.s2));
        CK(kv::CopyEngineBatch(ab, a, pool, bh, sh, n, 0, o_.layers, true, st_.s1));
      }));
      cs.copy_engine_after = Gbps(r.bytes, time(false, [&] {
        CK(kv::CopyEngineBatch(ab, a, pool, bh, sh, n, 0, o_.layers, true, st_.s1));
        CK(cudaMemsetAsync(sums_dev_, 0, sums_bytes, st_.s1));
        CK(kv::LaunchChecksumTerms(a, pool, Pairs(0, n, 0, o_.layers), sums_dev_, st_.s1));
      }));
      cs.sums_only = Gbps(r.bytes, time(false, [&] {
        CK(cudaMemsetAsync(sums_dev_, 0, sums_bytes, st_.s1));
        CK(kv::LaunchChecksumTerms(a, pool, Pairs(0, n, 0, o_.layers), sums_dev_, st_.s1));
      }));
    }

    r.lw_kernel = LayerWiseLoad(r.bytes, r.kernel.load, [&](uint32_t l) {
      CK(kv::LaunchScatter(a, pool, Pairs(0, n, l, l + 1), st_.s1));
    });
    r.lw_copy_engine = LayerWiseLoad(r.bytes, r.copy_engine.load, [&](uint32_t l) {
      CK(kv::CopyEngineBatch(ab, a, pool, bh, sh, n, l, l + 1, false, st_.s1));
    });
    return r;
  }

  // Load layer by layer on one stream with an event after each layer: median time to layer 0 done and to all
  // layers done, next to the one-shot load's time.
  LayerWise LayerWiseLoad(uint64_t bytes, double oneshot_gbps, const std::function<void(uint32_t)>& load_layer) {
    std::vector<double> first, all;
    for (int i = 0; i < o_.warmup + o_.iters; ++i) {
      CK(cudaEventRecord(st_.start, st_.s1));
      for (uint32_t l = 0; l < o_.layers; ++l) {
        load_layer(l);
        CK(cudaEventRecord(layer_events_[l], st_.s1));
      }
      CK(cudaEventSynchronize(layer_events_.back()));
      CK(cudaGetLastError());
      float f = 0, a = 0;
      CK(cudaEventElapsedTime(&f, st_.start, layer_events_.front()));
      CK(cudaEventElapsedTime(&a, st_.start, layer_events_.back()));
      if (i >= o_.warmup) {
        first.push_back(static_cast<double>(f));
        all.push_back(static_cast<double>(a));
      }
    }
    return LayerWise{Median(first), Median(all), static_cast<double>(bytes) / (oneshot_gbps * 1e6)};
  }

  // Launch-shape sweep for the kernels at one chunk size over about --sweep-mib bytes (a prefix of the map):
  // each direction alone for the plain and the bulk-copy kernels, then pairs of shapes for both at once.
  void Sweep(uint32_t chunk_kib, std::vector<SweepRow>& rows) {
    const uint64_t chunk = chunk_kib * kKiB;
    const uint64_t per_block = 2ull * o_.layers * chunk;
    const uint32_t count = static_cast<uint32_t>(
        std::clamp<uint64_t>((static_cast<uint64_t>(o_.sweep_mib) << 20) / per_block, 2, o_.blocks));
    const uint32_t h = count / 2;
    const uint64_t bytes = per_block * count, store_bytes = per_block * h;
    const kv::GpuKvView a = View(true, chunk);
    const kv::HostPoolView pool = Pool(chunk);
    auto time = [&](bool two, const std::function<void()>& op, double* s1 = nullptr, double* s2 = nullptr) {
      return TimeMs(st_, 1, o_.sweep_iters, two, op, s1, s2);
    };
    uint8_t* host = pool_->base();
    uint8_t* dev = static_cast<uint8_t*>(b_);
    const double ceil_d2h = Gbps(bytes, time(false, [&] { CK(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, st_.s1)); }));
    const double ceil_h2d = Gbps(bytes, time(false, [&] { CK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, st_.s1)); }));
    const double ceil_both = Gbps(bytes, time(true, [&] {
      CK(cudaMemcpyAsync(host, dev, store_bytes, cudaMemcpyDeviceToHost, st_.s1));
      CK(cudaMemcpyAsync(dev + store_bytes, host + store_bytes, bytes - store_bytes, cudaMemcpyHostToDevice, st_.s2));
    }));
    std::vector<kv::LaunchShape> shapes;
    for (int c : o_.sweep_ctas)
      for (int t : o_.sweep_threads)
        for (int u : o_.sweep_unroll) shapes.push_back({c, t, u, 1, 0, 0});
    for (int c : o_.sweep_ctas)
      for (int w : {2, 4}) shapes.push_back({c, 512, 4, w, 0, 0});
    for (int c : o_.sweep_bulk_ctas)
      for (int k : o_.sweep_bulk_kib)
        for (int st : o_.sweep_bulk_stages) shapes.push_back({c, 32, 1, 1, k, st});
    for (bool to_host : {true, false}) {
      for (const auto& s : shapes) {
        const double ms = time(false, [&] {
          const auto pairs = Pairs(0, count, 0, o_.layers);
          CK(to_host ? kv::LaunchGatherShaped(a, pool, pairs, st_.s1, s) : kv::LaunchScatterShaped(a, pool, pairs, st_.s1, s));
        });
        rows.push_back({chunk_kib, to_host ? "store" : "load", s, {}, Gbps(bytes, ms), to_host ? ceil_d2h : ceil_h2d});
      }
    }
    // Both at once: store pairs [0, h) on one stream, load pairs [h, count) on the other.
    std::vector<std::pair<kv::LaunchShape, kv::LaunchShape>> combos;
    for (int g : {8, 16, 32})
      for (int sc : {16, 32, 66, 132}) combos.push_back({{g, 512, 8, 1, 0, 0}, {sc, 512, 8, 1, 0, 0}});
    for (int g : {16, 32, 66})
      for (int sc : {32, 66, 132}) combos.push_back({{g, 32, 1, 1, 16, 4}, {sc, 32, 1, 1, 16, 4}});
    combos.push_back({kv::DefaultLaunchShape(true), kv::DefaultLaunchShape(false)});
    combos.push_back({{8, 256, 8, 1, 0, 0}, {66, 512, 8, 1, 0, 0}});
    combos.push_back({{16, 512, 8, 1, 0, 0}, {66, 32, 1, 1, 16, 4}});
    combos.push_back({{32, 32, 1, 1, 16, 4}, {32, 512, 8, 1, 0, 0}});
    for (const auto& [g, sc] : combos) {
      SweepRow row{chunk_kib, "both", g, sc, 0, ceil_both};
      const double ms = time(true, [&] {
        CK(kv::LaunchGatherShaped(a, pool, Pairs(0, h, 0, o_.layers), st_.s1, g));
        CK(kv::LaunchScatterShaped(a, pool, Pairs(h, count - h, 0, o_.layers), st_.s2, sc));
      }, &row.store_ms, &row.load_ms);
      row.gbps = Gbps(bytes, ms);
      rows.push_back(row);
    }
  }

 private:
  const TransferBenchOptions& o_;
  bool alt_ = false;
  kv::LaunchShape alt_store_, alt_load_;
  uint64_t max_chunk_ = 0, layer_bytes_max_ = 0, total_max_ = 0;
  Streams st_;
  std::vector<cudaEvent_t> layer_events_;
  std::vector<void*> a_layers_;
  void* b_ = nullptr;
  std::vector<uint64_t> a_bases_host_, b_bases_host_;
  uint64_t* a_bases_dev_ = nullptr;
  uint64_t* b_bases_dev_ = nullptr;
  std::unique_ptr<RegisteredPool> pool_;
  std::vector<uint32_t> blocks_host_, slots_host_;
  uint32_t* blocks_dev_ = nullptr;
  uint32_t* slots_dev_ = nullptr;
  uint64_t* sums_dev_ = nullptr;  // per-pair checksum term sums
  std::unique_ptr<kv::StagingRing> store_ring_, load_ring_;  // staged copies, one ring per direction as in the daemon
};

Json ShapeJson(const kv::LaunchShape& s) {
  return Json{{"ctas", s.ctas},        {"threads", s.threads},   {"unroll", s.unroll},
              {"warps_per_chunk", s.warps_per_chunk}, {"bulk_kib", s.bulk_kib}, {"stages", s.stages}};
}

Json TripleJson(const Triple& t, const Triple& ceil) {
  return Json{{"store_gbps", Rounded(t.store, 2)},
              {"load_gbps", Rounded(t.load, 2)},
              {"both_gbps", Rounded(t.both, 2)},
              {"store_ratio", Rounded(t.store / ceil.store, 3)},
              {"load_ratio", Rounded(t.load / ceil.load, 3)},
              {"both_ratio", Rounded(t.both / ceil.both, 3)},
              {"both_store_half_ms", Rounded(t.both_store_ms, 3)},
              {"both_load_half_ms", Rounded(t.both_load_ms, 3)}};
}

Json LayerWiseJson(const LayerWise& lw, uint64_t bytes) {
  return Json{{"first_layer_ms", Rounded(lw.first_ms, 3)},
              {"all_layers_ms", Rounded(lw.all_ms, 3)},
              {"oneshot_ms", Rounded(lw.oneshot_ms, 3)},
              {"all_layers_gbps", Rounded(Gbps(bytes, lw.all_ms), 2)},
              {"throughput_vs_oneshot", Rounded(lw.oneshot_ms / lw.all_ms, 3)}};
}

}  // namespace

int RunTransferBench(int argc, char** argv) {
  TransferBenchOptions o;
  CLI::App app{"flexkv-bench transfer: GPU <-> host pool block copies vs contiguous pinned copies", "transfer"};
  app.add_flag("--json", o.json, "One JSON object instead of the table");
  app.add_option("--chunk-kib", o.chunk_kib, "Chunk sizes (KiB per layer, plane and block), comma separated")
      ->delimiter(',')
      ->check(CLI::Range(1u, 1u << 20));
  app.add_option("--layers", o.layers)->check(CLI::Range(1u, 1024u));
  app.add_option("--blocks", o.blocks)->check(CLI::Range(2u, 1u << 24));
  app.add_option("--iters", o.iters, "Timed runs per figure (median)")->check(CLI::Range(1, 1000));
  app.add_option("--warmup", o.warmup, "Untimed runs first")->check(CLI::Range(0, 1000));
  app.add_flag("--sweep", o.sweep, "Also sweep the kernels' launch shapes");
  app.add_option("--sweep-chunk-kib", o.sweep_chunk_kib)->delimiter(',')->check(CLI::Range(1u, 1u << 20));
  app.add_option("--sweep-ctas", o.sweep_ctas)->delimiter(',')->check(CLI::Range(1, 65535));
  app.add_option("--sweep-threads", o.sweep_threads)->delimiter(',')->check(CLI::Range(32, 1024));
  app.add_option("--sweep-unroll", o.sweep_unroll)->delimiter(',');
  app.add_option("--sweep-bulk-ctas", o.sweep_bulk_ctas)->delimiter(',');
  app.add_option("--sweep-bulk-kib", o.sweep_bulk_kib)->delimiter(',');
  app.add_option("--sweep-bulk-stages", o.sweep_bulk_stages)->delimiter(',');
  app.add_option("--sweep-mib", o.sweep_mib, "Bytes per swept copy")->check(CLI::Range(1u, 1u << 20));
  app.add_option("--sweep-iters", o.sweep_iters)->check(CLI::Range(1, 1000));
  app.add_option("--alt-store-shape", o.alt_store,
                 "Also time the kernels with this store shape: ctas,threads,unroll,warps_per_chunk[,bulk_kib,stages]")
      ->delimiter(',');
  app.add_option("--alt-load-shape", o.alt_load, "... and this load shape")->delimiter(',');
  GeometryTransferOptions geometry;
  app.add_option("--geometry", geometry.geometry,
                 fmt::format("Instead of the chunk sizes: one cache hit of this geometry preset, per component and for "
                             "the hybrid block set ({})", GeometryPresetNames()))
      ->check([](const std::string& name) {
        return IsGeometryPreset(name) ? std::string() : fmt::format("expected one of {}", GeometryPresetNames());
      });
  app.add_option("--tp", geometry.tp, "--geometry: the model's TP size (the bench copies rank 0's shards)")
      ->check(CLI::Range(1u, 256u));
  app.add_option("--prefix-blocks", geometry.prefix_blocks, "--geometry: the hit's length in blocks")
      ->check(CLI::Range(1u, 1u << 20));
  std::string store_checksums = "on";
  app.add_option("--store-checksums", store_checksums,
                 "on: also time (and check) stores that compute the slots' content checksums")
      ->check(CLI::IsMember({"on", "off"}));
  std::string daemon_layers = "on";
  app.add_option("--daemon-layers", daemon_layers,
                 "on: also time a layer-wise load through a flexkvd started here (pool on /dev/shm), with progress "
                 "completions and with CUDA layer events")
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--staging-mib", o.staging_mib, "Staged copies: GPU ring bytes per direction (2 buffers)")
      ->check(CLI::Range(1u, 65536u));
  app.add_option("--daemon-blocks", o.daemon_blocks, "--daemon-layers: Llama-3-8B blocks per load (2 MiB each)")
      ->check(CLI::Range(1u, 1u << 16));
  CLI11_PARSE(app, argc, argv);
  o.store_checksums = store_checksums == "on";
  o.daemon_layers = daemon_layers == "on";
  if (!geometry.geometry.empty()) {
    geometry.iters = o.iters;
    geometry.warmup = o.warmup;
    geometry.json = o.json;
    return RunGeometryTransfer(geometry);
  }
  for (uint32_t c : o.chunk_kib)
    if ((c * kKiB) % 16) Die("--chunk-kib: chunks must be multiples of 16 bytes");

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) Die("no CUDA device visible");
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  int driver = 0, runtime = 0;
  CK(cudaDriverGetVersion(&driver));
  CK(cudaRuntimeGetVersion(&runtime));

  Bench bench(o);
  std::vector<ChunkResult> results;
  for (uint32_t c : o.chunk_kib) {
    bench.CheckRoundTrip(c * kKiB, false);
    bench.CheckRoundTrip(c * kKiB, true);
    bench.CheckRoundTrip(c * kKiB, false, true);
    if (o.store_checksums) bench.CheckSums(c * kKiB);
    results.push_back(bench.Measure(c));
    std::fprintf(stderr, "chunk %u KiB: round trips checked (kernel, copy engine, staged%s), measured\n", c,
                 o.store_checksums ? ", store checksums" : "");
  }
  std::vector<SweepRow> sweep;
  if (o.sweep)
    for (uint32_t c : o.sweep_chunk_kib) bench.Sweep(c, sweep);
  DaemonLayerResult daemon_result;
  const DaemonLayerOptions daemon_options{32, o.daemon_blocks, o.iters, o.warmup};
  if (o.daemon_layers) {
    daemon_result = MeasureDaemonLayers(daemon_options);
    std::fprintf(stderr, "layer-wise load through flexkvd: %s\n",
                 daemon_result.error.empty() ? "measured" : daemon_result.error.c_str());
  }

  const kv::LaunchShape dg = kv::DefaultLaunchShape(true), ds = kv::DefaultLaunchShape(false);
  if (o.json) {
    Json rows = Json::array();
    for (const auto& r : results) {
      Json row{{"chunk_kib", r.chunk_kib},
               {"bytes", r.bytes},
               {"ceiling",
                {{"store_gbps", Rounded(r.ceiling.store, 2)},
                 {"load_gbps", Rounded(r.ceiling.load, 2)},
                 {"both_gbps", Rounded(r.ceiling.both, 2)},
                 {"both_store_half_ms", Rounded(r.ceiling.both_store_ms, 3)},
                 {"both_load_half_ms", Rounded(r.ceiling.both_load_ms, 3)}}},
               {"kernel", TripleJson(r.kernel, r.ceiling)},
               {"staged", TripleJson(r.staged, r.ceiling)},
               {"copy_engine", TripleJson(r.copy_engine, r.ceiling)}};
      if (r.has_alt) row["kernel_alt"] = TripleJson(r.kernel_alt, r.ceiling);
      row["layerwise_kernel"] = LayerWiseJson(r.lw_kernel, r.bytes);
      row["layerwise_copy_engine"] = LayerWiseJson(r.lw_copy_engine, r.bytes);
      if (r.has_sums) {
        const ChecksummedStores& cs = r.sums;
        row["store_checksums"] = Json{{"kernel_store_gbps", Rounded(cs.kernel_store, 2)},
                                      {"kernel_store_vs_plain", Rounded(cs.kernel_store / r.kernel.store, 4)},
                                      {"plain_store_again_gbps", Rounded(cs.plain_again, 2)},
                                      {"kernel_both_gbps", Rounded(cs.kernel_both, 2)},
                                      {"kernel_both_vs_plain", Rounded(cs.kernel_both / r.kernel.both, 4)},
                                      {"kernel_both_store_half_ms", Rounded(cs.both_store_ms, 3)},
                                      {"kernel_both_load_half_ms", Rounded(cs.both_load_ms, 3)},
                                      {"copy_engine_beside_gbps", Rounded(cs.copy_engine_beside, 2)},
                                      {"copy_engine_beside_vs_plain", Rounded(cs.copy_engine_beside / r.copy_engine.store, 4)},
                                      {"copy_engine_after_gbps", Rounded(cs.copy_engine_after, 2)},
                                      {"copy_engine_after_vs_plain", Rounded(cs.copy_engine_after / r.copy_engine.store, 4)},
                                      {"sums_only_gbps", Rounded(cs.sums_only, 1)}};
      }
      rows.push_back(std::move(row));
    }
    Json swept = Json::array();
    for (const auto& s : sweep) {
      Json row{{"chunk_kib", s.chunk_kib}, {"dir", s.dir}, {"shape", ShapeJson(s.shape)}};
      if (s.dir == "both") {
        row["load_shape"] = ShapeJson(s.shape2);
        row["store_half_ms"] = Rounded(s.store_ms, 3);
        row["load_half_ms"] = Rounded(s.load_ms, 3);
      }
      row["gbps"] = Rounded(s.gbps, 2);
      row["ratio"] = Rounded(s.gbps / s.ceiling, 3);
      swept.push_back(std::move(row));
    }
    Json report{{"bench", "transfer"},
                      {"device", prop.name},
                      {"sms", prop.multiProcessorCount},
                      {"pci_bus", fmt::format("{:04x}:{:02x}:{:02x}", prop.pciDomainID, prop.pciBusID, prop.pciDeviceID)},
                      {"cuda_driver", driver},
                      {"cuda_runtime", runtime},
                      {"layers", o.layers},
                      {"blocks", o.blocks},
                      {"planes", 2},
                      {"iters", o.iters},
                      {"warmup", o.warmup},
                      {"correctness", "ok"},
                      {"store_checksums", o.store_checksums},
                      {"staging_mib", o.staging_mib},
                      {"default_gather", ShapeJson(dg)},
                      {"default_scatter", ShapeJson(ds)},
                      {"alt_store_shape", ShapeJson(bench.AltStore())},
                      {"alt_load_shape", ShapeJson(bench.AltLoad())},
                      {"results", rows},
                      {"sweep", swept}};
    if (o.daemon_layers) {
      report["daemon_layerwise"] = {
          {"blocks", daemon_options.blocks},
          {"layers", daemon_options.layers},
          {"error", daemon_result.error},
          {"progress_first_layer_ms", Rounded(daemon_result.progress_first_ms, 3)},
          {"progress_last_layer_ms", Rounded(daemon_result.progress_last_ms, 3)},
          {"events_first_layer_ms", Rounded(daemon_result.events_first_ms, 3)},
          {"events_last_layer_ms", Rounded(daemon_result.events_last_ms, 3)},
          {"progress_load_gbps", Rounded(daemon_result.load_gbps_progress, 2)},
          {"events_load_gbps", Rounded(daemon_result.load_gbps_events, 2)}};
    }
    std::fputs(DumpLine(report).c_str(), stdout);
    return 0;
  }

  fmt::print("{} ({} SMs), driver {}, runtime {}; LAYERFIRST K/V, {} layers, {} blocks, random block->slot map; "
             "median of {} after {} warm-up; GB/s = 1e9 B/s\n",
             prop.name, prop.multiProcessorCount, driver, runtime, o.layers, o.blocks, o.iters, o.warmup);
  fmt::print("kernel defaults: store {} CTAs x {} thr, unroll {}, {} warp(s)/chunk; load {} CTAs x {} thr, unroll {}, "
             "{} warp(s)/chunk\n",
             dg.ctas, dg.threads, dg.unroll, dg.warps_per_chunk, ds.ctas, ds.threads, ds.unroll, ds.warps_per_chunk);
  fmt::print("{:>5} {:>6} | {:>20} | {:>20} | {:>20} | {:>20} | {:>20} | {:>20}\n", "chunk", "MiB", "store kernel",
             "store staged", "load kernel", "load staged", "both kernel", "both staged");
  for (const auto& r : results) {
    auto cell = [](double v, double c) { return fmt::format("{:6.1f} / {:5.1f} {:.3f}", v, c, v / c); };
    fmt::print("{:>4}K {:>6} | {:>20} | {:>20} | {:>20} | {:>20} | {:>20} | {:>20}\n", r.chunk_kib, r.bytes >> 20,
               cell(r.kernel.store, r.ceiling.store), cell(r.staged.store, r.ceiling.store),
               cell(r.kernel.load, r.ceiling.load), cell(r.staged.load, r.ceiling.load),
               cell(r.kernel.both, r.ceiling.both), cell(r.staged.both, r.ceiling.both));
    fmt::print("{:>13} | copy engine: store {}, load {}, both {}\n", "", cell(r.copy_engine.store, r.ceiling.store),
               cell(r.copy_engine.load, r.ceiling.load), cell(r.copy_engine.both, r.ceiling.both));
  }
  for (const auto& r : results) {
    if (!r.has_alt) continue;
    fmt::print("{:>4}K alternative kernel shapes: store {:.1f} ({:.3f}), load {:.1f} ({:.3f}), both {:.1f} ({:.3f})\n",
               r.chunk_kib, r.kernel_alt.store, r.kernel_alt.store / r.ceiling.store, r.kernel_alt.load,
               r.kernel_alt.load / r.ceiling.load, r.kernel_alt.both, r.kernel_alt.both / r.ceiling.both);
  }
  for (const auto& r : results) {
    if (!r.has_sums) continue;
    const ChecksummedStores& cs = r.sums;
    fmt::print("{:>4}K store with checksums: kernel {:.1f} ({:.4f} of plain; plain again {:.1f}), with a load {:.1f} ({:.4f}); copy engine "
               "+ sums beside {:.1f} ({:.4f}), after {:.1f} ({:.4f}); sums alone {:.0f} GB/s\n",
               r.chunk_kib, cs.kernel_store, cs.kernel_store / r.kernel.store, cs.plain_again, cs.kernel_both, cs.kernel_both / r.kernel.both,
               cs.copy_engine_beside, cs.copy_engine_beside / r.copy_engine.store, cs.copy_engine_after,
               cs.copy_engine_after / r.copy_engine.store, cs.sums_only);
  }
  fmt::print("(cells: path GB/s / contiguous ceiling GB/s, ratio)\nlayer-wise load (one stream, event per layer):\n");
  for (const auto& r : results) {
    fmt::print("{:>4}K kernel: layer 0 {:.3f} ms, all {:.3f} ms vs one-shot {:.3f} ms ({:.3f}); copy-engine: layer 0 "
               "{:.3f} ms, all {:.3f} ms vs one-shot {:.3f} ms ({:.3f})\n",
               r.chunk_kib, r.lw_kernel.first_ms, r.lw_kernel.all_ms, r.lw_kernel.oneshot_ms,
               r.lw_kernel.oneshot_ms / r.lw_kernel.all_ms, r.lw_copy_engine.first_ms, r.lw_copy_engine.all_ms,
               r.lw_copy_engine.oneshot_ms, r.lw_copy_engine.oneshot_ms / r.lw_copy_engine.all_ms);
  }
  if (o.daemon_layers) {
    fmt::print("layer-wise load through flexkvd ({} Llama-3-8B blocks, {} layers, median of {}): until the engine's "
               "stream may run layer 0 / the last layer, from submission\n",
               daemon_options.blocks, daemon_options.layers, o.iters);
    if (!daemon_result.error.empty()) {
      fmt::print("  not measured: {}\n", daemon_result.error);
    } else {
      fmt::print("  {:<46} layer 0 {:7.3f} ms | last {:7.3f} ms | load {:5.1f} GB/s\n",
                 "progress completions (CPU WaitLayers, launch):", daemon_result.progress_first_ms,
                 daemon_result.progress_last_ms, daemon_result.load_gbps_progress);
      fmt::print("  {:<46} layer 0 {:7.3f} ms | last {:7.3f} ms | load {:5.1f} GB/s\n",
                 "CUDA layer events (stream waits, no CPU):", daemon_result.events_first_ms,
                 daemon_result.events_last_ms, daemon_result.load_gbps_events);
    }
  }
  for (const auto& s : sweep)
    fmt::print("sweep {:>4}K {:5} ctas {:3} thr {:4} unroll {} wpc {} bulk {} KiB x {}: {:6.1f} GB/s ({:.3f})\n",
               s.chunk_kib, s.dir, s.shape.ctas, s.shape.threads, s.shape.unroll, s.shape.warps_per_chunk,
               s.shape.bulk_kib, s.shape.stages, s.gbps, s.gbps / s.ceiling);
  return 0;
}
