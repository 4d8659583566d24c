// flexkv-bench transfer --geometry NAME: the copies of one cache hit of a geometry preset (transfer_geometry.h).
//
//   The hit: prefix end e = --prefix-blocks. What a load of it copies, and what a store of the same request
//   stores (docs/hybrid.md): a full component's blocks [0, e); a sliding-window component's last min(W, e)
//   blocks; a state component's one snapshot at e.
//   GPU side (TP rank 0 of --tp), per component: LAYERFIRST, one cudaMalloc'ed tensor per layer of
//   [planes][blocks][chunk] (vLLM's per-layer KV tensors; a state component: [snapshots][state bytes] per layer,
//   its copy geometry Geometry::Component(i)).
//   Pool: one anonymous mapping registered for DMA holding one sub-pool per component (2 MiB aligned, as in the pool
//   file), slots of Geometry::Component(i).host_block_bytes(); the rank's chunks land in its part of the slot.
//   Map: GPU block i <-> slot perm[i] of the component's sub-pool, perm random.
//   store = the checksummed gather (what the daemon runs; the plain gather is shown beside it), load = scatter;
//   the copy-engine batch both ways (without the sums kernel the daemon runs beside a copy-engine store);
//   ceiling = one contiguous cudaMemcpyAsync of the same bytes each way. The hybrid set is every component's copy
//   back to back on one stream: the daemon's per-GPU direction worker runs a hit's component jobs one after another
//   on one stream too, but waits for each (a host synchronisation this does not include). GB/s = 1e9 bytes/s of
//   this rank's bytes; each figure is the median of --iters timed runs after --warmup. Every path's bytes and the
//   store sums are checked against the CPU before timing.
#include "transfer_geometry.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_json.h"
#include "common/block_checksum.h"
#include "daemon/transfer/cuda/kv_copy.h"
#include "flexkv/geometry.h"
#include "transfer_cuda.h"

namespace flexkv::bench::transfer {
namespace {

namespace kv = flexkv::cuda;
using flexkv::bench::DumpLine;
using flexkv::bench::Json;
using flexkv::bench::Rounded;

struct Preset {
  const char* name;
  Geometry (*make)();
};
constexpr Preset kPresets[] = {
    {"llama3-8b", Llama3_8B},     {"qwen3-8b", Qwen3_8B},       {"deepseek-mla", DeepSeekMla},
    {"gpt-oss-20b", GptOss20B},   {"gemma3-27b", Gemma3_27B},   {"qwen3-next", Qwen3Next80B},
    {"jamba", JambaLike},
};

constexpr uint64_t kSubPoolAlign = 2ull << 20;
constexpr uint8_t kPoolPoison = 0xA5;
constexpr uint8_t kGpuPoison = 0x5A;

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// How many blocks (snapshots) of component i a hit of `e` blocks copies.
uint32_t HitBlocks(const Geometry& g, size_t i, uint32_t e) {
  switch (g.component_kind(i)) {
    case ComponentKind::kFull: return e;
    case ComponentKind::kSlidingWindow: return std::min(e, g.window_blocks(i));
    case ComponentKind::kState: return 1;
  }
  return e;
}

// This rank's side of one component of the hit: GPU tensors A (stores read them, loads write them) and B (the
// check's second load destination), the component's sub-pool and its block -> slot map. Frees what it allocated.
class ComponentCopies {
 public:
  ComponentCopies(const Geometry& model, size_t index, uint32_t count, uint8_t* sub_pool)
      : index_(index), kind_(model.component_kind(index)), copy_(model.Component(index)), count_(count),
        layers_(copy_.num_layers), planes_(copy_.kv_planes), shards_(copy_.is_mla() ? 1 : copy_.tp_size),
        chunk_(copy_.chunk_bytes_per_rank()), slot_bytes_(copy_.host_block_bytes()), sub_pool_(sub_pool) {
    const uint64_t layer_bytes = uint64_t{planes_} * count_ * chunk_;
    for (auto* side : {&a_, &b_}) {
      side->resize(layers_, nullptr);
      for (auto& p : *side) CK(cudaMalloc(&p, layer_bytes));
    }
    for (auto [side, bases] : {std::pair{&a_, &a_bases_}, std::pair{&b_, &b_bases_}}) {
      for (void* p : *side) bases->push_back(reinterpret_cast<uint64_t>(p));
    }
    CK(DeviceAlloc(&a_bases_dev_, layers_ * sizeof(uint64_t)));
    CK(DeviceAlloc(&b_bases_dev_, layers_ * sizeof(uint64_t)));
    CK(cudaMemcpy(a_bases_dev_, a_bases_.data(), layers_ * sizeof(uint64_t), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(b_bases_dev_, b_bases_.data(), layers_ * sizeof(uint64_t), cudaMemcpyHostToDevice));
    blocks_.resize(count_);
    std::iota(blocks_.begin(), blocks_.end(), 0u);
    slots_ = blocks_;
    std::mt19937_64 rng(20261203 + index);
    std::shuffle(slots_.begin(), slots_.end(), rng);
    CK(DeviceAlloc(&blocks_dev_, count_ * sizeof(uint32_t)));
    CK(DeviceAlloc(&slots_dev_, count_ * sizeof(uint32_t)));
    CK(DeviceAlloc(&sums_dev_, count_ * sizeof(uint64_t)));
    CK(cudaMemcpy(blocks_dev_, blocks_.data(), count_ * sizeof(uint32_t), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(slots_dev_, slots_.data(), count_ * sizeof(uint32_t), cudaMemcpyHostToDevice));
  }
  ~ComponentCopies() {
    for (auto* side : {&a_, &b_})
      for (void* p : *side) (void)cudaFree(p);
    (void)cudaFree(a_bases_dev_);
    (void)cudaFree(b_bases_dev_);
    (void)cudaFree(blocks_dev_);
    (void)cudaFree(slots_dev_);
    (void)cudaFree(sums_dev_);
  }
  ComponentCopies(const ComponentCopies&) = delete;
  ComponentCopies& operator=(const ComponentCopies&) = delete;

  size_t index() const { return index_; }
  ComponentKind kind() const { return kind_; }
  const Geometry& copy_geometry() const { return copy_; }
  uint32_t count() const { return count_; }
  uint64_t chunk_bytes() const { return chunk_; }
  uint64_t slot_bytes() const { return slot_bytes_; }
  uint64_t sub_pool_bytes() const { return uint64_t{count_} * slot_bytes_; }
  uint64_t bytes() const { return uint64_t{count_} * layers_ * planes_ * chunk_; }  // this rank's, one copy

  // The daemon's store: each slot's checksum term sums while copying (kernel), or the batch (copy engine).
  void Store(cudaStream_t s, bool copy_engine) {
    if (copy_engine) {
      CK(kv::CopyEngineBatch(a_bases_.data(), View(true), Pool(), blocks_.data(), slots_.data(), count_, 0, layers_, true, s));
      return;
    }
    CK(cudaMemsetAsync(sums_dev_, 0, count_ * sizeof(uint64_t), s));
    CK(kv::LaunchGatherChecksummed(View(true), Pool(), Pairs(), sums_dev_, s));
  }
  void StorePlain(cudaStream_t s) { CK(kv::LaunchGather(View(true), Pool(), Pairs(), s)); }
  void Load(cudaStream_t s, bool copy_engine, bool into_b = false) {
    if (copy_engine) {
      CK(kv::CopyEngineBatch(into_b ? b_bases_.data() : a_bases_.data(), View(!into_b), Pool(), blocks_.data(),
                             slots_.data(), count_, 0, layers_, false, s));
      return;
    }
    CK(kv::LaunchScatter(View(!into_b), Pool(), Pairs(), s));
  }

  // For the kernels and the copy engine: A := random words, the sub-pool poisoned, a store, every stored chunk
  // (and, for the kernel, each slot's term sum) against A; B poisoned, a load into B, B against A.
  void Check(cudaStream_t s) {
    const uint64_t layer_bytes = uint64_t{planes_} * count_ * chunk_;
    a_host_.assign(layers_, std::vector<uint8_t>(layer_bytes));
    for (uint32_t l = 0; l < layers_; ++l) {
      auto* words = reinterpret_cast<uint64_t*>(a_host_[l].data());
      const uint64_t seed = Mix((uint64_t{index_} << 40) + (uint64_t{l} << 20));
      ParallelFor(layer_bytes / 8, [&](uint64_t b, uint64_t e) {
        for (uint64_t w = b; w < e; ++w) words[w] = Mix(seed + w);
      });
      CK(cudaMemcpy(a_[l], a_host_[l].data(), layer_bytes, cudaMemcpyHostToDevice));
    }
    CK(cudaDeviceSynchronize());  // `s` does not wait for the legacy stream's copies
    for (bool copy_engine : {false, true}) {
      const char* path = copy_engine ? "copy engine" : "kernel";
      std::memset(sub_pool_, kPoolPoison, sub_pool_bytes());
      Store(s, copy_engine);
      std::vector<uint64_t> sums(count_);
      CK(cudaMemcpyAsync(sums.data(), sums_dev_, count_ * sizeof(uint64_t), cudaMemcpyDeviceToHost, s));
      CK(cudaStreamSynchronize(s));
      CheckSlots(path, copy_engine ? nullptr : &sums);
      for (void* p : b_) CK(cudaMemsetAsync(p, kGpuPoison, layer_bytes, s));
      Load(s, copy_engine, true);
      CK(cudaStreamSynchronize(s));
      std::vector<uint8_t> got(layer_bytes);
      for (uint32_t l = 0; l < layers_; ++l) {
        CK(cudaMemcpy(got.data(), b_[l], layer_bytes, cudaMemcpyDeviceToHost));
        if (std::memcmp(got.data(), a_host_[l].data(), layer_bytes) != 0) {
          Die(fmt::format("component {} ({}): {} load: layer {} differs from what was stored", index_,
                          ComponentKindName(kind_), path, l));
        }
      }
    }
    a_host_.clear();
  }

 private:
  kv::GpuKvView View(bool a) const {
    return kv::GpuKvView{a ? a_bases_dev_ : b_bases_dev_, uint64_t{count_} * chunk_, chunk_, layers_, planes_, chunk_};
  }
  kv::HostPoolView Pool() const { return kv::HostPoolView{sub_pool_, slot_bytes_, shards_, 0}; }
  kv::BlockPairs Pairs() const { return kv::BlockPairs{blocks_dev_, slots_dev_, count_, 0, layers_}; }

  // Every slot holds A's chunks at rank 0's shard offsets; `sums` (if given) are each slot's term sums of them.
  void CheckSlots(const char* path, const std::vector<uint64_t>* sums) const {
    std::atomic<uint64_t> bad{0};
    ParallelFor(count_, [&](uint64_t b, uint64_t e) {
      uint64_t wrong = 0;
      for (uint64_t i = b; i < e; ++i) {
        const uint8_t* slot = sub_pool_ + uint64_t{slots_[i]} * slot_bytes_;
        uint64_t sum = 0;
        for (uint32_t l = 0; l < layers_; ++l)
          for (uint32_t p = 0; p < planes_; ++p) {
            const uint64_t off = (uint64_t{l} * planes_ + p) * chunk_;  // rank 0's part: the slot's start
            const uint8_t* src = a_host_[l].data() + (uint64_t{p} * count_ + blocks_[i]) * chunk_;
            wrong += std::memcmp(slot + off, src, chunk_) != 0;
            if (sums) sum += ChecksumTermSum(slot + off, chunk_, static_cast<uint32_t>(off / kChecksumUnitBytes));
          }
        if (sums) wrong += (*sums)[i] != sum;
      }
      bad += wrong;
    });
    if (bad) {
      Die(fmt::format("component {} ({}): {} store: {} chunks or sums wrong", index_, ComponentKindName(kind_), path,
                      bad.load()));
    }
  }

  size_t index_;
  ComponentKind kind_;
  Geometry copy_;
  uint32_t count_, layers_, planes_, shards_;
  uint64_t chunk_, slot_bytes_;
  uint8_t* sub_pool_;
  std::vector<void*> a_, b_;
  std::vector<uint64_t> a_bases_, b_bases_;
  uint64_t* a_bases_dev_ = nullptr;
  uint64_t* b_bases_dev_ = nullptr;
  std::vector<uint32_t> blocks_, slots_;
  uint32_t* blocks_dev_ = nullptr;
  uint32_t* slots_dev_ = nullptr;
  uint64_t* sums_dev_ = nullptr;
  std::vector<std::vector<uint8_t>> a_host_;  // during Check only
};

struct Rates {
  uint64_t bytes = 0;
  double kernel_store = 0, kernel_store_plain = 0, kernel_load = 0;
  double copy_engine_store = 0, copy_engine_load = 0;
  double ceiling_store = 0, ceiling_load = 0;
};

// Times the copies of `set` back to back on one stream, each path separately, and contiguous copies of as many
// bytes between `host` (registered) and `dev`.
Rates Measure(const std::vector<ComponentCopies*>& set, Streams& st, const GeometryTransferOptions& o, uint8_t* host,
              uint8_t* dev) {
  Rates r;
  for (const auto* c : set) r.bytes += c->bytes();
  auto time = [&](const std::function<void()>& op) { return Gbps(r.bytes, TimeMs(st, o.warmup, o.iters, false, op)); };
  cudaStream_t s = st.s1;
  r.ceiling_store = time([&] { CK(cudaMemcpyAsync(host, dev, r.bytes, cudaMemcpyDeviceToHost, s)); });
  r.ceiling_load = time([&] { CK(cudaMemcpyAsync(dev, host, r.bytes, cudaMemcpyHostToDevice, s)); });
  r.kernel_store = time([&] {
    for (auto* c : set) c->Store(s, false);
  });
  r.kernel_store_plain = time([&] {
    for (auto* c : set) c->StorePlain(s);
  });
  r.kernel_load = time([&] {
    for (auto* c : set) c->Load(s, false);
  });
  r.copy_engine_store = time([&] {
    for (auto* c : set) c->Store(s, true);
  });
  r.copy_engine_load = time([&] {
    for (auto* c : set) c->Load(s, true);
  });
  return r;
}

Json RatesJson(const Rates& r) {
  return Json{{"bytes", r.bytes},
              {"kernel_store_gbps", Rounded(r.kernel_store, 2)},
              {"kernel_store_plain_gbps", Rounded(r.kernel_store_plain, 2)},
              {"kernel_load_gbps", Rounded(r.kernel_load, 2)},
              {"copy_engine_store_gbps", Rounded(r.copy_engine_store, 2)},
              {"copy_engine_load_gbps", Rounded(r.copy_engine_load, 2)},
              {"ceiling_store_gbps", Rounded(r.ceiling_store, 2)},
              {"ceiling_load_gbps", Rounded(r.ceiling_load, 2)},
              {"kernel_store_ratio", Rounded(r.kernel_store / r.ceiling_store, 3)},
              {"kernel_load_ratio", Rounded(r.kernel_load / r.ceiling_load, 3)},
              {"copy_engine_store_ratio", Rounded(r.copy_engine_store / r.ceiling_store, 3)},
              {"copy_engine_load_ratio", Rounded(r.copy_engine_load / r.ceiling_load, 3)}};
}

std::string RatesRow(const std::string& what, const Rates& r) {
  auto cell = [](double v, double c) { return fmt::format("{:6.1f} ({:.3f})", v, v / c); };
  return fmt::format("{:<26} {:>9.1f} | {:>14} {:>14} {:>14} | {:>14} {:>14} | {:6.1f} {:6.1f}\n", what,
                     static_cast<double>(r.bytes) / (1 << 20), cell(r.kernel_store, r.ceiling_store),
                     cell(r.kernel_store_plain, r.ceiling_store), cell(r.kernel_load, r.ceiling_load),
                     cell(r.copy_engine_store, r.ceiling_store), cell(r.copy_engine_load, r.ceiling_load),
                     r.ceiling_store, r.ceiling_load);
}

}  // namespace

const char* GeometryPresetNames() {
  return "llama3-8b, qwen3-8b, deepseek-mla, gpt-oss-20b, gemma3-27b, qwen3-next, jamba";
}

bool IsGeometryPreset(const std::string& name) {
  return std::any_of(std::begin(kPresets), std::end(kPresets), [&](const Preset& p) { return name == p.name; });
}

int RunGeometryTransfer(const GeometryTransferOptions& o) {
  const auto preset = std::find_if(std::begin(kPresets), std::end(kPresets),
                                   [&](const Preset& p) { return o.geometry == p.name; });
  if (preset == std::end(kPresets)) Die(fmt::format("--geometry {}: expected one of {}", o.geometry, GeometryPresetNames()));
  Geometry model = preset->make();
  model.tp_size = o.tp;
  if (Status valid = model.Validate(); !valid.ok()) Die(fmt::format("--geometry {} --tp {}: {}", o.geometry, o.tp, valid.message()));

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) Die("no CUDA device visible");
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  int driver = 0, runtime = 0;
  CK(cudaDriverGetVersion(&driver));
  CK(cudaRuntimeGetVersion(&runtime));

  // The pool: the components' sub-pools one after another, each 2 MiB aligned, registered as one range.
  std::vector<uint32_t> counts;
  std::vector<uint64_t> offsets;
  uint64_t pool_bytes = 0;
  for (size_t i = 0; i < model.component_count(); ++i) {
    counts.push_back(HitBlocks(model, i, o.prefix_blocks));
    offsets.push_back(pool_bytes);
    pool_bytes = AlignUp(pool_bytes + uint64_t{counts.back()} * model.Component(i).host_block_bytes(), kSubPoolAlign);
  }
  RegisteredPool pool(pool_bytes, kSubPoolAlign);
  std::vector<std::unique_ptr<ComponentCopies>> components;
  std::vector<ComponentCopies*> all;
  for (size_t i = 0; i < model.component_count(); ++i) {
    components.push_back(std::make_unique<ComponentCopies>(model, i, counts[i], pool.base() + offsets[i]));
    all.push_back(components.back().get());
  }
  Streams st;
  CK(cudaStreamCreateWithFlags(&st.s1, cudaStreamNonBlocking));
  CK(cudaEventCreate(&st.start));
  CK(cudaEventCreate(&st.stop));
  uint64_t total = 0;
  for (const auto* c : all) total += c->bytes();
  void* scratch = nullptr;  // the GPU side of the contiguous copies
  CK(cudaMalloc(&scratch, total));

  for (auto* c : all) {
    c->Check(st.s1);
    std::fprintf(stderr, "component %zu (%s): round trips checked (kernel with store sums, copy engine)\n", c->index(),
                 ComponentKindName(c->kind()));
  }
  std::vector<Rates> rates;
  for (auto* c : all) rates.push_back(Measure({c}, st, o, pool.base(), static_cast<uint8_t*>(scratch)));
  const Rates hybrid = Measure(all, st, o, pool.base(), static_cast<uint8_t*>(scratch));
  (void)cudaFree(scratch);
  (void)cudaEventDestroy(st.start);
  (void)cudaEventDestroy(st.stop);
  (void)cudaStreamDestroy(st.s1);

  const uint64_t hit_tokens = uint64_t{o.prefix_blocks} * model.tokens_per_block;
  if (o.json) {
    Json comps = Json::array();
    for (size_t i = 0; i < all.size(); ++i) {
      const ComponentCopies& c = *all[i];
      Json row = RatesJson(rates[i]);
      row["component"] = c.index();
      row["kind"] = ComponentKindName(c.kind());
      row["blocks"] = c.count();
      row["layers"] = c.copy_geometry().num_layers;
      row["chunk_bytes"] = c.chunk_bytes();
      row["slot_bytes"] = c.slot_bytes();
      comps.push_back(std::move(row));
    }
    const Json report{{"bench", "transfer-geometry"},
                      {"geometry", o.geometry},
                      {"geometry_detail", model.ToString()},
                      {"tp", o.tp},
                      {"tp_rank", 0},
                      {"prefix_blocks", o.prefix_blocks},
                      {"hit_tokens", hit_tokens},
                      {"rank_bytes_per_hit_token", Rounded(static_cast<double>(total) / static_cast<double>(hit_tokens), 1)},
                      {"device", prop.name},
                      {"sms", prop.multiProcessorCount},
                      {"cuda_driver", driver},
                      {"cuda_runtime", runtime},
                      {"iters", o.iters},
                      {"warmup", o.warmup},
                      {"correctness", "ok"},
                      {"components", comps},
                      {"hybrid_set", RatesJson(hybrid)}};
    std::fputs(DumpLine(report).c_str(), stdout);
    return 0;
  }
  fmt::print("{} ({} SMs), driver {}, runtime {}; {} = {}\nTP rank 0 of {}; a hit of {} blocks ({} tokens): {:.1f} MiB "
             "on this rank, {:.0f} bytes per hit token; median of {} after {} warm-up; GB/s = 1e9 B/s\n",
             prop.name, prop.multiProcessorCount, driver, runtime, o.geometry, model.ToString(), o.tp, o.prefix_blocks,
             hit_tokens, static_cast<double>(total) / (1 << 20), static_cast<double>(total) / static_cast<double>(hit_tokens), o.iters,
             o.warmup);
  fmt::print("{:<26} {:>9} | {:>14} {:>14} {:>14} | {:>14} {:>14} | ceiling st/ld\n", "copy", "MiB", "kernel store",
             "(no sums)", "kernel load", "c.e. store", "c.e. load");
  for (size_t i = 0; i < all.size(); ++i) {
    const ComponentCopies& c = *all[i];
    fmt::print("{}", RatesRow(fmt::format("{} {} x{}", c.index(), ComponentKindName(c.kind()), c.count()), rates[i]));
  }
  fmt::print("{}", RatesRow("hybrid set", hybrid));
  fmt::print("(cells: GB/s (ratio to the contiguous copy of the same bytes); kernel store = checksummed gather, as "
             "the daemon stores)\n");
  return 0;
}

}  // namespace flexkv::bench::transfer
