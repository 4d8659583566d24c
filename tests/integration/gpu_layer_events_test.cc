// Layer-wise loads completed by CUDA interprocess events (issue 19), on a real GPU through a real flexkvd: this test
// process is the engine. It stores KV blocks, poisons its GPU copy of them, loads them back naming a layer-event set,
// and - after WaitLaunched, on a stream of its own that the CPU never synchronizes between layers - waits on each
// layer's event and snapshots that layer's first and last bytes. Every snapshot must equal the stored bytes: a wait
// that did not order the read after the daemon's copy would read the poison (later layers are still in flight when
// the engine's snapshots are enqueued). Also: a set that a load in flight uses is refused to a second load, and
// events of the wrong count or unknown handles are refused. Skips where no GPU is visible.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "flexkv/client.h"
#include "flexkv/cuda.h"
#include "tests/support/process.h"

using namespace std::chrono_literals;
using flexkv::StatusCode;
using flexkv::testing::DaemonUnderTest;

namespace {

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define CUDA_REQUIRE(expr)                                                      \
  do {                                                                          \
    const cudaError_t flexkv_e_ = (expr);                                       \
    INFO(#expr << ": " << cudaGetErrorString(flexkv_e_));                       \
    REQUIRE(flexkv_e_ == cudaSuccess);                                          \
  } while (0)

struct ShmPoolDir {
  std::string dir = "/dev/shm/flexkv-gpu-events-test-" + std::to_string(getpid());
  ~ShmPoolDir() { std::filesystem::remove_all(dir); }
};

// The engine's KV cache: LAYER_FIRST, one cudaMalloc region per layer ([plane][block][chunk]), as vLLM's.
struct EngineKv {
  flexkv::Geometry g;
  uint32_t blocks = 0;
  uint64_t chunk = 0, region = 0;
  std::vector<void*> layers;
  EngineKv(const flexkv::Geometry& geometry, uint32_t num_blocks)
      : g(geometry), blocks(num_blocks), chunk(geometry.chunk_bytes_per_rank()),
        region(uint64_t{geometry.kv_planes} * num_blocks * geometry.chunk_bytes_per_rank()) {}
  ~EngineKv() {
    for (void* p : layers) cudaFree(p);
  }
  EngineKv(const EngineKv&) = delete;
  EngineKv& operator=(const EngineKv&) = delete;
  uint8_t* At(uint32_t layer, uint32_t plane, uint32_t block) const {
    return static_cast<uint8_t*>(layers[layer]) + (uint64_t{plane} * blocks + block) * chunk;
  }
};

// The byte the stored pattern has at `offset` of (layer, plane, block)'s chunk: never the poison (0xEE).
uint8_t Pattern(uint32_t layer, uint32_t plane, uint32_t block, uint64_t offset) {
  const uint8_t v = static_cast<uint8_t>(layer * 131 + plane * 71 + block * 29 + offset * 7 + 1);
  return v == 0xEE ? 0x11 : v;
}

std::unique_ptr<flexkv::Client> Attached(const DaemonUnderTest& d, const flexkv::Geometry& g,
                                         const std::string& model_namespace = "llama3-8b") {
  auto c = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
  REQUIRE(c.ok());
  flexkv::AttachOptions o;
  o.client_name = "events-engine";
  o.model_namespace = model_namespace;
  o.geometry = g;
  auto s = (*c)->Attach(o);
  INFO(s.status().ToString());
  REQUIRE(s.ok());
  return std::move(*c);
}

flexkv::OpResult Run(flexkv::Client& c, flexkv::Result<flexkv::Ticket> t) {
  INFO(t.status().ToString());
  REQUIRE(t.ok());
  auto r = c.Wait(*t, 60s);
  INFO(r.status().ToString());
  REQUIRE(r.ok());
  return *r;
}

}  // namespace

TEST_CASE("layer events: the engine's stream reads each layer only after its event, every snapshot is the stored bytes",
          "[gpu]") {
  if (!HaveGpu()) {
    WARN("no GPU visible; skipped");
    return;
  }
  ShmPoolDir shm;
  DaemonUnderTest d({"--pool-size", "2GiB", "--pool-path", shm.dir + "/pool"});
  REQUIRE(d.WaitReady());
  CUDA_REQUIRE(cudaSetDevice(0));
  flexkv::Geometry g = flexkv::Llama3_8B();  // 32 layers, 32 KiB chunks, 2 MiB blocks
  g.num_layers = 16;                          // 1 MiB blocks: 512 blocks = 512 MiB in flight per load
  const uint32_t kBlocks = 512;
  auto client = Attached(d, g);
  EngineKv kv(g, kBlocks);
  kv.layers.resize(g.num_layers, nullptr);
  for (void*& p : kv.layers) CUDA_REQUIRE(cudaMalloc(&p, kv.region));
  auto reg = flexkv::DescribeGpuKv(flexkv::KvLayout::kLayerFirst, kv.layers, kv.region, kBlocks, 0);
  INFO(reg.status().ToString());
  REQUIRE(reg.ok());
  REQUIRE(client->RegisterGpuKv(*reg).ok());

  // Fill every chunk with its pattern, store all blocks.
  std::vector<uint8_t> host(kv.region);
  for (uint32_t l = 0; l < g.num_layers; ++l) {
    for (uint32_t p = 0; p < g.kv_planes; ++p) {
      for (uint32_t b = 0; b < kBlocks; ++b) {
        uint8_t* chunk = host.data() + (uint64_t{p} * kBlocks + b) * kv.chunk;
        for (uint64_t o = 0; o < kv.chunk; ++o) chunk[o] = Pattern(l, p, b, o);
      }
    }
    CUDA_REQUIRE(cudaMemcpy(kv.layers[l], host.data(), kv.region, cudaMemcpyHostToDevice));
  }
  std::vector<int32_t> tokens(size_t{kBlocks} * g.tokens_per_block);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i * 3 + 1);
  const auto keys = flexkv::ComputeBlockKeys("llama3-8b", tokens, g.tokens_per_block);
  std::vector<uint32_t> ids(kBlocks);
  for (uint32_t b = 0; b < kBlocks; ++b) ids[b] = b;
  const flexkv::OpResult stored = Run(*client, client->Store(flexkv::BlockKeyChain(keys), ids));
  REQUIRE(stored.status.ok());
  REQUIRE(stored.done_blocks == kBlocks);

  auto events = flexkv::CudaLayerEvents::Create(g.num_layers, 0);
  INFO(events.status().ToString());
  REQUIRE(events.ok());
  const flexkv::LayerEventHandles handles = events->handles();
  auto set = flexkv::LayerEventSet::Register(*client, std::span<const flexkv::LayerEventHandles>(&handles, 1));
  INFO(set.status().ToString());
  REQUIRE(set.ok());
  REQUIRE(set->id() != 0);

  cudaStream_t stream = nullptr;
  CUDA_REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // Per layer: the first 16 bytes of (plane 0, first block) and the last 16 of (last plane, last block).
  uint8_t* snaps = nullptr;
  const size_t kSnap = 32;
  CUDA_REQUIRE(cudaMallocHost(reinterpret_cast<void**>(&snaps), kSnap * g.num_layers));

  // Several rounds: the set is reused, so a wait bound to an earlier load's recording would show as poison here.
  for (int round = 0; round < 3; ++round) {
    INFO("round " << round);
    for (void* p : kv.layers) CUDA_REQUIRE(cudaMemset(p, 0xEE, kv.region));  // poison the destination
    CUDA_REQUIRE(cudaDeviceSynchronize());
    std::memset(snaps, 0, kSnap * g.num_layers);
    const flexkv::OpResult m = Run(*client, client->Match(keys, true));
    REQUIRE(m.matched_blocks == kBlocks);
    auto load = client->LoadWithEvents(m.match_handle, ids, set->id());
    INFO(load.status().ToString());
    REQUIRE(load.ok());
    if (round == 0) {
      // The set is busy until that load ends: a second load naming it is refused, and nothing of it is done.
      auto m2 = Run(*client, client->Match(keys, true));
      auto second = client->LoadWithEvents(m2.match_handle, std::span<const uint32_t>(ids).first(1), set->id());
      REQUIRE(second.ok());
      // (The first load moves 512 MiB, milliseconds; the second is taken off the ring microseconds after it.)
      const flexkv::OpResult busy = Run(*client, std::move(second));
      CHECK(busy.status.code() == StatusCode::kFailedPrecondition);
      CHECK_THAT(busy.status.message(), Catch::Contains("is busy") && Catch::Contains("one load per set at a time"));
      CHECK(busy.done_blocks == 0);
      REQUIRE(Run(*client, client->Release(m2.match_handle)).status.ok());
    }
    const flexkv::Status launched = client->WaitLaunched(*load, 60s);
    INFO(launched.ToString());
    REQUIRE(launched.ok());
    for (uint32_t l = 0; l < g.num_layers; ++l) {
      REQUIRE(events->StreamWait(l, stream).ok());
      CUDA_REQUIRE(cudaMemcpyAsync(snaps + kSnap * l, kv.At(l, 0, 0), 16, cudaMemcpyDeviceToHost, stream));
      CUDA_REQUIRE(cudaMemcpyAsync(snaps + kSnap * l + 16, kv.At(l, g.kv_planes - 1, kBlocks - 1) + kv.chunk - 16, 16,
                                   cudaMemcpyDeviceToHost, stream));
    }
    CUDA_REQUIRE(cudaStreamSynchronize(stream));
    const flexkv::OpResult r = Run(*client, std::move(load));
    INFO(r.status.ToString());
    REQUIRE(r.status.ok());
    CHECK(r.done_blocks == kBlocks);
    for (uint32_t l = 0; l < g.num_layers; ++l) {
      INFO("layer " << l);
      for (uint64_t o = 0; o < 16; ++o) {
        REQUIRE(snaps[kSnap * l + o] == Pattern(l, 0, 0, o));
        REQUIRE(snaps[kSnap * l + 16 + o] == Pattern(l, g.kv_planes - 1, kBlocks - 1, kv.chunk - 16 + o));
      }
    }
    REQUIRE(Run(*client, client->Release(m.match_handle)).status.ok());
  }
  cudaFreeHost(snaps);
  cudaStreamDestroy(stream);
  const uint32_t id = set->id();
  CHECK(set->Release().ok());
  CHECK(set->id() == 0);
  CHECK(client->ReleaseLayerEvents(id).code() == StatusCode::kNotFound);  // gone
}

TEST_CASE("layer events: wrong counts, unknown GPUs and handles that are not events are refused with the reason",
          "[gpu]") {
  if (!HaveGpu()) {
    WARN("no GPU visible; skipped");
    return;
  }
  ShmPoolDir shm;
  DaemonUnderTest d({"--pool-size", "256MiB", "--pool-path", shm.dir + "/pool"});
  REQUIRE(d.WaitReady());
  CUDA_REQUIRE(cudaSetDevice(0));
  flexkv::Geometry g = flexkv::Llama3_8B();
  g.num_layers = 4;
  auto client = Attached(d, g);

  auto three = flexkv::CudaLayerEvents::Create(3, 0);
  REQUIRE(three.ok());
  const flexkv::LayerEventHandles wrong = three->handles();
  auto refused = client->RegisterLayerEvents(std::span<const flexkv::LayerEventHandles>(&wrong, 1));
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(refused.status().message(), Catch::Contains("has 3 event handles; expected one per layer of the geometry: 4"));

  auto four = flexkv::CudaLayerEvents::Create(4, 0);
  REQUIRE(four.ok());
  flexkv::LayerEventHandles elsewhere = four->handles();
  elsewhere.gpu_uuid = "GPU-00000000-0000-0000-0000-000000000000";
  auto unknown_gpu = client->RegisterLayerEvents(std::span<const flexkv::LayerEventHandles>(&elsewhere, 1));
  REQUIRE_FALSE(unknown_gpu.ok());
  CHECK(unknown_gpu.status().code() == StatusCode::kNotFound);
  CHECK_THAT(unknown_gpu.status().message(), Catch::Contains("is not a GPU this daemon sees"));

  flexkv::LayerEventHandles garbage = four->handles();
  garbage.handles[2] = std::string(64, '\0');
  auto not_event = client->RegisterLayerEvents(std::span<const flexkv::LayerEventHandles>(&garbage, 1));
  REQUIRE_FALSE(not_event.ok());
  CHECK(not_event.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(not_event.status().message(), Catch::Contains("cudaIpcOpenEventHandle of layer 2"));

  // The good set registers; ids are never reused; the daemon keeps serving.
  const flexkv::LayerEventHandles good = four->handles();
  auto a = client->RegisterLayerEvents(std::span<const flexkv::LayerEventHandles>(&good, 1));
  REQUIRE(a.ok());
  REQUIRE(client->ReleaseLayerEvents(*a).ok());
  auto b = client->RegisterLayerEvents(std::span<const flexkv::LayerEventHandles>(&good, 1));
  REQUIRE(b.ok());
  CHECK(*b != *a);
  CHECK(client->ReleaseLayerEvents(*a).code() == StatusCode::kNotFound);
  CHECK(client->CheckHealth().ok());
}

TEST_CASE("copy-engine loads: a GPU registration with chunks under 32 KiB is refused naming the kernel path", "[gpu]") {
  if (!HaveGpu()) {
    WARN("no GPU visible; skipped");
    return;
  }
  ShmPoolDir shm;
  DaemonUnderTest d({"--pool-size", "256MiB", "--pool-path", shm.dir + "/pool", "--load-path", "copy-engine",
                     "--max-domains", "2"});
  REQUIRE(d.WaitReady());
  CUDA_REQUIRE(cudaSetDevice(0));
  for (const uint32_t heads : {4u, 8u}) {  // 16 KiB chunks: refused; 32 KiB: served
    INFO("kv heads " << heads);
    flexkv::Geometry g = flexkv::Llama3_8B();
    g.num_layers = 2;
    g.kv_heads_per_rank = heads;
    auto client = Attached(d, g, "heads-" + std::to_string(heads));
    EngineKv kv(g, 8);
    kv.layers.resize(g.num_layers, nullptr);
    for (void*& p : kv.layers) CUDA_REQUIRE(cudaMalloc(&p, kv.region));
    auto reg = flexkv::DescribeGpuKv(flexkv::KvLayout::kLayerFirst, kv.layers, kv.region, 8, 0);
    REQUIRE(reg.ok());
    const flexkv::Status st = client->RegisterGpuKv(*reg);
    if (heads == 4) {
      CHECK(st.code() == StatusCode::kFailedPrecondition);
      CHECK_THAT(st.message(), Catch::Contains("--load-path copy-engine") && Catch::Contains("16384-byte chunks") &&
                                   Catch::Contains("--load-path kernel"));
    } else {
      CHECK(st.ok());
    }
    REQUIRE(client->Detach().ok());
  }
}
