// GPU end to end through the daemon: engine processes with vLLM-shaped KV caches in GPU memory share
// blocks via the CUDA backend. Skips where no GPU is visible.
#include <cuda_runtime_api.h>
#include <signal.h>

#include <catch2/catch.hpp>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <thread>

#include "flexkv/client.h"
#include "flexkv/cuda.h"
#include "tests/support/process.h"

using namespace std::chrono_literals;
using flexkv::testing::ChildProcess;
using flexkv::testing::DaemonUnderTest;

namespace {

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// layout: the test client's --layout (layer-first: FLASH_ATTN-shaped tensors; layer-block-regions: FlashInfer's).
ChildProcess GpuClient(const DaemonUnderTest& d, const std::string& name, const std::vector<std::string>& steps,
                       uint32_t layers = 4, uint32_t kv_blocks = 256, uint32_t tp = 1, bool vmm = false,
                       const std::string& layout = "layer-first") {
  const char* env = std::getenv("FLEXKV_TEST_GPU_CLIENT");
  std::vector<std::string> argv = {env != nullptr ? env : FLEXKV_TEST_GPU_CLIENT, "--socket", d.socket(), "--name", name,
                                   "--layers", std::to_string(layers), "--kv-blocks", std::to_string(kv_blocks),
                                   "--tp", std::to_string(tp), "--heads", std::to_string(8 / tp), "--layout", layout};
  if (vmm) argv.push_back("--vmm");
  for (const auto& s : steps) {
    argv.push_back("--do");
    argv.push_back(s);
  }
  return ChildProcess::Spawn(argv);
}

// GPU DMA needs the pool on shared memory (cudaHostRegister refuses file-backed mappings on disk). The
// directory is removed when the test ends.
struct ShmPoolDir {
  std::string dir = "/dev/shm/flexkv-gpu-test-" + std::to_string(getpid());
  ~ShmPoolDir() { std::filesystem::remove_all(dir); }
};

std::vector<std::string> GpuDaemonArgs(const ShmPoolDir& shm, std::vector<std::string> extra) {
  extra.push_back("--pool-path");
  extra.push_back(shm.dir + "/pool");
  return extra;
}

std::vector<std::string> Lines(ChildProcess& p) {
  std::vector<std::string> out;
  while (auto line = p.ReadLine(120s)) out.push_back(*line);
  return out;
}

}  // namespace

TEST_CASE("GPU blocks stored by one engine load byte-exact into another engine's GPU cache", "[gpu]") {
  if (!HaveGpu()) {
    WARN("no GPU visible; skipped");
    return;
  }
  ShmPoolDir shm;
  DaemonUnderTest d(GpuDaemonArgs(shm, {"--pool-size", "2GiB"}));
  REQUIRE(d.WaitReady());
  ChildProcess a = GpuClient(d, "rank0", {"store:11:200"});
  auto la = Lines(a);
  INFO((la.empty() ? std::string() : la.back()) << "\n" << a.Stderr() << d.process().Stderr());
  REQUIRE(la.size() == 2);
  CHECK(la[1].rfind("STORED 0 200 OK", 0) == 0);
  ChildProcess b = GpuClient(d, "rank1", {"load:11:200", "load:12:8"});
  auto lb = Lines(b);
  REQUIRE(lb.size() == 3);
  CHECK(lb[1].rfind("LOADED 200 200 1 OK", 0) == 0);
  CHECK(lb[1].substr(lb[1].size() - 2) == " 1");  // layers were reported in order
  CHECK(lb[2].rfind("LOADED 0 0 1 OK", 0) == 0);
  auto c = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
  REQUIRE(c.ok());
  auto st = (*c)->GetStatus();
  REQUIRE(st.ok());
  bool cuda_listed = false;
  for (const auto& backend : st->backends) cuda_listed |= backend.name == "cuda" && !backend.devices.empty();
  CHECK(cuda_listed);
  CHECK(st->counters.at("load_blocks") == 200);
}

TEST_CASE("LAYER_BLOCK_REGIONS: FlashInfer-shaped per-layer GPU caches round-trip byte-exact by kernels and copy engine",
          "[gpu]") {
  if (!HaveGpu()) {
    WARN("no GPU visible; skipped");
    return;
  }
  for (const std::string path : {"kernel", "copy-engine"}) {
    INFO("--load-path / --store-path " << path);
    ShmPoolDir shm;
    DaemonUnderTest d(GpuDaemonArgs(shm, {"--pool-size", "1GiB", "--load-path", path, "--store-path", path}));
    REQUIRE(d.WaitReady());
    // Per layer (blocks, 2, 16 tokens, 8 heads, 128): 32 KiB chunks, a region per layer in its own cudaMalloc.
    ChildProcess a = GpuClient(d, "flashinfer-writer", {"store:51:150"}, 4, 192, 1, false, "layer-block-regions");
    auto la = Lines(a);
    INFO((la.empty() ? std::string() : la.back()) << "\n" << a.Stderr() << d.process().Stderr());
    REQUIRE(la.size() == 2);
    CHECK(la[1].rfind("STORED 0 150 OK", 0) == 0);
    ChildProcess b = GpuClient(d, "flashinfer-reader", {"load:51:150"}, 4, 192, 1, false, "layer-block-regions");
    auto lb = Lines(b);
    REQUIRE(lb.size() == 2);
    CHECK(lb[1].rfind("LOADED 150 150 1 OK", 0) == 0);  // every chunk of every block byte-exact in its place
    // The same blocks into a FLASH_ATTN-shaped (LAYER_FIRST) engine: equal bytes there prove each chunk was read from
    // (layer, plane, block)'s place, not merely put back where the same wrong address took it from.
    ChildProcess c = GpuClient(d, "flash-attn-reader", {"load:51:150"}, 4, 192, 1, false, "layer-first");
    auto lc = Lines(c);
    REQUIRE(lc.size() == 2);
    CHECK(lc[1].rfind("LOADED 150 150 1 OK", 0) == 0);
    // And the other way: stored from LAYER_FIRST, loaded into LAYER_BLOCK_REGIONS.
    ChildProcess e = GpuClient(d, "flash-attn-writer", {"store:52:100"}, 4, 192, 1, false, "layer-first");
    auto le = Lines(e);
    REQUIRE(le.size() == 2);
    CHECK(le[1].rfind("STORED 0 100 OK", 0) == 0);
    ChildProcess f = GpuClient(d, "flashinfer-reader-2", {"load:52:100"}, 4, 192, 1, false, "layer-block-regions");
    auto lf = Lines(f);
    REQUIRE(lf.size() == 2);
    CHECK(lf[1].rfind("LOADED 100 100 1 OK", 0) == 0);
  }
}

TEST_CASE("LAYER_BLOCK_REGIONS: a layer region smaller than its blocks need is refused naming the layer and the bytes",
          "[gpu]") {
  if (!HaveGpu()) {
    WARN("no GPU visible; skipped");
    return;
  }
  ShmPoolDir shm;
  DaemonUnderTest d(GpuDaemonArgs(shm, {"--pool-size", "256MiB"}));
  REQUIRE(d.WaitReady());
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  flexkv::Geometry g = flexkv::Llama3_8B();
  g.num_layers = 2;
  constexpr uint32_t kBlocks = 8;
  const uint64_t need = uint64_t{kBlocks} * 2 * g.chunk_bytes_per_rank();
  std::vector<void*> layers(g.num_layers, nullptr);
  for (void*& p : layers) REQUIRE(cudaMalloc(&p, need) == cudaSuccess);
  auto c = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
  REQUIRE(c.ok());
  REQUIRE((*c)->Attach({"too-small", 0, 0, "test-model", g}).ok());
  auto small = flexkv::DescribeGpuKv(flexkv::KvLayout::kLayerBlockRegions, layers, need - 16, kBlocks, 0);
  REQUIRE(small.ok());
  const flexkv::Status refused = (*c)->RegisterGpuKv(*small);
  CHECK(refused.code() == flexkv::StatusCode::kInvalidArgument);
  CHECK_THAT(refused.message(), Catch::Contains("region 0 (layer 0) has " + std::to_string(need - 16) + " bytes") &&
                                    Catch::Contains("layout LAYER_BLOCK_REGIONS needs " + std::to_string(need)));
  auto exact = flexkv::DescribeGpuKv(flexkv::KvLayout::kLayerBlockRegions, layers, need, kBlocks, 0);
  REQUIRE(exact.ok());
  CHECK((*c)->RegisterGpuKv(*exact).ok());
  REQUIRE((*c)->Detach().ok());
  for (void* p : layers) cudaFree(p);
}

TEST_CASE("TP=2: two worker processes on one GPU are the two ranks of one engine, shards round-trip", "[gpu]") {
  if (!HaveGpu()) {
    WARN("no GPU visible; skipped");
    return;
  }
  ShmPoolDir shm;
  DaemonUnderTest d(GpuDaemonArgs(shm, {"--pool-size", "1GiB"}));
  REQUIRE(d.WaitReady());
  ChildProcess a = GpuClient(d, "tp2-writer", {"store:31:100"}, 4, 128, 2);
  auto la = Lines(a);
  INFO((la.empty() ? std::string() : la.back()) << "\n" << d.process().Stderr());
  REQUIRE(la.size() == 2);
  CHECK(la[1].rfind("STORED 0 100 OK", 0) == 0);
  ChildProcess b = GpuClient(d, "tp2-reader", {"load:31:100"}, 4, 128, 2);
  auto lb = Lines(b);
  REQUIRE(lb.size() == 2);
  CHECK(lb[1].rfind("LOADED 100 100 1 OK", 0) == 0);  // both ranks' shards byte-exact
  auto c = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
  REQUIRE(c.ok());
  auto st = (*c)->GetStatus();
  REQUIRE(st.ok());
  CHECK(st->index_blocks == 100);  // one slot per block, both shards in it
  // A TP=1 engine lays heads out differently: it is refused, not served shards in the wrong places.
  ChildProcess tp1 = GpuClient(d, "tp1", {"load:31:100"}, 4, 128, 1);
  auto l1 = Lines(tp1);
  REQUIRE(!l1.empty());
  CHECK_THAT(l1.back(), Catch::Contains("FAILED_PRECONDITION") && Catch::Contains("tp_size"));
}

TEST_CASE("kill -9 of a GPU engine mid-load: pins released, mappings closed, the daemon keeps serving", "[gpu]") {
  if (!HaveGpu()) {
    WARN("no GPU visible; skipped");
    return;
  }
  ShmPoolDir shm;
  DaemonUnderTest d(GpuDaemonArgs(shm, {"--pool-size", "2GiB", "--log-level", "debug"}));
  REQUIRE(d.WaitReady());
  ChildProcess a = GpuClient(d, "writer", {"store:21:200"});
  auto la = Lines(a);
  INFO((la.empty() ? std::string() : la.back()) << "\n" << d.process().Stderr());
  REQUIRE(la.size() == 2);
  // Baseline once the daemon's own CUDA context and copy workers exist (the writer's registration made them).
  REQUIRE(a.Wait(10s).has_value());
  size_t free_before = 0, total = 0;
  std::this_thread::sleep_for(200ms);
  REQUIRE(cudaMemGetInfo(&free_before, &total) == cudaSuccess);
  for (int round = 0; round < 3; ++round) {
    ChildProcess victim = GpuClient(d, "victim", {"load:21:200", "load:21:200", "load:21:200", "hold"});
    REQUIRE(victim.WaitForLine("ATTACHED", 60s).has_value());
    std::this_thread::sleep_for(std::chrono::milliseconds(20 * round));
    victim.Signal(SIGKILL);
    REQUIRE(victim.Wait(10s).has_value());
  }
  auto c = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
  REQUIRE(c.ok());
  bool clean = false;
  for (int i = 0; i < 100 && !clean; ++i) {
    auto st = (*c)->GetStatus();
    REQUIRE(st.ok());
    clean = st->pool.pinned_blocks == 0 && st->sessions == 0;  // the observer did not attach
    if (!clean) std::this_thread::sleep_for(10ms);
  }
  CHECK(clean);
  // Every victim's IPC mappings are closed once its last copy finishes (pins go at once, a copy in flight when
  // the engine died runs to its end first): wait for it.
  size_t closed = 0;
  for (int i = 0; i < 200 && closed < 4; ++i) {
    const std::string log = d.process().Stderr();
    closed = 0;
    for (size_t pos = log.find("closed IPC/VMM mappings"); pos != std::string::npos;
         pos = log.find("closed IPC/VMM mappings", pos + 1)) {
      ++closed;
    }
    if (closed < 4) std::this_thread::sleep_for(25ms);
  }
  CHECK(closed >= 4);  // the writer and three victims
  // The dead engines' device memory is free again: nothing holds their allocations open.
  size_t free_after = 0;
  for (int i = 0; i < 100; ++i) {
    REQUIRE(cudaMemGetInfo(&free_after, &total) == cudaSuccess);
    if (free_after + (64ULL << 20) >= free_before) break;
    std::this_thread::sleep_for(20ms);
  }
  INFO("free before " << free_before << ", after " << free_after);
  CHECK(free_after + (64ULL << 20) >= free_before);
  ChildProcess after = GpuClient(d, "after", {"load:21:200"});
  auto lines = Lines(after);
  REQUIRE(lines.size() == 2);
  CHECK(lines[1].rfind("LOADED 200 200 1 OK", 0) == 0);
}

TEST_CASE("cuMem/VMM KV caches (shareable fds, as PyTorch's expandable segments) round-trip byte-exact", "[gpu]") {
  if (!HaveGpu()) {
    WARN("no GPU visible; skipped");
    return;
  }
  ShmPoolDir shm;
  DaemonUnderTest d(GpuDaemonArgs(shm, {"--pool-size", "2GiB", "--log-level", "debug"}));
  REQUIRE(d.WaitReady());
  // 4 layers x 2 planes x 200 blocks x 32 KiB: each layer spans several 4 MiB allocations and some
  // allocations straddle two layers.
  ChildProcess a = GpuClient(d, "vmm-writer", {"store:41:200"}, 4, 200, 1, /*vmm=*/true);
  auto la = Lines(a);
  INFO((la.empty() ? std::string() : la.back()) << "\n" << a.Stderr() << d.process().Stderr());
  REQUIRE(la.size() == 2);
  CHECK(la[1].rfind("STORED 0 200 OK", 0) == 0);
  REQUIRE(a.Wait(10s).has_value());
  size_t free_before = 0, total = 0;
  std::this_thread::sleep_for(200ms);
  REQUIRE(cudaMemGetInfo(&free_before, &total) == cudaSuccess);
  ChildProcess b = GpuClient(d, "vmm-reader", {"load:41:200"}, 4, 200, 1, /*vmm=*/true);
  auto lb = Lines(b);
  REQUIRE(lb.size() == 2);
  CHECK(lb[1].rfind("LOADED 200 200 1 OK", 0) == 0);
  // Mixed: a cudaMalloc engine reads what the VMM engine wrote.
  ChildProcess c = GpuClient(d, "ipc-reader", {"load:41:200"}, 4, 200, 1, /*vmm=*/false);
  auto lc = Lines(c);
  REQUIRE(lc.size() == 2);
  CHECK(lc[1].rfind("LOADED 200 200 1 OK", 0) == 0);
  // kill -9 of a VMM engine mid-load: its physical allocations are freed (the daemon unmapped them).
  ChildProcess victim = GpuClient(d, "vmm-victim", {"load:41:200", "load:41:200", "hold"}, 4, 200, 1, /*vmm=*/true);
  REQUIRE(victim.WaitForLine("ATTACHED", 60s).has_value());
  victim.Signal(SIGKILL);
  REQUIRE(victim.Wait(10s).has_value());
  size_t free_after = 0;
  for (int i = 0; i < 100; ++i) {
    REQUIRE(cudaMemGetInfo(&free_after, &total) == cudaSuccess);
    if (free_after + (64ULL << 20) >= free_before) break;
    std::this_thread::sleep_for(20ms);
  }
  INFO("free before " << free_before << ", after " << free_after);
  CHECK(free_after + (64ULL << 20) >= free_before);
  CHECK_THAT(d.process().Stderr(), Catch::Contains("closed IPC/VMM mappings"));
}

namespace {

// One engine's GPU KV cache of a hybrid geometry, vLLM-shaped: per component one cudaMalloc tensor per layer,
// [planes][blocks][chunk] (a state component: [state slots][state bytes]).
class HybridGpuCache {
 public:
  HybridGpuCache(const flexkv::Geometry& g, uint32_t blocks, uint32_t state_slots) : g_(g) {
    for (size_t c = 0; c < g.component_count(); ++c) {
      const flexkv::Geometry cg = g.Component(c);
      Part p;
      p.blocks = g.component_kind(c) == flexkv::ComponentKind::kState ? state_slots : blocks;
      p.chunk = cg.chunk_bytes_per_rank();
      p.planes = cg.kv_planes;
      p.region = uint64_t{p.planes} * p.blocks * p.chunk;
      for (uint32_t l = 0; l < cg.num_layers; ++l) {
        void* ptr = nullptr;
        REQUIRE(cudaMalloc(&ptr, p.region) == cudaSuccess);
        REQUIRE(cudaMemset(ptr, 0xA5, p.region) == cudaSuccess);
        p.layers.push_back(ptr);
      }
      parts_.push_back(std::move(p));
    }
  }
  ~HybridGpuCache() {
    for (auto& p : parts_) {
      for (void* ptr : p.layers) cudaFree(ptr);
    }
  }
  // Registers every component with the client's session.
  void Register(flexkv::Client& client) {
    for (size_t c = 0; c < parts_.size(); ++c) {
      auto reg = flexkv::DescribeGpuKv(flexkv::KvLayout::kLayerFirst, parts_[c].layers, parts_[c].region,
                                       parts_[c].blocks, 0);
      REQUIRE(reg.ok());
      reg->component = static_cast<uint32_t>(c);
      const flexkv::Status st = client.RegisterGpuKv(*reg);
      INFO(st.ToString());
      REQUIRE(st.ok());
    }
  }
  // The bytes of block `b` of component c, layer by layer and plane by plane.
  std::vector<uint8_t> Read(size_t c, uint32_t b) const {
    const Part& p = parts_[c];
    std::vector<uint8_t> out;
    for (void* layer : p.layers) {
      for (uint32_t plane = 0; plane < p.planes; ++plane) {
        std::vector<uint8_t> chunk(p.chunk);
        const auto* src = static_cast<const uint8_t*>(layer) + (uint64_t{plane} * p.blocks + b) * p.chunk;
        REQUIRE(cudaMemcpy(chunk.data(), src, p.chunk, cudaMemcpyDeviceToHost) == cudaSuccess);
        out.insert(out.end(), chunk.begin(), chunk.end());
      }
    }
    return out;
  }
  // Fills block `b` of component c with bytes of `seed`.
  void Fill(size_t c, uint32_t b, uint32_t seed) {
    const Part& p = parts_[c];
    std::vector<uint8_t> chunk(p.chunk);
    for (size_t l = 0; l < p.layers.size(); ++l) {
      for (uint32_t plane = 0; plane < p.planes; ++plane) {
        for (size_t i = 0; i < chunk.size(); ++i) chunk[i] = static_cast<uint8_t>(seed * 131 + c * 31 + l * 7 + plane * 3 + i);
        auto* dst = static_cast<uint8_t*>(p.layers[l]) + (uint64_t{plane} * p.blocks + b) * p.chunk;
        REQUIRE(cudaMemcpy(dst, chunk.data(), p.chunk, cudaMemcpyHostToDevice) == cudaSuccess);
      }
    }
  }
  uint32_t blocks(size_t c) const { return parts_[c].blocks; }

 private:
  struct Part {
    std::vector<void*> layers;
    uint32_t blocks = 0, planes = 0;
    uint64_t chunk = 0, region = 0;
  };
  flexkv::Geometry g_;
  std::vector<Part> parts_;
};

}  // namespace

TEST_CASE("hybrid geometry on the GPU: FULL blocks, the window and the state round-trip byte-exact through flexkvd",
          "[gpu][hybrid]") {
  if (!HaveGpu()) {
    WARN("no GPU visible; skipped");
    return;
  }
  ShmPoolDir shm;
  DaemonUnderTest d(GpuDaemonArgs(shm, {"--pool-size", "256MiB", "--swa-share", "0.2", "--state-share", "0.1"}));
  REQUIRE(d.WaitReady());
  // gpt-oss-like FULL + a 4-block window, plus a Mamba-like state of 8 KiB per layer.
  flexkv::Geometry g;
  g.tokens_per_block = 16;
  g.num_layers = 2;
  g.kv_planes = 2;
  g.kv_heads_per_rank = 2;
  g.head_dim = 64;
  g.dtype_bytes = 2;
  flexkv::ComponentSpec swa;
  swa.kind = flexkv::ComponentKind::kSlidingWindow;
  swa.num_layers = 3;
  swa.kv_heads_per_rank = 2;
  swa.head_dim = 64;
  swa.window_tokens = 64;
  flexkv::ComponentSpec state;
  state.kind = flexkv::ComponentKind::kState;
  state.num_layers = 2;
  state.state_bytes_per_layer = 8192;
  g.components = {swa, state};
  constexpr uint32_t kBlocks = 32, kN = 20;
  std::vector<int32_t> tokens(kN * g.tokens_per_block);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i * 7 + 3);
  const auto keys = flexkv::ComputeBlockKeys("gpu-hybrid", tokens, g.tokens_per_block);

  auto a = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
  auto b = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
  REQUIRE((a.ok() && b.ok()));
  REQUIRE((*a)->Attach({"hybrid-a", 0, 0, "gpu-hybrid", g}).ok());
  REQUIRE((*b)->Attach({"hybrid-b", 1, 0, "gpu-hybrid", g}).ok());
  HybridGpuCache cache_a(g, kBlocks, 4), cache_b(g, kBlocks, 4);
  cache_a.Register(**a);
  cache_b.Register(**b);

  // A stores 20 blocks: FULL 0..19, the window's blocks 16..19, states at 8 and 20 (engine state slots 0 and 1).
  std::vector<uint32_t> full(kN), window, state_ids = {0, 1};
  for (uint32_t i = 0; i < kN; ++i) full[i] = i;
  for (uint32_t i = kN - 4; i < kN; ++i) window.push_back(i);
  for (uint32_t i : full) cache_a.Fill(0, i, i);
  for (uint32_t i : window) cache_a.Fill(1, i, 100 + i);
  cache_a.Fill(2, 0, 208);
  cache_a.Fill(2, 1, 220);
  const std::vector<std::span<const uint32_t>> store_ids = {full, window, state_ids};
  const std::vector<uint32_t> boundaries = {8, 20};
  auto st = (*a)->Store(flexkv::BlockKeyChain(keys), store_ids, boundaries);
  REQUIRE(st.ok());
  auto stored = (*a)->Wait(*st, 30s);
  REQUIRE(stored.ok());
  INFO(stored->status.ToString());
  REQUIRE(stored->status.ok());
  CHECK(stored->done_blocks == kN);

  // B: the hit is the whole prompt; its load lands FULL 0..19 in blocks 10..29, the window in blocks 0..3 and the
  // state in slot 3, and nothing else of B's cache changes.
  auto m = (*b)->Match(keys, true);
  REQUIRE(m.ok());
  auto matched = (*b)->Wait(*m, 30s);
  REQUIRE(matched.ok());
  REQUIRE(matched->matched_blocks == kN);
  std::vector<uint32_t> dst_full(kN), dst_window = {0, 1, 2, 3}, dst_state = {3};
  for (uint32_t i = 0; i < kN; ++i) dst_full[i] = 10 + i;
  const std::vector<std::span<const uint32_t>> load_ids = {dst_full, dst_window, dst_state};
  auto l = (*b)->Load(matched->match_handle, load_ids);
  REQUIRE(l.ok());
  auto loaded = (*b)->Wait(*l, 30s);
  REQUIRE(loaded.ok());
  INFO(loaded->status.ToString());
  REQUIRE(loaded->status.ok());
  for (uint32_t i = 0; i < kN; ++i) CHECK(cache_b.Read(0, 10 + i) == cache_a.Read(0, i));
  for (uint32_t i = 0; i < 4; ++i) CHECK(cache_b.Read(1, i) == cache_a.Read(1, kN - 4 + i));
  CHECK(cache_b.Read(2, 3) == cache_a.Read(2, 1));  // the snapshot at 20
  const std::vector<uint8_t> poison_full(cache_b.Read(0, 0).size(), 0xA5);
  for (uint32_t i = 0; i < 10; ++i) CHECK(cache_b.Read(0, i) == poison_full);
  const std::vector<uint8_t> poison_window(cache_b.Read(1, 4).size(), 0xA5);
  for (uint32_t i = 4; i < kBlocks; ++i) CHECK(cache_b.Read(1, i) == poison_window);
  const std::vector<uint8_t> poison_state(cache_b.Read(2, 0).size(), 0xA5);
  for (uint32_t i = 0; i < 3; ++i) CHECK(cache_b.Read(2, i) == poison_state);
  auto r = (*b)->Release(matched->match_handle);
  REQUIRE(r.ok());
  REQUIRE((*b)->Wait(*r, 30s).ok());
}
