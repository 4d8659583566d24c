// Pins have a bound and a lease, against a real flexkvd: a stopped engine's pins lapse after --pin-lease and
// other engines store again; a running client keeps its pins however long it idles (its library renews the
// lease); a client that does not renew (or writes a far-future heartbeat) loses them, and its handles then say
// so; a Match with pin beyond --max-session-pin-share pins nothing and names the flag.
#include <signal.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <thread>

#include "flexkv/client.h"
#include "tests/integration/ring_sessions.h"
#include "tests/support/process.h"

using namespace std::chrono_literals;
using flexkv::testing::ChildProcess;
using flexkv::testing::DaemonUnderTest;
using flexkv::testing::NowMs;
using flexkv::testing::TestClientPath;

namespace {

// 2 layers: 128 KiB blocks, 16 of them in a 2 MiB pool.
ChildProcess Engine(const DaemonUnderTest& d, const std::string& name, const std::vector<std::string>& steps) {
  std::vector<std::string> argv = {TestClientPath(), "--socket", d.socket(), "--name", name, "--kv-blocks", "32",
                                   "--layers", "2"};
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

std::unique_ptr<flexkv::Client> Connect(const DaemonUnderTest& d) {
  auto c = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
  REQUIRE(c.ok());
  return std::move(*c);
}

// The value of an unlabelled metric in the daemon's exposition.
uint64_t Metric(flexkv::Client& c, const std::string& name) {
  auto text = c.GetMetrics();
  REQUIRE(text.ok());
  const std::string prefix = "\n" + name + " ";
  const size_t at = text->find(prefix);
  REQUIRE(at != std::string::npos);
  return static_cast<uint64_t>(std::stod(text->substr(at + prefix.size())));
}

// Waits (generously: no assertion on the speed) until `name` reaches `at_least`.
bool WaitForMetric(flexkv::Client& c, const std::string& name, uint64_t at_least) {
  const int64_t start = NowMs();
  while (NowMs() - start < 30000) {
    if (Metric(c, name) >= at_least) return true;
    std::this_thread::sleep_for(50ms);
  }
  return false;
}

flexkv::Geometry SmallGeometry() {
  flexkv::Geometry g = flexkv::Llama3_8B();
  g.num_layers = 2;
  return g;
}

}  // namespace

TEST_CASE("pins of a SIGSTOPped engine lapse after the pin lease: other engines store again",
          "[integration][regression]") {
  // Before the lease, an engine stopped while holding pins over the whole pool made every other store fail
  // with RESOURCE_EXHAUSTED for as long as it stayed stopped.
  DaemonUnderTest d({"--pool-size", "2MiB", "--max-session-pin-share", "1", "--pin-lease", "1"});
  REQUIRE(d.WaitReady());
  auto observer = Connect(d);
  ChildProcess a = Engine(d, "pinner", {"store:900:16", "pin:900:16", "hold"});
  auto attached = a.WaitForLine("ATTACHED", 10s);
  REQUIRE(attached.has_value());
  REQUIRE(attached->substr(attached->rfind(' ') + 1) == "16");  // the pool's slots: A pins every one
  REQUIRE(a.WaitForLine("PINNED 16", 10s).has_value());
  a.Signal(SIGSTOP);
  // Stores of others succeed once A's lease ran out (each try is a fresh engine; poll, with a generous deadline).
  std::string last;
  const int64_t start = NowMs();
  while (NowMs() - start < 30000) {
    ChildProcess b = Engine(d, "B", {"store:901:4"});
    auto lines = Lines(b);
    REQUIRE(lines.size() == 2);
    last = lines[1];
    if (last == "STORED 0 4 OK") break;
    CHECK(last == "STORED 0 0 RESOURCE_EXHAUSTED");  // the pool is still full of A's pins
    std::this_thread::sleep_for(100ms);
  }
  CHECK(last == "STORED 0 4 OK");
  CHECK(Metric(*observer, "flexkv_pin_lapses_total") == 1);
  CHECK(Metric(*observer, "flexkv_pin_lapsed_blocks_total") == 16);
  CHECK_THAT(d.process().Stderr(), Catch::Contains("pins lapsed after") && Catch::Contains("(process stopped?)"));
  // A is still attached: a resumed engine carries on, and its next Match pins again.
  auto sessions = observer->ListSessions();
  REQUIRE(sessions.ok());
  bool a_attached = false;
  for (const auto& s : *sessions) a_attached |= s.pid == static_cast<uint32_t>(a.pid());
  CHECK(a_attached);
  a.Signal(SIGCONT);
  a.Signal(SIGKILL);
  REQUIRE(a.Wait(5s).has_value());
}

TEST_CASE("a running client keeps its pins while it idles longer than the pin lease", "[integration]") {
  DaemonUnderTest d({"--pool-size", "2MiB", "--pin-lease", "0.2"});
  REQUIRE(d.WaitReady());
  auto c = Connect(d);
  REQUIRE(c->Attach({"idler", 0, 0, "test-model", SmallGeometry()}).ok());
  auto kv = c->CreateHostKv(flexkv::KvLayout::kBlockFirst, 4);
  REQUIRE(kv.ok());
  std::vector<int32_t> tokens(64, 5);
  const auto keys = flexkv::ComputeBlockKeys("test-model", tokens, 16);
  const std::vector<uint32_t> ids = {0, 1, 2, 3};
  auto stored = c->Wait(*c->Store(flexkv::BlockKeyChain(keys), ids), 5s);
  REQUIRE(stored.ok());
  REQUIRE(stored->status.ok());
  auto matched = c->Wait(*c->Match(keys, /*pin=*/true), 5s);
  REQUIRE(matched.ok());
  REQUIRE(matched->status.ok());
  REQUIRE(matched->match_handle != 0);
  std::this_thread::sleep_for(1500ms);  // 7 leases without a request: only the library's heartbeat renews
  auto loaded = c->Wait(*c->Load(matched->match_handle, ids), 5s);
  REQUIRE(loaded.ok());
  INFO(loaded->status.ToString());
  CHECK(loaded->status.ok());
  CHECK(loaded->done_blocks == 4);
  auto released = c->Wait(*c->Release(matched->match_handle), 5s);
  REQUIRE(released.ok());
  CHECK(released->status.ok());
  CHECK(Metric(*c, "flexkv_pin_lapses_total") == 0);
}

TEST_CASE("a client that does not renew loses its pins after the lease, a far-future heartbeat included",
          "[integration][regression]") {
  using flexkv::testing::ring::KeysFor;
  using flexkv::testing::ring::MessageOf;
  using flexkv::testing::ring::RawSession;
  DaemonUnderTest d({"--pool-size", "64MiB", "--pin-lease", "0.3"});
  REQUIRE(d.WaitReady());
  auto observer = Connect(d);
  RawSession raw(d.socket(), /*register_kv=*/true);
  REQUIRE(raw.hdr().pin_lease_ms == 300);  // the daemon says the lease in the header
  const auto keys = KeysFor(41, 4);
  raw.StoreOk(1, keys, 0);
  // A client writing a far-future heartbeat renews once, by the daemon's clock, not until that time.
  raw.hdr().client_heartbeat_ms.store(std::numeric_limits<uint64_t>::max());
  const flexkv::CompletionDescriptor pinned = raw.MatchOk(2, keys, 0, /*pin=*/true);
  REQUIRE(pinned.match_handle != 0);
  REQUIRE(WaitForMetric(*observer, "flexkv_pin_lapses_total", 1));
  CHECK(observer->GetStatus()->pool.pinned_blocks == 0);

  const std::string lapsed = "pins lapsed after 300 ms without renewal (process stopped?); Match again";
  uint32_t block = 0;
  raw.PutArena(4096, &block, sizeof(block));
  flexkv::SubmitDescriptor load = flexkv::testing::ring::Desc(3, static_cast<uint16_t>(flexkv::RingOp::kLoad), 1);
  load.block_ids_offset = 4096;
  load.match_handle = pinned.match_handle;
  flexkv::CompletionDescriptor c = raw.SubmitOne(load);
  CHECK(c.status_code == static_cast<int32_t>(flexkv::StatusCode::kFailedPrecondition));
  CHECK(MessageOf(c) == lapsed);
  flexkv::SubmitDescriptor release = flexkv::testing::ring::Desc(4, static_cast<uint16_t>(flexkv::RingOp::kRelease), 0);
  release.match_handle = pinned.match_handle;
  c = raw.SubmitOne(release);
  CHECK(c.status_code == static_cast<int32_t>(flexkv::StatusCode::kFailedPrecondition));
  CHECK(MessageOf(c) == lapsed);
  // The session stays attached and may pin again: it runs, as its Match shows.
  const flexkv::CompletionDescriptor again = raw.MatchOk(5, keys, 0, /*pin=*/true);
  CHECK(again.match_handle != 0);
  CHECK(again.matched_blocks == 4);
}

TEST_CASE("a Match with pin beyond --max-session-pin-share pins nothing and names the cap",
          "[integration][regression]") {
  DaemonUnderTest d({"--pool-size", "2MiB", "--max-session-pin-share", "0.25"});  // 16 slots: 4 per session
  REQUIRE(d.WaitReady());
  auto observer = Connect(d);
  ChildProcess a = Engine(d, "filler", {"store:900:8"});
  REQUIRE(Lines(a).at(1) == "STORED 0 8 OK");
  auto c = Connect(d);
  REQUIRE(c->Attach({"greedy", 0, 0, "test-model", SmallGeometry()}).ok());
  std::vector<int32_t> tokens(8 * 16);
  {
    // The test client's tokens of seed 900 (tests/support/test_client.cc): keys of the 8 stored blocks.
    std::mt19937_64 rng(900);
    for (auto& t : tokens) t = static_cast<int32_t>(rng() % 128000);
  }
  const auto keys = flexkv::ComputeBlockKeys("test-model", tokens, 16);
  auto over = c->Wait(*c->Match(keys, /*pin=*/true), 5s);
  REQUIRE(over.ok());
  CHECK(over->status.code() == flexkv::StatusCode::kResourceExhausted);
  CHECK(over->status.message() == "session pin cap: 0 pinned + 8 > 4 (--max-session-pin-share); Release handles");
  CHECK(over->matched_blocks == 8);
  CHECK(over->match_handle == 0);
  CHECK(observer->GetStatus()->pool.pinned_blocks == 0);
  auto within = c->Wait(*c->Match(std::span(keys).first(4), /*pin=*/true), 5s);
  REQUIRE(within.ok());
  CHECK(within->status.ok());
  CHECK(within->match_handle != 0);
  auto beyond = c->Wait(*c->Match(std::span(keys).first(1), /*pin=*/true), 5s);
  REQUIRE(beyond.ok());
  CHECK(beyond->status.code() == flexkv::StatusCode::kResourceExhausted);
  // Another session has a cap of its own.
  auto other = Connect(d);
  REQUIRE(other->Attach({"other", 0, 0, "test-model", SmallGeometry()}).ok());
  auto theirs = other->Wait(*other->Match(std::span(keys).first(4), /*pin=*/true), 5s);
  REQUIRE(theirs.ok());
  CHECK(theirs->status.ok());
}
