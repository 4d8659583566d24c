// Data plane end to end: several engine processes share one cache through the rings (host backend).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "flexkv/client.h"
#include "tests/support/process.h"

using namespace std::chrono_literals;
using flexkv::testing::ChildProcess;
using flexkv::testing::DaemonUnderTest;
using flexkv::testing::NowMs;
using flexkv::testing::TestClientPath;

namespace {

// 2 layers: 128 KiB blocks keep these tests fast.
const std::vector<std::string> kSmallGeometry = {"--layers", "2"};

ChildProcess Client(const DaemonUnderTest& d, const std::string& name, const std::vector<std::string>& steps,
                    uint32_t kv_blocks = 128) {
  std::vector<std::string> argv = {TestClientPath(), "--socket", d.socket(), "--name", name, "--kv-blocks",
                                   std::to_string(kv_blocks)};
  argv.insert(argv.end(), kSmallGeometry.begin(), kSmallGeometry.end());
  for (const auto& s : steps) {
    argv.push_back("--do");
    argv.push_back(s);
  }
  return ChildProcess::Spawn(argv);
}

std::vector<std::string> Lines(ChildProcess& p, std::chrono::milliseconds timeout = 30s) {
  std::vector<std::string> out;
  while (auto line = p.ReadLine(timeout)) out.push_back(*line);
  return out;
}

std::unique_ptr<flexkv::Client> Observer(const DaemonUnderTest& d) {
  auto c = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
  REQUIRE(c.ok());
  return std::move(*c);
}

}  // namespace

TEST_CASE("a prefix stored by one process is a hit with the same bytes for another", "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  ChildProcess a = Client(d, "A", {"store:7:64"});
  auto a_lines = Lines(a);
  REQUIRE(a_lines.size() == 2);
  CHECK(a_lines[1] == "STORED 0 64 OK");
  ChildProcess b = Client(d, "B", {"load:7:64", "store:7:64", "load:8:4"});
  auto b_lines = Lines(b);
  REQUIRE(b_lines.size() == 4);
  CHECK(b_lines[1] == "LOADED 64 64 1 OK");  // 64 hits, 64 loaded, bytes equal to A's
  CHECK(b_lines[2] == "STORED 64 0 OK");     // the cached prefix is skipped
  CHECK(b_lines[3] == "LOADED 0 0 1 OK");    // another prompt: a miss
  auto s = Observer(d)->GetStatus();
  REQUIRE(s.ok());
  CHECK(s->index_blocks == 64);
  CHECK(s->pool.used_blocks == 64);
  CHECK(s->pool.pinned_blocks == 0);
  CHECK(s->counters.at("hit_blocks") == 64);
  CHECK(s->counters.at("store_blocks") == 64);
  CHECK(s->counters.at("load_blocks") == 64);
  CHECK(s->counters.at("bytes_loaded") == 64ULL * 128 * 1024);
}

TEST_CASE("kill -9 of a client holding pins with a load in flight leaks nothing, others see no error",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  ChildProcess seed = Client(d, "seed", {"store:1:64"});
  REQUIRE(Lines(seed).at(1) == "STORED 0 64 OK");
  std::vector<std::string> survivor_steps;
  for (int i = 0; i < 40; ++i) {
    survivor_steps.push_back("load:1:64");
    survivor_steps.push_back("store:" + std::to_string(100 + i) + ":2");
  }
  ChildProcess survivor = Client(d, "survivor", survivor_steps);
  auto observer = Observer(d);
  int64_t worst_ms = 0;
  for (int round = 0; round < 5; ++round) {
    ChildProcess victim = Client(d, "victim", {"pin:1:32", "inflight-load:1:64", "hold"});
    REQUIRE(victim.WaitForLine("PINNED", 10s).has_value());
    REQUIRE(victim.WaitForLine("INFLIGHT", 10s).has_value());
    victim.Signal(SIGKILL);
    REQUIRE(victim.Wait(5s).has_value());
    const int64_t t0 = NowMs();
    int64_t clean_after = -1;
    while (NowMs() - t0 < 2000) {
      auto sessions = observer->ListSessions();
      REQUIRE(sessions.ok());
      bool victim_listed = false;
      for (const auto& s : *sessions) victim_listed |= s.client_name == "victim";
      auto st = observer->GetStatus();
      REQUIRE(st.ok());
      // The survivor pins at most 64 blocks while loading; the victim's 32 + 64 must be gone.
      if (!victim_listed && st->pool.pinned_blocks <= 64) {
        clean_after = NowMs() - t0;
        break;
      }
      std::this_thread::sleep_for(1ms);
    }
    INFO("round " << round << ": reclaimed after " << clean_after << " ms");
    CHECK(clean_after >= 0);
    CHECK(clean_after <= 100);
    worst_ms = std::max(worst_ms, clean_after);
  }
  auto lines = Lines(survivor, 60s);
  REQUIRE(lines.size() == survivor_steps.size() + 1);
  for (size_t i = 1; i < lines.size(); ++i) {
    INFO(lines[i]);
    if (lines[i].rfind("LOADED", 0) == 0) CHECK(lines[i] == "LOADED 64 64 1 OK");
    if (lines[i].rfind("STORED", 0) == 0) CHECK(lines[i] == "STORED 0 2 OK");
  }
  auto st = observer->GetStatus();
  REQUIRE(st.ok());
  CHECK(st->pool.pinned_blocks == 0);
  CHECK(st->pool.used_blocks == st->index_blocks);  // no slot stuck pending: used + free = capacity
  CHECK(st->index_blocks == 64 + 80);
  WARN("worst reclamation after kill -9: " << worst_ms << " ms");
}

TEST_CASE("kill -9 of flexkvd during stores: after restart every completed store is served, nothing torn",
          "[integration]") {
  std::optional<DaemonUnderTest> d;
  d.emplace(std::vector<std::string>{"--pool-size", "64MiB"});
  REQUIRE(d->WaitReady());
  const std::string dir = d->dir();
  std::vector<std::string> steps;
  for (int i = 0; i < 150; ++i) steps.push_back("store:" + std::to_string(1000 + i) + ":3");
  ChildProcess writer = Client(*d, "writer", steps);
  std::set<int> completed;
  for (int i = 0; i < 40; ++i) {
    auto line = writer.WaitForLine("STORED", 10s);
    REQUIRE(line.has_value());
    REQUIRE(*line == "STORED 0 3 OK");
    completed.insert(1000 + i);
  }
  d->process().Signal(SIGKILL);
  REQUIRE(d->process().Wait(5s).has_value());
  // STORED lines still in the pipe are stores that completed before the kill.
  for (int i = 40;; ++i) {
    auto line = writer.ReadLine(2s);
    if (!line) break;
    if (*line == "STORED 0 3 OK") completed.insert(1000 + i);
  }
  DaemonUnderTest restarted({"--pool-size", "64MiB"}, dir);
  REQUIRE(restarted.WaitReady());
  std::vector<std::string> checks;
  for (int i = 0; i < 150; ++i) checks.push_back("load:" + std::to_string(1000 + i) + ":3");
  ChildProcess reader = Client(restarted, "reader", checks);
  auto lines = Lines(reader, 60s);
  REQUIRE(lines.size() == 151);
  for (int i = 0; i < 150; ++i) {
    const std::string& line = lines[static_cast<size_t>(i) + 1];
    INFO("seed " << 1000 + i << ": " << line);
    if (completed.count(1000 + i) != 0) {
      CHECK(line == "LOADED 3 3 1 OK");
    } else {
      // Not known to have completed: absent or partly present, but whatever is served is whole.
      CHECK(line.find(" 1 OK") != std::string::npos);
    }
  }
  CHECK(completed.size() >= 40);
  CHECK_THAT(restarted.process().Stderr(), Catch::Contains("re-attached pool"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("a pool of pinned blocks only: a store keeps what it can and reports RESOURCE_EXHAUSTED", "[integration]") {
  // 8 slots of 128 KiB. One session pins the whole pool on purpose: its pin cap is lifted to all of it.
  DaemonUnderTest d({"--pool-size", "1MiB", "--max-session-pin-share", "1"});
  REQUIRE(d.WaitReady());
  ChildProcess a = Client(d, "A", {"store:5:8", "pin:5:8", "hold"});
  REQUIRE(a.WaitForLine("PINNED 8", 10s).has_value());
  ChildProcess b = Client(d, "B", {"store:6:4"});
  auto lines = Lines(b);
  REQUIRE(lines.size() == 2);
  CHECK(lines[1] == "STORED 0 0 RESOURCE_EXHAUSTED");
  a.Signal(SIGKILL);
  REQUIRE(a.Wait(5s).has_value());
  std::this_thread::sleep_for(100ms);
  ChildProcess c = Client(d, "C", {"store:6:4", "load:6:4"});
  auto after = Lines(c);
  REQUIRE(after.size() == 3);
  CHECK(after[1] == "STORED 0 4 OK");  // eviction of unpinned leaves made room
  CHECK(after[2] == "LOADED 4 4 1 OK");
  auto st = Observer(d)->GetStatus();
  REQUIRE(st.ok());
  CHECK(st->counters.at("evicted_blocks") >= 4);
}

TEST_CASE("drain refuses new loads and stores, resume admits them again", "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  ChildProcess a = Client(d, "A", {"store:3:4"});
  REQUIRE(Lines(a).at(1) == "STORED 0 4 OK");
  auto admin = Observer(d);
  REQUIRE(admin->Drain().ok());
  CHECK(admin->GetStatus()->state == "drained");
  auto client = Observer(d);
  flexkv::AttachOptions o;
  o.model_namespace = "test-model";
  o.geometry = flexkv::Llama3_8B();
  o.geometry.num_layers = 2;
  CHECK(client->Attach(o).status().code() == flexkv::StatusCode::kUnavailable);  // no new sessions either
  REQUIRE(admin->Resume().ok());
  REQUIRE(client->Attach(o).ok());
  auto kv = client->CreateHostKv(flexkv::KvLayout::kBlockFirst, 8);
  REQUIRE(kv.ok());
  REQUIRE(admin->Drain().ok());
  std::vector<int32_t> tokens(64, 1);
  auto keys = flexkv::ComputeBlockKeys("test-model", tokens, 16);
  std::vector<uint32_t> ids = {0, 1, 2, 3};
  auto t = client->Store(flexkv::BlockKeyChain(keys), ids);
  REQUIRE(t.ok());
  auto r = client->Wait(*t, 5s);
  REQUIRE(r.ok());
  CHECK(r->status.code() == flexkv::StatusCode::kUnavailable);
  CHECK_THAT(r->status.message(), Catch::Contains("draining"));
  auto m = client->Match(keys);  // lookups still answer
  REQUIRE(m.ok());
  REQUIRE(client->Wait(*m, 5s).ok());
  REQUIRE(admin->Resume().ok());
  auto t2 = client->Store(flexkv::BlockKeyChain(keys), ids);
  REQUIRE(t2.ok());
  auto r2 = client->Wait(*t2, 5s);
  REQUIRE(r2.ok());
  CHECK(r2->status.ok());
  CHECK(r2->done_blocks == 4);
}

TEST_CASE("a corrupt pool file is refused with a clear message, and replaced only when asked", "[integration]") {
  char tmpl[] = "/tmp/flexkvd-test-XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  const std::string dir = tmpl;
  {
    DaemonUnderTest d({"--pool-size", "64MiB"}, dir);
    REQUIRE(d.WaitReady());
    ChildProcess a = Client(d, "A", {"store:3:4"});
    REQUIRE(Lines(a).at(1) == "STORED 0 4 OK");
    d.process().Signal(SIGTERM);
    REQUIRE(d.process().Wait(5s).has_value());
  }
  {
    std::fstream f(dir + "/pool", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(20);
    f.write("garbage!", 8);
  }
  auto refused = flexkv::testing::RunCommand({flexkv::testing::FlexkvdPath(), "--socket", dir + "/flexkvd.sock",
                                              "--pool-path", dir + "/pool", "--pool-size", "64MiB"});
  CHECK(refused.exit_code == 1);
  CHECK_THAT(refused.output, Catch::Contains("corrupt") && Catch::Contains("--discard-pool"));
  {
    DaemonUnderTest d({"--pool-size", "64MiB", "--discard-pool"}, dir);
    REQUIRE(d.WaitReady());
    CHECK_THAT(d.process().Stderr(), Catch::Contains("discarding pool file"));
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("a new session's first request is served at once while the poller is parked", "[integration]") {
  // The poller parks in epoll_wait (200 ms) once idle. A session opened meanwhile must ring its doorbell: a first
  // request that waited for the park to time out took up to 200 ms. Ten rounds, each after the poller parked.
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  flexkv::Geometry g = flexkv::Llama3_8B();
  g.num_layers = 2;
  const auto keys = flexkv::ComputeBlockKeys("llama3-8b", std::vector<int32_t>(64, 7), g.tokens_per_block);
  std::vector<int64_t> took_ms;
  for (int round = 0; round < 10; ++round) {
    std::this_thread::sleep_for(250ms);  // idle: the poller is parked
    auto c = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
    REQUIRE(c.ok());
    REQUIRE((*c)->Attach({.client_name = "first-request", .model_namespace = "llama3-8b", .geometry = g}).ok());
    const int64_t t0 = NowMs();
    auto t = (*c)->Match(keys);
    REQUIRE(t.ok());
    auto r = (*c)->Wait(*t, 5s);
    REQUIRE(r.ok());
    CHECK(r->status.ok());
    took_ms.push_back(NowMs() - t0);
  }
  // The median, not the slowest: on a loaded 2-core CI machine one round may be descheduled for tens of ms. A
  // missed doorbell waits out the rest of the 200 ms park, ~100 ms on average, in every round.
  std::sort(took_ms.begin(), took_ms.end());
  INFO("first requests (ms, sorted): " << fmt::format("{}", fmt::join(took_ms, " ")));
  CHECK(took_ms[took_ms.size() / 2] < 50);  // ~1 ms when the doorbell is rung
}
