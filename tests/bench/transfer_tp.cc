// `flexkv-bench transfer --tp-ranks`: see transfer_tp.h.
#include "transfer_tp.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <sys/mman.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_json.h"
#include "daemon/transfer/cuda/kv_copy.h"
#include "transfer_cuda.h"

namespace {

namespace kv = flexkv::cuda;
using namespace flexkv::bench::transfer;  // NOLINT(google-build-using-namespace): transfer_cuda.h
using flexkv::bench::DumpLine;
using flexkv::bench::Json;
using flexkv::bench::Rounded;

struct TpOptions {
  std::vector<uint32_t> tp{2, 4, 8};
  std::vector<uint32_t> chunk_kib{8, 16, 32, 64, 128};  // one rank's chunk
  uint32_t mib = 2048;                                    // bytes per copy over every rank (both: half each way)
  uint32_t layers = 32;
  int iters = 5;
  int warmup = 1;
  uint32_t staging_mib = 64;  // the daemon's --copy-staging-mib default, per copy worker (one per direction)
  bool json = false;
};

struct TpRow {
  uint32_t tp, chunk_kib;
  std::string path, dir;
  double gbps, ceiling, ratio;  // ratio: the median of each iteration's own (TpPaired), not gbps / ceiling
  std::string sms;
};

// The host pool: anonymous 4 KiB pages (as the daemon's /dev/shm pool), registered for DMA.
class TpHostPool {
 public:
  explicit TpHostPool(uint64_t bytes) : bytes_(bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) Die(fmt::format("mmap {} bytes: {}", bytes, std::strerror(errno)));
    base_ = static_cast<uint8_t*>(p);
    (void)madvise(base_, bytes, MADV_NOHUGEPAGE);
    ParallelFor(bytes / 4096, [&](uint64_t b, uint64_t e) { std::memset(base_ + b * 4096, 0x11, (e - b) * 4096); });
    CK(cudaHostRegister(base_, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped));
  }
  ~TpHostPool() {
    (void)cudaHostUnregister(base_);
    munmap(base_, bytes_);
  }
  TpHostPool(const TpHostPool&) = delete;
  TpHostPool& operator=(const TpHostPool&) = delete;
  uint8_t* base() const { return base_; }

 private:
  uint64_t bytes_;
  uint8_t* base_ = nullptr;
};

// One TP size and chunk: `tp` ranks on this GPU, each with LAYERFIRST per-layer tensors ([plane][block][chunk]) of
// `blocks` blocks, and one pool of `blocks` slots of tp rank parts (the rank-major slot order). The daemon's copy
// workers serve every rank of a GPU, one job after another on one stream per direction: so do these.
class TpCase {
 public:
  TpCase(const TpOptions& o, uint32_t tp, uint32_t chunk_kib, cudaStream_t store, cudaStream_t load)
      : o_(o), tp_(tp), chunk_(uint64_t{chunk_kib} * kKiB), store_(store), load_(load) {
    total_ = uint64_t{o.mib} << 20;
    part_ = uint64_t{o.layers} * 2 * chunk_;
    slot_ = part_ * tp;
    blocks_ = static_cast<uint32_t>(total_ / slot_);
    if (blocks_ < 8) Die(fmt::format("--mib {} holds fewer than 8 slots of TP {} x {} KiB chunks", o.mib, tp, chunk_kib));
    total_ = uint64_t{blocks_} * slot_;
    pool_ = std::make_unique<TpHostPool>(total_);
    const uint64_t layer_bytes = 2ull * blocks_ * chunk_;
    for (uint32_t r = 0; r < tp; ++r) {
      Rank rank;
      std::vector<uint64_t> bases(o.layers);
      for (uint32_t l = 0; l < o.layers; ++l) {
        void* p = nullptr;
        CK(cudaMalloc(&p, layer_bytes));
        rank.layers.push_back(p);
        bases[l] = reinterpret_cast<uint64_t>(p);
      }
      CK(DeviceAlloc(&rank.bases_dev, o.layers * sizeof(uint64_t)));
      CK(cudaMemcpy(rank.bases_dev, bases.data(), o.layers * sizeof(uint64_t), cudaMemcpyHostToDevice));
      ranks_.push_back(rank);
    }
    // Every rank's block i is in slot perm[i] (a random map, as a pool that has evicted and refilled).
    perm_.resize(blocks_);
    std::iota(perm_.begin(), perm_.end(), 0u);
    std::mt19937_64 rng(20261206 + tp * 1000 + chunk_kib);
    std::shuffle(perm_.begin(), perm_.end(), rng);
    std::vector<uint32_t> iota(blocks_);
    std::iota(iota.begin(), iota.end(), 0u);
    CK(DeviceAlloc(&iota_dev_, blocks_ * sizeof(uint32_t)));
    CK(cudaMemcpy(iota_dev_, iota.data(), blocks_ * sizeof(uint32_t), cudaMemcpyHostToDevice));
    CK(DeviceAlloc(&perm_dev_, blocks_ * sizeof(uint32_t)));
    CK(cudaMemcpy(perm_dev_, perm_.data(), blocks_ * sizeof(uint32_t), cudaMemcpyHostToDevice));
    for (auto* ring : {&store_ring_, &load_ring_}) CK(kv::StagingRing::Create(uint64_t{o.staging_mib} << 20, 2, ring));
    if (store_ring_->SlotsPerBuffer(part_) == 0) {
      Die(fmt::format("a rank's part of a slot ({} KiB) does not fit half of --staging-mib {}", part_ / kKiB,
                      o.staging_mib));
    }
  }
  ~TpCase() {
    (void)cudaDeviceSynchronize();
    store_ring_.reset();
    load_ring_.reset();
    for (auto& r : ranks_) {
      for (void* p : r.layers) (void)cudaFree(p);
      (void)cudaFree(r.bases_dev);
    }
    (void)cudaFree(iota_dev_);
    (void)cudaFree(perm_dev_);
  }
  TpCase(const TpCase&) = delete;
  TpCase& operator=(const TpCase&) = delete;

  uint64_t bytes() const { return total_; }
  uint32_t blocks() const { return blocks_; }

  // Every rank's blocks [b, e) stored (to_host) or loaded, on the direction's stream: staged, or by the kernels.
  void Copy(bool staged, bool to_host, uint32_t b, uint32_t e) {
    if (e <= b) return;
    for (uint32_t r = 0; r < tp_; ++r) {
      const kv::GpuKvView view = View(r);
      const kv::HostPoolView pool{pool_->base(), slot_, tp_, r};
      cudaStream_t s = to_host ? store_ : load_;
      if (staged) {
        CK(kv::StagedCopy(view, pool, iota_dev_ + b, perm_.data() + b, e - b, to_host,
                          to_host ? *store_ring_ : *load_ring_, s));
      } else if (to_host) {
        CK(kv::LaunchGather(view, pool, kv::BlockPairs{iota_dev_ + b, perm_dev_ + b, e - b, 0, o_.layers}, s));
      } else {
        CK(kv::LaunchScatter(view, pool, kv::BlockPairs{iota_dev_ + b, perm_dev_ + b, e - b, 0, o_.layers}, s));
      }
    }
  }

  // Byte-exact check of one path before it is timed: every rank's blocks stored into a poisoned pool land in their
  // parts of their slots (rank r's (layer, plane) chunk at ((r * layers + l) * 2 + p) * chunk), and loaded back into
  // poisoned GPU tensors are what was stored.
  void Check(bool staged) {
    const uint64_t layer_bytes = 2ull * blocks_ * chunk_;
    std::vector<std::vector<std::vector<uint8_t>>> want(tp_);  // [rank][layer]
    for (uint32_t r = 0; r < tp_; ++r) {
      for (uint32_t l = 0; l < o_.layers; ++l) {
        std::vector<uint8_t> bytes(layer_bytes);
        auto* w = reinterpret_cast<uint64_t*>(bytes.data());
        const uint64_t seed = Mix((uint64_t{r} << 40) ^ (uint64_t{l} << 20) ^ (staged ? 1 : 2));
        ParallelFor(layer_bytes / 8, [&](uint64_t b, uint64_t e) {
          for (uint64_t i = b; i < e; ++i) w[i] = Mix(seed + i);
        });
        CK(cudaMemcpy(ranks_[r].layers[l], bytes.data(), layer_bytes, cudaMemcpyHostToDevice));
        want[r].push_back(std::move(bytes));
      }
    }
    std::memset(pool_->base(), 0xA5, total_);
    Copy(staged, true, 0, blocks_);
    CK(cudaStreamSynchronize(store_));
    std::atomic<uint64_t> wrong{0};
    ParallelFor(blocks_, [&](uint64_t b, uint64_t e) {
      uint64_t bad = 0;
      for (uint64_t i = b; i < e; ++i)
        for (uint32_t r = 0; r < tp_; ++r)
          for (uint32_t l = 0; l < o_.layers; ++l)
            for (uint32_t p = 0; p < 2; ++p) {
              const uint8_t* got = pool_->base() + perm_[i] * slot_ + ((uint64_t{r} * o_.layers + l) * 2 + p) * chunk_;
              const uint8_t* exp = want[r][l].data() + (uint64_t{p} * blocks_ + i) * chunk_;
              bad += std::memcmp(got, exp, chunk_) != 0 ? 1 : 0;
            }
      wrong += bad;
    });
    if (wrong != 0) Die(fmt::format("TP {}, {} KiB, {} store: {} chunks wrong", tp_, chunk_ / kKiB, Name(staged), wrong.load()));
    for (auto& rank : ranks_)
      for (void* p : rank.layers) CK(cudaMemset(p, 0x5A, layer_bytes));
    Copy(staged, false, 0, blocks_);
    CK(cudaStreamSynchronize(load_));
    std::vector<uint8_t> got(layer_bytes);
    for (uint32_t r = 0; r < tp_; ++r)
      for (uint32_t l = 0; l < o_.layers; ++l) {
        CK(cudaMemcpy(got.data(), ranks_[r].layers[l], layer_bytes, cudaMemcpyDeviceToHost));
        if (got != want[r][l]) Die(fmt::format("TP {}, {} KiB, {} load: rank {} layer {} differs", tp_, chunk_ / kKiB, Name(staged), r, l));
      }
  }

  static const char* Name(bool staged) { return staged ? "staged" : "kernel"; }

 private:
  struct Rank {
    std::vector<void*> layers;
    uint64_t* bases_dev = nullptr;
  };
  kv::GpuKvView View(uint32_t r) const {
    return kv::GpuKvView{ranks_[r].bases_dev, uint64_t{blocks_} * chunk_, chunk_, o_.layers, 2, chunk_};
  }

  const TpOptions& o_;
  const uint32_t tp_;
  const uint64_t chunk_;
  cudaStream_t store_, load_;
  uint64_t total_ = 0, part_ = 0, slot_ = 0;
  uint32_t blocks_ = 0;
  std::unique_ptr<TpHostPool> pool_;
  std::vector<Rank> ranks_;
  std::vector<uint32_t> perm_;
  uint32_t* iota_dev_ = nullptr;
  uint32_t* perm_dev_ = nullptr;
  std::unique_ptr<kv::StagingRing> store_ring_, load_ring_;
};

// Median wall time (ms) of `op` forked from and joined to s0 over `streams`, after warm-up.
double TpTimeMs(const TpOptions& o, cudaStream_t s0, const std::vector<cudaStream_t>& streams,
              const std::function<void()>& op) {
  cudaEvent_t start = nullptr, stop = nullptr;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));
  std::vector<cudaEvent_t> done(streams.size());
  for (auto& e : done) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  std::vector<double> ms;
  for (int i = 0; i < o.warmup + o.iters; ++i) {
    CK(cudaEventRecord(start, s0));
    for (cudaStream_t s : streams) CK(cudaStreamWaitEvent(s, start, 0));
    op();
    for (size_t k = 0; k < streams.size(); ++k) {
      CK(cudaEventRecord(done[k], streams[k]));
      CK(cudaStreamWaitEvent(s0, done[k], 0));
    }
    CK(cudaEventRecord(stop, s0));
    CK(cudaEventSynchronize(stop));
    CK(cudaGetLastError());
    float t = 0;
    CK(cudaEventElapsedTime(&t, start, stop));
    if (i >= o.warmup) ms.push_back(t);
  }
  for (auto e : done) (void)cudaEventDestroy(e);
  (void)cudaEventDestroy(start);
  (void)cudaEventDestroy(stop);
  return Median(ms);
}

struct Paired {
  double gbps, ceiling, ratio;
};

// A path against its ceiling, timed in turns (the ceiling first on even iterations, the path first on odd ones), so
// that a slow stretch of the link - seen in one run as a ceiling sample at half the link's rate - lands on both: the
// ratio is the median of each iteration's own ratio, the GB/s the medians of each.
Paired TpPaired(const TpOptions& o, uint64_t bytes, cudaStream_t s0, const std::vector<cudaStream_t>& streams,
                const std::function<void()>& ceiling, const std::function<void()>& path) {
  TpOptions once = o;
  once.iters = 1;
  once.warmup = 0;
  for (int i = 0; i < o.warmup; ++i) {
    (void)TpTimeMs(once, s0, streams, ceiling);
    (void)TpTimeMs(once, s0, streams, path);
  }
  std::vector<double> c, p, r;
  for (int i = 0; i < o.iters; ++i) {
    double cm = 0, pm = 0;
    if (i % 2 == 0) {
      cm = TpTimeMs(once, s0, streams, ceiling);
      pm = TpTimeMs(once, s0, streams, path);
    } else {
      pm = TpTimeMs(once, s0, streams, path);
      cm = TpTimeMs(once, s0, streams, ceiling);
    }
    c.push_back(cm);
    p.push_back(pm);
    r.push_back(cm / pm);
  }
  return {Gbps(bytes, Median(p)), Gbps(bytes, Median(c)), Median(r)};
}

}  // namespace

int RunTpStudy(int argc, char** argv) {
  TpOptions o;
  CLI::App app{"flexkv-bench transfer --tp-ranks: TP ranks on one GPU against the same run's ceilings", "transfer"};
  bool tp_ranks = true;
  app.add_flag("--tp-ranks", tp_ranks, "This study");
  app.add_flag("--json", o.json, "One JSON object instead of the table");
  app.add_option("--tp", o.tp, "TP sizes")->delimiter(',')->check(CLI::Range(1u, 64u));
  app.add_option("--chunk-kib", o.chunk_kib, "One rank's chunk sizes")->delimiter(',')->check(CLI::Range(1u, 1u << 14));
  app.add_option("--mib", o.mib, "Bytes per copy over every rank (both: half each way)")->check(CLI::Range(64u, 1u << 16));
  app.add_option("--layers", o.layers)->check(CLI::Range(1u, 1024u));
  app.add_option("--iters", o.iters)->check(CLI::Range(1, 1000));
  app.add_option("--warmup", o.warmup)->check(CLI::Range(0, 1000));
  app.add_option("--staging-mib", o.staging_mib, "Each direction's staging ring (2 buffers)")->check(CLI::Range(1u, 65536u));
  CLI11_PARSE(app, argc, argv);
  for (uint32_t c : o.chunk_kib)
    if ((c * kKiB) % 16) Die("--chunk-kib: chunks must be multiples of 16 bytes");
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) Die("no CUDA device visible");
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  const auto sms = [&](bool staged, const std::string& dir) {
    const auto grid = [&](bool to_host) { return std::min(kv::DefaultLaunchShape(to_host).ctas, prop.multiProcessorCount); };
    const int n = dir == "store" ? grid(true) : dir == "load" ? grid(false) : std::min(grid(true) + grid(false), prop.multiProcessorCount);
    return staged ? fmt::format("{} while packing", n) : std::to_string(n);
  };

  cudaStream_t s0 = nullptr, store = nullptr, load = nullptr;
  for (cudaStream_t* s : {&s0, &store, &load}) CK(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking));
  std::vector<TpRow> rows;
  for (uint32_t tp : o.tp) {
    for (uint32_t chunk_kib : o.chunk_kib) {
      TpCase c(o, tp, chunk_kib, store, load);
      const uint64_t bytes = c.bytes();
      const uint32_t n = c.blocks(), h = n / 2;
      // The ceilings: one contiguous copy of the same bytes each way, and half each way at once, from a GPU buffer of
      // that size to a pool of it (the case's own pool is behind `c`; a second registered buffer of the same size).
      void* dev = nullptr;
      CK(cudaMalloc(&dev, bytes));
      TpHostPool contiguous(bytes);
      auto* host = contiguous.base();
      const auto ceil_store = [&] { CK(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, store)); };
      const auto ceil_load = [&] { CK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, load)); };
      const auto ceil_both = [&] {
        CK(cudaMemcpyAsync(host, dev, bytes / 2, cudaMemcpyDeviceToHost, store));
        CK(cudaMemcpyAsync(static_cast<uint8_t*>(dev) + bytes / 2, host + bytes / 2, bytes - bytes / 2,
                           cudaMemcpyHostToDevice, load));
      };
      for (bool staged : {true, false}) {
        c.Check(staged);
        const std::string path = TpCase::Name(staged);
        const auto add = [&](const std::string& dir, const Paired& m) {
          rows.push_back(TpRow{tp, chunk_kib, path, dir, m.gbps, m.ceiling, m.ratio, sms(staged, dir)});
          std::fprintf(stderr, "TP %u %4u KiB %-6s %-5s %6.1f GB/s (%.3f; ceiling %.1f)\n", tp, chunk_kib,
                       path.c_str(), dir.c_str(), m.gbps, m.ratio, m.ceiling);
        };
        add("store", TpPaired(o, bytes, s0, {store}, ceil_store, [&] { c.Copy(staged, true, 0, n); }));
        add("load", TpPaired(o, bytes, s0, {load}, ceil_load, [&] { c.Copy(staged, false, 0, n); }));
        add("both", TpPaired(o, bytes, s0, {store, load}, ceil_both, [&] {
              c.Copy(staged, true, 0, h);
              c.Copy(staged, false, h, n);
            }));
      }
      CK(cudaFree(dev));
    }
  }
  for (cudaStream_t s : {s0, store, load}) (void)cudaStreamDestroy(s);

  if (o.json) {
    Json out = Json::array();
    for (const auto& r : rows) {
      out.push_back(Json{{"tp", r.tp}, {"chunk_kib", r.chunk_kib}, {"path", r.path}, {"dir", r.dir},
                         {"gbps", Rounded(r.gbps, 2)}, {"ceiling_gbps", Rounded(r.ceiling, 2)},
                         {"ratio", Rounded(r.ratio, 3)}, {"sms", r.sms}});
    }
    std::fputs(DumpLine(Json{{"bench", "transfer-tp-ranks"}, {"device", prop.name}, {"mib", o.mib},
                             {"layers", o.layers}, {"iters", o.iters}, {"warmup", o.warmup},
                             {"staging_mib", o.staging_mib}, {"correctness", "ok"}, {"rows", out}})
                   .c_str(),
               stdout);
    return 0;
  }
  fmt::print("{} ({} SMs): TP ranks on one GPU, {} MiB per copy over the ranks, {} layers, LAYERFIRST K/V, random "
             "block->slot map, median of {} after {}; staging ring {} MiB per direction; ceiling = one contiguous "
             "copy of the same bytes, timed in turns with the path; ratio = the median of each turn's own\n",
             prop.name, prop.multiProcessorCount, o.mib, o.layers, o.iters, o.warmup, o.staging_mib);
  fmt::print("{:>3} {:>6} {:<7} {:<5} {:>9} {:>9} {:>6}  {}\n", "TP", "chunk", "path", "dir", "GB/s", "ceiling", "ratio", "SMs");
  for (const auto& r : rows) {
    fmt::print("{:>3} {:>5}K {:<7} {:<5} {:>9.1f} {:>9.1f} {:>6.3f}  {}\n", r.tp, r.chunk_kib, r.path, r.dir, r.gbps,
               r.ceiling, r.ratio, r.sms);
  }
  return 0;
}
