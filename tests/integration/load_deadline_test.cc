// A Load's launch deadline (ring layout 6, docs/protocol.md "Session rings") through a real flexkvd with host KV
// buffers: a Load whose deadline passed before the daemon launched it - already when submitted, or while the daemon
// was stopped (SIGSTOP) - ends DEADLINE_EXCEEDED and leaves every engine block as it was (a sentinel), releases its
// pins and is counted as a load error; a Load with a far deadline copies as any other.
#include <signal.h>

#include <catch2/catch.hpp>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "flexkv/client.h"
#include "tests/support/process.h"

using namespace std::chrono_literals;
using flexkv::BlockKey;
using flexkv::StatusCode;
using flexkv::testing::DaemonUnderTest;

namespace {

using Ids = std::vector<uint32_t>;

constexpr uint32_t kEngineBlocks = 16;
constexpr uint8_t kSentinel = 0xEE;

flexkv::Geometry SmallGeometry() {
  flexkv::Geometry g = flexkv::Llama3_8B();
  g.num_layers = 2;
  return g;
}

void Fill(uint8_t* p, uint64_t bytes, uint32_t block) {
  for (uint64_t i = 0; i < bytes; ++i) p[i] = static_cast<uint8_t>(block * 31 + i * 7 + (i >> 8));
}

bool Holds(const uint8_t* p, uint64_t bytes, uint32_t block) {
  std::vector<uint8_t> want(bytes);
  Fill(want.data(), bytes, block);
  return std::memcmp(p, want.data(), bytes) == 0;
}

bool IsSentinel(const uint8_t* p, uint64_t bytes) {
  for (uint64_t i = 0; i < bytes; ++i) {
    if (p[i] != kSentinel) return false;
  }
  return true;
}

// SIGSTOP, returning once /proc says every thread of the daemon is stopped (T): a request submitted then stays
// untouched until SIGCONT.
void Freeze(DaemonUnderTest& d) {
  const pid_t pid = d.process().pid();
  d.process().Signal(SIGSTOP);
  for (int i = 0; i < 5000; ++i) {
    bool all_stopped = true;
    for (const auto& task : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task")) {
      std::ifstream stat(task.path() / "stat");
      std::string line;
      std::getline(stat, line);
      const size_t paren = line.rfind(')');
      if (paren == std::string::npos || paren + 2 >= line.size()) continue;
      const char state = line[paren + 2];
      if (state != 'T' && state != 't') all_stopped = false;
    }
    if (all_stopped) return;
    std::this_thread::sleep_for(1ms);
  }
  FAIL("flexkvd did not stop after SIGSTOP");
}

// The value of the metric line that has all of `parts`, 0 when there is none.
uint64_t MetricWith(flexkv::Client& c, const std::vector<std::string>& parts) {
  auto text = c.GetMetrics();
  REQUIRE(text.ok());
  std::istringstream lines(*text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] == '#') continue;
    bool all = true;
    for (const std::string& p : parts) all = all && line.find(p) != std::string::npos;
    if (all) return static_cast<uint64_t>(std::stod(line.substr(line.rfind(' ') + 1)));
  }
  return 0;
}

// One engine with kEngineBlocks host blocks, the first four stored under `keys`, the rest sentinel-filled.
struct Engine {
  std::unique_ptr<flexkv::Client> client;
  flexkv::HostKvBuffers kv;
  uint64_t block_bytes = 0;
  std::vector<BlockKey> keys;

  explicit Engine(const DaemonUnderTest& d) {
    auto c = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
    REQUIRE(c.ok());
    client = std::move(*c);
    flexkv::AttachOptions o;
    o.client_name = "deadline";
    o.model_namespace = "llama";
    o.geometry = SmallGeometry();
    auto info = client->Attach(o);
    REQUIRE(info.ok());
    auto buffers = client->CreateHostKv(flexkv::KvLayout::kBlockFirst, kEngineBlocks);
    REQUIRE(buffers.ok());
    kv = *buffers;
    block_bytes = kv.bytes / kEngineBlocks;
    std::memset(kv.data, kSentinel, kv.bytes);
    std::vector<int32_t> tokens(4 * o.geometry.tokens_per_block);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i * 13 + 5);
    keys = flexkv::ComputeBlockKeys("llama", tokens, o.geometry.tokens_per_block);
    for (uint32_t j = 0; j < 4; ++j) Fill(Block(j), block_bytes, j);
    CHECK(Wait(client->Store(flexkv::BlockKeyChain(keys), Ids{0, 1, 2, 3})).status.ok());
    std::memset(kv.data, kSentinel, kv.bytes);  // the engine's copies are gone: only the daemon has the bytes
  }

  uint8_t* Block(uint32_t id) const { return kv.data + id * block_bytes; }

  flexkv::OpResult Wait(const flexkv::Result<flexkv::Ticket>& t) {
    REQUIRE(t.ok());
    auto r = client->Wait(*t, 10s);
    REQUIRE(r.ok());
    return *r;
  }

  uint64_t Pin() {
    const flexkv::OpResult r = Wait(client->Match(keys, /*pin=*/true));
    REQUIRE(r.status.ok());
    REQUIRE(r.matched_blocks == 4);
    return r.match_handle;
  }

  bool AllSentinel() const { return IsSentinel(kv.data, kv.bytes); }

  uint64_t Pinned() {
    auto st = client->GetStatus();
    REQUIRE(st.ok());
    return st->pool.pinned_blocks;
  }
};

void ExpectRefusedByDeadline(const flexkv::OpResult& r) {
  INFO(r.status.ToString());
  CHECK(r.status.code() == StatusCode::kDeadlineExceeded);
  CHECK(r.status.message() == "not launched by its launch deadline; nothing was copied");
  CHECK(r.done_blocks == 0);
  CHECK(r.bytes == 0);
}

}  // namespace

TEST_CASE("load deadline: a Load whose launch deadline passed is refused DEADLINE_EXCEEDED and copies nothing",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  Engine e(d);
  const uint64_t errors_before = MetricWith(*e.client, {"flexkv_request_errors_total", "op=\"load\"",
                                                        "code=\"DEADLINE_EXCEEDED\""});
  const uint64_t handle = e.Pin();
  const int64_t passed = flexkv::NowNs() - 1000000;  // 1 ms ago

  SECTION("a whole load") {
    ExpectRefusedByDeadline(e.Wait(e.client->Load(handle, Ids{8, 9, 10, 11}, false, 0, passed)));
  }
  SECTION("a layer-wise load from block 2: no layer is reported") {
    ExpectRefusedByDeadline(e.Wait(e.client->Load(handle, Ids{12, 13}, /*layerwise=*/true, /*first_block=*/2, passed)));
  }
  CHECK(e.AllSentinel());
  CHECK(MetricWith(*e.client, {"flexkv_request_errors_total", "op=\"load\"", "code=\"DEADLINE_EXCEEDED\""}) ==
        errors_before + 1);
  // The refused load held the handle as any load does, and gave it back: the handle still loads, byte-exact.
  const flexkv::OpResult ok = e.Wait(e.client->Load(handle, Ids{4, 5, 6, 7}, false, 0, flexkv::NowNs() + 60'000'000'000));
  INFO(ok.status.ToString());
  REQUIRE(ok.status.ok());
  CHECK(ok.done_blocks == 4);
  for (uint32_t j = 0; j < 4; ++j) CHECK(Holds(e.Block(4 + j), e.block_bytes, j));
  CHECK(e.Wait(e.client->Release(handle)).status.ok());
  CHECK(e.Pinned() == 0);
  // A negative deadline is refused before anything is sent.
  CHECK(e.client->Load(handle, Ids{4}, false, 0, -5).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("load deadline: a Load submitted while flexkvd is stopped past its deadline ends DEADLINE_EXCEEDED after "
          "SIGCONT, the engine's blocks untouched",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  Engine e(d);
  const uint64_t handle = e.Pin();

  Freeze(d);
  const int64_t deadline = flexkv::NowNs() + 200'000'000;  // 200 ms ahead
  auto whole = e.client->Load(handle, Ids{8, 9, 10, 11}, false, 0, deadline);
  auto layerwise = e.client->Load(handle, Ids{12, 13, 14, 15}, /*layerwise=*/true, 0, deadline);
  REQUIRE(whole.ok());
  REQUIRE(layerwise.ok());
  // The client gives up at the deadline: the daemon has not launched anything (it is stopped).
  CHECK(e.client->WaitLayers(*layerwise, 1, 1ms).status().code() == StatusCode::kDeadlineExceeded);
  while (flexkv::NowNs() <= deadline + 50'000'000) std::this_thread::sleep_for(10ms);
  d.process().Signal(SIGCONT);

  ExpectRefusedByDeadline(e.Wait(whole));
  ExpectRefusedByDeadline(e.Wait(layerwise));
  CHECK(e.AllSentinel());
  // Both loads gave their hold on the handle back; it is still pinned by the match, and still loads.
  const flexkv::OpResult ok = e.Wait(e.client->Load(handle, Ids{8, 9, 10, 11}, false, 0, flexkv::NowNs() + 60'000'000'000));
  INFO(ok.status.ToString());
  REQUIRE(ok.status.ok());
  for (uint32_t j = 0; j < 4; ++j) CHECK(Holds(e.Block(8 + j), e.block_bytes, j));
  CHECK(e.Wait(e.client->Release(handle)).status.ok());
  CHECK(e.Pinned() == 0);
}
