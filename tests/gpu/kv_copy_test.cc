// GPU <-> host-pool block copies (daemon/transfer/cuda/kv_copy.h): byte-exact round trips through a registered
// pool for every GPU layout, K/V and MLA, TP shards, layer ranges, odd sizes and launch shapes, for the kernels
// and the copy-engine batch, and the stores' content checksums against the CPU's. Without a visible GPU (CI)
// every case warns and passes. Over 600 lines: every kernel path's cases share the fixtures at the top (GpuKv, Pool,
// DevicePairs, RoundTrip, ChecksummedStore), which a split would have to move to a header of their own.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/block_checksum.h"
#include "common/mapped_region.h"
#include "daemon/transfer/cuda/kv_copy.h"
#include "tests/gpu/gpu_test_support.h"

namespace {

namespace kv = flexkv::cuda;

// cuda_runtime_api.h takes void**; these keep the pointer types.
template <class T>
cudaError_t DeviceAlloc(T** p, size_t bytes) {
  void* v = nullptr;
  const cudaError_t e = cudaMalloc(&v, bytes);
  *p = static_cast<T*>(v);
  return e;
}
template <class T>
cudaError_t PinnedAlloc(T** p, size_t bytes) {
  void* v = nullptr;
  const cudaError_t e = cudaMallocHost(&v, bytes);
  *p = static_cast<T*>(v);
  return e;
}

constexpr uint8_t kPoolPoison = 0xA5;
constexpr uint8_t kGpuPoison = 0x5A;

enum class Layout { kLayerFirst, kBlockFirst, kLayerBlock, kLayerBlockRegions };

const char* Name(Layout l) {
  switch (l) {
    case Layout::kLayerFirst: return "LAYERFIRST";
    case Layout::kBlockFirst: return "BLOCKFIRST";
    case Layout::kLayerBlockRegions: return "LAYERBLOCKREGIONS";
    default: return "LAYERBLOCK";
  }
}

// An allocation per layer (LAYERFIRST, LAYERBLOCKREGIONS) or one for the whole cache.
bool PerLayer(Layout l) { return l == Layout::kLayerFirst || l == Layout::kLayerBlockRegions; }

std::mt19937_64 Rng() {
  std::random_device rd;
  const uint64_t seed = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  UNSCOPED_INFO("rng seed " << seed);
  return std::mt19937_64(seed);
}

// One TP rank's KV cache on the GPU in `layout`, with a host mirror of every allocation. LAYERFIRST is one
// allocation per layer ([planes][blocks][chunk], vLLM FLASH_ATTN), LAYERBLOCKREGIONS too ([blocks][planes][chunk],
// FlashInfer / Triton); the others are one allocation.
class GpuKv {
 public:
  GpuKv(Layout layout, uint32_t layers, uint32_t planes, uint32_t blocks, uint64_t chunk)
      : layout_(layout), layers_(layers), planes_(planes), blocks_(blocks), chunk_(chunk) {
    const uint64_t per_layer = static_cast<uint64_t>(planes) * blocks * chunk;
    const size_t allocs = PerLayer(layout) ? layers : 1;
    const uint64_t bytes = PerLayer(layout) ? per_layer : per_layer * layers;
    dev_.resize(allocs, nullptr);
    mirror_.assign(allocs, std::vector<uint8_t>(bytes));
    for (auto& d : dev_) CUDA_OK(cudaMalloc(&d, bytes));
    bases_.resize(layers);
    for (uint32_t l = 0; l < layers; ++l) {
      auto* base = static_cast<uint8_t*>(dev_[PerLayer(layout) ? l : 0]);
      if (layout == Layout::kBlockFirst) base += static_cast<uint64_t>(l) * planes * chunk;
      if (layout == Layout::kLayerBlock) base += static_cast<uint64_t>(l) * blocks * planes * chunk;
      bases_[l] = reinterpret_cast<uint64_t>(base);
    }
    CUDA_OK(DeviceAlloc(&bases_dev_, layers * sizeof(uint64_t)));
    CUDA_OK(cudaMemcpy(bases_dev_, bases_.data(), layers * sizeof(uint64_t), cudaMemcpyHostToDevice));
  }
  ~GpuKv() {
    for (auto* d : dev_) (void)cudaFree(d);
    (void)cudaFree(bases_dev_);
  }
  GpuKv(const GpuKv&) = delete;
  GpuKv& operator=(const GpuKv&) = delete;

  kv::GpuKvView View() const {
    kv::GpuKvView v{};
    v.layer_base = bases_dev_;
    v.num_layers = layers_;
    v.num_planes = planes_;
    v.chunk_bytes = chunk_;
    v.layers_in_one_allocation = !PerLayer(layout_);
    switch (layout_) {
      case Layout::kLayerFirst: v.plane_stride = static_cast<uint64_t>(blocks_) * chunk_; v.block_stride = chunk_; break;
      case Layout::kBlockFirst: v.plane_stride = chunk_; v.block_stride = static_cast<uint64_t>(layers_) * planes_ * chunk_; break;
      case Layout::kLayerBlock:
      case Layout::kLayerBlockRegions:
        v.plane_stride = chunk_;
        v.block_stride = static_cast<uint64_t>(planes_) * chunk_;
        break;
    }
    return v;
  }
  const uint64_t* HostBases() const { return bases_.data(); }

  // The mirror bytes of chunk (layer, plane, block).
  uint8_t* Chunk(uint32_t l, uint32_t p, uint32_t b) {
    const kv::GpuKvView v = View();
    const size_t a = PerLayer(layout_) ? l : 0;
    const uint64_t off = bases_[l] - reinterpret_cast<uint64_t>(dev_[a]) + p * v.plane_stride + b * v.block_stride;
    return mirror_[a].data() + off;
  }

  void Randomize(std::mt19937_64& rng) {
    for (auto& m : mirror_)
      for (size_t i = 0; i + 8 <= m.size(); i += 8) {
        const uint64_t r = rng();
        std::memcpy(m.data() + i, &r, 8);
      }
    Upload();
  }
  void Upload() {
    for (size_t a = 0; a < dev_.size(); ++a)
      CUDA_OK(cudaMemcpy(dev_[a], mirror_[a].data(), mirror_[a].size(), cudaMemcpyHostToDevice));
  }
  void Poison() {
    for (size_t a = 0; a < dev_.size(); ++a) CUDA_OK(cudaMemset(dev_[a], kGpuPoison, mirror_[a].size()));
  }
  std::vector<std::vector<uint8_t>> Download() const {
    std::vector<std::vector<uint8_t>> out(mirror_.size());
    for (size_t a = 0; a < dev_.size(); ++a) {
      out[a].resize(mirror_[a].size());
      CUDA_OK(cudaMemcpy(out[a].data(), dev_[a], out[a].size(), cudaMemcpyDeviceToHost));
    }
    return out;
  }
  // What the GPU should hold after loading `blocks` over layers [lb, le) into a poisoned cache.
  std::vector<std::vector<uint8_t>> ExpectedAfterLoad(const std::vector<uint32_t>& blocks, uint32_t lb, uint32_t le) {
    std::vector<std::vector<uint8_t>> want(mirror_.size());
    for (size_t a = 0; a < want.size(); ++a) want[a].assign(mirror_[a].size(), kGpuPoison);
    for (uint32_t b : blocks)
      for (uint32_t l = lb; l < le; ++l)
        for (uint32_t p = 0; p < planes_; ++p) {
          const uint8_t* src = Chunk(l, p, b);
          const size_t a = PerLayer(layout_) ? l : 0;
          std::memcpy(want[a].data() + (src - mirror_[a].data()), src, chunk_);
        }
    return want;
  }

 private:
  Layout layout_;
  uint32_t layers_, planes_, blocks_;
  uint64_t chunk_;
  std::vector<void*> dev_;
  std::vector<std::vector<uint8_t>> mirror_;
  std::vector<uint64_t> bases_;
  uint64_t* bases_dev_ = nullptr;
};

// The host pool as the daemon has it: anonymous page-aligned memory registered for DMA.
class Pool {
 public:
  Pool(uint32_t slots, uint64_t block_bytes) : slots_(slots), block_bytes_(block_bytes), bytes_(slots * block_bytes) {
    auto map = flexkv::MappedRegion::Anonymous("the test pool", bytes_);
    INFO(map.status().ToString());
    REQUIRE(map.ok());
    map_ = std::move(*map);
    base_ = map_.bytes();
    CUDA_OK(cudaHostRegister(base_, bytes_, cudaHostRegisterPortable | cudaHostRegisterMapped));
    void* dev = nullptr;
    CUDA_OK(cudaHostGetDevicePointer(&dev, base_, 0));
    dev_ = static_cast<uint8_t*>(dev);
  }
  ~Pool() {
    (void)cudaHostUnregister(base_);  // before map_ unmaps
  }
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  kv::HostPoolView View(uint32_t tp_shards, uint32_t tp_rank) const { return {dev_, block_bytes_, tp_shards, tp_rank}; }
  void Poison() { std::memset(base_, kPoolPoison, bytes_); }
  uint8_t* Slot(uint32_t s) { return base_ + s * block_bytes_; }
  const uint8_t* data() const { return base_; }
  uint64_t bytes() const { return bytes_; }
  uint32_t slots() const { return slots_; }

 private:
  uint32_t slots_;
  uint64_t block_bytes_, bytes_;
  flexkv::MappedRegion map_;
  uint8_t* base_ = nullptr;  // map_'s bytes
  uint8_t* dev_ = nullptr;
};

// `count` distinct values from [0, n), in random order.
std::vector<uint32_t> Pick(std::mt19937_64& rng, uint32_t n, uint32_t count) {
  REQUIRE(count <= n);
  std::vector<uint32_t> v(n);
  std::iota(v.begin(), v.end(), 0u);
  std::shuffle(v.begin(), v.end(), rng);
  v.resize(count);
  return v;
}

// Block/slot arrays in device memory (or pinned host memory when `pinned`), freed on destruction.
class DevicePairs {
 public:
  DevicePairs(const std::vector<uint32_t>& blocks, const std::vector<uint32_t>& slots, bool pinned) : pinned_(pinned) {
    const size_t n = std::max<size_t>(1, blocks.size()) * sizeof(uint32_t);
    if (pinned) {
      CUDA_OK(PinnedAlloc(&b_, n));
      CUDA_OK(PinnedAlloc(&s_, n));
      std::memcpy(b_, blocks.data(), blocks.size() * sizeof(uint32_t));
      std::memcpy(s_, slots.data(), slots.size() * sizeof(uint32_t));
    } else {
      CUDA_OK(DeviceAlloc(&b_, n));
      CUDA_OK(DeviceAlloc(&s_, n));
      CUDA_OK(cudaMemcpy(b_, blocks.data(), blocks.size() * sizeof(uint32_t), cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemcpy(s_, slots.data(), slots.size() * sizeof(uint32_t), cudaMemcpyHostToDevice));
    }
  }
  ~DevicePairs() {
    if (pinned_) {
      (void)cudaFreeHost(b_);
      (void)cudaFreeHost(s_);
    } else {
      (void)cudaFree(b_);
      (void)cudaFree(s_);
    }
  }
  DevicePairs(const DevicePairs&) = delete;
  DevicePairs& operator=(const DevicePairs&) = delete;
  kv::BlockPairs Pairs(uint32_t count, uint32_t lb, uint32_t le) const { return {b_, s_, count, lb, le}; }

 private:
  bool pinned_;
  uint32_t* b_ = nullptr;
  uint32_t* s_ = nullptr;
};

// kStaged: StagedCopy through a ring of two buffers of kStagedSlotsPerBuffer slots, so that a request of more
// slots runs in several batches and wraps the ring.
enum class Path { kKernel, kCopyEngine, kStaged };
constexpr uint32_t kStagedSlotsPerBuffer = 3;

std::unique_ptr<kv::StagingRing> SmallRing(const kv::GpuKvView& view) {
  std::unique_ptr<kv::StagingRing> ring;
  CUDA_OK(kv::StagingRing::Create(2 * kStagedSlotsPerBuffer * kv::StagedSlotBytes(view), 2, &ring));
  REQUIRE(ring->SlotsPerBuffer(kv::StagedSlotBytes(view)) == kStagedSlotsPerBuffer);
  return ring;
}

// A staged copy on `stream` (its own stream when null: StagedCopy needs one), waited for.
void Staged(GpuKv& gpu, const Pool& pool, const std::vector<uint32_t>& blocks, const std::vector<uint32_t>& slots,
            bool to_host, uint64_t* sums, cudaStream_t stream, uint32_t shards = 1, uint32_t rank = 0,
            const uint8_t* follows = nullptr) {
  cudaStream_t own = nullptr;
  if (stream == nullptr) {
    CUDA_OK(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking));
    stream = own;
  }
  auto ring = SmallRing(gpu.View());
  DevicePairs dp(blocks, slots, false);
  CUDA_OK(kv::StagedCopy(gpu.View(), pool.View(shards, rank), dp.Pairs(1, 0, 1).gpu_blocks, slots.data(),
                         static_cast<uint32_t>(blocks.size()), to_host, *ring, stream, sums, 0, follows));
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaGetLastError());
  if (own != nullptr) CUDA_OK(cudaStreamDestroy(own));
}

void Store(Path path, GpuKv& gpu, const Pool& pool, uint32_t shards, uint32_t rank, const std::vector<uint32_t>& blocks,
           const std::vector<uint32_t>& slots, uint32_t lb, uint32_t le, const kv::LaunchShape& shape, bool pinned_pairs,
           cudaStream_t stream,
           const uint8_t* follows = nullptr) {
  const uint32_t n = static_cast<uint32_t>(blocks.size());
  if (path == Path::kStaged) {
    REQUIRE((lb == 0 && le == gpu.View().num_layers));
    Staged(gpu, pool, blocks, slots, true, nullptr, stream, shards, rank, follows);
  } else if (path == Path::kCopyEngine) {
    CUDA_OK(kv::CopyEngineBatch(gpu.HostBases(), gpu.View(), pool.View(shards, rank), blocks.data(), slots.data(), n, lb,
                                le, true, stream, follows));
  } else {
    DevicePairs dp(blocks, slots, pinned_pairs);
    if (shape.ctas == 0 && shape.threads == 0)
      CUDA_OK(kv::LaunchGather(gpu.View(), pool.View(shards, rank), dp.Pairs(n, lb, le), stream));
    else
      CUDA_OK(kv::LaunchGatherShaped(gpu.View(), pool.View(shards, rank), dp.Pairs(n, lb, le), stream, shape));
    CUDA_OK(cudaStreamSynchronize(stream));
  }
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaGetLastError());
}

void Load(Path path, GpuKv& gpu, const Pool& pool, uint32_t shards, uint32_t rank, const std::vector<uint32_t>& blocks,
          const std::vector<uint32_t>& slots, uint32_t lb, uint32_t le, const kv::LaunchShape& shape, bool pinned_pairs,
          cudaStream_t stream,
          const uint8_t* follows = nullptr) {
  const uint32_t n = static_cast<uint32_t>(blocks.size());
  if (path == Path::kStaged) {
    REQUIRE((lb == 0 && le == gpu.View().num_layers));
    Staged(gpu, pool, blocks, slots, false, nullptr, stream, shards, rank, follows);
  } else if (path == Path::kCopyEngine) {
    CUDA_OK(kv::CopyEngineBatch(gpu.HostBases(), gpu.View(), pool.View(shards, rank), blocks.data(), slots.data(), n, lb,
                                le, false, stream, follows));
  } else {
    DevicePairs dp(blocks, slots, pinned_pairs);
    if (shape.ctas == 0 && shape.threads == 0)
      CUDA_OK(kv::LaunchScatter(gpu.View(), pool.View(shards, rank), dp.Pairs(n, lb, le), stream));
    else
      CUDA_OK(kv::LaunchScatterShaped(gpu.View(), pool.View(shards, rank), dp.Pairs(n, lb, le), stream, shape));
    CUDA_OK(cudaStreamSynchronize(stream));
  }
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaGetLastError());
}

// Byte compare with the first difference in the failure message.
void RequireSame(const uint8_t* got, const uint8_t* want, uint64_t n, const std::string& what) {
  if (std::memcmp(got, want, n) == 0) return;
  uint64_t i = 0;
  while (got[i] == want[i]) ++i;
  uint64_t wrong = 0;
  for (uint64_t j = 0; j < n; ++j) wrong += got[j] != want[j];
  FAIL(what << ": " << wrong << " of " << n << " bytes differ, first at " << i << " (got 0x" << std::hex
            << int{got[i]} << ", want 0x" << int{want[i]} << ")");
}

struct Case {
  Layout layout = Layout::kLayerFirst;
  uint32_t layers = 4, planes = 2, gpu_blocks = 40, slots = 48, count = 33;
  uint64_t chunk = 4096;
  uint32_t lb = 0, le = 0;  // le 0: all layers
  uint64_t slot_padding = 0;
  Path path = Path::kKernel;
  kv::LaunchShape shape{};
  bool pinned_pairs = false;
  bool sequential = false;  // blocks i..i+count -> slots j..j+count (copy-engine merges)
  // Slots in runs of consecutive slots (shuffled runs of 1..8), blocks in a row, and the slot-run marks (kv_copy.h)
  // handed to the copies - with one wrong mark (a jump marked as following) and one missing.
  bool slot_runs = false;
  cudaStream_t stream = nullptr;
};

// One rank, one shard: store into a poisoned pool, check every pool byte; load into a poisoned GPU cache,
// check every GPU byte.
void RoundTrip(const Case& c) {
  CAPTURE(Name(c.layout), c.layers, c.planes, c.chunk, c.count, c.lb, c.le, static_cast<int>(c.path), c.shape.ctas,
          c.shape.threads, c.shape.unroll, c.shape.warps_per_chunk, c.pinned_pairs, c.sequential, c.slot_runs,
          c.slot_padding);
  auto rng = Rng();
  const uint32_t le = c.le ? c.le : c.layers;
  GpuKv gpu(c.layout, c.layers, c.planes, c.gpu_blocks, c.chunk);
  const uint64_t block_bytes = c.layers * c.planes * c.chunk + c.slot_padding;
  Pool pool(c.slots, block_bytes);
  gpu.Randomize(rng);
  pool.Poison();

  std::vector<uint32_t> blocks, slots;
  if (c.sequential) {
    blocks.resize(c.count);
    slots.resize(c.count);
    std::iota(blocks.begin(), blocks.end(), c.gpu_blocks - c.count);
    std::iota(slots.begin(), slots.end(), 1u);
  } else if (c.slot_runs) {
    blocks.resize(c.count);
    std::iota(blocks.begin(), blocks.end(), c.gpu_blocks - c.count);
    std::vector<std::vector<uint32_t>> runs;
    for (uint32_t s = 0; s < c.slots;) {
      const uint32_t len = std::min<uint32_t>(c.slots - s, 1 + static_cast<uint32_t>(rng() % 8));
      runs.emplace_back(len);
      std::iota(runs.back().begin(), runs.back().end(), s);
      s += len;
    }
    std::shuffle(runs.begin(), runs.end(), rng);
    for (const auto& run : runs) slots.insert(slots.end(), run.begin(), run.end());
    slots.resize(c.count);
  } else {
    blocks = Pick(rng, c.gpu_blocks, c.count);
    slots = Pick(rng, c.slots, c.count);
  }
  std::vector<uint8_t> follows;
  if (c.slot_runs) {
    follows.assign(c.count, 0);
    uint32_t marked = 0;
    for (uint32_t i = 1; i < c.count; ++i) {
      follows[i] = slots[i] == slots[i - 1] + 1;
      marked += follows[i];
    }
    REQUIRE(marked >= 4);  // runs to merge (count 33 over runs of at most 8)
    for (uint32_t i = 1; i < c.count; ++i)
      if (!follows[i]) {
        follows[i] = 1;  // wrong: the copies must check the slots themselves
        break;
      }
    for (uint32_t i = c.count - 1; i > 0; --i)
      if (follows[i] && slots[i] == slots[i - 1] + 1) {
        follows[i] = 0;  // missing: those two go as two copies
        break;
      }
  }
  const uint8_t* marks = follows.empty() ? nullptr : follows.data();
  cudaStream_t stream = c.stream;
  Store(c.path, gpu, pool, 1, 0, blocks, slots, c.lb, le, c.shape, c.pinned_pairs, stream, marks);

  std::vector<uint8_t> want(pool.bytes(), kPoolPoison);
  for (uint32_t i = 0; i < c.count; ++i)
    for (uint32_t l = c.lb; l < le; ++l)
      for (uint32_t p = 0; p < c.planes; ++p)
        std::memcpy(want.data() + slots[i] * block_bytes + (l * c.planes + p) * c.chunk, gpu.Chunk(l, p, blocks[i]),
                    c.chunk);
  RequireSame(pool.data(), want.data(), pool.bytes(), "pool after store");

  gpu.Poison();
  Load(c.path, gpu, pool, 1, 0, blocks, slots, c.lb, le, c.shape, c.pinned_pairs, stream, marks);
  const auto got = gpu.Download();
  const auto want_gpu = gpu.ExpectedAfterLoad(blocks, c.lb, le);
  for (size_t a = 0; a < got.size(); ++a)
    RequireSame(got[a].data(), want_gpu[a].data(), got[a].size(), "GPU allocation " + std::to_string(a) + " after load");
}

}  // namespace

TEST_CASE("kernels round-trip every GPU layout, K/V and MLA, byte for byte", "[gpu]") {
  SKIP_WITHOUT_GPU();
  for (Layout layout : {Layout::kLayerFirst, Layout::kBlockFirst, Layout::kLayerBlock, Layout::kLayerBlockRegions})
    for (uint32_t planes : {2u, 1u})
      for (uint64_t chunk : {uint64_t{16}, uint64_t{48}, uint64_t{528}, uint64_t{4112}, uint64_t{32768}}) {
        Case c;
        c.layout = layout;
        c.planes = planes;
        c.chunk = chunk;
        c.layers = planes == 1 ? 5 : 4;  // MLA-like: one plane, odd layer count
        RoundTrip(c);
      }
}

TEST_CASE("kernels: odd counts, layer ranges, padded slots, pinned pair arrays", "[gpu]") {
  SKIP_WITHOUT_GPU();
  for (uint32_t count : {1u, 7u, 33u, 40u}) {
    Case c;
    c.count = count;
    c.chunk = 1040;
    RoundTrip(c);
  }
  Case range;
  range.layers = 6;
  range.lb = 2;
  range.le = 5;
  range.layout = Layout::kBlockFirst;
  RoundTrip(range);
  Case padded;
  padded.slot_padding = 4096 + 16;
  padded.layout = Layout::kLayerBlock;
  RoundTrip(padded);
  Case pinned;
  pinned.pinned_pairs = true;
  RoundTrip(pinned);
}

TEST_CASE("kernels: every launch shape gives the same bytes", "[gpu]") {
  SKIP_WITHOUT_GPU();
  const kv::LaunchShape shapes[] = {
      {1, 32, 1, 1, 0, 0},   {3, 96, 2, 1, 0, 0},    {5, 256, 8, 2, 0, 0},  {2, 128, 4, 4, 0, 0},
      {132, 1024, 8, 1, 0, 0}, {8, 512, 4, 2, 0, 0},  {200, 64, 1, 2, 0, 0},
      // bulk-copy kernel: one piece in flight, pieces smaller than a chunk, more than 48 KiB of shared memory
      {1, 32, 1, 1, 1, 1},   {3, 32, 1, 1, 1, 2},    {7, 0, 0, 0, 4, 4},    {132, 32, 1, 1, 16, 4},
      {2, 32, 1, 1, 64, 3},  {5, 32, 1, 1, 2, 8},
  };
  for (const auto& s : shapes)
    for (uint64_t chunk : {uint64_t{48}, uint64_t{528}, uint64_t{8192 + 16}, uint64_t{32768}}) {
      Case c;
      c.shape = s;
      c.chunk = chunk;
      c.layout = Layout::kLayerFirst;
      RoundTrip(c);
    }
}

TEST_CASE("TP ranks store into one host block, each its part contiguous, and load back only their part, every path",
          "[gpu]") {
  SKIP_WITHOUT_GPU();
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (uint32_t tp : {2u, 4u})
    for (Path path : {Path::kKernel, Path::kCopyEngine, Path::kStaged})
      for (Layout layout : {Layout::kLayerFirst, Layout::kBlockFirst}) {
        CAPTURE(tp, Name(layout), static_cast<int>(path));
        auto rng = Rng();
        const uint32_t layers = 3, planes = 2, nblocks = 24, nslots = 30, count = 11;
        const uint64_t shard = 2048;  // per-rank chunk
        std::vector<std::unique_ptr<GpuKv>> ranks;
        for (uint32_t r = 0; r < tp; ++r) {
          ranks.push_back(std::make_unique<GpuKv>(layout, layers, planes, nblocks, shard));
          ranks.back()->Randomize(rng);
        }
        const uint64_t block_bytes = layers * planes * tp * shard;
        Pool pool(nslots, block_bytes);
        pool.Poison();
        // Each rank has its own GPU block ids for the same host blocks.
        const auto slots = Pick(rng, nslots, count);
        std::vector<std::vector<uint32_t>> blocks;
        for (uint32_t r = 0; r < tp; ++r) blocks.push_back(Pick(rng, nblocks, count));
        for (uint32_t r = 0; r < tp; ++r) Store(path, *ranks[r], pool, tp, r, blocks[r], slots, 0, layers, {}, false, stream);
        // The rank-major slot order (common/slot_order.h): rank r's part is [layer][plane][chunk] at r * its size.
        std::vector<uint8_t> want(pool.bytes(), kPoolPoison);
        for (uint32_t i = 0; i < count; ++i)
          for (uint32_t r = 0; r < tp; ++r)
            for (uint32_t l = 0; l < layers; ++l)
              for (uint32_t p = 0; p < planes; ++p) {
                uint8_t* at = want.data() + slots[i] * block_bytes + ((uint64_t{r} * layers + l) * planes + p) * shard;
                std::memcpy(at, ranks[r]->Chunk(l, p, blocks[r][i]), shard);
              }
        RequireSame(pool.data(), want.data(), pool.bytes(), "pool after every rank stored");

        for (auto& r : ranks) r->Poison();
        for (uint32_t r = 0; r < tp; ++r) Load(path, *ranks[r], pool, tp, r, blocks[r], slots, 0, layers, {}, false, stream);
        for (uint32_t r = 0; r < tp; ++r) {
          const auto got = ranks[r]->Download(), want_gpu = ranks[r]->ExpectedAfterLoad(blocks[r], 0, layers);
          for (size_t a = 0; a < got.size(); ++a)
            RequireSame(got[a].data(), want_gpu[a].data(), got[a].size(), "rank " + std::to_string(r) + " after load");
        }
      }
  CUDA_OK(cudaStreamDestroy(stream));
}

TEST_CASE("copy-engine batch round-trips every layout, merged runs, and the legacy-stream fallback", "[gpu]") {
  SKIP_WITHOUT_GPU();
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (Layout layout : {Layout::kLayerFirst, Layout::kBlockFirst, Layout::kLayerBlock, Layout::kLayerBlockRegions})
    for (uint32_t planes : {2u, 1u}) {
      Case c;
      c.path = Path::kCopyEngine;
      c.layout = layout;
      c.planes = planes;
      c.chunk = 4112;
      c.stream = stream;
      RoundTrip(c);
      c.sequential = true;  // BLOCKFIRST: whole blocks contiguous on both sides, merged into one copy per run
      RoundTrip(c);
    }
  Case range;
  range.path = Path::kCopyEngine;
  range.layers = 6;
  range.lb = 1;
  range.le = 4;
  range.count = 7;
  range.stream = stream;
  RoundTrip(range);
  Case legacy;  // stream 0: per-chunk cudaMemcpyAsync
  legacy.path = Path::kCopyEngine;
  legacy.count = 5;
  RoundTrip(legacy);
  CUDA_OK(cudaStreamDestroy(stream));
}

TEST_CASE("bad views are refused before anything is enqueued, and empty requests succeed", "[gpu]") {
  SKIP_WITHOUT_GPU();
  GpuKv gpu(Layout::kLayerFirst, 2, 2, 4, 64);
  Pool pool(4, 2 * 2 * 64);
  const std::vector<uint32_t> blocks{0, 1}, slots{2, 3};
  DevicePairs dp(blocks, slots, false);
  const kv::GpuKvView good = gpu.View();
  const kv::HostPoolView pv = pool.View(1, 0);

  kv::GpuKvView odd = good;
  odd.chunk_bytes = 40;
  CHECK(kv::LaunchGather(odd, pv, dp.Pairs(2, 0, 2), nullptr) == cudaErrorInvalidValue);
  CHECK(kv::LaunchScatter(good, pool.View(2, 2), dp.Pairs(2, 0, 2), nullptr) == cudaErrorInvalidValue);
  CHECK(kv::LaunchScatter(good, pv, dp.Pairs(2, 0, 3), nullptr) == cudaErrorInvalidValue);
  CHECK(kv::LaunchGather(good, pool.View(2, 0), dp.Pairs(2, 0, 2), nullptr) == cudaErrorInvalidValue);  // slot too small
  kv::LaunchShape bad_shape{4, 100, 4, 1};
  CHECK(kv::LaunchGatherShaped(good, pv, dp.Pairs(2, 0, 2), nullptr, bad_shape) == cudaErrorInvalidValue);
  bad_shape = {4, 128, 3, 1};
  CHECK(kv::LaunchGatherShaped(good, pv, dp.Pairs(2, 0, 2), nullptr, bad_shape) == cudaErrorInvalidValue);
  CHECK(kv::CopyEngineBatch(gpu.HostBases(), odd, pv, blocks.data(), slots.data(), 2, 0, 2, true, nullptr) ==
        cudaErrorInvalidValue);

  pool.Poison();
  CHECK(kv::LaunchGather(good, pv, dp.Pairs(0, 0, 2), nullptr) == cudaSuccess);
  CHECK(kv::LaunchGather(good, pv, dp.Pairs(2, 1, 1), nullptr) == cudaSuccess);
  CHECK(kv::CopyEngineBatch(gpu.HostBases(), good, pv, blocks.data(), slots.data(), 0, 0, 2, true, nullptr) ==
        cudaSuccess);
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint8_t> untouched(pool.bytes(), kPoolPoison);
  RequireSame(pool.data(), untouched.data(), pool.bytes(), "pool after empty requests");
}

namespace {

// Per-pair checksum term sums in device memory, zeroed on creation.
class DeviceSums {
 public:
  explicit DeviceSums(size_t n) : n_(n) {
    CUDA_OK(DeviceAlloc(&dev_, std::max<size_t>(1, n) * sizeof(uint64_t)));
    CUDA_OK(cudaMemset(dev_, 0, std::max<size_t>(1, n) * sizeof(uint64_t)));
  }
  ~DeviceSums() { (void)cudaFree(dev_); }
  DeviceSums(const DeviceSums&) = delete;
  DeviceSums& operator=(const DeviceSums&) = delete;
  uint64_t* get() const { return dev_; }
  std::vector<uint64_t> Download() const {
    std::vector<uint64_t> out(n_);
    CUDA_OK(cudaMemcpy(out.data(), dev_, n_ * sizeof(uint64_t), cudaMemcpyDeviceToHost));
    return out;
  }

 private:
  size_t n_;
  uint64_t* dev_ = nullptr;
};

// A store that also sums: the checksummed gather kernel, or the copy-engine batch and the sums-only kernel.
void StoreSummed(Path path, GpuKv& gpu, const Pool& pool, uint32_t shards, uint32_t rank,
                 const std::vector<uint32_t>& blocks, const std::vector<uint32_t>& slots, uint32_t lb, uint32_t le,
                 const kv::LaunchShape& shape, const DeviceSums& sums, cudaStream_t stream) {
  const uint32_t n = static_cast<uint32_t>(blocks.size());
  DevicePairs dp(blocks, slots, false);
  if (path == Path::kStaged) {
    REQUIRE((lb == 0 && le == gpu.View().num_layers));
    Staged(gpu, pool, blocks, slots, true, sums.get(), stream, shards, rank);
    return;
  }
  if (path == Path::kCopyEngine) {
    CUDA_OK(kv::CopyEngineBatch(gpu.HostBases(), gpu.View(), pool.View(shards, rank), blocks.data(), slots.data(), n, lb,
                                le, true, stream));
    CUDA_OK(kv::LaunchChecksumTerms(gpu.View(), pool.View(shards, rank), dp.Pairs(n, lb, le), sums.get(), stream, shape));
  } else {
    CUDA_OK(kv::LaunchGatherChecksummed(gpu.View(), pool.View(shards, rank), dp.Pairs(n, lb, le), sums.get(), stream,
                                        shape));
  }
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaGetLastError());
}

// The term sum of the chunks (layers [lb, le) of `layers`, every plane, TP shard `rank`) of one slot, from the
// slot's bytes on the CPU (the rank-major slot order).
uint64_t ChunkTermSums(const uint8_t* slot, uint32_t layers, uint32_t planes, uint32_t rank, uint64_t chunk,
                       uint32_t lb, uint32_t le) {
  uint64_t sum = 0;
  for (uint32_t l = lb; l < le; ++l)
    for (uint32_t p = 0; p < planes; ++p) {
      const uint64_t off = ((static_cast<uint64_t>(rank) * layers + l) * planes + p) * chunk;
      sum += flexkv::ChecksumTermSum(slot + off, chunk, static_cast<uint32_t>(off / flexkv::kChecksumUnitBytes));
    }
  return sum;
}

// One rank, one shard, all layers, unpadded slots: the plain store and the summing store (kernel or copy engine)
// each leave exactly the expected bytes in a poisoned pool, and each pair's sum finishes to BlockChecksum of its
// slot as the CPU computes it.
void ChecksummedStore(const Case& c) {
  CAPTURE(Name(c.layout), c.layers, c.planes, c.chunk, c.count, static_cast<int>(c.path), c.shape.ctas,
          c.shape.threads, c.shape.unroll, c.shape.warps_per_chunk, c.shape.bulk_kib);
  auto rng = Rng();
  GpuKv gpu(c.layout, c.layers, c.planes, c.gpu_blocks, c.chunk);
  const uint64_t block_bytes = c.layers * c.planes * c.chunk;
  Pool pool(c.slots, block_bytes);
  gpu.Randomize(rng);
  const auto blocks = Pick(rng, c.gpu_blocks, c.count), slots = Pick(rng, c.slots, c.count);
  std::vector<uint8_t> want(pool.bytes(), kPoolPoison);
  for (uint32_t i = 0; i < c.count; ++i)
    for (uint32_t l = 0; l < c.layers; ++l)
      for (uint32_t p = 0; p < c.planes; ++p)
        std::memcpy(want.data() + slots[i] * block_bytes + (l * c.planes + p) * c.chunk, gpu.Chunk(l, p, blocks[i]),
                    c.chunk);

  pool.Poison();
  Store(c.path, gpu, pool, 1, 0, blocks, slots, 0, c.layers, c.shape, false, nullptr);
  RequireSame(pool.data(), want.data(), pool.bytes(), "pool after the store without checksums");

  pool.Poison();
  DeviceSums sums(c.count);
  StoreSummed(c.path, gpu, pool, 1, 0, blocks, slots, 0, c.layers, c.shape, sums, nullptr);
  RequireSame(pool.data(), want.data(), pool.bytes(), "pool after the store with checksums");
  const auto got = sums.Download();
  for (uint32_t i = 0; i < c.count; ++i) {
    CAPTURE(i, slots[i]);
    REQUIRE(flexkv::FinishBlockChecksum(got[i], block_bytes) == flexkv::BlockChecksum(pool.Slot(slots[i]), block_bytes));
  }
}

}  // namespace

TEST_CASE("checksummed gather: each slot's sum finishes to its BlockChecksum, every layout, K/V and MLA, odd chunks",
          "[gpu]") {
  SKIP_WITHOUT_GPU();
  for (Path path : {Path::kKernel, Path::kCopyEngine})
    for (Layout layout : {Layout::kLayerFirst, Layout::kBlockFirst, Layout::kLayerBlock, Layout::kLayerBlockRegions})
      for (uint32_t planes : {2u, 1u})
        // 4112 B = 257 units: one unit past a full round of 32 lanes x 8 loads.
        for (uint64_t chunk : {uint64_t{16}, uint64_t{48}, uint64_t{4112}, uint64_t{32768 + 16}}) {
          Case c;
          c.path = path;
          c.layout = layout;
          c.planes = planes;
          c.chunk = chunk;
          c.layers = planes == 1 ? 5 : 4;  // MLA-like: one plane, odd layer count
          ChecksummedStore(c);
        }
}

TEST_CASE("checksummed gather: every launch shape gives the same sums, bulk-copy shapes included", "[gpu]") {
  SKIP_WITHOUT_GPU();
  const kv::LaunchShape shapes[] = {
      {1, 32, 1, 1, 0, 0},  // one warp: consecutive chunks of a pair go into one atomic
      {3, 96, 2, 1, 0, 0},   {5, 256, 8, 2, 0, 0}, {2, 128, 4, 4, 0, 0}, {132, 1024, 8, 1, 0, 0},
      {200, 64, 1, 2, 0, 0}, {7, 0, 0, 0, 4, 4},   {2, 32, 1, 1, 64, 3},
  };
  for (const auto& s : shapes)
    for (uint64_t chunk : {uint64_t{48}, uint64_t{528}, uint64_t{8192 + 16}})
      for (Path path : {Path::kKernel, Path::kCopyEngine}) {
        Case c;
        c.shape = s;
        c.chunk = chunk;
        c.path = path;
        ChecksummedStore(c);
      }
}

TEST_CASE("checksummed gather: layer ranges add up, padded slots sum only what was written", "[gpu]") {
  SKIP_WITHOUT_GPU();
  for (Path path : {Path::kKernel, Path::kCopyEngine}) {
    CAPTURE(static_cast<int>(path));
    auto rng = Rng();
    const uint32_t layers = 6, planes = 2, nblocks = 20, nslots = 24, count = 9;
    const uint64_t chunk = 1040, padding = 4096 + 16;
    const uint64_t block_bytes = layers * planes * chunk + padding;
    GpuKv gpu(Layout::kBlockFirst, layers, planes, nblocks, chunk);
    gpu.Randomize(rng);
    Pool pool(nslots, block_bytes);
    pool.Poison();
    const auto blocks = Pick(rng, nblocks, count), slots = Pick(rng, nslots, count);
    DeviceSums sums(count);
    // Layers [1, 4) first: the sums cover only those chunks.
    StoreSummed(path, gpu, pool, 1, 0, blocks, slots, 1, 4, {}, sums, nullptr);
    auto got = sums.Download();
    for (uint32_t i = 0; i < count; ++i)
      REQUIRE(got[i] == ChunkTermSums(pool.Slot(slots[i]), layers, planes, 0, chunk, 1, 4));
    // Then [0, 1) and [4, 6) into the same entries: the sum of the whole written part of each slot.
    StoreSummed(path, gpu, pool, 1, 0, blocks, slots, 0, 1, {}, sums, nullptr);
    StoreSummed(path, gpu, pool, 1, 0, blocks, slots, 4, layers, {}, sums, nullptr);
    got = sums.Download();
    for (uint32_t i = 0; i < count; ++i) {
      CAPTURE(i);
      REQUIRE(got[i] == flexkv::ChecksumTermSum(pool.Slot(slots[i]), layers * planes * chunk, 0));
      REQUIRE(got[i] == ChunkTermSums(pool.Slot(slots[i]), layers, planes, 0, chunk, 0, layers));
    }
  }
}

TEST_CASE("checksummed gather, TP=2: both ranks add into the same sums and finish to the whole slot's checksum",
          "[gpu]") {
  SKIP_WITHOUT_GPU();
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (Path path : {Path::kKernel, Path::kCopyEngine, Path::kStaged})
    for (Layout layout : {Layout::kLayerFirst, Layout::kBlockFirst})
      for (uint64_t shard : {uint64_t{2048}, uint64_t{4112}}) {
        CAPTURE(Name(layout), static_cast<int>(path), shard);
        auto rng = Rng();
        const uint32_t layers = 3, planes = 2, nblocks = 24, nslots = 30, count = 11;
        GpuKv r0(layout, layers, planes, nblocks, shard), r1(layout, layers, planes, nblocks, shard);
        r0.Randomize(rng);
        r1.Randomize(rng);
        const uint64_t block_bytes = layers * planes * 2 * shard;
        Pool pool(nslots, block_bytes);
        pool.Poison();
        const auto b0 = Pick(rng, nblocks, count), b1 = Pick(rng, nblocks, count), slots = Pick(rng, nslots, count);
        DeviceSums both(count), rank1(count);
        StoreSummed(path, r0, pool, 2, 0, b0, slots, 0, layers, {}, both, stream);
        StoreSummed(path, r1, pool, 2, 1, b1, slots, 0, layers, {}, both, stream);
        StoreSummed(path, r1, pool, 2, 1, b1, slots, 0, layers, {}, rank1, stream);
        std::vector<uint8_t> want(pool.bytes(), kPoolPoison);
        for (uint32_t i = 0; i < count; ++i)
          for (uint32_t l = 0; l < layers; ++l)
            for (uint32_t p = 0; p < planes; ++p) {
              uint8_t* slot = want.data() + slots[i] * block_bytes;  // rank r's part at r * layers * planes chunks
              std::memcpy(slot + (uint64_t{l} * planes + p) * shard, r0.Chunk(l, p, b0[i]), shard);
              std::memcpy(slot + ((uint64_t{layers} + l) * planes + p) * shard, r1.Chunk(l, p, b1[i]), shard);
            }
        RequireSame(pool.data(), want.data(), pool.bytes(), "pool after both ranks stored");
        const auto got = both.Download(), got1 = rank1.Download();
        for (uint32_t i = 0; i < count; ++i) {
          CAPTURE(i);
          REQUIRE(got1[i] == ChunkTermSums(pool.Slot(slots[i]), layers, planes, 1, shard, 0, layers));
          REQUIRE(flexkv::FinishBlockChecksum(got[i], block_bytes) ==
                  flexkv::BlockChecksum(pool.Slot(slots[i]), block_bytes));
        }
      }
  CUDA_OK(cudaStreamDestroy(stream));
}

TEST_CASE("checksum kernels refuse a null sums array, and the sums-only kernel writes nothing to the pool", "[gpu]") {
  SKIP_WITHOUT_GPU();
  auto rng = Rng();
  GpuKv gpu(Layout::kLayerFirst, 2, 2, 4, 64);
  gpu.Randomize(rng);
  Pool pool(4, 2 * 2 * 64);
  const std::vector<uint32_t> blocks{0, 1}, slots{2, 3};
  DevicePairs dp(blocks, slots, false);
  const kv::HostPoolView pv = pool.View(1, 0);
  CHECK(kv::LaunchGatherChecksummed(gpu.View(), pv, dp.Pairs(2, 0, 2), nullptr, nullptr) == cudaErrorInvalidValue);
  CHECK(kv::LaunchChecksumTerms(gpu.View(), pv, dp.Pairs(2, 0, 2), nullptr, nullptr) == cudaErrorInvalidValue);

  pool.Poison();
  DeviceSums sums(2);
  CHECK(kv::LaunchGatherChecksummed(gpu.View(), pv, dp.Pairs(0, 0, 2), sums.get(), nullptr) == cudaSuccess);
  CHECK(kv::LaunchChecksumTerms(gpu.View(), pv, dp.Pairs(2, 0, 2), sums.get(), nullptr) == cudaSuccess);
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint8_t> untouched(pool.bytes(), kPoolPoison);
  RequireSame(pool.data(), untouched.data(), pool.bytes(), "pool after an empty gather and a sums-only pass");
  const auto got = sums.Download();
  for (uint32_t i = 0; i < 2; ++i) {
    uint64_t want = 0;
    for (uint32_t l = 0; l < 2; ++l)
      for (uint32_t p = 0; p < 2; ++p)
        want += flexkv::ChecksumTermSum(gpu.Chunk(l, p, blocks[i]), 64, (l * 2 + p) * 64 / 16);
    CHECK(got[i] == want);
  }
}

TEST_CASE("few large chunks are split into pieces: bytes and sums as whole chunks, a shorter last piece, every shape",
          "[gpu]") {
  SKIP_WITHOUT_GPU();
  // 5127 units (~80 KiB): one or a few such chunks leave most thread groups idle, so the kernels cut each into up to
  // 5 pieces of 1088 units with a last one of 775; a state component's per-layer snapshots (~2 MiB) are cut the same
  // way.
  const kv::LaunchShape shapes[] = {
      {},  // the defaults: 512 thread groups
      {1, 32, 1, 1, 0, 0},   {3, 96, 2, 1, 0, 0},  {5, 256, 8, 2, 0, 0}, {132, 1024, 8, 1, 0, 0},
      {200, 64, 1, 2, 0, 0}, {7, 0, 0, 0, 4, 4},   {132, 32, 1, 1, 16, 4}, {2, 32, 1, 1, 64, 3},
  };
  for (const auto& s : shapes)
    for (uint32_t count : {1u, 3u})
      for (uint32_t planes : {1u, 2u}) {
        Case c;
        c.shape = s;
        c.chunk = 16 * (1024 * 5 + 7);
        c.layers = 2;
        c.planes = planes;
        c.gpu_blocks = 5;
        c.slots = 6;
        c.count = count;
        RoundTrip(c);
        if (s.bulk_kib == 0 || count == 1) {  // the summing kernels replace bulk shapes: once is enough
          c.path = Path::kKernel;
          ChecksummedStore(c);
          c.path = Path::kCopyEngine;
          ChecksummedStore(c);
        }
      }
}

TEST_CASE("copy-engine batch: layers in separate allocations that sit back to back are never copied as one run",
          "[gpu]") {
  SKIP_WITHOUT_GPU();
  // Regression: a Jamba state snapshot (one 560 KiB chunk per layer, a cudaMalloc per layer) was refused by
  // cudaMemcpyBatchAsync with an invalid argument, because consecutive layers' allocations were adjacent and their
  // chunks were merged into one copy spanning two allocations.
  constexpr uint64_t kChunk = 573440;
  std::vector<void*> allocs(16, nullptr);
  for (auto& a : allocs) CUDA_OK(cudaMalloc(&a, kChunk));
  std::vector<uint64_t> sorted;
  for (void* a : allocs) sorted.push_back(reinterpret_cast<uint64_t>(a));
  std::sort(sorted.begin(), sorted.end());
  std::vector<uint64_t> bases{sorted[0], sorted[1]};
  for (size_t i = 0; i + 1 < sorted.size(); ++i) {
    if (sorted[i] + kChunk == sorted[i + 1]) {
      bases = {sorted[i], sorted[i + 1]};
      break;
    }
  }
  if (bases[0] + kChunk != bases[1]) WARN("no two allocations are adjacent here; the case runs without its trigger");
  uint64_t* bases_dev = nullptr;
  CUDA_OK(DeviceAlloc(&bases_dev, 2 * sizeof(uint64_t)));
  CUDA_OK(cudaMemcpy(bases_dev, bases.data(), 2 * sizeof(uint64_t), cudaMemcpyHostToDevice));
  kv::GpuKvView view{bases_dev, kChunk, kChunk, 2, 1, kChunk};  // LAYERFIRST: one block of one plane per layer

  auto rng = Rng();
  std::vector<uint8_t> src(2 * kChunk);
  for (size_t i = 0; i + 8 <= src.size(); i += 8) {
    const uint64_t r = rng();
    std::memcpy(src.data() + i, &r, 8);
  }
  for (int l = 0; l < 2; ++l)
    CUDA_OK(cudaMemcpy(reinterpret_cast<void*>(bases[l]), src.data() + l * kChunk, kChunk, cudaMemcpyHostToDevice));
  CUDA_OK(cudaDeviceSynchronize());  // the copies below run on a non-blocking stream
  Pool pool(2, 2 * kChunk);
  pool.Poison();
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const uint32_t block = 0, slot = 1;
  CUDA_OK(kv::CopyEngineBatch(bases.data(), view, pool.View(1, 0), &block, &slot, 1, 0, 2, true, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  RequireSame(pool.Slot(1), src.data(), 2 * kChunk, "the slot after the store");
  for (int l = 0; l < 2; ++l) CUDA_OK(cudaMemset(reinterpret_cast<void*>(bases[l]), kGpuPoison, kChunk));
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(kv::CopyEngineBatch(bases.data(), view, pool.View(1, 0), &block, &slot, 1, 0, 2, false, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  std::vector<uint8_t> got(2 * kChunk);
  for (int l = 0; l < 2; ++l)
    CUDA_OK(cudaMemcpy(got.data() + l * kChunk, reinterpret_cast<void*>(bases[l]), kChunk, cudaMemcpyDeviceToHost));
  RequireSame(got.data(), src.data(), 2 * kChunk, "the layers after the load");
  CUDA_OK(cudaStreamDestroy(stream));
  (void)cudaFree(bases_dev);
  for (void* a : allocs) (void)cudaFree(a);
}

TEST_CASE("staged copies round-trip every layout, K/V and MLA, odd sizes and counts, padded slots, wrapping the ring",
          "[gpu]") {
  SKIP_WITHOUT_GPU();
  for (Layout layout : {Layout::kLayerFirst, Layout::kBlockFirst, Layout::kLayerBlock, Layout::kLayerBlockRegions})
    for (uint32_t planes : {2u, 1u})
      for (uint64_t chunk : {uint64_t{16}, uint64_t{528}, uint64_t{4112}, uint64_t{32768}}) {
        Case c;
        c.path = Path::kStaged;
        c.layout = layout;
        c.planes = planes;
        c.chunk = chunk;
        c.layers = planes == 1 ? 5 : 4;
        RoundTrip(c);
      }
  for (uint32_t count : {1u, 3u, 7u, 40u}) {  // one slot, exactly one buffer, a partial last batch, many batches
    Case c;
    c.path = Path::kStaged;
    c.count = count;
    c.chunk = 1040;
    RoundTrip(c);
  }
  Case padded;
  padded.path = Path::kStaged;
  padded.slot_padding = 4096 + 16;  // only the slot's prefix of chunks moves; the padding stays poisoned
  padded.layout = Layout::kBlockFirst;
  RoundTrip(padded);
}

TEST_CASE("slot runs: staged and copy-engine copies of consecutive slots stay byte-exact, wrong marks ignored",
          "[gpu]") {
  SKIP_WITHOUT_GPU();
  for (Path path : {Path::kStaged, Path::kCopyEngine})
    for (Layout layout : {Layout::kLayerFirst, Layout::kBlockFirst, Layout::kLayerBlockRegions})
      for (uint64_t padding : {uint64_t{0}, uint64_t{4096 + 16}}) {  // padded slots are never contiguous
        Case c;
        c.path = path;
        c.layout = layout;
        c.slot_runs = true;
        c.slot_padding = padding;
        c.chunk = 1040;
        c.gpu_blocks = 64;
        RoundTrip(c);
      }
}

TEST_CASE("staged stores sum what they pack: each slot's sum finishes to its BlockChecksum", "[gpu]") {
  SKIP_WITHOUT_GPU();
  for (Layout layout : {Layout::kLayerFirst, Layout::kBlockFirst})
    for (uint64_t chunk : {uint64_t{48}, uint64_t{4112}, uint64_t{32768 + 16}}) {
      Case c;
      c.path = Path::kStaged;
      c.layout = layout;
      c.chunk = chunk;
      ChecksummedStore(c);
    }
}

TEST_CASE("staged copies are refused where they cannot be staged, with nothing enqueued", "[gpu]") {
  SKIP_WITHOUT_GPU();
  GpuKv gpu(Layout::kLayerFirst, 3, 2, 8, 1024);
  const kv::GpuKvView view = gpu.View();
  const uint64_t slot = kv::StagedSlotBytes(view);
  REQUIRE(slot == 3 * 2 * 1024);
  Pool pool(8, 2 * slot);  // room for a second TP shard
  const std::vector<uint32_t> blocks{0, 5, 2}, slots{7, 1, 4};
  DevicePairs dp(blocks, slots, false);
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto ring = SmallRing(view);
  pool.Poison();

  CHECK(kv::CanStage(view, pool.View(1, 0), 0, 3));
  CHECK(kv::CanStage(view, pool.View(2, 0), 0, 3));  // each rank's part of a slot is one run (rank-major order)
  CHECK(kv::CanStage(view, pool.View(2, 1), 0, 3));
  CHECK_FALSE(kv::CanStage(view, pool.View(3, 2), 0, 3));  // slots too small for three shards
  CHECK_FALSE(kv::CanStage(view, pool.View(1, 0), 1, 3));  // a layer range
  CHECK_FALSE(kv::CanStage(view, pool.View(1, 0), 0, 2));
  const uint32_t* gpu_blocks = dp.Pairs(3, 0, 3).gpu_blocks;
  CHECK(kv::StagedCopy(view, pool.View(3, 2), gpu_blocks, slots.data(), 3, true, *ring, stream) == cudaErrorInvalidValue);
  CHECK(kv::StagedCopy(view, pool.View(1, 0), gpu_blocks, slots.data(), 3, true, *ring, nullptr) ==
        cudaErrorInvalidValue);  // no stream to join the copies into
  GpuKv big(Layout::kLayerFirst, 3, 2, 8, 4096);  // slots 4x the ring's
  Pool big_pool(8, kv::StagedSlotBytes(big.View()));  // room for them: only the ring is too small
  big_pool.Poison();
  CHECK(kv::CanStage(big.View(), big_pool.View(1, 0), 0, 3));
  CHECK(ring->SlotsPerBuffer(kv::StagedSlotBytes(big.View())) == 0);
  CHECK(kv::StagedCopy(big.View(), big_pool.View(1, 0), gpu_blocks, slots.data(), 3, true, *ring, stream) ==
        cudaErrorInvalidValue);
  std::unique_ptr<kv::StagingRing> none;
  CHECK(kv::StagingRing::Create(1 << 20, 1, &none) == cudaErrorInvalidValue);
  CHECK(none == nullptr);
  CHECK(kv::StagedCopy(view, pool.View(1, 0), gpu_blocks, slots.data(), 0, true, *ring, stream) == cudaSuccess);
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint8_t> untouched(pool.bytes(), kPoolPoison);
  RequireSame(pool.data(), untouched.data(), pool.bytes(), "pool after refused and empty staged copies");
  const std::vector<uint8_t> big_untouched(big_pool.bytes(), kPoolPoison);
  RequireSame(big_pool.data(), big_untouched.data(), big_pool.bytes(), "pool after a refused staged copy");
  CUDA_OK(cudaStreamDestroy(stream));
}

TEST_CASE("a staged store and a staged load at once, on two rings and two streams, are both byte-exact", "[gpu]") {
  SKIP_WITHOUT_GPU();
  auto rng = Rng();
  const uint32_t layers = 4, planes = 2, nblocks = 96, nslots = 80, count = 29;
  const uint64_t chunk = 8192;
  GpuKv gpu(Layout::kLayerFirst, layers, planes, nblocks, chunk);
  const uint64_t block_bytes = layers * planes * chunk;
  Pool pool(nslots, block_bytes);
  gpu.Randomize(rng);
  pool.Poison();
  // The load's slots hold known bytes first (stored from blocks `lb`); then the load brings them into blocks `lb2`
  // while blocks `sb` are stored into other slots.
  auto ids = Pick(rng, nblocks, 3 * count);
  auto to = Pick(rng, nslots, 2 * count);
  const std::vector<uint32_t> lb(ids.begin(), ids.begin() + count), sb(ids.begin() + count, ids.begin() + 2 * count),
      lb2(ids.begin() + 2 * count, ids.end()), ls(to.begin(), to.begin() + count), ss(to.begin() + count, to.end());
  Store(Path::kStaged, gpu, pool, 1, 0, lb, ls, 0, layers, {}, false, nullptr);
  std::vector<uint8_t> want(pool.bytes());
  std::memcpy(want.data(), pool.data(), pool.bytes());
  for (uint32_t i = 0; i < count; ++i)
    for (uint32_t l = 0; l < layers; ++l)
      for (uint32_t p = 0; p < planes; ++p)
        std::memcpy(want.data() + ss[i] * block_bytes + (l * planes + p) * chunk, gpu.Chunk(l, p, sb[i]), chunk);
  // What blocks lb2 must hold afterwards: the chunks of blocks lb (which the slots ls hold).
  std::vector<std::vector<uint8_t>> expect_chunks;
  for (uint32_t i = 0; i < count; ++i)
    for (uint32_t l = 0; l < layers; ++l)
      for (uint32_t p = 0; p < planes; ++p) expect_chunks.emplace_back(gpu.Chunk(l, p, lb[i]), gpu.Chunk(l, p, lb[i]) + chunk);

  cudaStream_t s1 = nullptr, s2 = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  auto store_ring = SmallRing(gpu.View()), load_ring = SmallRing(gpu.View());
  DevicePairs sp(sb, ss, false), lp(lb2, ls, false);
  CUDA_OK(kv::StagedCopy(gpu.View(), pool.View(1, 0), sp.Pairs(count, 0, layers).gpu_blocks, ss.data(), count, true,
                         *store_ring, s1));
  CUDA_OK(kv::StagedCopy(gpu.View(), pool.View(1, 0), lp.Pairs(count, 0, layers).gpu_blocks, ls.data(), count, false,
                         *load_ring, s2));
  CUDA_OK(cudaStreamSynchronize(s1));
  CUDA_OK(cudaStreamSynchronize(s2));
  CUDA_OK(cudaGetLastError());
  RequireSame(pool.data(), want.data(), pool.bytes(), "pool after the store beside a load");
  const auto got = gpu.Download();  // LAYERFIRST: allocation l is layer l, [plane][block][chunk]
  size_t k = 0;
  for (uint32_t i = 0; i < count; ++i)
    for (uint32_t l = 0; l < layers; ++l)
      for (uint32_t p = 0; p < planes; ++p, ++k)
        RequireSame(got[l].data() + (static_cast<uint64_t>(p) * nblocks + lb2[i]) * chunk, expect_chunks[k].data(), chunk,
                    "a loaded chunk");
  CUDA_OK(cudaStreamDestroy(s1));
  CUDA_OK(cudaStreamDestroy(s2));
}

TEST_CASE("staged copies back to back on one stream, nothing waited for between them, each reading what the last wrote",
          "[gpu]") {
  SKIP_WITHOUT_GPU();
  auto rng = Rng();
  const uint32_t layers = 4, planes = 2, nblocks = 96, nslots = 80, count = 29;  // 10 batches of 3: rings wrap
  const uint64_t chunk = 4096;
  GpuKv gpu(Layout::kLayerFirst, layers, planes, nblocks, chunk);
  const uint64_t block_bytes = layers * planes * chunk;
  Pool pool(nslots, block_bytes);
  gpu.Randomize(rng);
  pool.Poison();
  const auto ids = Pick(rng, nblocks, 3 * count), to = Pick(rng, nslots, 2 * count);
  const std::vector<uint32_t> b1(ids.begin(), ids.begin() + count), b2(ids.begin() + count, ids.begin() + 2 * count),
      b3(ids.begin() + 2 * count, ids.end()), s1(to.begin(), to.begin() + count), s2(to.begin() + count, to.end());
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto store_ring = SmallRing(gpu.View()), load_ring = SmallRing(gpu.View());
  DevicePairs p1(b1, s1, false), p2(b2, s1, false), p3(b2, s2, false), p4(b3, s2, false);
  const kv::HostPoolView pv = pool.View(1, 0);
  // b1 -> s1, s1 -> b2, b2 -> s2, s2 -> b3, each a whole ring's worth of batches, then one wait: every step must
  // see the last one's bytes, so blocks b3 and slots s1, s2 end up with b1's chunks.
  CUDA_OK(kv::StagedCopy(gpu.View(), pv, p1.Pairs(count, 0, layers).gpu_blocks, s1.data(), count, true, *store_ring, stream));
  CUDA_OK(kv::StagedCopy(gpu.View(), pv, p2.Pairs(count, 0, layers).gpu_blocks, s1.data(), count, false, *load_ring, stream));
  CUDA_OK(kv::StagedCopy(gpu.View(), pv, p3.Pairs(count, 0, layers).gpu_blocks, s2.data(), count, true, *store_ring, stream));
  CUDA_OK(kv::StagedCopy(gpu.View(), pv, p4.Pairs(count, 0, layers).gpu_blocks, s2.data(), count, false, *load_ring, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaGetLastError());
  std::vector<uint8_t> want(pool.bytes(), kPoolPoison);
  for (uint32_t i = 0; i < count; ++i)
    for (uint32_t l = 0; l < layers; ++l)
      for (uint32_t p = 0; p < planes; ++p)
        for (uint32_t slot : {s1[i], s2[i]})
          std::memcpy(want.data() + slot * block_bytes + (l * planes + p) * chunk, gpu.Chunk(l, p, b1[i]), chunk);
  RequireSame(pool.data(), want.data(), pool.bytes(), "pool after the chain");
  const auto got = gpu.Download();  // LAYERFIRST: allocation l is layer l, [plane][block][chunk]
  for (uint32_t i = 0; i < count; ++i)
    for (uint32_t l = 0; l < layers; ++l)
      for (uint32_t p = 0; p < planes; ++p)
        for (uint32_t block : {b2[i], b3[i]})
          RequireSame(got[l].data() + (static_cast<uint64_t>(p) * nblocks + block) * chunk, gpu.Chunk(l, p, b1[i]), chunk,
                      "a block loaded at the end of the chain");
  CUDA_OK(cudaStreamDestroy(stream));
}
