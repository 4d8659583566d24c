// flexkv-bench transfer --two-way (transfer_two_way.h): the two-way study of issue 19.
#include "transfer_two_way.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <sys/mman.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_json.h"
#include "transfer_cuda.h"
#include "daemon/transfer/cuda/kv_copy.h"

namespace {

namespace kv = flexkv::cuda;
using namespace flexkv::bench::transfer;  // NOLINT(google-build-using-namespace): transfer_cuda.h
using flexkv::bench::DumpLine;
using flexkv::bench::Json;
using flexkv::bench::Rounded;

struct TwoWayOptions {
  std::vector<uint32_t> chunk_kib{8, 32, 128};
  uint32_t mib = 2048;  // bytes per copy (both: half each way)
  uint32_t layers = 32;
  int iters = 5;
  int warmup = 1;
  uint32_t staging_mib = 64;        // the daemon's --copy-staging-mib default: 2 buffers of 32 MiB
  uint32_t large_staging_mib = 192;  // a second ring, 3 buffers
  uint32_t slot_run = 16;  // the slot-run rows: the map in shuffled runs of this many consecutive slots (1: none)
  bool ncu_kernels = false;  // one launch of each kernel and stop (for a profiler)
  bool json = false;
};

uint64_t MeminfoKiB(const char* key) {
  std::ifstream in("/proc/meminfo");
  std::string k;
  uint64_t v = 0;
  std::string unit;
  while (in >> k >> v) {
    std::getline(in, unit);
    if (k == std::string(key) + ":") return v;
  }
  return 0;
}

// Host memory registered for DMA, in 4 KiB pages (MADV_NOHUGEPAGE, as the daemon's /dev/shm pool) or in
// transparent huge pages (MADV_HUGEPAGE before the first touch, 2 MiB aligned).
class HostRegion {
 public:
  HostRegion(uint64_t bytes, bool huge) : bytes_(bytes) {
    constexpr uint64_t kHuge = 2ull << 20;
    map_bytes_ = bytes + kHuge;
    void* p = mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) Die(fmt::format("mmap {} bytes: {}", map_bytes_, std::strerror(errno)));
    map_ = static_cast<uint8_t*>(p);
    base_ = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(map_) + kHuge - 1) / kHuge * kHuge);
    const uint64_t huge_before = MeminfoKiB("AnonHugePages");
    if (madvise(base_, bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE) != 0)
      std::fprintf(stderr, "madvise(%s): %s\n", huge ? "MADV_HUGEPAGE" : "MADV_NOHUGEPAGE", std::strerror(errno));
    ParallelFor(bytes / kHuge, [&](uint64_t b, uint64_t e) { std::memset(base_ + b * kHuge, 0x11, (e - b) * kHuge); });
    huge_kib_ = MeminfoKiB("AnonHugePages") - std::min(huge_before, MeminfoKiB("AnonHugePages"));
    CK(cudaHostRegister(base_, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped));
  }
  ~HostRegion() {
    (void)cudaHostUnregister(base_);
    munmap(map_, map_bytes_);
  }
  HostRegion(const HostRegion&) = delete;
  HostRegion& operator=(const HostRegion&) = delete;
  uint8_t* base() const { return base_; }
  uint64_t huge_kib() const { return huge_kib_; }

 private:
  uint64_t bytes_ = 0, map_bytes_ = 0, huge_kib_ = 0;
  uint8_t* map_ = nullptr;
  uint8_t* base_ = nullptr;
};

struct Row {
  uint32_t chunk_kib;
  std::string variant;
  std::string dir;  // store, load, both
  double gbps;
  double ceiling;
  double store_ms = 0, load_ms = 0;  // both: when each direction finished
};

// SMs a path keeps busy while it copies (engines care: SGLang reports it for its own kernels), from the launches it
// makes: the gather/scatter kernels run their direction's default grid (DefaultLaunchShape) for the whole copy, at
// most one CTA per SM resident at a time counted as one SM each; the copy engine runs none; a staged copy runs the
// pack (stores) or unpack (loads) kernels with the same default grid, but only while they move a batch HBM to HBM
// (about a tenth of the copy's time at PCIe rates), so "while packing" is said. A mixed variant names both.
std::string SmsOf(const std::string& variant, const std::string& dir, int sm_count) {
  const auto grid = [&](bool to_host) { return std::min(kv::DefaultLaunchShape(to_host).ctas, sm_count); };
  const bool kernel = variant.rfind("kernel", 0) == 0, staged = variant.rfind("staged", 0) == 0;
  if (variant.find(" + ") != std::string::npos) {  // "staged store + kernel load", "kernel store + staged load"
    return fmt::format("{} (kernel) / {} while packing", std::max(grid(true), grid(false)), grid(true));
  }
  if (!kernel && !staged) return "0";  // the copy engine: contiguous ceilings, 2D copies
  const int n = dir == "store" ? grid(true) : dir == "load" ? grid(false) : grid(true) + grid(false);
  return staged ? fmt::format("{} while packing", std::min(n, sm_count)) : std::to_string(std::min(n, sm_count));
}

class Study {
 public:
  explicit Study(const TwoWayOptions& o) : o_(o) {
    total_ = static_cast<uint64_t>(o.mib) << 20;
    layer_bytes_ = total_ / o.layers;
    for (cudaStream_t* s : {&s0_, &k1_, &c1_, &k2_, &c2_}) CK(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking));
    for (cudaEvent_t* e : {&start_, &stop_, &k1_done_, &c1_done_, &k2_done_, &c2_done_}) CK(cudaEventCreate(e));
    layers_.resize(o.layers);
    for (auto& p : layers_) CK(cudaMalloc(&p, layer_bytes_));
    std::vector<uint64_t> bases(o.layers);
    for (uint32_t l = 0; l < o.layers; ++l) bases[l] = reinterpret_cast<uint64_t>(layers_[l]);
    CK(DeviceAlloc(&bases_dev_, o.layers * sizeof(uint64_t)));
    CK(cudaMemcpy(bases_dev_, bases.data(), o.layers * sizeof(uint64_t), cudaMemcpyHostToDevice));
    CK(cudaMalloc(&dev_, total_));
    const uint64_t dev_base = reinterpret_cast<uint64_t>(dev_);
    CK(DeviceAlloc(&contig_base_dev_, sizeof(uint64_t)));
    CK(cudaMemcpy(contig_base_dev_, &dev_base, sizeof(uint64_t), cudaMemcpyHostToDevice));
    pool_ = std::make_unique<HostRegion>(total_, false);
    thp_ = std::make_unique<HostRegion>(total_, true);
    const uint32_t min_chunk = *std::min_element(o.chunk_kib.begin(), o.chunk_kib.end());
    max_pairs_ = static_cast<uint32_t>(total_ / (min_chunk * kKiB));
    std::vector<uint32_t> iota(max_pairs_);
    std::iota(iota.begin(), iota.end(), 0u);
    CK(DeviceAlloc(&iota_dev_, max_pairs_ * sizeof(uint32_t)));
    CK(cudaMemcpy(iota_dev_, iota.data(), max_pairs_ * sizeof(uint32_t), cudaMemcpyHostToDevice));
    CK(DeviceAlloc(&perm_dev_, max_pairs_ * sizeof(uint32_t)));
    for (auto* r : {&store_ring_, &load_ring_}) CK(kv::StagingRing::Create(uint64_t{o.staging_mib} << 20, 2, r));
    for (auto* r : {&store_large_, &load_large_}) CK(kv::StagingRing::Create(uint64_t{o.large_staging_mib} << 20, 3, r));
  }
  ~Study() {
    (void)cudaDeviceSynchronize();
    for (cudaStream_t st : {s0_, k1_, c1_, k2_, c2_}) (void)cudaStreamDestroy(st);
    for (cudaEvent_t e : {start_, stop_, k1_done_, c1_done_, k2_done_, c2_done_}) (void)cudaEventDestroy(e);
    for (auto* p : layers_) (void)cudaFree(p);
    for (void* p : {static_cast<void*>(bases_dev_), static_cast<void*>(contig_base_dev_), dev_,
                    static_cast<void*>(iota_dev_), static_cast<void*>(perm_dev_)})
      (void)cudaFree(p);
  }
  Study(const Study&) = delete;
  Study& operator=(const Study&) = delete;

  uint64_t pool_huge_kib() const { return pool_->huge_kib(); }
  uint64_t thp_huge_kib() const { return thp_->huge_kib(); }

  // Sets up chunk size `chunk_kib`: blocks, slot bytes, a random block -> slot map.
  void Chunk(uint32_t chunk_kib) {
    chunk_ = chunk_kib * kKiB;
    block_bytes_ = 2ull * o_.layers * chunk_;
    blocks_ = static_cast<uint32_t>(total_ / block_bytes_);
    if (blocks_ < 4) Die(fmt::format("--mib {} holds fewer than 4 blocks of {} KiB chunks", o_.mib, chunk_kib));
    perm_.resize(blocks_);
    std::iota(perm_.begin(), perm_.end(), 0u);
    std::mt19937_64 rng(20261204 + chunk_kib);
    std::shuffle(perm_.begin(), perm_.end(), rng);
    CK(cudaMemcpy(perm_dev_, perm_.data(), blocks_ * sizeof(uint32_t), cudaMemcpyHostToDevice));
    // The slot-run map: runs of o_.slot_run consecutive slots in random order, and its marks (kv_copy.h slot runs:
    // the whole pool is one registration).
    std::vector<std::vector<uint32_t>> runs;
    for (uint32_t s = 0; s < blocks_; s += o_.slot_run) {
      runs.emplace_back(std::min(o_.slot_run, blocks_ - s));
      std::iota(runs.back().begin(), runs.back().end(), s);
    }
    std::shuffle(runs.begin(), runs.end(), rng);
    runs_.clear();
    for (const auto& run : runs) runs_.insert(runs_.end(), run.begin(), run.end());
    follows_.assign(blocks_, 0);
    for (uint32_t i = 1; i < blocks_; ++i) follows_[i] = runs_[i] == runs_[i - 1] + 1;
  }

  kv::GpuKvView View() const {
    return kv::GpuKvView{bases_dev_, static_cast<uint64_t>(blocks_) * chunk_, chunk_, o_.layers, 2, chunk_};
  }
  kv::HostPoolView PoolView(const HostRegion& r) const { return kv::HostPoolView{r.base(), block_bytes_, 1, 0}; }

  // ---- timing: every variant runs on the five streams, forked from and joined to s0 ----------------------
  Row Time(const std::string& variant, const std::string& dir, uint64_t bytes, double ceiling,
           const std::function<void()>& op) {
    std::vector<double> ms, st_ms, ld_ms;
    for (int i = 0; i < o_.warmup + o_.iters; ++i) {
      CK(cudaEventRecord(start_, s0_));
      for (cudaStream_t s : {k1_, c1_, k2_, c2_}) CK(cudaStreamWaitEvent(s, start_, 0));
      op();
      const cudaStream_t ss[] = {k1_, c1_, k2_, c2_};
      const cudaEvent_t es[] = {k1_done_, c1_done_, k2_done_, c2_done_};
      for (int k = 0; k < 4; ++k) {
        CK(cudaEventRecord(es[k], ss[k]));
        CK(cudaStreamWaitEvent(s0_, es[k], 0));
      }
      CK(cudaEventRecord(stop_, s0_));
      CK(cudaEventSynchronize(stop_));
      CK(cudaGetLastError());
      float t = 0, a = 0, b = 0, c = 0, d = 0;
      CK(cudaEventElapsedTime(&t, start_, stop_));
      CK(cudaEventElapsedTime(&a, start_, k1_done_));
      CK(cudaEventElapsedTime(&b, start_, c1_done_));
      CK(cudaEventElapsedTime(&c, start_, k2_done_));
      CK(cudaEventElapsedTime(&d, start_, c2_done_));
      if (i >= o_.warmup) {
        ms.push_back(t);
        st_ms.push_back(std::max(a, b));
        ld_ms.push_back(std::max(c, d));
      }
    }
    Row r{static_cast<uint32_t>(chunk_ / kKiB), variant, dir, Gbps(bytes, Median(ms)), ceiling};
    if (dir == "both") {
      r.store_ms = Median(st_ms);
      r.load_ms = Median(ld_ms);
    }
    std::fprintf(stderr, "%4u KiB %-28s %-5s %6.1f GB/s (%.3f)\n", r.chunk_kib, variant.c_str(), dir.c_str(), r.gbps,
                 r.gbps / ceiling);
    return r;
  }

  // ---- the variants' enqueue functions ------------------------------------------------------------------
  // Contiguous copies: store = D2H on c1, load = H2D on c2; both = the first half stored, the second loaded.
  void Contiguous(bool store, bool load, uint8_t* host) {
    const uint64_t half = (store && load) ? total_ / 2 : total_;
    if (store) CK(cudaMemcpyAsync(host, dev_, half, cudaMemcpyDeviceToHost, c1_));
    if (load) {
      const uint64_t off = store ? half : 0;
      CK(cudaMemcpyAsync(static_cast<uint8_t*>(dev_) + off, host + off, total_ - off, cudaMemcpyHostToDevice, c2_));
    }
  }

  // The contiguous copies cut into `piece`-byte copies in one batch per direction, in address or random order.
  struct Batch {
    std::vector<void*> dst;
    std::vector<const void*> src;
    std::vector<size_t> size;
  };
  static void Enqueue(const Batch& b, cudaStream_t s, unsigned flags = cudaMemcpyFlagDefault) {
    if (b.dst.empty()) return;
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = flags;
    size_t idx = 0;
    CK(cudaMemcpyBatchAsync(const_cast<void**>(b.dst.data()), const_cast<const void**>(b.src.data()),
                            const_cast<size_t*>(b.size.data()), b.dst.size(), &attr, &idx, 1, s));
  }
  std::pair<Batch, Batch> Pieces(uint64_t piece, bool random, bool store, bool load, uint8_t* host) const {
    const uint64_t n = total_ / piece;
    std::vector<uint64_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    if (random) {
      std::mt19937_64 rng(7);
      std::shuffle(order.begin(), order.end(), rng);
    }
    const uint64_t split = (store && load) ? n / 2 : (store ? n : 0);
    Batch st, ld;
    for (uint64_t k = 0; k < n; ++k) {
      const uint64_t off = order[k] * piece;
      uint8_t* d = static_cast<uint8_t*>(dev_) + off;
      if (k < split) {
        st.dst.push_back(host + off);
        st.src.push_back(d);
      } else {
        ld.dst.push_back(d);
        ld.src.push_back(host + off);
      }
      (k < split ? st : ld).size.push_back(piece);
    }
    return {std::move(st), std::move(ld)};
  }

  // The kernels: store pairs [b, e) of `map` on k1, load pairs [b2, e2) on k2.
  void Kernel(const HostRegion& pool, const uint32_t* map, uint32_t sb, uint32_t se, uint32_t lb, uint32_t le) {
    const kv::GpuKvView v = View();
    if (se > sb) CK(kv::LaunchGather(v, PoolView(pool), kv::BlockPairs{iota_dev_ + sb, map + sb, se - sb, 0, o_.layers}, k1_));
    if (le > lb) CK(kv::LaunchScatter(v, PoolView(pool), kv::BlockPairs{iota_dev_ + lb, map + lb, le - lb, 0, o_.layers}, k2_));
  }
  // The kernels over a contiguous copy (one layer, one plane, chunk-sized "blocks" in address order).
  void KernelContiguous(bool store, bool load) {
    const uint32_t n = static_cast<uint32_t>(total_ / chunk_);
    const kv::GpuKvView v{contig_base_dev_, 0, chunk_, 1, 1, chunk_};
    const kv::HostPoolView p{pool_->base(), chunk_, 1, 0};
    const uint32_t split = (store && load) ? n / 2 : (store ? n : 0);
    if (split > 0) CK(kv::LaunchGather(v, p, kv::BlockPairs{iota_dev_, iota_dev_, split, 0, 1}, k1_));
    if (n > split) CK(kv::LaunchScatter(v, p, kv::BlockPairs{iota_dev_ + split, iota_dev_ + split, n - split, 0, 1}, k2_));
  }

  // Staged copies of pairs [b, e) (GPU block i <-> slot perm[i]) by the daemon's StagedCopy (kv_copy.h): stores on
  // k1 through store_ring, loads on k2 through load_ring (each ring's copy stream joined back into them).
  // On the slot-run map instead (`runs`): with its marks when `merged`.
  void Staged(const HostRegion& pool, bool to_host, uint32_t b, uint32_t e, bool large = false,
              unsigned flags = cudaMemcpyFlagDefault, bool runs = false, bool merged = false) {
    kv::StagingRing& ring = to_host ? (large ? *store_large_ : *store_ring_) : (large ? *load_large_ : *load_ring_);
    const std::vector<uint32_t>& map = runs ? runs_ : perm_;
    CK(kv::StagedCopy(View(), PoolView(pool), iota_dev_ + b, map.data() + b, e - b, to_host, ring, to_host ? k1_ : k2_,
                      nullptr, flags, runs && merged ? follows_.data() + b : nullptr));
  }

  // ---- correctness of what the timed variants read and write ----------------------------------------------
  // Logical GPU offset o (layer * layer_bytes + plane * blocks * chunk + block * chunk) holds Mix(seed + o / 8).
  void FillGpu(uint64_t seed) {
    uint64_t* w = reinterpret_cast<uint64_t*>(pool_->base());
    ParallelFor(total_ / 8, [&](uint64_t b, uint64_t e) {
      for (uint64_t i = b; i < e; ++i) w[i] = Mix(seed + i);
    });
    for (uint32_t l = 0; l < o_.layers; ++l)
      CK(cudaMemcpy(layers_[l], pool_->base() + l * layer_bytes_, layer_bytes_, cudaMemcpyHostToDevice));
    CK(cudaDeviceSynchronize());
  }
  // Every pool slot map[i] (perm_ unless given) holds GPU block i's chunks in [layer][plane] order.
  uint64_t WrongPoolWords(uint64_t seed, const std::vector<uint32_t>* map = nullptr) const {
    const std::vector<uint32_t>& slots = map != nullptr ? *map : perm_;
    const uint64_t* words = reinterpret_cast<const uint64_t*>(pool_->base());
    const uint64_t cw = chunk_ / 8;
    std::atomic<uint64_t> bad{0};
    ParallelFor(blocks_, [&](uint64_t b, uint64_t e) {
      uint64_t wrong = 0;
      for (uint64_t i = b; i < e; ++i) {
        const uint64_t* slot = words + slots[i] * (block_bytes_ / 8);
        for (uint32_t l = 0; l < o_.layers; ++l)
          for (uint32_t p = 0; p < 2; ++p) {
            const uint64_t* got = slot + (l * 2ull + p) * cw;
            const uint64_t first = (l * layer_bytes_ + p * blocks_ * chunk_ + i * chunk_) / 8;
            for (uint64_t w = 0; w < cw; ++w) wrong += got[w] != Mix(seed + first + w);
          }
      }
      bad += wrong;
    });
    return bad.load();
  }
  // The GPU cache holds the pattern everywhere (read back through a host buffer).
  uint64_t WrongGpuWords(uint64_t seed) {
    std::vector<uint64_t> host(total_ / 8);
    for (uint32_t l = 0; l < o_.layers; ++l)
      CK(cudaMemcpy(reinterpret_cast<uint8_t*>(host.data()) + l * layer_bytes_, layers_[l], layer_bytes_, cudaMemcpyDeviceToHost));
    std::atomic<uint64_t> bad{0};
    ParallelFor(host.size(), [&](uint64_t b, uint64_t e) {
      uint64_t wrong = 0;
      for (uint64_t i = b; i < e; ++i) wrong += host[i] != Mix(seed + i);
      bad += wrong;
    });
    return bad.load();
  }
  void PoisonPool() {
    ParallelFor(total_ / kKiB, [&](uint64_t b, uint64_t e) { std::memset(pool_->base() + b * kKiB, 0xA5, (e - b) * kKiB); });
  }
  void PoisonGpu() {
    for (auto* p : layers_) CK(cudaMemset(p, 0x5A, layer_bytes_));
    CK(cudaDeviceSynchronize());  // the memsets run on the legacy stream, which the copy streams do not wait for
  }
  void Sync() {
    CK(cudaDeviceSynchronize());
  }

  // ---- the study at one chunk size ------------------------------------------------------------------------
  void Run(uint32_t chunk_kib, std::vector<Row>& rows) {
    Chunk(chunk_kib);
    const uint32_t n = blocks_, h = blocks_ / 2;
    const uint64_t bytes = static_cast<uint64_t>(n) * block_bytes_;  // == total_ (blocks fill it)
    uint8_t* pool = pool_->base();
    auto add = [&](Row r) { rows.push_back(std::move(r)); };

    // Ceilings (and again at the end).
    const double cs = Time("ceiling", "store", bytes, 1, [&] { Contiguous(true, false, pool); }).gbps;
    const double cl = Time("ceiling", "load", bytes, 1, [&] { Contiguous(false, true, pool); }).gbps;
    const double cb = Time("ceiling", "both", bytes, 1, [&] { Contiguous(true, true, pool); }).gbps;
    add(Row{chunk_kib, "ceiling", "store", cs, cs});
    add(Row{chunk_kib, "ceiling", "load", cl, cl});
    add(Row{chunk_kib, "ceiling", "both", cb, cb});
    auto ceil = [&](const std::string& dir) { return dir == "store" ? cs : dir == "load" ? cl : cb; };
    auto each = [&](const std::string& variant, const std::function<void(bool, bool)>& op) {
      for (const char* dir : {"store", "load", "both"}) {
        const bool st = std::strcmp(dir, "load") != 0, ld = std::strcmp(dir, "store") != 0;
        add(Time(variant, dir, bytes, ceil(dir), [&] { op(st, ld); }));
      }
    };
    add(Time("ceiling thp pool", "both", bytes, cb, [&] { Contiguous(true, true, thp_->base()); }));

    // The copy engine with many copies: slot-sized and chunk-sized pieces, address and random order.
    for (uint64_t piece : {block_bytes_, chunk_}) {
      if (piece == chunk_ && chunk_ < 32 * kKiB) continue;  // hundreds of thousands of copies: known slow
      for (bool random : {false, true}) {
        const std::string name = fmt::format("ce {} KiB pieces {}", piece / kKiB, random ? "random" : "in order");
        std::vector<std::pair<Batch, Batch>> plans;
        for (int d = 0; d < 3; ++d) plans.push_back(Pieces(piece, random, d != 1, d != 0, pool));
        int d = 0;
        for (const char* dir : {"store", "load", "both"}) {
          const auto& pl = plans[d++];
          add(Time(name, dir, bytes, ceil(dir), [&] {
            Enqueue(pl.first, c1_);
            Enqueue(pl.second, c2_);
          }));
        }
      }
    }
    // TP-sharded slots (slot = [layer][plane][shard][chunk]): one rank's chunks are `rows` rows of `chunk` bytes at
    // a pitch of tp * chunk. One cudaMemcpy2DAsync per slot between them and a contiguous GPU buffer: could a staged
    // copy serve a TP rank? Bytes = the rank's share, total / tp.
    for (uint32_t tp : {2u, 4u}) {
      const uint64_t chunk_rows = 2ull * o_.layers, rank_bytes = chunk_rows * chunk_, slot = tp * rank_bytes;
      const uint64_t slots = total_ / slot;
      auto copy2d = [&](bool st, bool ld) {
        const uint64_t split = (st && ld) ? slots / 2 : (st ? slots : 0);
        for (uint64_t k = 0; k < slots; ++k) {
          uint8_t* host = pool + k * slot;
          uint8_t* dev = static_cast<uint8_t*>(dev_) + k * rank_bytes;
          if (k < split)
            CK(cudaMemcpy2DAsync(host, tp * chunk_, dev, chunk_, chunk_, chunk_rows, cudaMemcpyDeviceToHost, c1_));
          else
            CK(cudaMemcpy2DAsync(dev, chunk_, host, tp * chunk_, chunk_, chunk_rows, cudaMemcpyHostToDevice, c2_));
        }
      };
      for (const char* dir : {"store", "load", "both"}) {
        const bool st = std::strcmp(dir, "load") != 0, ld = std::strcmp(dir, "store") != 0;
        add(Time(fmt::format("ce 2D per slot, tp {} rows", tp), dir, slots * rank_bytes, ceil(dir), [&] { copy2d(st, ld); }));
      }
    }
    // SM-issued contiguous copies.
    each("kernel contiguous", [&](bool st, bool ld) { KernelContiguous(st, ld); });
    // The kernels on the identity map and on the THP pool (their loads put other bytes in the GPU cache: before
    // the pattern is written).
    add(Time("kernel identity map", "both", bytes, cb, [&] { Kernel(*pool_, iota_dev_, 0, h, h, n); }));
    each("kernel thp pool", [&](bool st, bool ld) {
      Kernel(*thp_, perm_dev_, 0, st ? (ld ? h : n) : 0, st ? (ld ? h : n) : 0, ld ? n : 0);
    });
    add(Time("staged thp pool", "both", bytes, cb, [&] {
      Staged(*thp_, true, 0, h);
      Staged(*thp_, false, h, n);
    }));

    // The pattern: staged store and load checked byte for byte before they are timed.
    const uint64_t seed = Mix(chunk_kib);
    FillGpu(seed);
    PoisonPool();
    Staged(*pool_, true, 0, n);
    Sync();
    if (uint64_t bad = WrongPoolWords(seed)) Die(fmt::format("staged store: {} pool words wrong at {} KiB", bad, chunk_kib));
    PoisonGpu();
    Staged(*pool_, false, 0, n);
    Sync();
    if (uint64_t bad = WrongGpuWords(seed)) Die(fmt::format("staged load: {} GPU words wrong at {} KiB", bad, chunk_kib));

    // Timed on the pattern: every variant below moves consistent bytes (a store writes the pattern's slot, a load
    // reads it back to where it came from), so the pool and the GPU cache must still hold it at the end.
    each("kernel", [&](bool st, bool ld) {
      Kernel(*pool_, perm_dev_, 0, st ? (ld ? h : n) : 0, st ? (ld ? h : n) : 0, ld ? n : 0);
    });
    for (bool large : {false, true}) {
      const std::string name = large ? fmt::format("staged {} MiB ring", o_.large_staging_mib)
                                     : fmt::format("staged (daemon default {} MiB)", o_.staging_mib);
      add(Time(name, "store", bytes, cs, [&] { Staged(*pool_, true, 0, n, large); }));
      add(Time(name, "load", bytes, cl, [&] { Staged(*pool_, false, 0, n, large); }));
      add(Time(name, "both", bytes, cb, [&] {
        Staged(*pool_, true, 0, h, large);
        Staged(*pool_, false, h, n, large);
      }));
    }
    add(Time("staged overlap-hint", "both", bytes, cb, [&] {
      Staged(*pool_, true, 0, h, false, cudaMemcpyFlagPreferOverlapWithCompute);
      Staged(*pool_, false, h, n, false, cudaMemcpyFlagPreferOverlapWithCompute);
    }));
    add(Time("staged store + kernel load", "both", bytes, cb, [&] {
      Staged(*pool_, true, 0, h);
      Kernel(*pool_, perm_dev_, 0, 0, h, n);
    }));
    add(Time("kernel store + staged load", "both", bytes, cb, [&] {
      Kernel(*pool_, perm_dev_, 0, h, 0, 0);
      Staged(*pool_, false, h, n);
    }));
    add(Time("kernel again", "both", bytes, cb, [&] { Kernel(*pool_, perm_dev_, 0, h, h, n); }));
    Sync();
    if (uint64_t bad = WrongPoolWords(seed) + WrongGpuWords(seed))
      Die(fmt::format("after the timed copies: {} words wrong at {} KiB", bad, chunk_kib));
    if (o_.slot_run > 1) {
      // Slot runs (an allocator handing out consecutive slots): the same staged copies on a map of shuffled runs,
      // each slot its own copy, then runs merged into one copy by the marks; checked byte for byte first and after.
      PoisonPool();
      Staged(*pool_, true, 0, n, false, cudaMemcpyFlagDefault, true, true);
      Sync();
      if (uint64_t bad = WrongPoolWords(seed, &runs_)) Die(fmt::format("slot-run store: {} pool words wrong", bad));
      PoisonGpu();
      Staged(*pool_, false, 0, n, false, cudaMemcpyFlagDefault, true, true);
      Sync();
      if (uint64_t bad = WrongGpuWords(seed)) Die(fmt::format("slot-run load: {} GPU words wrong", bad));
      for (bool merged : {false, true}) {
        const std::string name = fmt::format("staged, runs of {} slots{}", o_.slot_run, merged ? " merged" : "");
        const unsigned f = cudaMemcpyFlagDefault;
        add(Time(name, "store", bytes, cs, [&] { Staged(*pool_, true, 0, n, false, f, true, merged); }));
        add(Time(name, "load", bytes, cl, [&] { Staged(*pool_, false, 0, n, false, f, true, merged); }));
        add(Time(name, "both", bytes, cb, [&] {
          Staged(*pool_, true, 0, h, false, f, true, merged);
          Staged(*pool_, false, h, n, false, f, true, merged);
        }));
      }
      Sync();
      if (uint64_t bad = WrongPoolWords(seed, &runs_) + WrongGpuWords(seed))
        Die(fmt::format("after the slot-run copies: {} words wrong at {} KiB", bad, chunk_kib));
    }
    add(Time("ceiling again", "store", bytes, cs, [&] { Contiguous(true, false, pool); }));
    add(Time("ceiling again", "load", bytes, cl, [&] { Contiguous(false, true, pool); }));
    add(Time("ceiling again", "both", bytes, cb, [&] { Contiguous(true, true, pool); }));
  }

  // One launch each of the store and load kernels and of a pack, for a profiler (ncu), at the first chunk size.
  void NcuKernels() {
    Chunk(o_.chunk_kib.front());
    Kernel(*pool_, perm_dev_, 0, blocks_, 0, 0);
    Sync();
    Kernel(*pool_, perm_dev_, 0, 0, 0, blocks_);
    Sync();
    Staged(*pool_, true, 0, std::min(blocks_, store_ring_->SlotsPerBuffer(kv::StagedSlotBytes(View()))));
    Sync();
  }

 private:
  const TwoWayOptions& o_;
  uint64_t total_ = 0, layer_bytes_ = 0, chunk_ = 0, block_bytes_ = 0;
  uint32_t blocks_ = 0, max_pairs_ = 0;
  cudaStream_t s0_ = nullptr, k1_ = nullptr, c1_ = nullptr, k2_ = nullptr, c2_ = nullptr;
  cudaEvent_t start_ = nullptr, stop_ = nullptr, k1_done_ = nullptr, c1_done_ = nullptr, k2_done_ = nullptr,
              c2_done_ = nullptr;
  std::unique_ptr<kv::StagingRing> store_ring_, load_ring_, store_large_, load_large_;
  std::vector<void*> layers_;
  uint64_t* bases_dev_ = nullptr;
  uint64_t* contig_base_dev_ = nullptr;
  void* dev_ = nullptr;
  std::unique_ptr<HostRegion> pool_, thp_;
  uint32_t* iota_dev_ = nullptr;
  uint32_t* perm_dev_ = nullptr;
  std::vector<uint32_t> perm_;
  std::vector<uint32_t> runs_;   // the slot-run map
  std::vector<uint8_t> follows_;  // its marks
};

}  // namespace

int RunTwoWayStudy(int argc, char** argv) {
  TwoWayOptions o;
  CLI::App app{"flexkv-bench transfer --two-way: a store and a load at once against the two-way ceiling", "transfer"};
  bool two_way = true;
  app.add_flag("--two-way", two_way, "This study");
  app.add_flag("--json", o.json, "One JSON object instead of the table");
  app.add_option("--chunk-kib", o.chunk_kib)->delimiter(',')->check(CLI::Range(1u, 1u << 14));
  app.add_option("--mib", o.mib, "Bytes per copy (both: half each way)")->check(CLI::Range(64u, 1u << 16));
  app.add_option("--layers", o.layers)->check(CLI::Range(1u, 1024u));
  app.add_option("--iters", o.iters)->check(CLI::Range(1, 1000));
  app.add_option("--warmup", o.warmup)->check(CLI::Range(0, 1000));
  app.add_option("--staging-mib", o.staging_mib, "Staged: the first ring's bytes (2 buffers)")->check(CLI::Range(1u, 65536u));
  app.add_option("--slot-run", o.slot_run, "Slot-run rows: runs of this many consecutive slots (1: no such rows)")
      ->check(CLI::Range(1u, 4096u));
  app.add_option("--large-staging-mib", o.large_staging_mib, "Staged: the second ring's bytes (3 buffers)")
      ->check(CLI::Range(1u, 65536u));
  app.add_flag("--ncu-kernels", o.ncu_kernels, "One launch of each kernel, then exit (run under ncu)");
  CLI11_PARSE(app, argc, argv);
  for (uint32_t c : o.chunk_kib)
    if ((c * kKiB) % 16) Die("--chunk-kib: chunks must be multiples of 16 bytes");
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) Die("no CUDA device visible");
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));

  Study study(o);
  if (o.ncu_kernels) {
    study.NcuKernels();
    return 0;
  }
  std::vector<Row> rows;
  for (uint32_t c : o.chunk_kib) study.Run(c, rows);

  if (o.json) {
    Json out = Json::array();
    for (const auto& r : rows) {
      Json j{{"chunk_kib", r.chunk_kib}, {"variant", r.variant}, {"dir", r.dir}, {"gbps", Rounded(r.gbps, 2)},
             {"ratio", Rounded(r.gbps / r.ceiling, 3)}, {"sms", SmsOf(r.variant, r.dir, prop.multiProcessorCount)}};
      if (r.dir == "both") {
        j["store_half_ms"] = Rounded(r.store_ms, 3);
        j["load_half_ms"] = Rounded(r.load_ms, 3);
      }
      out.push_back(std::move(j));
    }
    std::fputs(DumpLine(Json{{"bench", "transfer-two-way"},
                             {"device", prop.name},
                             {"mib", o.mib},
                             {"layers", o.layers},
                             {"iters", o.iters},
                             {"warmup", o.warmup},
                             {"staging_mib", o.staging_mib},
                             {"large_staging_mib", o.large_staging_mib},
                             {"pool_anon_huge_kib", study.pool_huge_kib()},
                             {"thp_pool_anon_huge_kib", study.thp_huge_kib()},
                             {"correctness", "ok"},
                             {"rows", out}})
                   .c_str(),
               stdout);
    return 0;
  }
  fmt::print("{}: {} MiB per copy, {} layers, median of {} after {}; staging rings {} MiB x 2, {} MiB x 3; THP pool {} "
             "MiB in huge pages (4 KiB pool {} MiB)\n",
             prop.name, o.mib, o.layers, o.iters, o.warmup, o.staging_mib, o.large_staging_mib, study.thp_huge_kib() >> 10,
             study.pool_huge_kib() >> 10);
  for (const auto& r : rows)
    fmt::print("{:>4}K {:<30} {:<5} {:7.1f} GB/s ({:.3f})  SMs {}{}\n", r.chunk_kib, r.variant, r.dir, r.gbps,
               r.gbps / r.ceiling, SmsOf(r.variant, r.dir, prop.multiProcessorCount),
               r.dir == "both" ? fmt::format("  store done {:.1f} ms, load done {:.1f} ms", r.store_ms, r.load_ms) : "");
  return 0;
}
