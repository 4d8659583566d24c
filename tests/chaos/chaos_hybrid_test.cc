// Chaos with a hybrid geometry (docs/hybrid.md): engines storing and loading FULL blocks, a sliding window and a
// state are killed -9 at random points, and flexkvd itself is killed -9 and restarted on the same pool; no load
// ever returns a torn window or state or writes outside what its prefix end needs, every completed store is served
// after the last restart, and nothing stays pinned or attached.
#include <signal.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "tests/chaos/chaos_support.h"
#include "tests/support/process.h"

using namespace std::chrono_literals;
using flexkv::testing::ChildProcess;
using flexkv::testing::DaemonUnderTest;
using flexkv::testing::NowMs;
using flexkv::testing::TestClientPath;

using namespace flexkv::testing::chaos;  // NOLINT(google-build-using-namespace): the chaos fixtures

namespace {

// gpt-oss-like FULL + window (4 blocks) plus a 4 KiB state per layer, snapshots every 3 blocks and at the end.
const std::vector<std::string> kHybrid = {"--layers",       "2",  "--heads",        "2",    "--head-dim",
                                          "64",             "--swa-layers",     "2",    "--window-tokens",
                                          "64",             "--state-layers",   "2",    "--state-bytes",
                                          "4096",           "--state-every",    "3"};
constexpr int kBlocks = 6;  // per prompt: ends with a state at 3 (no window there) and at 6

ChildProcess HybridEngine(const std::string& socket, const std::string& name, const std::vector<std::string>& steps) {
  std::vector<std::string> argv = {TestClientPath(), "--socket", socket, "--name", name, "--kv-blocks", "32"};
  argv.insert(argv.end(), kHybrid.begin(), kHybrid.end());
  for (const auto& s : steps) {
    argv.push_back("--do");
    argv.push_back(s);
  }
  return ChildProcess::Spawn(argv);
}

std::string Step(const char* op, int seed) { return std::string(op) + ":" + std::to_string(seed) + ":" + std::to_string(kBlocks); }

// A load line is whole: every block it reports loaded, bytes equal, nothing else written; the end is 0 or 6.
bool WholeLoad(const std::string& line) {
  unsigned hits = 0, loaded = 0, equal = 0, untouched = 0;
  char st[32] = {};
  if (std::sscanf(line.c_str(), "LOADED %u %u %u %31s %u", &hits, &loaded, &equal, st, &untouched) != 5) return false;
  return hits == loaded && equal == 1 && untouched == 1 && std::string(st) == "OK" && (hits == 0 || hits == kBlocks);
}

}  // namespace

TEST_CASE("chaos: hybrid engines and flexkvd killed -9 under load: no torn window or state, nothing lost or leaked",
          "[chaos][hybrid]") {
  const std::string dir = MakeDir();
  // Nothing is evicted at this load: 250 prompts need 1000 window slots of 16 KiB and 500 state slots of 8 KiB.
  const std::vector<std::string> args = {"--pool-size", "64MiB", "--swa-share", "0.3", "--state-share", "0.1"};
  constexpr int kRounds = 5, kSeedsPerRound = 30;
  std::mt19937 rng(20261203);
  std::set<int> completed;
  int torn = 0, victims = 0;
  for (int round = 0; round < kRounds; ++round) {
    DaemonUnderTest d(args, dir);
    REQUIRE(d.WaitReady());
    std::vector<std::string> stores, loads, victim_steps;
    for (int i = 0; i < kSeedsPerRound; ++i) stores.push_back(Step("store", 5000 + round * 100 + i));
    for (int seed : completed) loads.push_back(Step("load", seed));  // stored in earlier rounds
    for (int i = 0; i < 20; ++i) {
      victim_steps.push_back(Step("store", 9000 + round * 100 + i));
      victim_steps.push_back(Step("load", 9000 + round * 100 + i));
    }
    ChildProcess writer = HybridEngine(d.socket(), "writer", stores);
    ChildProcess reader = HybridEngine(d.socket(), "reader", loads);
    ChildProcess victim = HybridEngine(d.socket(), "victim", victim_steps);
    // The victim dies -9 after a random number of its requests, mid-store or mid-load.
    const int victim_lines = 1 + static_cast<int>(rng() % 12);
    for (int i = 0; i < victim_lines; ++i) {
      if (!victim.ReadLine(10s)) break;
    }
    victim.Signal(SIGKILL);
    ++victims;
    // The writer runs a random part of its stores, then the daemon dies -9 under it.
    const int before_kill = 5 + static_cast<int>(rng() % 15);
    int stored = 0;
    while (stored < before_kill) {
      auto line = writer.ReadLine(10s);
      REQUIRE(line.has_value());
      if (line->rfind("STORED", 0) == 0) {
        REQUIRE(*line == "STORED 0 6 OK");
        completed.insert(5000 + round * 100 + stored);
        ++stored;
      }
    }
    d.process().Signal(SIGKILL);
    REQUIRE(d.process().Wait(5s).has_value());
    for (;;) {  // STORED lines still in the pipe completed before the kill
      auto line = writer.ReadLine(2s);
      if (!line) break;
      if (*line == "STORED 0 6 OK") completed.insert(5000 + round * 100 + stored++);
    }
    for (auto line = reader.ReadLine(2s); line; line = reader.ReadLine(2s)) {
      if (line->rfind("LOADED", 0) != 0) continue;  // ATTACHED, or the ERROR UNAVAILABLE of the kill
      if (!WholeLoad(*line)) {
        ++torn;
        UNSCOPED_INFO("round " << round << ": " << *line);
      }
    }
    (void)victim.Wait(5s);
  }
  // The last restart: once the restored blocks are verified, every completed store is a whole hit, and nothing is
  // left pinned or attached.
  DaemonUnderTest d(args, dir);
  REQUIRE(d.WaitReady());
  auto observer = Observer(d.socket());
  const int64_t start = NowMs();
  while (NowMs() - start < 30000) {
    auto st = observer->GetStatus();
    REQUIRE(st.ok());
    if (st->pool.unverified_blocks == 0) break;
    std::this_thread::sleep_for(20ms);
  }
  std::vector<std::string> checks;
  for (int seed : completed) checks.push_back(Step("load", seed));
  ChildProcess reader = HybridEngine(d.socket(), "final-reader", checks);
  std::vector<std::string> lines = Lines(reader, 60s);
  REQUIRE(lines.size() == completed.size() + 1);
  int lost = 0;
  for (size_t i = 1; i < lines.size(); ++i) {
    if (lines[i] != "LOADED 6 6 1 OK 1") {
      ++lost;
      UNSCOPED_INFO("lost or torn: " << lines[i]);
    }
  }
  auto st = observer->GetStatus();
  REQUIRE(st.ok());
  CHECK(torn == 0);
  CHECK(lost == 0);
  CHECK(victims == kRounds);
  CHECK(completed.size() >= static_cast<size_t>(kRounds * 5));
  CHECK(st->pool.pinned_blocks == 0);
  CHECK(st->sessions == 0);
  std::filesystem::remove_all(dir);
}
