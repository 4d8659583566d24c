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
#include "tests/support/process.h"

using namespace std::chrono_literals;
using flexkv::testing::ChildProcess;
using flexkv::testing::DaemonUnderTest;

namespace {

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

ChildProcess GpuClient(const DaemonUnderTest& d, const std::string& name, const std::vector<std::string>& steps,
                       uint32_t layers = 4, uint32_t kv_blocks = 256, uint32_t tp = 1, bool vmm = false) {
  const char* env = std::getenv("FLEXKV_TEST_GPU_CLIENT");
  std::vector<std::string> argv = {env != nullptr ? env : FLEXKV_TEST_GPU_CLIENT, "--socket", d.socket(), "--name", name,
                                   "--layers", std::to_string(layers), "--kv-blocks", std::to_string(kv_blocks),
                                   "--tp", std::to_string(tp), "--heads", std::to_string(8 / tp)};
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
