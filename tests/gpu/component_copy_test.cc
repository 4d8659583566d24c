// Hybrid models on the GPU path: every component of the gpt-oss-20b, Gemma-3-27B, Qwen3-Next-80B and Jamba presets
// (full, sliding-window and state components, by their copy geometries Geometry::Component) stored from engine
// buffers into its own sub-pool of one pool range registered for DMA, and loaded back into another engine's blocks,
// through CudaEngineMemory, by the kernels and by the copy engine, at TP 1 and 2: byte-exact, nothing outside the
// copied slots and blocks touched, store checksums equal to the CPU's. Without a visible GPU (CI) every case warns
// and passes.
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
#include "common/slot_order.h"
#include "daemon/transfer/cuda/copy_path_policy.h"
#include "daemon/transfer/cuda/cuda_engine_memory.h"
#include "flexkv/geometry.h"
#include "tests/gpu/gpu_test_support.h"

namespace {

using flexkv::gpu_test::RunCopy;
using flexkv::gpu_test::VmmAllocation;

constexpr uint8_t kPoolPoison = 0xA5;
constexpr uint8_t kGpuPoison = 0x5A;
// Ahead of the first sub-pool, as the pool file's header pages are ahead of its data: no sub-pool starts where the
// registered range does.
constexpr uint64_t kLeadIn = 64 * 1024;

std::mt19937_64 Rng() {
  std::random_device rd;
  const uint64_t seed = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  UNSCOPED_INFO("rng seed " << seed);
  return std::mt19937_64(seed);
}

// `count` distinct values from [0, n), in random order.
std::vector<uint32_t> Pick(std::mt19937_64& rng, uint32_t n, uint32_t count) {
  std::vector<uint32_t> v(n);
  std::iota(v.begin(), v.end(), 0u);
  std::shuffle(v.begin(), v.end(), rng);
  v.resize(count);
  return v;
}

// Byte compare with the first difference in the failure message.
void RequireSame(const uint8_t* got, const uint8_t* want, uint64_t n, const std::string& what) {
  if (std::memcmp(got, want, n) == 0) return;
  uint64_t i = 0;
  while (got[i] == want[i]) ++i;
  FAIL(what << ": bytes differ, first at " << i << " of " << n << " (got 0x" << std::hex << int{got[i]} << ", want 0x"
            << int{want[i]} << ")");
}

// Every one of `n` bytes at `got` is `byte`.
void RequireAll(const uint8_t* got, uint8_t byte, uint64_t n, const std::string& what) {
  const std::vector<uint8_t> same(std::min<uint64_t>(n, 1 << 20), byte);
  for (uint64_t off = 0; off < n; off += same.size())
    RequireSame(got + off, same.data(), std::min<uint64_t>(same.size(), n - off), what + " (from byte " + std::to_string(off) + ")");
}

// One TP rank's buffers of one component as an engine keeps them: LAYER_FIRST, one cuMem allocation per layer
// holding [planes][blocks][chunk] (vLLM's per-layer KV tensors; for a state component [blocks][state bytes] per
// layer, as vLLM's and SGLang's Mamba state tensors), with a host mirror of what the GPU should hold.
class EngineBuffers {
 public:
  EngineBuffers(const flexkv::Geometry& copy, uint32_t blocks)
      : planes_(copy.kv_planes), blocks_(blocks), chunk_(copy.chunk_bytes_per_rank()),
        layer_bytes_(uint64_t{copy.kv_planes} * blocks * copy.chunk_bytes_per_rank()) {
    for (uint32_t l = 0; l < copy.num_layers; ++l) {
      layers_.push_back(std::make_unique<VmmAllocation>(layer_bytes_));
      mirror_.emplace_back(layer_bytes_);
    }
  }

  flexkv::GpuKvDescription Describe(const std::string& gpu_uuid, uint32_t tp_rank) const {
    flexkv::GpuKvDescription d;
    d.gpu_uuid = gpu_uuid;
    d.layout = flexkv::KvLayout::kLayerFirst;
    d.num_blocks = blocks_;
    d.tp_rank = tp_rank;
    for (uint32_t l = 0; l < layers_.size(); ++l) {
      d.regions.push_back({"", 0, layer_bytes_, {{l, layers_[l]->bytes()}}});
      d.vmm_fds[l] = std::make_shared<flexkv::UniqueFd>(layers_[l]->ExportFd());
    }
    return d;
  }

  void Randomize(std::mt19937_64& rng) {
    for (auto& m : mirror_)
      for (size_t i = 0; i + 8 <= m.size(); i += 8) {
        const uint64_t r = rng();
        std::memcpy(m.data() + i, &r, 8);
      }
    for (size_t l = 0; l < layers_.size(); ++l)
      CUDA_OK(cudaMemcpy(layers_[l]->data(), mirror_[l].data(), layer_bytes_, cudaMemcpyHostToDevice));
    CUDA_OK(cudaDeviceSynchronize());  // the backend's streams do not wait for the legacy stream's work
  }
  void Poison() {
    for (size_t l = 0; l < layers_.size(); ++l) {
      std::memset(mirror_[l].data(), kGpuPoison, layer_bytes_);
      CUDA_OK(cudaMemset(layers_[l]->data(), kGpuPoison, layer_bytes_));
    }
    CUDA_OK(cudaDeviceSynchronize());
  }
  // Every layer's bytes as the GPU holds them now against the mirror.
  void RequireMirror(const std::string& what) const {
    std::vector<uint8_t> got(layer_bytes_);
    for (size_t l = 0; l < layers_.size(); ++l) {
      CUDA_OK(cudaMemcpy(got.data(), layers_[l]->data(), layer_bytes_, cudaMemcpyDeviceToHost));
      RequireSame(got.data(), mirror_[l].data(), layer_bytes_, what + ", layer " + std::to_string(l));
    }
  }
  uint8_t* Chunk(uint32_t layer, uint32_t plane, uint32_t block) {
    return mirror_[layer].data() + (uint64_t{plane} * blocks_ + block) * chunk_;
  }

 private:
  uint32_t planes_, blocks_;
  uint64_t chunk_, layer_bytes_;
  std::vector<std::unique_ptr<VmmAllocation>> layers_;
  std::vector<std::vector<uint8_t>> mirror_;
};

// The pool file's data range as the daemon registers it: a lead-in, then one sub-pool per component, each of
// `slots[i]` slots of component i's block bytes.
struct HybridPool {
  flexkv::MappedRegion map;
  flexkv::PoolRegion whole;              // what RegisterPool gets (slot_bytes unused)
  std::vector<flexkv::PoolRegion> subs;  // per component: what its CopyJobs carry

  HybridPool(const flexkv::Geometry& g, const std::vector<uint32_t>& slots) {
    uint64_t bytes = kLeadIn;
    for (size_t i = 0; i < g.component_count(); ++i) bytes += slots[i] * g.Component(i).host_block_bytes();
    auto m = flexkv::MappedRegion::Anonymous("the test pool", bytes);
    INFO(m.status().ToString());
    REQUIRE(m.ok());
    map = std::move(*m);
    whole = {map.bytes(), bytes, 0, 0};
    uint64_t at = kLeadIn;
    for (size_t i = 0; i < g.component_count(); ++i) {
      const uint64_t slot_bytes = g.Component(i).host_block_bytes();
      subs.push_back({map.bytes() + at, slots[i] * slot_bytes, slot_bytes, slots[i]});
      at += slots[i] * slot_bytes;
    }
  }
  void Poison() { std::memset(whole.base, kPoolPoison, whole.bytes); }
};

flexkv::CopyJob Job(std::shared_ptr<flexkv::EngineKv> kv, flexkv::CopyDirection direction, const flexkv::PoolRegion& pool,
                    const std::vector<uint32_t>& blocks, const std::vector<uint32_t>& slots) {
  flexkv::CopyJob job;
  job.kv = std::move(kv);
  job.direction = direction;
  job.engine_blocks = std::make_shared<const std::vector<uint32_t>>(blocks);
  job.slots = std::make_shared<const std::vector<uint32_t>>(slots);
  job.pool = pool;
  return job;
}

// Component i of `model`: each TP rank's engine A stores `count` random blocks into random slots of the
// component's sub-pool (every byte of the pool range checked: the slots hold A's chunks at their (layer, plane,
// shard) offsets in the rank-major slot order, common/slot_order.h, all else is untouched; the ranks' term sums finish to the CPU's checksum of each slot), then each
// rank's engine B loads those slots into other random blocks (every byte of B checked).
void StoreAndLoadComponent(flexkv::CudaEngineMemory& backend, HybridPool& pool, const flexkv::Geometry& model,
                           size_t component, uint32_t blocks, uint32_t count, std::mt19937_64& rng,
                           bool copy_engine) {
  const flexkv::Geometry copy = model.Component(component);
  INFO("copy geometry " << copy.ToString());
  REQUIRE(copy.Validate().ok());
  const flexkv::PoolRegion& sub = pool.subs[component];
  const uint32_t tp = copy.tp_size, planes = copy.kv_planes;
  const uint64_t chunk = copy.chunk_bytes_per_rank();
  const std::string uuid = backend.devices().at(0);
  if (copy_engine && chunk < flexkv::kCopyEngineLoadMinChunkBytes) {
    // The copy-engine path refuses chunks where it is known slow (issue 19): the registration says so.
    EngineBuffers engine(copy, blocks);
    auto opened = backend.Open(flexkv::KvRegistration{engine.Describe(uuid, 0)}, copy);
    INFO(opened.status().ToString());
    REQUIRE_FALSE(opened.ok());
    CHECK(opened.status().code() == flexkv::StatusCode::kFailedPrecondition);
    CHECK(opened.status().message().find("--load-path kernel") != std::string::npos);
    return;
  }

  auto open = [&](const EngineBuffers& engine, uint32_t rank) {
    auto opened = backend.Open(flexkv::KvRegistration{engine.Describe(uuid, rank)}, copy);
    INFO("rank " << rank << ": " << opened.status().ToString());
    REQUIRE(opened.ok());
    return std::move(*opened);
  };
  std::vector<std::unique_ptr<EngineBuffers>> a, b;
  std::vector<std::shared_ptr<flexkv::EngineKv>> kv_a, kv_b;
  for (uint32_t r = 0; r < tp; ++r) {
    a.push_back(std::make_unique<EngineBuffers>(copy, blocks));
    b.push_back(std::make_unique<EngineBuffers>(copy, blocks));
    a[r]->Randomize(rng);
    b[r]->Poison();
    kv_a.push_back(open(*a[r], r));
    kv_b.push_back(open(*b[r], r));
  }
  const auto from = Pick(rng, blocks, count), to = Pick(rng, sub.slots, count), into = Pick(rng, blocks, count);

  pool.Poison();
  std::vector<std::shared_ptr<std::vector<uint64_t>>> sums;
  for (uint32_t r = 0; r < tp; ++r) {
    auto job = Job(kv_a[r], flexkv::CopyDirection::kToPool, sub, from, to);
    job.term_sums = std::make_shared<std::vector<uint64_t>>(count, 0);
    sums.push_back(job.term_sums);
    const flexkv::Status st = RunCopy(backend, std::move(job));
    INFO("store of rank " << r << ": " << st.ToString());
    REQUIRE(st.ok());
  }
  std::vector<uint32_t> order(count);
  std::iota(order.begin(), order.end(), 0u);
  std::sort(order.begin(), order.end(), [&](uint32_t x, uint32_t y) { return to[x] < to[y]; });
  const uint8_t* cursor = pool.whole.base;
  for (uint32_t i : order) {
    CAPTURE(i, from[i], to[i]);
    uint8_t* slot = sub.SlotData(to[i]);
    RequireAll(cursor, kPoolPoison, static_cast<uint64_t>(slot - cursor), "the pool before a stored slot");
    for (uint32_t l = 0; l < copy.num_layers; ++l)
      for (uint32_t p = 0; p < planes; ++p)
        for (uint32_t r = 0; r < tp; ++r) {
          const uint64_t off = flexkv::SlotChunkOffset(copy, l, p, r);
          RequireSame(slot + off, a[r]->Chunk(l, p, from[i]), chunk,
                      "slot chunk (layer " + std::to_string(l) + ", plane " + std::to_string(p) + ", rank " +
                          std::to_string(r) + ")");
        }
    uint64_t total = 0;
    for (uint32_t r = 0; r < tp; ++r) total += (*sums[r])[i];
    REQUIRE(flexkv::FinishBlockChecksum(total, sub.slot_bytes) == flexkv::BlockChecksum(slot, sub.slot_bytes));
    cursor = slot + sub.slot_bytes;
  }
  RequireAll(cursor, kPoolPoison, static_cast<uint64_t>(pool.whole.base + pool.whole.bytes - cursor),
             "the pool after the last stored slot");

  for (uint32_t r = 0; r < tp; ++r) {
    const flexkv::Status st = RunCopy(backend, Job(kv_b[r], flexkv::CopyDirection::kFromPool, sub, into, to));
    INFO("load of rank " << r << ": " << st.ToString());
    REQUIRE(st.ok());
    for (uint32_t i = 0; i < count; ++i)
      for (uint32_t l = 0; l < copy.num_layers; ++l)
        for (uint32_t p = 0; p < planes; ++p) std::memcpy(b[r]->Chunk(l, p, into[i]), a[r]->Chunk(l, p, from[i]), chunk);
    b[r]->RequireMirror("engine B of rank " + std::to_string(r) + " after the load");
  }
}

// Every component of `model` at TP 1 and 2, by the kernels and by the copy engine, in one registered pool range per
// run. State components have fewer engine slots than KV components have blocks (each is a whole-model snapshot).
void CopyEveryComponent(flexkv::Geometry model) {
  for (uint32_t tp : {1u, 2u})
    for (bool copy_engine : {false, true}) {
      model.tp_size = tp;
      REQUIRE(model.Validate().ok());
      CAPTURE(model.ToString(), tp, copy_engine);
      auto rng = Rng();
      std::vector<uint32_t> slots;
      for (size_t i = 0; i < model.component_count(); ++i)
        slots.push_back(model.component_kind(i) == flexkv::ComponentKind::kState ? 4 : 9);
      HybridPool pool(model, slots);
      auto backend = flexkv::CudaEngineMemory::Create(flexkv::CudaCopyPaths{copy_engine, copy_engine});
      REQUIRE(backend != nullptr);
      REQUIRE(backend->RegisterPool(pool.whole).ok());
      for (size_t i = 0; i < model.component_count(); ++i) {
        const bool state = model.component_kind(i) == flexkv::ComponentKind::kState;
        CAPTURE(i, flexkv::ComponentKindName(model.component_kind(i)));
        StoreAndLoadComponent(*backend, pool, model, i, state ? 3 : 7, state ? 2 : 5, rng, copy_engine);
      }
    }  // the backend (which unregisters the pool) goes before the pool
}

}  // namespace

TEST_CASE("CUDA backend copies every component of gpt-oss-20b through its own sub-pool, byte-exact", "[gpu]") {
  SKIP_WITHOUT_GPU();
  CopyEveryComponent(flexkv::GptOss20B());
}

TEST_CASE("CUDA backend copies every component of Gemma-3-27B through its own sub-pool, byte-exact", "[gpu]") {
  SKIP_WITHOUT_GPU();
  CopyEveryComponent(flexkv::Gemma3_27B());
}

TEST_CASE("CUDA backend copies the full layers and the ~2 MiB per-layer states of Qwen3-Next-80B, byte-exact", "[gpu]") {
  SKIP_WITHOUT_GPU();
  CopyEveryComponent(flexkv::Qwen3Next80B());
}

TEST_CASE("CUDA backend copies the attention layers and the Mamba states of a Jamba-like model, byte-exact", "[gpu]") {
  SKIP_WITHOUT_GPU();
  CopyEveryComponent(flexkv::JambaLike());
}

TEST_CASE("CUDA backend refuses a copy whose sub-pool, slot or block lies outside what was registered", "[gpu]") {
  SKIP_WITHOUT_GPU();
  auto rng = Rng();
  const flexkv::Geometry model = flexkv::Qwen3Next80B();
  HybridPool pool(model, {6, 3});
  pool.Poison();
  auto backend = flexkv::CudaEngineMemory::Create(flexkv::CudaCopyPaths{});
  REQUIRE(backend != nullptr);
  const flexkv::Geometry state = model.Component(1);
  EngineBuffers engine(state, 2);
  engine.Randomize(rng);
  auto kv = backend->Open(flexkv::KvRegistration{engine.Describe(backend->devices().at(0), 0)}, state);
  INFO(kv.status().ToString());
  REQUIRE(kv.ok());
  const flexkv::PoolRegion sub = pool.subs[1];
  // The code a store and a load of these pairs get (the same for both).
  auto refused = [&](const flexkv::PoolRegion& region, const std::vector<uint32_t>& blocks,
                     const std::vector<uint32_t>& slots) {
    const flexkv::Status store = RunCopy(*backend, Job(*kv, flexkv::CopyDirection::kToPool, region, blocks, slots));
    const flexkv::Status load = RunCopy(*backend, Job(*kv, flexkv::CopyDirection::kFromPool, region, blocks, slots));
    UNSCOPED_INFO("store: " << store.ToString() << "; load: " << load.ToString());
    CHECK(store.code() == load.code());
    return store.code();
  };

  // Before RegisterPool: nothing is registered for DMA.
  CHECK(refused(sub, {0}, {0}) == flexkv::StatusCode::kFailedPrecondition);
  REQUIRE(backend->RegisterPool(pool.whole).ok());

  flexkv::PoolRegion past_end = sub;
  past_end.slots = sub.slots + 1;  // a region one slot longer than what was registered: its last slot is outside
  CHECK(refused(past_end, {0}, {sub.slots}) == flexkv::StatusCode::kFailedPrecondition);
  CHECK(refused(past_end, {0, 1}, {1, sub.slots}) == flexkv::StatusCode::kFailedPrecondition);  // one of them
  auto elsewhere_map = flexkv::MappedRegion::Anonymous("memory that is not the pool", sub.slot_bytes);
  REQUIRE(elsewhere_map.ok());
  const flexkv::PoolRegion elsewhere{elsewhere_map->bytes(), sub.slot_bytes, sub.slot_bytes, 1};
  CHECK(refused(elsewhere, {0}, {0}) == flexkv::StatusCode::kFailedPrecondition);
  flexkv::PoolRegion small_slots = pool.subs[0];  // the full layers' slots: smaller than a state snapshot
  REQUIRE(small_slots.slot_bytes < state.host_block_bytes());
  CHECK(refused(small_slots, {0}, {0}) == flexkv::StatusCode::kFailedPrecondition);
  flexkv::PoolRegion unaligned = sub;
  unaligned.base += 8;
  unaligned.slots = 1;
  CHECK(refused(unaligned, {0}, {0}) == flexkv::StatusCode::kFailedPrecondition);
  CHECK(refused(sub, {0, 1}, {1, sub.slots}) == flexkv::StatusCode::kFailedPrecondition);  // a slot id past the sub-pool
  CHECK(refused(sub, {1, 2}, {0, 1}) == flexkv::StatusCode::kInvalidArgument);             // a block id past the engine's
  CHECK(refused(sub, {0, 1}, {0}) == flexkv::StatusCode::kInvalidArgument);                // blocks and slots differ
  RequireAll(pool.whole.base, kPoolPoison, pool.whole.bytes, "the pool after refused copies");
  engine.RequireMirror("the engine after refused copies");

  // The same sub-pool, in range: copied.
  REQUIRE(RunCopy(*backend, Job(*kv, flexkv::CopyDirection::kToPool, sub, {1}, {2})).ok());
  for (uint32_t l = 0; l < state.num_layers; ++l)
    RequireSame(sub.SlotData(2) + l * state.chunk_bytes_per_rank(), engine.Chunk(l, 0, 1), state.chunk_bytes_per_rank(),
                "the stored snapshot, layer " + std::to_string(l));
}

TEST_CASE("CUDA backend serves several registered pools and unregisters exactly the one dropped", "[gpu]") {
  SKIP_WITHOUT_GPU();
  auto rng = Rng();
  const flexkv::Geometry model = flexkv::Qwen3Next80B();
  const flexkv::Geometry state = model.Component(1);
  HybridPool a(model, {6, 3}), b(model, {6, 3});  // two cache domains' pools
  auto backend = flexkv::CudaEngineMemory::Create(flexkv::CudaCopyPaths{});
  REQUIRE(backend != nullptr);
  EngineBuffers engine(state, 2);
  engine.Randomize(rng);
  auto kv = backend->Open(flexkv::KvRegistration{engine.Describe(backend->devices().at(0), 0)}, state);
  INFO(kv.status().ToString());
  REQUIRE(kv.ok());
  REQUIRE(backend->RegisterPool(a.whole).ok());
  REQUIRE(backend->RegisterPool(b.whole).ok());
  REQUIRE(backend->RegisterPool(a.whole).ok());  // again: nothing more is registered
  REQUIRE(RunCopy(*backend, Job(*kv, flexkv::CopyDirection::kToPool, a.subs[1], {0}, {1})).ok());
  REQUIRE(RunCopy(*backend, Job(*kv, flexkv::CopyDirection::kToPool, b.subs[1], {1}, {2})).ok());

  // Domain a is dropped: its region is unregistered, b's stays and keeps copying.
  backend->UnregisterPool(a.whole);
  CHECK(RunCopy(*backend, Job(*kv, flexkv::CopyDirection::kToPool, a.subs[1], {0}, {0})).code() ==
        flexkv::StatusCode::kFailedPrecondition);
  REQUIRE(RunCopy(*backend, Job(*kv, flexkv::CopyDirection::kFromPool, b.subs[1], {0}, {2})).ok());
  backend->UnregisterPool(a.whole);  // not registered: nothing happens
  REQUIRE(backend->RegisterPool(a.whole).ok());
  REQUIRE(RunCopy(*backend, Job(*kv, flexkv::CopyDirection::kToPool, a.subs[1], {0}, {0})).ok());
  backend->UnregisterPool(a.whole);
  backend->UnregisterPool(b.whole);
}
