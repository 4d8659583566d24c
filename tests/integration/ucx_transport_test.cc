// The cluster tier's UCX transport (daemon/cluster/ucx/): two transports in this process over 127.0.0.1 with UCX
// restricted to tcp (the transport a cluster without RDMA uses, and the only one this machine has), then a peer
// process in a network namespace behind a veth pair: reads byte-exact, bounds, deadlines, a killed peer, a
// partition, the accept filter.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/stat.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "daemon/cluster/ucx/ucx_transport.h"
#include "tests/support/process.h"

namespace flexkv::cluster {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

uint8_t Pattern(uint64_t j) { return static_cast<uint8_t>((j * 2654435761u) >> 11); }

std::vector<uint8_t> PatternBuffer(uint64_t bytes) {
  std::vector<uint8_t> b(bytes);
  for (uint64_t j = 0; j < bytes; ++j) b[j] = Pattern(j);
  return b;
}

bool MatchesPattern(const uint8_t* p, uint64_t offset, uint64_t len) {
  for (uint64_t j = 0; j < len; ++j) {
    if (p[j] != Pattern(offset + j)) return false;
  }
  return true;
}

// One Get's outcome.
class Waiter {
 public:
  std::function<void(Status)> Callback() {
    return [this](Status s) {
      std::lock_guard<std::mutex> lock(mu_);
      ++calls_;
      status_ = std::move(s);
      cv_.notify_all();
    };
  }
  std::optional<Status> Wait(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, timeout, [&] { return status_.has_value(); });
    return status_;
  }
  int calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<Status> status_;
  int calls_ = 0;
};

UcxOptions LoopbackOptions(bool listen) {
  UcxOptions o;
  o.transports = "tcp";
  o.devices = "lo";
  if (listen) o.listen_address = "127.0.0.1";
  o.get_deadline = 1000ms;
  return o;
}

std::unique_ptr<UcxTransport> MakeTransport(const UcxOptions& o) {
  auto t = UcxTransport::Create(o);
  INFO(t.status().ToString());
  REQUIRE(t.ok());
  return std::move(t).value();
}

// Gets [offset, offset+len) synchronously.
Status GetSync(UcxTransport& t, const PeerHandle& peer, const RemoteRegion& r, uint64_t offset, void* dst,
               uint64_t len, std::chrono::milliseconds timeout = 10s) {
  Waiter w;
  Status s = t.Get(peer, r, offset, dst, len, w.Callback());
  if (!s.ok()) return s;
  auto result = w.Wait(timeout);
  REQUIRE(result.has_value());
  return *result;
}

TEST_CASE("cluster transport (UCX): a peer reads a registered region byte-exact over tcp on loopback", "[integration][cluster]") {
  auto a = MakeTransport(LoopbackOptions(true));
  auto b = MakeTransport(LoopbackOptions(false));
  REQUIRE(a->endpoint().rfind("127.0.0.1:", 0) == 0);
  CHECK(b->endpoint().empty());

  constexpr uint64_t kBytes = 4 << 20;
  auto pool = PatternBuffer(kBytes);
  auto region = a->Register(pool.data(), kBytes);
  REQUIRE(region.ok());
  auto remote = RemoteRegion::Parse(region->descriptor());
  REQUIRE(remote.ok());
  CHECK(remote->base() == reinterpret_cast<uintptr_t>(pool.data()));
  CHECK(remote->length() == kBytes);

  auto peer = b->Connect(a->endpoint());
  INFO(peer.status().ToString());
  REQUIRE(peer.ok());

  // Plain memory as the destination.
  std::vector<uint8_t> dst(kBytes);
  struct Range {
    uint64_t offset, len;
  };
  for (Range r : {Range{0, 4096}, Range{(1 << 20) + 123, 65536}, Range{kBytes - 1, 1}, Range{0, kBytes},
                  Range{777, 3 << 20}}) {
    std::fill(dst.begin(), dst.end(), 0);
    Status s = GetSync(*b, *peer, *remote, r.offset, dst.data(), r.len);
    INFO("offset " << r.offset << " len " << r.len << ": " << s.ToString());
    REQUIRE(s.ok());
    CHECK(MatchesPattern(dst.data(), r.offset, r.len));
  }

  // A destination inside a region B registered.
  std::vector<uint8_t> landing(1 << 20);
  auto landing_region = b->Register(landing.data(), landing.size());
  REQUIRE(landing_region.ok());
  REQUIRE(GetSync(*b, *peer, *remote, 4096, landing.data() + 512, 256 << 10).ok());
  CHECK(MatchesPattern(landing.data() + 512, 4096, 256 << 10));

  // What UCX chose: tcp only.
  auto in_use = b->transports_in_use();
  REQUIRE(in_use.size() >= 2);
  CHECK(in_use[0] == "config: TLS=tcp NET_DEVICES=lo");
  for (size_t i = 1; i < in_use.size(); ++i) CHECK(in_use[i].rfind("tcp/", 0) == 0);
  WARN("transports in use: " << [&] {
    std::string s;
    for (auto& x : in_use) s += x + "; ";
    return s;
  }());
  CHECK(a->stats().connections_accepted >= 1);
  CHECK(b->stats().gets_ok == 6);
}

TEST_CASE("cluster transport (UCX): ranges outside the region and malformed descriptors are refused",
          "[integration][cluster]") {
  auto a = MakeTransport(LoopbackOptions(true));
  auto b = MakeTransport(LoopbackOptions(false));
  constexpr uint64_t kBytes = 1 << 20;
  auto pool = PatternBuffer(kBytes);
  auto region = a->Register(pool.data(), kBytes);
  REQUIRE(region.ok());
  auto remote = RemoteRegion::Parse(region->descriptor());
  REQUIRE(remote.ok());
  auto peer = b->Connect(a->endpoint());
  REQUIRE(peer.ok());
  std::vector<uint8_t> dst(kBytes + 4096);
  int calls = 0;
  auto never = [&calls](Status) { ++calls; };

  CHECK(b->Get(*peer, *remote, kBytes, dst.data(), 1, never).code() == StatusCode::kInvalidArgument);
  CHECK(b->Get(*peer, *remote, kBytes - 10, dst.data(), 11, never).code() == StatusCode::kInvalidArgument);
  CHECK(b->Get(*peer, *remote, 0, dst.data(), kBytes + 1, never).code() == StatusCode::kInvalidArgument);
  CHECK(b->Get(*peer, *remote, UINT64_MAX, dst.data(), 2, never).code() == StatusCode::kInvalidArgument);
  CHECK(b->Get(*peer, *remote, 1, dst.data(), UINT64_MAX, never).code() == StatusCode::kInvalidArgument);
  CHECK(b->Get(*peer, *remote, 0, dst.data(), 0, never).code() == StatusCode::kInvalidArgument);
  CHECK(b->Get(*peer, *remote, 0, nullptr, 16, never).code() == StatusCode::kInvalidArgument);
  CHECK(b->Get(PeerHandle{}, *remote, 0, dst.data(), 16, never).code() == StatusCode::kNotFound);
  CHECK(calls == 0);

  // Descriptors are untrusted bytes.
  const std::string good = region->descriptor();
  auto parse_code = [](const std::string& d) { return RemoteRegion::Parse(d).status().code(); };
  CHECK(parse_code("") == StatusCode::kInvalidArgument);
  CHECK(parse_code(good.substr(0, 10)) == StatusCode::kInvalidArgument);
  CHECK(parse_code(good.substr(0, good.size() - 1)) == StatusCode::kInvalidArgument);
  CHECK(parse_code(good + "x") == StatusCode::kInvalidArgument);
  std::string bad = good;
  bad[0] = 'X';
  CHECK(parse_code(bad) == StatusCode::kInvalidArgument);  // magic
  bad = good;
  bad[4] = 9;
  CHECK(parse_code(bad) == StatusCode::kInvalidArgument);  // version
  bad = good;
  std::memset(&bad[16], 0, 8);
  CHECK(parse_code(bad) == StatusCode::kInvalidArgument);  // length 0
  bad = good;
  std::memset(&bad[8], 0xff, 16);
  CHECK(parse_code(bad) == StatusCode::kInvalidArgument);  // base + length overflows
  bad = good;
  std::memset(&bad[24], 0xff, 4);
  CHECK(parse_code(bad) == StatusCode::kInvalidArgument);  // rkey length huge
  bad = good;
  bad[24] = 1;
  CHECK(parse_code(bad + "k") == StatusCode::kInvalidArgument);  // an rkey: version 2 carries none
  bad = good;
  bad[4] = 1;
  CHECK(parse_code(bad) == StatusCode::kInvalidArgument);  // version 1 (with an rkey) is no longer read

  // Random base addresses (0x1000, the region's neighbours, anything): the serving side checks every range against
  // its registrations and refuses with NOT_FOUND; it reads nothing else and survives; done runs once.
  std::mt19937_64 rng(42);
  const uint64_t base = reinterpret_cast<uintptr_t>(pool.data());
  for (int i = 0; i < 50; ++i) {
    std::string fuzzed = good;
    uint64_t address = i == 0 ? 0x1000 : i == 1 ? base - 4096 : i == 2 ? base + kBytes : rng() | 1;
    for (int k = 0; k < 8; ++k) fuzzed[8 + k] = static_cast<char>((address >> (8 * k)) & 0xff);
    auto r = RemoteRegion::Parse(fuzzed);
    if (!r.ok()) continue;  // base + length overflows
    Waiter w;
    Status s = b->Get(*peer, *r, 0, dst.data(), 64, w.Callback());
    REQUIRE(s.ok());
    auto result = w.Wait(5s);
    REQUIRE(result.has_value());
    INFO(result->ToString());
    CHECK(result->code() == StatusCode::kNotFound);
    CHECK(w.calls() == 1);
  }
  CHECK(a->stats().requests_refused >= 3);
  // A descriptor that claims more than was registered (a lying or stale peer record): over tcp the serving side
  // checks every range against its registrations and refuses; nothing outside a registered region is read.
  {
    std::string bigger = good;
    const uint64_t twice = 2 * kBytes;
    for (int i = 0; i < 8; ++i) bigger[16 + i] = static_cast<char>((twice >> (8 * i)) & 0xff);
    auto r = RemoteRegion::Parse(bigger);
    REQUIRE(r.ok());
    Status s = GetSync(*b, *peer, *r, kBytes - 16, dst.data(), 64);
    INFO(s.ToString());
    CHECK(s.code() == StatusCode::kNotFound);
    CHECK(GetSync(*b, *peer, *r, kBytes - 64, dst.data(), 64).ok());  // inside: still served
  }
  // The good descriptor still reads.
  REQUIRE(GetSync(*b, *peer, *remote, 100, dst.data(), 4096).ok());
  CHECK(MatchesPattern(dst.data(), 100, 4096));
}

TEST_CASE("cluster transport (UCX): many gets in flight from two threads all complete byte-exact", "[integration][cluster]") {
  auto a = MakeTransport(LoopbackOptions(true));
  auto bopt = LoopbackOptions(false);
  bopt.max_inflight_gets = 16;
  bopt.get_deadline = 10s;  // a loaded 2-core machine: this test is about correctness, not liveness
  auto b = MakeTransport(bopt);
  constexpr uint64_t kBytes = 8 << 20;
  auto pool = PatternBuffer(kBytes);
  auto region = a->Register(pool.data(), kBytes);
  REQUIRE(region.ok());
  auto remote = RemoteRegion::Parse(region->descriptor());
  REQUIRE(remote.ok());
  auto peer = b->Connect(a->endpoint());
  REQUIRE(peer.ok());

  constexpr int kGetsPerThread = 300;
  constexpr int kWindow = 8;
  std::atomic<int> ok{0}, mismatches{0}, failures{0}, exhausted{0};
  auto worker = [&](uint64_t seed) {
    std::mt19937_64 rng(seed);
    struct Slot {
      std::vector<uint8_t> buf = std::vector<uint8_t>(256 << 10);
      uint64_t offset = 0, len = 0;
      Waiter* waiter = nullptr;
    };
    std::vector<Slot> slots(kWindow);
    std::vector<std::unique_ptr<Waiter>> waiters;
    auto check = [&](Slot& slot) {
      auto r = slot.waiter->Wait(30s);
      if (!r.has_value() || !r->ok()) {
        ++failures;
      } else if (!MatchesPattern(slot.buf.data(), slot.offset, slot.len)) {
        ++mismatches;
      } else {
        ++ok;
      }
      slot.waiter = nullptr;
    };
    for (int i = 0; i < kGetsPerThread; ++i) {
      Slot& slot = slots[i % kWindow];
      if (slot.waiter != nullptr) check(slot);
      slot.len = 1 + rng() % (256 << 10);
      slot.offset = rng() % (kBytes - slot.len + 1);
      waiters.push_back(std::make_unique<Waiter>());
      slot.waiter = waiters.back().get();
      for (;;) {
        Status s = b->Get(*peer, *remote, slot.offset, slot.buf.data(), slot.len, slot.waiter->Callback());
        if (s.ok()) break;
        REQUIRE(s.code() == StatusCode::kResourceExhausted);  // both threads share the bound of 16
        ++exhausted;
        std::this_thread::sleep_for(100us);
      }
    }
    for (Slot& slot : slots) {
      if (slot.waiter != nullptr) check(slot);
    }
  };
  std::thread t1(worker, 1), t2(worker, 2);
  t1.join();
  t2.join();
  CHECK(failures == 0);
  CHECK(mismatches == 0);
  CHECK(ok == 2 * kGetsPerThread);
  WARN("RESOURCE_EXHAUSTED retries: " << exhausted.load());
}

// A peer whose progress thread is stuck (its accept filter blocks until released): gets to it cannot complete,
// exactly like a peer behind a partition, but deterministic and in this process.
struct StalledPeer {
  std::mutex mu;
  std::condition_variable cv;
  bool blocked = false, release = false;
  std::unique_ptr<UcxTransport> intruder;
  std::thread connector;
  UcxTransport* stalled = nullptr;

  // Makes `t` stall: a third transport connects to it and its filter waits.
  void Stall(UcxTransport& t) {
    stalled = &t;
    t.set_accept_filter([this](const sockaddr&) {
      std::unique_lock<std::mutex> lock(mu);
      blocked = true;
      cv.notify_all();
      cv.wait(lock, [&] { return release; });
      return false;
    });
    intruder = MakeTransport(LoopbackOptions(false));
    connector = std::thread([this, ep = t.endpoint()] { (void)intruder->Connect(ep); });
    std::unique_lock<std::mutex> lock(mu);
    REQUIRE(cv.wait_for(lock, 10s, [&] { return blocked; }));
  }
  void Release() {
    {
      std::lock_guard<std::mutex> lock(mu);
      release = true;
    }
    cv.notify_all();
    if (connector.joinable()) connector.join();
    if (stalled != nullptr) stalled->set_accept_filter(nullptr);  // accepts again
    stalled = nullptr;
  }
  ~StalledPeer() { Release(); }
};

TEST_CASE("cluster transport (UCX): max_inflight_gets is enforced at once with RESOURCE_EXHAUSTED", "[integration][cluster]") {
  auto a = MakeTransport(LoopbackOptions(true));
  auto bopt = LoopbackOptions(false);
  bopt.max_inflight_gets = 4;
  bopt.get_deadline = 20s;  // the stall below must not end the gets
  auto b = MakeTransport(bopt);
  constexpr uint64_t kBytes = 1 << 20;
  auto pool = PatternBuffer(kBytes);
  auto region = a->Register(pool.data(), kBytes);
  REQUIRE(region.ok());
  auto remote = RemoteRegion::Parse(region->descriptor());
  REQUIRE(remote.ok());
  auto peer = b->Connect(a->endpoint());
  REQUIRE(peer.ok());

  StalledPeer stall;
  stall.Stall(*a);
  std::vector<std::vector<uint8_t>> bufs(4, std::vector<uint8_t>(65536));
  std::vector<Waiter> waiters(4);
  for (int i = 0; i < 4; ++i) {
    REQUIRE(b->Get(*peer, *remote, static_cast<uint64_t>(i) * 65536, bufs[i].data(), 65536, waiters[i].Callback()).ok());
  }
  std::vector<uint8_t> extra(16);
  int extra_calls = 0;
  CHECK(b->Get(*peer, *remote, 0, extra.data(), 16, [&](Status) { ++extra_calls; }).code() ==
        StatusCode::kResourceExhausted);
  CHECK(!waiters[0].Wait(200ms).has_value());  // still stuck
  stall.Release();
  for (int i = 0; i < 4; ++i) {
    auto r = waiters[i].Wait(10s);
    REQUIRE(r.has_value());
    CHECK(r->ok());
    CHECK(MatchesPattern(bufs[i].data(), static_cast<uint64_t>(i) * 65536, 65536));
  }
  CHECK(extra_calls == 0);
  // Room again.
  CHECK(GetSync(*b, *peer, *remote, 0, extra.data(), 16).ok());
  CHECK(a->stats().connections_rejected == 1);
}

TEST_CASE("cluster transport (UCX): a peer that stops answering ends every get with DEADLINE_EXCEEDED, then reconnects",
          "[integration][cluster]") {
  auto a = MakeTransport(LoopbackOptions(true));
  auto bopt = LoopbackOptions(false);
  bopt.get_deadline = 500ms;
  auto b = MakeTransport(bopt);
  constexpr uint64_t kBytes = 1 << 20;
  auto pool = PatternBuffer(kBytes);
  auto region = a->Register(pool.data(), kBytes);
  REQUIRE(region.ok());
  auto remote = RemoteRegion::Parse(region->descriptor());
  REQUIRE(remote.ok());
  auto peer = b->Connect(a->endpoint());
  REQUIRE(peer.ok());
  std::vector<uint8_t> dst(kBytes);
  REQUIRE(GetSync(*b, *peer, *remote, 0, dst.data(), kBytes).ok());

  {
    StalledPeer stall;
    stall.Stall(*a);
    std::vector<std::vector<uint8_t>> bufs(3, std::vector<uint8_t>(65536));
    std::vector<Waiter> waiters(3);
    const auto start = Clock::now();
    for (int i = 0; i < 3; ++i) REQUIRE(b->Get(*peer, *remote, 0, bufs[i].data(), 65536, waiters[i].Callback()).ok());
    for (int i = 0; i < 3; ++i) {
      auto r = waiters[i].Wait(10s);
      REQUIRE(r.has_value());  // never hangs
      INFO(r->ToString());
      CHECK(r->code() == StatusCode::kDeadlineExceeded);
      CHECK(waiters[i].calls() == 1);
    }
    const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
    CHECK(took >= 450ms);
    CHECK(b->stats().deadlines == 3);
    stall.Release();
  }
  // The next get reconnects and reads.
  std::fill(dst.begin(), dst.end(), 0);
  Status s = GetSync(*b, *peer, *remote, 4096, dst.data(), 65536);
  INFO(s.ToString());
  REQUIRE(s.ok());
  CHECK(MatchesPattern(dst.data(), 4096, 65536));
  CHECK(b->stats().reconnects >= 1);
}

TEST_CASE("cluster transport (UCX): destroying the serving transport mid-get ends every get, never hangs",
          "[integration][cluster]") {
  auto a = MakeTransport(LoopbackOptions(true));
  auto bopt = LoopbackOptions(false);
  bopt.get_deadline = 1000ms;
  auto b = MakeTransport(bopt);
  constexpr uint64_t kBytes = 4 << 20;
  auto pool = PatternBuffer(kBytes);
  auto region = a->Register(pool.data(), kBytes);
  REQUIRE(region.ok());
  auto remote = RemoteRegion::Parse(region->descriptor());
  REQUIRE(remote.ok());
  auto peer = b->Connect(a->endpoint());
  REQUIRE(peer.ok());

  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, failed{0}, hung{0}, bad{0};
  std::atomic<int64_t> worst_ms{0};
  std::thread puller([&] {
    std::vector<uint8_t> dst(1 << 20);
    while (!stop) {
      Waiter w;
      const auto start = Clock::now();
      Status s = b->Get(*peer, *remote, 0, dst.data(), dst.size(), w.Callback());
      if (!s.ok()) {
        ++failed;
        continue;
      }
      auto r = w.Wait(10s);
      const int64_t ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
      if (ms > worst_ms) worst_ms = ms;
      if (!r.has_value()) {
        ++hung;
        break;
      }
      if (r->ok()) {
        ++ok;
        if (!MatchesPattern(dst.data(), 0, dst.size())) ++bad;
      } else {
        // NOT_FOUND: served after the region was unregistered, before the transport went.
        CHECK((r->code() == StatusCode::kUnavailable || r->code() == StatusCode::kDeadlineExceeded ||
               r->code() == StatusCode::kNotFound));
        ++failed;
      }
    }
  });
  while (ok < 5) std::this_thread::sleep_for(1ms);
  region->Reset();
  a.reset();  // closes the listener and every connection; the pool's memory is still valid here
  const int failed_before = failed;
  const auto until = Clock::now() + 10s;
  while (failed < failed_before + 3 && Clock::now() < until) std::this_thread::sleep_for(5ms);
  stop = true;
  puller.join();
  CHECK(hung == 0);
  CHECK(bad == 0);
  CHECK(failed >= failed_before + 3);  // gets after A's end fail (reconnects are refused)
  CHECK(worst_ms < 5000);              // every get ended within the deadline plus slack
  WARN("gets ok " << ok.load() << ", failed " << failed.load() << ", worst " << worst_ms.load() << " ms");
}

TEST_CASE("cluster transport (UCX): the accept filter refuses a connection", "[integration][cluster]") {
  auto a = MakeTransport(LoopbackOptions(true));
  auto b = MakeTransport(LoopbackOptions(false));
  std::atomic<int> asked{0};
  std::string seen;
  std::mutex seen_mu;
  a->set_accept_filter([&](const sockaddr& addr) {
    ++asked;
    std::lock_guard<std::mutex> lock(seen_mu);
    seen = addr.sa_family == AF_INET ? "inet" : "other";
    return false;
  });
  constexpr uint64_t kBytes = 1 << 20;
  auto pool = PatternBuffer(kBytes);
  auto region = a->Register(pool.data(), kBytes);
  REQUIRE(region.ok());
  auto remote = RemoteRegion::Parse(region->descriptor());
  REQUIRE(remote.ok());

  auto peer = b->Connect(a->endpoint());
  REQUIRE_FALSE(peer.ok());
  INFO(peer.status().ToString());
  CHECK((peer.status().code() == StatusCode::kUnavailable || peer.status().code() == StatusCode::kDeadlineExceeded));
  CHECK(asked >= 1);
  CHECK(seen == "inet");
  CHECK(a->stats().connections_rejected >= 1);
  CHECK(a->stats().connections_accepted == 0);

  // Accepted once the filter says so.
  a->set_accept_filter([](const sockaddr& addr) {
    if (addr.sa_family != AF_INET) return false;
    const auto* in = reinterpret_cast<const sockaddr_in*>(&addr);
    return ntohl(in->sin_addr.s_addr) == INADDR_LOOPBACK;
  });
  auto peer2 = b->Connect(a->endpoint());
  REQUIRE(peer2.ok());
  std::vector<uint8_t> dst(4096);
  REQUIRE(GetSync(*b, *peer2, *remote, 8192, dst.data(), dst.size()).ok());
  CHECK(MatchesPattern(dst.data(), 8192, dst.size()));
}

TEST_CASE("cluster transport (UCX): options that would bypass the network or listen by accident are refused",
          "[integration][cluster]") {
  for (const char* tls : {"sm", "tcp,posix", "all", "sysv", "cma", "^rc", "tcp,,rc", ""}) {
    UcxOptions o = LoopbackOptions(false);
    o.transports = tls;
    auto t = UcxTransport::Create(o);
    INFO(tls);
    CHECK(t.status().code() == StatusCode::kInvalidArgument);
  }
  UcxOptions o = LoopbackOptions(false);
  o.listen_address = "localhost";  // numeric only
  CHECK(UcxTransport::Create(o).status().code() == StatusCode::kInvalidArgument);
  o = LoopbackOptions(false);
  o.max_inflight_gets = 0;
  CHECK(UcxTransport::Create(o).status().code() == StatusCode::kInvalidArgument);
  auto b = MakeTransport(LoopbackOptions(false));
  for (const char* ep : {"", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:99999", "host.example:1234", "[::1", "1.2.3.4:x"}) {
    INFO(ep);
    CHECK(b->Connect(ep).status().code() == StatusCode::kInvalidArgument);
  }
  // Nobody listens there: refused or timed out, in bounded time.
  const auto start = Clock::now();
  auto refused = b->Connect("127.0.0.1:1");
  CHECK_FALSE(refused.ok());
  CHECK(Clock::now() - start < 5s);
  // The default restriction works on a machine without RDMA ("rc" unavailable, tcp used).
  UcxOptions d;
  d.listen_address = "127.0.0.1";
  auto t = UcxTransport::Create(d);
  INFO(t.status().ToString());
  CHECK(t.ok());
}

TEST_CASE("cluster transport (UCX): the RDMA inventory is empty, not an error, without RDMA", "[integration][cluster]") {
  auto devices = ListRdmaDevices();
  struct stat st;
  if (stat("/sys/class/infiniband", &st) != 0) {
    CHECK(devices.empty());
  } else {
    WARN("RDMA devices: " << devices.size());
    for (const auto& d : devices) CHECK(d.find(':') != std::string::npos);
  }
}

// ---- peer authentication (a cluster secret) and Calls ---------------------------------------------------------

constexpr char kSecret[] = "0123456789abcdef-the-cluster-secret";

UcxOptions SecretOptions(bool listen, const std::string& node, const std::string& secret = kSecret) {
  UcxOptions o = LoopbackOptions(listen);
  o.secret = secret;
  o.node_id = node;
  return o;
}

// Waits (bounded) until `pred` holds: for counters the peer updates after the caller's own outcome.
template <typename Pred>
bool Eventually(Pred pred) {
  const auto until = Clock::now() + 10s;
  while (!pred()) {
    if (Clock::now() > until) return false;
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

// Method numbers of the test handler.
constexpr uint16_t kEcho = 1;         // replies the request
constexpr uint16_t kPatternOf = 2;    // replies PatternBuffer(decimal request)
constexpr uint16_t kFail = 3;         // replies NOT_FOUND "no block <request>"
constexpr uint16_t kLongError = 4;    // replies INTERNAL with a 5000-byte message
constexpr uint16_t kLater = 5;        // replies the request from another thread after 20 ms
constexpr uint16_t kNever = 6;        // keeps `reply` and never calls it (until the test does)
constexpr uint16_t kTooLarge = 7;     // replies kMaxCallBytes + 1 bytes

// A CallHandler serving the methods above; counts the calls it saw and from whom.
class TestHandler {
 public:
  ~TestHandler() {
    for (auto& t : threads_) t.join();
  }
  UcxTransport::CallHandler Handler() {
    return [this](const std::string& node, uint16_t method, std::string request,
                  std::function<void(Result<std::string>)> reply) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++calls_;
        last_node_ = node;
      }
      switch (method) {
        case kEcho: reply(std::move(request)); break;
        case kPatternOf: {
          auto v = PatternBuffer(std::stoull(request));
          reply(std::string(v.begin(), v.end()));
          break;
        }
        case kFail: reply(Status::NotFound("no block " + request)); break;
        case kLongError: reply(Status::Internal(std::string(5000, 'x'))); break;
        case kLater: {
          std::lock_guard<std::mutex> lock(mu_);
          threads_.emplace_back([request = std::move(request), reply = std::move(reply)]() mutable {
            std::this_thread::sleep_for(20ms);
            reply("later:" + request);
            reply(std::string("a second reply is ignored"));
          });
          break;
        }
        case kNever: {
          std::lock_guard<std::mutex> lock(mu_);
          kept_.push_back(std::move(reply));
          break;
        }
        case kTooLarge: reply(std::string(kMaxCallBytes + 1, 'z')); break;
        default: reply(Status::InvalidArgument("unknown method"));
      }
    };
  }
  int calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }
  std::string last_node() {
    std::lock_guard<std::mutex> lock(mu_);
    return last_node_;
  }
  // The replies kept by kNever, answered now (they must be dropped silently).
  void AnswerKept() {
    std::vector<std::function<void(Result<std::string>)>> kept;
    {
      std::lock_guard<std::mutex> lock(mu_);
      kept.swap(kept_);
    }
    for (auto& r : kept) r(std::string("too late"));
  }

 private:
  std::mutex mu_;
  int calls_ = 0;
  std::string last_node_;
  std::vector<std::thread> threads_;
  std::vector<std::function<void(Result<std::string>)>> kept_;
};

TEST_CASE("cluster transport (UCX): with the same secret the handshake passes both ways and proves the node ids",
          "[integration][cluster]") {
  auto a = MakeTransport(SecretOptions(true, "node-a"));
  auto b = MakeTransport(SecretOptions(true, "node-b"));
  TestHandler ha, hb;
  a->set_call_handler(ha.Handler());
  b->set_call_handler(hb.Handler());
  constexpr uint64_t kBytes = 1 << 20;
  auto pool = PatternBuffer(kBytes);
  auto region = a->Register(pool.data(), kBytes);
  REQUIRE(region.ok());
  auto remote = RemoteRegion::Parse(region->descriptor());
  REQUIRE(remote.ok());

  auto to_a = b->Connect(a->endpoint());
  INFO(to_a.status().ToString());
  REQUIRE(to_a.ok());
  CHECK(to_a->node_id == "node-a");
  auto to_b = a->Connect(b->endpoint());
  INFO(to_b.status().ToString());
  REQUIRE(to_b.ok());
  CHECK(to_b->node_id == "node-b");

  std::vector<uint8_t> dst(kBytes);
  REQUIRE(GetSync(*b, *to_a, *remote, 0, dst.data(), kBytes).ok());
  CHECK(MatchesPattern(dst.data(), 0, kBytes));
  auto r1 = b->CallSync(*to_a, kEcho, "hello a");
  REQUIRE(r1.ok());
  CHECK(*r1 == "hello a");
  CHECK(ha.last_node() == "node-b");  // the handler learns who called
  auto r2 = a->CallSync(*to_b, kEcho, "hello b");
  REQUIRE(r2.ok());
  CHECK(*r2 == "hello b");
  CHECK(hb.last_node() == "node-a");
  CHECK(a->stats().auth_failures == 0);
  CHECK(b->stats().auth_failures == 0);
  CHECK(a->stats().requests_refused == 0);
}

TEST_CASE("cluster transport (UCX): a wrong secret fails Connect with PERMISSION_DENIED and nothing is served",
          "[integration][cluster]") {
  auto a = MakeTransport(SecretOptions(true, "node-a"));
  auto b = MakeTransport(SecretOptions(false, "node-b", "another-secret-of-enough-bytes"));
  TestHandler ha;
  a->set_call_handler(ha.Handler());
  auto peer = b->Connect(a->endpoint());
  REQUIRE_FALSE(peer.ok());
  INFO(peer.status().ToString());
  CHECK(peer.status().code() == StatusCode::kPermissionDenied);
  CHECK(peer.status().message().find("did not prove the cluster secret") != std::string::npos);
  CHECK(peer.status().message().find(a->endpoint()) != std::string::npos);
  CHECK(b->stats().auth_failures == 1);
  CHECK(Eventually([&] { return a->stats().auth_failures == 1; }));
  CHECK(ha.calls() == 0);

  // A server without a secret refuses a client with one, and says why.
  auto c = MakeTransport(LoopbackOptions(true));
  auto to_c = b->Connect(c->endpoint());
  REQUIRE_FALSE(to_c.ok());
  INFO(to_c.status().ToString());
  CHECK(to_c.status().code() == StatusCode::kPermissionDenied);
  CHECK(to_c.status().message().find("no cluster secret") != std::string::npos);
}

TEST_CASE("cluster transport (UCX): a node that is not a member is refused with PERMISSION_DENIED",
          "[integration][cluster]") {
  auto aopt = SecretOptions(true, "node-a");
  std::atomic<int> asked{0};
  aopt.is_member = [&asked](std::string_view node) {
    ++asked;
    return node == "node-c";
  };
  auto a = MakeTransport(aopt);
  auto b = MakeTransport(SecretOptions(false, "node-b"));
  auto peer = b->Connect(a->endpoint());
  REQUIRE_FALSE(peer.ok());
  INFO(peer.status().ToString());
  CHECK(peer.status().code() == StatusCode::kPermissionDenied);
  CHECK(peer.status().message().find("not a member") != std::string::npos);
  CHECK(peer.status().message().find("node-b") != std::string::npos);
  CHECK(a->stats().auth_failures == 1);
  CHECK(asked == 1);

  auto c = MakeTransport(SecretOptions(false, "node-c"));
  auto ok = c->Connect(a->endpoint());
  INFO(ok.status().ToString());
  CHECK(ok.ok());
}

TEST_CASE("cluster transport (UCX): a client without the secret gets no bytes and no calls from a server with one",
          "[integration][cluster]") {
  auto a = MakeTransport(SecretOptions(true, "node-a"));
  auto b = MakeTransport(LoopbackOptions(false));  // no secret: no handshake
  TestHandler ha;
  a->set_call_handler(ha.Handler());
  constexpr uint64_t kBytes = 1 << 20;
  auto pool = PatternBuffer(kBytes);
  auto region = a->Register(pool.data(), kBytes);
  REQUIRE(region.ok());
  auto remote = RemoteRegion::Parse(region->descriptor());  // as if the descriptor had leaked
  REQUIRE(remote.ok());

  auto peer = b->Connect(a->endpoint());
  INFO(peer.status().ToString());
  REQUIRE(peer.ok());  // the transport connects; the server serves nothing on it
  CHECK(peer->node_id.empty());
  std::vector<uint8_t> dst(65536, 0xEE);
  Status s = GetSync(*b, *peer, *remote, 0, dst.data(), dst.size());
  INFO(s.ToString());
  CHECK(s.code() == StatusCode::kPermissionDenied);
  CHECK(std::all_of(dst.begin(), dst.end(), [](uint8_t v) { return v == 0xEE; }));
  auto r = b->CallSync(*peer, kEcho, "let me in");
  INFO(r.status().ToString());
  CHECK(r.status().code() == StatusCode::kPermissionDenied);
  CHECK(ha.calls() == 0);
  CHECK(a->stats().requests_refused == 2);
}

TEST_CASE("cluster transport (UCX): calls carry requests and replies byte-exact, small and large, and errors back",
          "[integration][cluster]") {
  auto a = MakeTransport(SecretOptions(true, "node-a"));
  auto b = MakeTransport(SecretOptions(false, "node-b"));
  TestHandler ha;
  a->set_call_handler(ha.Handler());
  auto peer = b->Connect(a->endpoint());
  REQUIRE(peer.ok());

  auto small = b->CallSync(*peer, kEcho, std::string("a\0b", 3));
  REQUIRE(small.ok());
  CHECK(*small == std::string("a\0b", 3));
  auto empty = b->CallSync(*peer, kEcho, "");
  REQUIRE(empty.ok());
  CHECK(empty->empty());

  // A 2 MiB reply (UCX's rendezvous path) and a 3 MiB request echoed.
  auto big = b->CallSync(*peer, kPatternOf, std::to_string(2 << 20));
  INFO(big.status().ToString());
  REQUIRE(big.ok());
  REQUIRE(big->size() == (2u << 20));
  CHECK(MatchesPattern(reinterpret_cast<const uint8_t*>(big->data()), 0, big->size()));
  auto pattern = PatternBuffer(3 << 20);
  const std::string request(pattern.begin(), pattern.end());
  auto echoed = b->CallSync(*peer, kEcho, request);
  REQUIRE(echoed.ok());
  CHECK(*echoed == request);
  auto at_limit = b->CallSync(*peer, kPatternOf, std::to_string(kMaxCallBytes));
  REQUIRE(at_limit.ok());
  CHECK(at_limit->size() == kMaxCallBytes);

  // The handler's error travels back: code and message (cut at 1 KiB).
  auto fail = b->CallSync(*peer, kFail, "42");
  CHECK(fail.status().code() == StatusCode::kNotFound);
  CHECK(fail.status().message() == "no block 42");
  auto long_error = b->CallSync(*peer, kLongError, "");
  CHECK(long_error.status().code() == StatusCode::kInternal);
  CHECK(long_error.status().message() == std::string(1024, 'x'));
  // A reply over the limit becomes RESOURCE_EXHAUSTED naming its size.
  auto too_large = b->CallSync(*peer, kTooLarge, "");
  INFO(too_large.status().ToString());
  CHECK(too_large.status().code() == StatusCode::kResourceExhausted);
  CHECK(too_large.status().message().find(std::to_string(kMaxCallBytes + 1)) != std::string::npos);

  // Refused at once: an oversized request, an invalid handle; `done` never runs.
  int calls = 0;
  auto never = [&calls](Result<std::string>) { ++calls; };
  CHECK(b->Call(*peer, kEcho, std::string(kMaxCallBytes + 1, 'q'), never).code() == StatusCode::kInvalidArgument);
  CHECK(b->Call(PeerHandle{}, kEcho, "x", never).code() == StatusCode::kNotFound);
  CHECK(calls == 0);
  CHECK(b->stats().calls_ok == 5);
  CHECK(b->stats().calls_failed == 3);
}

TEST_CASE("cluster transport (UCX): a handler that replies later from its own thread, calls from two threads",
          "[integration][cluster]") {
  auto a = MakeTransport(SecretOptions(true, "node-a"));
  auto b = MakeTransport(SecretOptions(false, "node-b"));
  TestHandler ha;
  a->set_call_handler(ha.Handler());
  auto peer = b->Connect(a->endpoint());
  REQUIRE(peer.ok());
  std::atomic<int> ok{0}, wrong{0};
  auto caller = [&](int t) {
    for (int i = 0; i < 8; ++i) {
      const std::string req = std::to_string(t) + "/" + std::to_string(i);
      auto r = b->CallSync(*peer, kLater, req);
      if (r.ok() && *r == "later:" + req) {
        ++ok;
      } else {
        ++wrong;
      }
    }
  };
  std::thread t1(caller, 1), t2(caller, 2);
  t1.join();
  t2.join();
  CHECK(ok == 16);
  CHECK(wrong == 0);

  // Async Calls complete on the progress thread, where CallSync is refused.
  std::mutex mu;
  std::condition_variable cv;
  std::optional<Status> nested;
  REQUIRE(b->Call(*peer, kEcho, "x", [&](Result<std::string> r) {
               REQUIRE(r.ok());
               auto inner = b->CallSync(*peer, kEcho, "y");
               std::lock_guard<std::mutex> lock(mu);
               nested = inner.status();
               cv.notify_all();
             }).ok());
  std::unique_lock<std::mutex> lock(mu);
  REQUIRE(cv.wait_for(lock, 10s, [&] { return nested.has_value(); }));
  CHECK(nested->code() == StatusCode::kFailedPrecondition);
}

TEST_CASE("cluster transport (UCX): a call whose handler never replies ends with DEADLINE_EXCEEDED, then reconnects",
          "[integration][cluster]") {
  auto a = MakeTransport(SecretOptions(true, "node-a"));
  auto bopt = SecretOptions(false, "node-b");
  bopt.get_deadline = 300ms;
  auto b = MakeTransport(bopt);
  TestHandler ha;
  a->set_call_handler(ha.Handler());
  auto peer = b->Connect(a->endpoint());
  REQUIRE(peer.ok());
  auto r = b->CallSync(*peer, kNever, "hello?");
  INFO(r.status().ToString());
  CHECK(r.status().code() == StatusCode::kDeadlineExceeded);
  CHECK(b->stats().deadlines == 1);
  // The endpoint was force-closed: the next call reconnects, redoes the handshake and works.
  auto again = b->CallSync(*peer, kEcho, "again");
  INFO(again.status().ToString());
  REQUIRE(again.ok());
  CHECK(*again == "again");
  CHECK(b->stats().reconnects >= 1);
  CHECK(a->stats().connections_accepted >= 2);
  CHECK(a->stats().requests_refused == 0);  // the new endpoint was authenticated before the call
  // The old reply for the closed endpoint is dropped; and after the transport's end too.
  ha.AnswerKept();
  CHECK(b->CallSync(*peer, kNever, "keep this one").status().code() == StatusCode::kDeadlineExceeded);
  a.reset();
  ha.AnswerKept();
}

TEST_CASE("cluster transport (UCX): a call to a peer without a handler is UNIMPLEMENTED", "[integration][cluster]") {
  auto a = MakeTransport(LoopbackOptions(true));
  auto b = MakeTransport(LoopbackOptions(false));
  auto peer = b->Connect(a->endpoint());
  REQUIRE(peer.ok());
  auto r = b->CallSync(*peer, kEcho, "anyone?");
  INFO(r.status().ToString());
  CHECK(r.status().code() == StatusCode::kUnimplemented);
  // Without secrets on either side calls are served (tests of the transport alone).
  TestHandler ha;
  a->set_call_handler(ha.Handler());
  auto ok = b->CallSync(*peer, kEcho, "now");
  REQUIRE(ok.ok());
  CHECK(*ok == "now");
  CHECK(ha.last_node().empty());
}

TEST_CASE("cluster transport (UCX): secrets and node ids are validated", "[integration][cluster]") {
  auto o = SecretOptions(true, "node-a", "too-short");
  CHECK(UcxTransport::Create(o).status().code() == StatusCode::kInvalidArgument);
  for (const std::string& bad : std::vector<std::string>{"", "has space", "semi;colon", std::string(65, 'n')}) {
    o = SecretOptions(true, bad);
    INFO(bad);
    CHECK(UcxTransport::Create(o).status().code() == StatusCode::kInvalidArgument);
  }
  o = SecretOptions(true, std::string(64, 'n'));
  CHECK(UcxTransport::Create(o).ok());
}

// A hand-made UCP client speaking the transport's active messages directly, to send what ours never sends: an
// attacker on a member's host without the secret. With `rma`, its context asks for UCP_FEATURE_RMA, so that it can
// try UCX's own (emulated, over tcp) one-sided gets.
class RawUcpClient {
 public:
  explicit RawUcpClient(const std::string& endpoint, bool rma = false) {
    ucp_config_t* config = nullptr;
    REQUIRE(ucp_config_read(nullptr, nullptr, &config) == UCS_OK);
    REQUIRE(ucp_config_modify(config, "TLS", "tcp") == UCS_OK);
    REQUIRE(ucp_config_modify(config, "NET_DEVICES", "lo") == UCS_OK);
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_AM | (rma ? UCP_FEATURE_RMA : 0);
    REQUIRE(ucp_init(&params, config, &context_) == UCS_OK);
    ucp_config_release(config);
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    REQUIRE(ucp_worker_create(context_, &wp, &worker_) == UCS_OK);
    for (unsigned id : {0x4b32u, 0x4b34u, 0x4b36u, 0x4b38u}) {
      ucp_am_handler_param_t hp{};
      hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
      hp.id = id;
      hp.cb = &RawUcpClient::OnReply;
      hp.arg = this;
      REQUIRE(ucp_worker_set_am_recv_handler(worker_, &hp) == UCS_OK);
    }
    const auto colon = endpoint.rfind(':');
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(std::stoi(endpoint.substr(colon + 1))));
    REQUIRE(inet_pton(AF_INET, endpoint.substr(0, colon).c_str(), &addr.sin_addr) == 1);
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
    ep.sockaddr.addrlen = sizeof addr;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    REQUIRE(ucp_ep_create(worker_, &ep, &ep_) == UCS_OK);
  }
  ~RawUcpClient() {
    for (void* r : pending_) ucp_request_free(r);  // released by UCX once the close ends them
    if (rkey_ != nullptr) ucp_rkey_destroy(rkey_);
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void* r = ucp_ep_close_nbx(ep_, &p);
    if (UCS_PTR_IS_PTR(r)) {
      while (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_worker_progress(worker_);
      ucp_request_free(r);
    }
    if (memh_ != nullptr) ucp_mem_unmap(context_, memh_);
    ucp_worker_destroy(worker_);
    ucp_cleanup(context_);
  }
  // UCX's own one-sided get (ucp_get_nbx) of [address, +len) into rma_buffer(), with an rkey this client packed for
  // its own memory (over tcp UCX emulates the get and the serving side never looks at the rkey). True when the get
  // completed OK within `timeout`; false when it failed or is still pending (then it is left to the endpoint's
  // close).
  bool RmaGet(uint64_t address, size_t len, std::chrono::milliseconds timeout) {
    if (rkey_ == nullptr) {
      rma_buffer_.assign(1 << 16, 0);
      ucp_mem_map_params_t mp{};
      mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
      mp.address = rma_buffer_.data();
      mp.length = rma_buffer_.size();
      REQUIRE(ucp_mem_map(context_, &mp, &memh_) == UCS_OK);
      void* packed = nullptr;
      size_t packed_len = 0;
      REQUIRE(ucp_rkey_pack(context_, memh_, &packed, &packed_len) == UCS_OK);
      // The endpoint must be wired up before an rkey is unpacked on it.
      const auto until = Clock::now() + 5s;
      while (Clock::now() < until && !Flushed()) ucp_worker_progress(worker_);
      const ucs_status_t s = ucp_ep_rkey_unpack(ep_, packed, &rkey_);
      ucp_rkey_buffer_release(packed);
      REQUIRE(s == UCS_OK);
    }
    REQUIRE(len <= rma_buffer_.size());
    std::fill(rma_buffer_.begin(), rma_buffer_.end(), 0xEE);
    ucp_request_param_t p{};
    void* r = ucp_get_nbx(ep_, rma_buffer_.data(), len, address, rkey_, &p);
    if (r == nullptr) return true;
    if (UCS_PTR_IS_ERR(r)) return false;
    const auto until = Clock::now() + timeout;
    while (ucp_request_check_status(r) == UCS_INPROGRESS && Clock::now() < until) ucp_worker_progress(worker_);
    const ucs_status_t st = ucp_request_check_status(r);
    if (st == UCS_INPROGRESS) {
      pending_.push_back(r);  // freed by the endpoint's close
      return false;
    }
    ucp_request_free(r);
    return st == UCS_OK;
  }
  const std::vector<uint8_t>& rma_buffer() const { return rma_buffer_; }
  // Sends `count` copies of one message as fast as UCX takes them (no reply expected), with or without the reply
  // flag; waits until they left.
  void Flood(unsigned am_id, const std::string& header, const std::string& data, int count, bool reply_flag) {
    std::vector<void*> sent;
    for (int i = 0; i < count; ++i) {
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = reply_flag ? UCP_AM_SEND_FLAG_REPLY : 0;
      void* r = ucp_am_send_nbx(ep_, am_id, header.data(), header.size(), data.data(), data.size(), &p);
      if (UCS_PTR_IS_PTR(r)) sent.push_back(r);
      ucp_worker_progress(worker_);
    }
    const auto until = Clock::now() + 10s;
    for (void* r : sent) {
      while (ucp_request_check_status(r) == UCS_INPROGRESS && Clock::now() < until) ucp_worker_progress(worker_);
      ucp_request_free(r);
    }
  }
  // Sends one message and waits until it left; then, when `reply_expected`, for a reply (its code, or -1).
  int64_t Send(unsigned am_id, const std::string& header, const std::string& data, bool reply_expected) {
    replies_ = 0;
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY;
    void* r = ucp_am_send_nbx(ep_, am_id, header.data(), header.size(), data.data(), data.size(), &p);
    if (UCS_PTR_IS_PTR(r)) {
      while (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_worker_progress(worker_);
      ucp_request_free(r);
    }
    const auto until = Clock::now() + (reply_expected ? 10s : 200ms);
    while (replies_ == 0 && Clock::now() < until) ucp_worker_progress(worker_);
    return replies_ == 0 ? -1 : last_code_;
  }
  const std::string& last_data() const { return last_data_; }

  // The header of the transport's messages: id, code, aux, a 16-byte token.
  static std::string Header(uint64_t id, uint32_t code, uint32_t aux) {
    std::string h(32, 'T');
    std::memcpy(h.data(), &id, 8);
    std::memcpy(h.data() + 8, &code, 4);
    std::memcpy(h.data() + 12, &aux, 4);
    return h;
  }

 private:
  static ucs_status_t OnReply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                              const ucp_am_recv_param_t* param) {
    auto* self = static_cast<RawUcpClient*>(arg);
    ++self->replies_;
    self->last_code_ = 0;
    if (header_length >= 12) {
      uint32_t code = 0;
      std::memcpy(&code, static_cast<const char*>(header) + 8, 4);
      self->last_code_ = code;
    }
    self->last_data_ = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ? std::string()
                                                                       : std::string(static_cast<char*>(data), length);
    return UCS_OK;
  }
  bool Flushed() {
    ucp_request_param_t p{};
    void* r = ucp_ep_flush_nbx(ep_, &p);
    if (r == nullptr) return true;
    if (UCS_PTR_IS_ERR(r)) return false;
    while (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_worker_progress(worker_);
    const bool ok = ucp_request_check_status(r) == UCS_OK;
    ucp_request_free(r);
    return ok;
  }
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
  ucp_mem_h memh_ = nullptr;
  ucp_rkey_h rkey_ = nullptr;
  std::vector<uint8_t> rma_buffer_;
  std::vector<void*> pending_;
  int replies_ = 0;
  int64_t last_code_ = -1;
  std::string last_data_;
};

TEST_CASE("cluster transport (UCX): malformed and out-of-order handshake messages are refused, never crash",
          "[integration][cluster]") {
  auto a = MakeTransport(SecretOptions(true, "node-a"));
  TestHandler ha;
  a->set_call_handler(ha.Handler());
  constexpr uint64_t kBytes = 1 << 16;
  auto pool = PatternBuffer(kBytes);
  auto region = a->Register(pool.data(), kBytes);
  REQUIRE(region.ok());
  const auto perm = static_cast<int64_t>(StatusCode::kPermissionDenied);
  const auto invalid = static_cast<int64_t>(StatusCode::kInvalidArgument);
  const auto precondition = static_cast<int64_t>(StatusCode::kFailedPrecondition);
  {
    RawUcpClient raw(a->endpoint());
    constexpr unsigned kHello = 0x4b33, kProof = 0x4b35, kCall = 0x4b37, kGet = 0x4b31;
    const std::string nonce(16, 'n');
    // Headers of the wrong size: dropped (counted), no reply.
    CHECK(raw.Send(kHello, "abc", std::string("\x01\x01x", 3) + nonce, false) == -1);
    CHECK(raw.Send(kCall, std::string(40, '\0'), "x", false) == -1);
    // Bodies of the wrong size or content: refused with INVALID_ARGUMENT.
    CHECK(raw.Send(kHello, RawUcpClient::Header(1, 0, 0), std::string("\x01\xc8", 2) + "short", true) == invalid);
    CHECK(raw.Send(kHello, RawUcpClient::Header(1, 0, 0), "", true) == invalid);
    CHECK(raw.Send(kHello, RawUcpClient::Header(1, 0, 0), std::string("\x01\x01x", 3) + nonce, true) == invalid);
    CHECK(raw.Send(kHello, RawUcpClient::Header(1, 0, 0), std::string("\x02\x03x y", 5) + nonce, true) == invalid);
    // A proof without a hello.
    CHECK(raw.Send(kProof, RawUcpClient::Header(2, 0, 0), std::string(32, 'm'), true) == precondition);
    // A valid hello, then a proof of the wrong size, then a wrong proof (the nonces serve one proof).
    CHECK(raw.Send(kHello, RawUcpClient::Header(3, 0, 0), std::string("\x02\x03raw", 5) + nonce, true) == 0);
    CHECK(raw.last_data().size() == 1 + 6 + 16 + 32);
    CHECK(raw.Send(kProof, RawUcpClient::Header(3, 0, 0), std::string(31, 'm'), true) == invalid);
    CHECK(raw.Send(kProof, RawUcpClient::Header(3, 0, 0), std::string(32, 'm'), true) == precondition);
    CHECK(raw.Send(kHello, RawUcpClient::Header(4, 0, 0), std::string("\x02\x03raw", 5) + nonce, true) ==
          precondition);  // one handshake per connection
    // Still unauthenticated: a call and a get are refused.
    CHECK(raw.Send(kCall, RawUcpClient::Header(5, 0, kEcho), "x", true) == perm);
    std::string get(40, '\0');  // id, address, length, token
    const uint64_t address = reinterpret_cast<uintptr_t>(pool.data()), length = 64;
    std::memcpy(get.data() + 8, &address, 8);
    std::memcpy(get.data() + 16, &length, 8);
    CHECK(raw.Send(kGet, get, "", true) == 2);  // the get reply's status: 2, not authenticated
    CHECK(raw.last_data().empty());             // no bytes
  }
  {
    // A wrong proof after a valid hello: PERMISSION_DENIED and an auth failure.
    RawUcpClient raw(a->endpoint());
    CHECK(raw.Send(0x4b33, RawUcpClient::Header(1, 0, 0), std::string("\x02\x03raw", 5) + std::string(16, 'n'),
                   true) == 0);
    CHECK(raw.Send(0x4b35, RawUcpClient::Header(1, 0, 0), std::string(32, 'm'), true) == perm);
    CHECK(raw.last_data().find("did not prove the cluster secret") != std::string::npos);
    CHECK(a->stats().auth_failures == 1);
  }
  CHECK(ha.calls() == 0);
  CHECK(a->stats().requests_refused >= 10);
  // The server still serves members.
  auto b = MakeTransport(SecretOptions(false, "node-b"));
  auto peer = b->Connect(a->endpoint());
  INFO(peer.status().ToString());
  REQUIRE(peer.ok());
  auto r = b->CallSync(*peer, kEcho, "fine");
  REQUIRE(r.ok());
  CHECK(*r == "fine");
}

// Issue 29 item 1: a process on a member's host without the secret. The serving node is flexkv-ucx-peer, another
// process, so that what used to kill it (a get at 0x1000 through UCX's emulated RMA) cannot take the test along.
TEST_CASE("cluster transport (UCX): a process without the secret reads nothing through UCX's own RMA get and "
          "crashes nothing, not even at 0x1000",
          "[integration][cluster]") {
  constexpr uint64_t kBytes = 1 << 16;
  auto server = testing::ChildProcess::Spawn({FLEXKV_TEST_UCX_PEER, "--secret", kSecret, "--node-id", "node-a",
                                              "127.0.0.1", "lo", "tcp", std::to_string(kBytes)});
  auto ep = server.WaitForLine("ENDPOINT ", 20s);
  INFO(server.Stderr());
  REQUIRE(ep.has_value());
  const std::string endpoint = ep->substr(9);
  auto desc = server.WaitForLine("DESC ", 5s);
  REQUIRE(desc.has_value());
  std::string descriptor;
  for (size_t i = 5; i + 1 < desc->size(); i += 2) {
    descriptor.push_back(static_cast<char>(std::stoi(desc->substr(i, 2), nullptr, 16)));
  }
  auto remote = RemoteRegion::Parse(descriptor);
  REQUIRE(remote.ok());
  {
    RawUcpClient attacker(endpoint, /*rma=*/true);
    // A registered address (what the old transport served byte-exact), then one that is mapped nowhere.
    const bool read = attacker.RmaGet(remote->base(), 4096, 1500ms);
    CHECK_FALSE(read);
    CHECK_FALSE(MatchesPattern(attacker.rma_buffer().data(), 0, 4096));
    CHECK_FALSE(attacker.RmaGet(0x1000, 4096, 1000ms));
  }
  // The node is alive and still serves a member byte-exact.
  CHECK_FALSE(server.Wait(200ms).has_value());
  auto member = MakeTransport(SecretOptions(false, "node-b"));
  auto peer = member->Connect(endpoint);
  INFO(peer.status().ToString());
  REQUIRE(peer.ok());
  std::vector<uint8_t> dst(4096);
  REQUIRE(GetSync(*member, *peer, *remote, 0, dst.data(), dst.size()).ok());
  CHECK(MatchesPattern(dst.data(), 0, dst.size()));
  CHECK_FALSE(server.Wait(10ms).has_value());
}

// Issue 29 item 1: replies were matched by a per-lane sequence id only, so a flood of forged replies made a node take
// the attacker's bytes for a block it was pulling, and its Call for the attacker's answer.
TEST_CASE("cluster transport (UCX): forged replies flooded at a node are dropped and counted, never taken for its "
          "gets or calls",
          "[integration][cluster]") {
  auto a = MakeTransport(SecretOptions(true, "node-a"));
  auto bopt = SecretOptions(true, "node-b");  // B listens, as every node does: the attacker reaches it there
  bopt.get_deadline = 3000ms;
  auto b = MakeTransport(bopt);
  TestHandler ha;
  a->set_call_handler(ha.Handler());
  constexpr uint64_t kBytes = 1 << 20;
  constexpr uint64_t kLen = 4096;
  auto pool = PatternBuffer(kBytes);
  auto region = a->Register(pool.data(), kBytes);
  REQUIRE(region.ok());
  auto remote = RemoteRegion::Parse(region->descriptor());
  REQUIRE(remote.ok());
  auto peer = b->Connect(a->endpoint());
  INFO(peer.status().ToString());
  REQUIRE(peer.ok());

  // A stops answering (its one lane stalls): B's gets and its call wait for replies while the attacker floods B.
  StalledPeer stall;
  stall.Stall(*a);
  constexpr int kGets = 8;
  std::vector<std::vector<uint8_t>> bufs(kGets, std::vector<uint8_t>(kLen, 0));
  std::vector<Waiter> waiters(kGets);
  for (int i = 0; i < kGets; ++i) {
    REQUIRE(b->Get(*peer, *remote, kLen * i, bufs[i].data(), kLen, waiters[i].Callback()).ok());
  }
  std::optional<Result<std::string>> call_result;
  std::mutex call_mu;
  REQUIRE(b->Call(*peer, kEcho, "the real request", [&](Result<std::string> r) {
    std::lock_guard<std::mutex> lock(call_mu);
    call_result = std::move(r);
  }).ok());
  {
    RawUcpClient attacker(b->endpoint());
    const std::string forged(kLen, '\xEE');
    for (uint64_t id = 1; id <= 32; ++id) {
      // Get replies: the old 16-byte header (id, status 0), and the current one with a guessed token.
      std::string old_get(16, '\0'), new_get(32, '\0');
      std::memcpy(old_get.data(), &id, 8);
      std::memcpy(new_get.data(), &id, 8);
      // Call replies: the old 16-byte header (id, code 0, aux), and the current one.
      std::string old_call = RawUcpClient::Header(id, 0, 0).substr(0, 16);
      std::string new_call = RawUcpClient::Header(id, 0, 0);
      for (bool reply_flag : {false, true}) {
        attacker.Flood(0x4b32, old_get, forged, 2, reply_flag);
        attacker.Flood(0x4b32, new_get, forged, 2, reply_flag);
        attacker.Flood(0x4b38, old_call, "forged answer", 2, reply_flag);
        attacker.Flood(0x4b38, new_call, "forged answer", 2, reply_flag);
      }
    }
    CHECK(Eventually([&] { return b->stats().replies_dropped >= 32 * 16; }));
  }
  stall.Release();
  for (int i = 0; i < kGets; ++i) {
    auto r = waiters[i].Wait(15s);
    REQUIRE(r.has_value());
    INFO("get " << i << ": " << r->ToString());
    if (r->ok()) {
      CHECK(MatchesPattern(bufs[i].data(), kLen * i, kLen));  // A's bytes, or nothing
    } else {
      CHECK(std::none_of(bufs[i].begin(), bufs[i].end(), [](uint8_t v) { return v == 0xEE; }));
    }
  }
  REQUIRE(Eventually([&] {
    std::lock_guard<std::mutex> lock(call_mu);
    return call_result.has_value();
  }));
  {
    std::lock_guard<std::mutex> lock(call_mu);
    INFO(call_result->status().ToString());
    if (call_result->ok()) CHECK(**call_result == "the real request");
  }
  CHECK(b->stats().replies_dropped >= 32 * 16);
  // B still reads from A byte-exact.
  std::vector<uint8_t> dst(kLen);
  Status s = GetSync(*b, *peer, *remote, kLen, dst.data(), kLen);
  INFO(s.ToString());
  REQUIRE(s.ok());
  CHECK(MatchesPattern(dst.data(), kLen, kLen));
}

// ---- across network namespaces ------------------------------------------------------------------------------

const char* const kIp = "/usr/sbin/ip";  // iproute2 (scripts/deps.sh)

// A namespace with one end of a veth pair; the other end stays in this (the test's) namespace. Removed at scope
// exit.
class NetnsLink {
 public:
  static std::optional<NetnsLink> Create(std::string* why) {
    NetnsLink l;
    const int id = static_cast<int>(getpid() % 200) + 20;
    l.ns_ = "fkvu" + std::to_string(getpid());
    l.host_if_ = "fkvuh" + std::to_string(getpid() % 100000);
    l.ns_if_ = "fkvun" + std::to_string(getpid() % 100000);
    l.host_ip_ = "10.231." + std::to_string(id) + ".1";
    l.ns_ip_ = "10.231." + std::to_string(id) + ".2";
    auto r = testing::RunCommand({kIp, "netns", "add", l.ns_});
    if (r.exit_code != 0) {
      *why = "ip netns add: " + r.output;
      return std::nullopt;
    }
    l.created_ = true;
    for (std::vector<std::string> cmd : std::vector<std::vector<std::string>>{
             {kIp, "link", "add", l.host_if_, "type", "veth", "peer", "name", l.ns_if_},
             {kIp, "link", "set", l.ns_if_, "netns", l.ns_},
             {kIp, "addr", "add", l.host_ip_ + "/24", "dev", l.host_if_},
             {kIp, "-n", l.ns_, "addr", "add", l.ns_ip_ + "/24", "dev", l.ns_if_},
             {kIp, "link", "set", l.host_if_, "up"},
             {kIp, "-n", l.ns_, "link", "set", l.ns_if_, "up"},
             {kIp, "-n", l.ns_, "link", "set", "lo", "up"}}) {
      auto c = testing::RunCommand(cmd);
      if (c.exit_code != 0) {
        *why = cmd[0] + " " + cmd[1] + " " + cmd[2] + ": " + c.output;
        return std::nullopt;
      }
    }
    return l;
  }
  NetnsLink(NetnsLink&& o) noexcept
      : ns_(o.ns_), host_if_(o.host_if_), ns_if_(o.ns_if_), host_ip_(o.host_ip_), ns_ip_(o.ns_ip_),
        created_(std::exchange(o.created_, false)) {}
  ~NetnsLink() {
    if (!created_) return;
    auto pids = testing::RunCommand({kIp, "netns", "pids", ns_});
    size_t pos = 0;
    while (pos < pids.output.size()) {
      size_t end = pids.output.find('\n', pos);
      if (end == std::string::npos) end = pids.output.size();
      const std::string p = pids.output.substr(pos, end - pos);
      if (!p.empty() && p.find_first_not_of("0123456789") == std::string::npos) kill(std::stoi(p), SIGKILL);
      pos = end + 1;
    }
    (void)testing::RunCommand({kIp, "netns", "del", ns_});  // destroys both ends of the veth
    (void)testing::RunCommand({kIp, "link", "del", host_if_});
  }
  void SetNsLink(bool up) {
    auto r = testing::RunCommand({kIp, "-n", ns_, "link", "set", ns_if_, up ? "up" : "down"});
    REQUIRE(r.exit_code == 0);
  }
  // Starts flexkv-ucx-peer in the namespace; returns {process, endpoint, descriptor}.
  struct Peer {
    std::optional<testing::ChildProcess> process;
    std::string endpoint;
    std::string descriptor;
  };
  Peer StartPeer(uint64_t bytes, const std::vector<std::string>& flags = {}) {
    Peer p;
    std::vector<std::string> argv = {kIp, "netns", "exec", ns_, FLEXKV_TEST_UCX_PEER};
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.insert(argv.end(), {ns_ip_, ns_if_, "tcp", std::to_string(bytes)});
    p.process.emplace(testing::ChildProcess::Spawn(argv));
    auto ep = p.process->WaitForLine("ENDPOINT ", 20s);
    INFO(p.process->Stderr());
    REQUIRE(ep.has_value());
    p.endpoint = ep->substr(9);
    auto desc = p.process->WaitForLine("DESC ", 5s);
    REQUIRE(desc.has_value());
    const std::string hex = desc->substr(5);
    for (size_t i = 0; i + 1 < hex.size(); i += 2) {
      p.descriptor.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
    }
    return p;
  }
  const std::string& host_if() const { return host_if_; }
  const std::string& ns_ip() const { return ns_ip_; }

 private:
  NetnsLink() = default;
  std::string ns_, host_if_, ns_if_, host_ip_, ns_ip_;
  bool created_ = false;
};

TEST_CASE("cluster transport (UCX): across a veth into another network namespace: reads, a killed peer, a partition",
          "[integration][cluster][netns]") {
  std::string why;
  auto link = NetnsLink::Create(&why);
  if (!link) {
    WARN("network namespaces unavailable, skipped: " << why);
    return;
  }
  UcxOptions o;
  o.transports = "tcp";
  o.devices = link->host_if();  // only the veth: the bytes must cross it
  o.get_deadline = 1000ms;
  auto b = MakeTransport(o);
  constexpr uint64_t kBytes = 4 << 20;

  SECTION("reads byte-exact, then the peer is killed mid-pull") {
    auto peer_proc = link->StartPeer(kBytes);
    REQUIRE(peer_proc.endpoint.rfind(link->ns_ip() + ":", 0) == 0);
    auto remote = RemoteRegion::Parse(peer_proc.descriptor);
    REQUIRE(remote.ok());
    auto peer = b->Connect(peer_proc.endpoint);
    INFO(peer.status().ToString());
    REQUIRE(peer.ok());
    std::vector<uint8_t> dst(kBytes);
    REQUIRE(GetSync(*b, *peer, *remote, 0, dst.data(), kBytes).ok());
    CHECK(MatchesPattern(dst.data(), 0, kBytes));
    REQUIRE(GetSync(*b, *peer, *remote, 12345, dst.data(), 100000).ok());
    CHECK(MatchesPattern(dst.data(), 12345, 100000));
    bool veth_lane = false;
    for (const auto& l : b->transports_in_use()) veth_lane |= l == "tcp/" + link->host_if();
    CHECK(veth_lane);

    // Kill -9 while 1 MiB gets run back to back.
    std::vector<Waiter> waiters(64);
    std::vector<int64_t> took_ms(64, -1);
    int posted = 0, ok = 0, failed = 0;
    for (int i = 0; i < 64; ++i) {
      if (i == 8) peer_proc.process->Signal(SIGKILL);
      const auto start = Clock::now();
      Status s = b->Get(*peer, *remote, 0, dst.data(), 1 << 20, waiters[i].Callback());
      if (!s.ok()) continue;
      ++posted;
      auto r = waiters[i].Wait(10s);
      REQUIRE(r.has_value());
      took_ms[i] = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
      CHECK(took_ms[i] < 5000);
      if (r->ok()) {
        ++ok;
      } else {
        ++failed;
        CHECK((r->code() == StatusCode::kUnavailable || r->code() == StatusCode::kDeadlineExceeded));
      }
    }
    CHECK(ok >= 8);
    CHECK(failed >= 1);
    WARN("after kill -9: " << ok << " ok, " << failed << " failed of " << posted);
  }

  SECTION("a peer process with a cluster secret: members read and call, a wrong secret is refused") {
    auto peer_proc = link->StartPeer(kBytes, {"--secret", kSecret, "--node-id", "peer-in-ns"});
    auto remote = RemoteRegion::Parse(peer_proc.descriptor);
    REQUIRE(remote.ok());
    auto bs = MakeTransport([&] {
      UcxOptions so = o;
      so.secret = kSecret;
      so.node_id = "test-node";
      return so;
    }());
    auto peer = bs->Connect(peer_proc.endpoint);
    INFO(peer.status().ToString());
    REQUIRE(peer.ok());
    CHECK(peer->node_id == "peer-in-ns");
    std::vector<uint8_t> dst(1 << 20);
    REQUIRE(GetSync(*bs, *peer, *remote, 77, dst.data(), dst.size()).ok());
    CHECK(MatchesPattern(dst.data(), 77, dst.size()));
    auto echoed = bs->CallSync(*peer, 1, "across the veth");
    REQUIRE(echoed.ok());
    CHECK(*echoed == "across the veth");

    auto wrong = MakeTransport([&] {
      UcxOptions wo = o;
      wo.secret = "not-the-cluster-secret!";
      wo.node_id = "intruder";
      return wo;
    }());
    auto refused = wrong->Connect(peer_proc.endpoint);
    INFO(refused.status().ToString());
    CHECK(refused.status().code() == StatusCode::kPermissionDenied);
    // Without a secret: connected, but no bytes.
    auto open_peer = b->Connect(peer_proc.endpoint);
    REQUIRE(open_peer.ok());
    std::fill(dst.begin(), dst.end(), 0xEE);
    CHECK(GetSync(*b, *open_peer, *remote, 0, dst.data(), 4096).code() == StatusCode::kPermissionDenied);
    CHECK(std::all_of(dst.begin(), dst.begin() + 4096, [](uint8_t v) { return v == 0xEE; }));
  }

  SECTION("a partition (the peer's veth down) ends the get with DEADLINE_EXCEEDED, and it reads again after") {
    auto peer_proc = link->StartPeer(kBytes);
    auto remote = RemoteRegion::Parse(peer_proc.descriptor);
    REQUIRE(remote.ok());
    auto peer = b->Connect(peer_proc.endpoint);
    REQUIRE(peer.ok());
    std::vector<uint8_t> dst(kBytes);
    REQUIRE(GetSync(*b, *peer, *remote, 0, dst.data(), 1 << 20).ok());

    link->SetNsLink(false);
    Waiter w;
    const auto start = Clock::now();
    REQUIRE(b->Get(*peer, *remote, 0, dst.data(), kBytes, w.Callback()).ok());
    auto r = w.Wait(10s);
    const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
    REQUIRE(r.has_value());
    INFO(r->ToString());
    CHECK(r->code() == StatusCode::kDeadlineExceeded);
    CHECK(took >= 900ms);
    CHECK(took < 5s);

    // Still partitioned: the reconnecting get ends too.
    Waiter w2;
    REQUIRE(b->Get(*peer, *remote, 0, dst.data(), 4096, w2.Callback()).ok());
    auto r2 = w2.Wait(10s);
    REQUIRE(r2.has_value());
    CHECK_FALSE(r2->ok());

    // Healed: a get reads again once the link is back (each attempt ends within its deadline; the link may take
    // a moment to carry traffic again, so a few attempts are allowed).
    link->SetNsLink(true);
    std::fill(dst.begin(), dst.end(), 0);
    Status s;
    int attempts = 0;
    const auto healed_by = Clock::now() + 15s;
    do {
      ++attempts;
      s = GetSync(*b, *peer, *remote, 999, dst.data(), 1 << 20);
      if (!s.ok()) std::this_thread::sleep_for(100ms);
    } while (!s.ok() && Clock::now() < healed_by);
    INFO(s.ToString() << " after " << attempts << " attempts");
    CHECK(s.ok());
    CHECK(MatchesPattern(dst.data(), 999, 1 << 20));
  }
}

// ---- lanes: several workers, each peer connected once per lane ---------------------------------------------------

TEST_CASE("cluster transport (UCX): gets and calls over 4 lanes all complete byte-exact, each lane authenticated",
          "[integration][cluster]") {
  auto aopt = SecretOptions(true, "node-a");
  aopt.lanes = 4;
  auto bopt = SecretOptions(false, "node-b");
  bopt.lanes = 4;
  bopt.max_inflight_gets = 32;
  bopt.get_deadline = 10s;  // a loaded 2-core machine: this test is about correctness, not liveness
  auto a = MakeTransport(aopt);
  auto b = MakeTransport(bopt);
  TestHandler ha;
  a->set_call_handler(ha.Handler());
  constexpr uint64_t kBytes = 8 << 20;
  auto pool = PatternBuffer(kBytes);
  auto region = a->Register(pool.data(), kBytes);
  REQUIRE(region.ok());
  auto remote = RemoteRegion::Parse(region->descriptor());
  REQUIRE(remote.ok());
  auto peer = b->Connect(a->endpoint());
  INFO(peer.status().ToString());
  REQUIRE(peer.ok());
  CHECK(peer->node_id == "node-a");
  // One connection and one handshake per lane; A's listener handed them to its 4 lanes.
  CHECK(Eventually([&] { return a->stats().connections_accepted == 4; }));
  CHECK(a->stats().auth_failures == 0);
  CHECK(b->transports_in_use()[0] == "config: TLS=tcp NET_DEVICES=lo LANES=4");

  // 2 threads x 200 gets of up to 256 KiB, 8 in flight each: every one ends OK with the right bytes.
  std::atomic<int> ok{0}, wrong{0}, failed{0};
  auto reader = [&](uint64_t seed) {
    std::mt19937_64 rng(seed);
    constexpr int kWindow = 8;
    std::vector<std::vector<uint8_t>> bufs(kWindow, std::vector<uint8_t>(256 << 10));
    std::vector<std::unique_ptr<Waiter>> waiters(kWindow);
    std::vector<std::pair<uint64_t, uint64_t>> ranges(kWindow);
    auto check = [&](int k) {
      auto r = waiters[k]->Wait(30s);
      if (!r.has_value() || !r->ok()) {
        ++failed;
      } else if (!MatchesPattern(bufs[k].data(), ranges[k].first, ranges[k].second)) {
        ++wrong;
      } else {
        ++ok;
      }
      waiters[k].reset();
    };
    for (int i = 0; i < 200; ++i) {
      const int k = i % kWindow;
      if (waiters[k]) check(k);
      const uint64_t len = 1 + rng() % (256 << 10);
      ranges[k] = {rng() % (kBytes - len + 1), len};
      std::fill(bufs[k].begin(), bufs[k].end(), 0);
      waiters[k] = std::make_unique<Waiter>();
      Status s;
      while ((s = b->Get(*peer, *remote, ranges[k].first, bufs[k].data(), len, waiters[k]->Callback())).code() ==
             StatusCode::kResourceExhausted) {
        std::this_thread::sleep_for(100us);
      }
      REQUIRE(s.ok());
    }
    for (int k = 0; k < kWindow; ++k) {
      if (waiters[k]) check(k);
    }
  };
  std::thread t1(reader, 11), t2(reader, 12);
  t1.join();
  t2.join();
  CHECK(failed == 0);
  CHECK(wrong == 0);
  CHECK(ok == 400);
  CHECK(b->stats().gets_ok == 400);
  // Calls go round the lanes too: each reaches the handler with the proven node id.
  for (int i = 0; i < 8; ++i) {
    auto r = b->CallSync(*peer, kEcho, "call " + std::to_string(i));
    INFO(r.status().ToString());
    REQUIRE(r.ok());
    CHECK(*r == "call " + std::to_string(i));
  }
  CHECK(ha.last_node() == "node-b");
  CHECK(a->stats().requests_refused == 0);
}

TEST_CASE("cluster transport (UCX): a lane whose serving thread stalls ends its gets at the deadline, the other lane "
          "goes on, then it reconnects",
          "[integration][cluster]") {
  auto aopt = LoopbackOptions(true);
  aopt.lanes = 2;
  auto bopt = LoopbackOptions(false);
  bopt.lanes = 2;
  bopt.get_deadline = 500ms;
  auto a = MakeTransport(aopt);
  auto b = MakeTransport(bopt);
  constexpr uint64_t kBytes = 1 << 20;
  auto pool = PatternBuffer(kBytes);
  auto region = a->Register(pool.data(), kBytes);
  REQUIRE(region.ok());
  auto remote = RemoteRegion::Parse(region->descriptor());
  REQUIRE(remote.ok());
  auto peer = b->Connect(a->endpoint());
  REQUIRE(peer.ok());
  REQUIRE(Eventually([&] { return a->stats().connections_accepted == 2; }));  // one on each of A's lanes
  std::vector<uint8_t> dst(kBytes);
  for (int i = 0; i < 2; ++i) REQUIRE(GetSync(*b, *peer, *remote, 0, dst.data(), kBytes).ok());  // both lanes

  {
    // A's lane 0 (its listener's) stalls: the B lane it serves gets nothing, the one A's lane 1 serves goes on.
    StalledPeer stall;
    stall.Stall(*a);
    constexpr int kGets = 8;
    std::vector<std::vector<uint8_t>> bufs(kGets, std::vector<uint8_t>(65536));
    std::vector<Waiter> waiters(kGets);
    for (int i = 0; i < kGets; ++i) {
      REQUIRE(b->Get(*peer, *remote, 4096 * i, bufs[i].data(), 65536, waiters[i].Callback()).ok());
    }
    int ok = 0, failed = 0, deadline_hit = 0;
    for (int i = 0; i < kGets; ++i) {
      auto r = waiters[i].Wait(10s);
      REQUIRE(r.has_value());  // never hangs
      INFO(r->ToString());
      CHECK(waiters[i].calls() == 1);
      if (r->ok()) {
        ++ok;
        CHECK(MatchesPattern(bufs[i].data(), 4096 * i, 65536));
      } else {
        // The first get on the stalled lane to pass its deadline closes the endpoint; the ones behind it (posted a
        // moment later, not yet at their own deadline on a loaded machine) end cancelled, naming the deadline.
        const bool own_deadline = r->code() == StatusCode::kDeadlineExceeded;
        const bool sibling_deadline = r->code() == StatusCode::kUnavailable &&
                                      r->message().find("another request to this peer hit its deadline") !=
                                          std::string::npos;
        CHECK((own_deadline || sibling_deadline));
        if (own_deadline) ++deadline_hit;
        ++failed;
      }
    }
    CHECK(ok == kGets / 2);  // the round robin alternates the two lanes
    CHECK(failed == kGets / 2);
    CHECK(deadline_hit >= 1);  // at least the first of them ended at its own deadline
    stall.Release();
  }
  // The stalled lane's endpoint was closed at the deadline; its next get reconnects and reads.
  for (int i = 0; i < 4; ++i) {
    std::fill(dst.begin(), dst.end(), 0);
    Status s = GetSync(*b, *peer, *remote, 4096, dst.data(), 65536);
    INFO(s.ToString());
    REQUIRE(s.ok());
    CHECK(MatchesPattern(dst.data(), 4096, 65536));
  }
  CHECK(b->stats().reconnects >= 1);
}

TEST_CASE("cluster transport (UCX): a lane count outside 1..16 is refused", "[integration][cluster]") {
  for (uint32_t lanes : {0u, kMaxLanes + 1}) {
    auto o = LoopbackOptions(false);
    o.lanes = lanes;
    auto t = UcxTransport::Create(o);
    REQUIRE_FALSE(t.ok());
    CHECK(t.status().code() == StatusCode::kInvalidArgument);
    CHECK(t.status().message().find("lanes") != std::string::npos);
  }
}

// The TCP connections on local port `port` in TIME_WAIT (/proc/net/tcp and tcp6: state 06).
int TimeWaitOnPort(uint16_t port) {
  int n = 0;
  for (const char* path : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    FILE* f = std::fopen(path, "r");
    if (f == nullptr) continue;
    char line[512];
    while (std::fgets(line, sizeof line, f) != nullptr) {
      char local[128] = {}, remote[128] = {};
      unsigned state = 0;
      if (std::sscanf(line, " %*d: %127s %127s %x", local, remote, &state) != 3) continue;
      const char* colon = std::strrchr(local, ':');
      if (colon != nullptr && std::strtoul(colon + 1, nullptr, 16) == port && state == 0x06) ++n;
    }
    std::fclose(f);
  }
  return n;
}

uint16_t PortOf(const std::string& endpoint) {
  return static_cast<uint16_t>(std::stoul(endpoint.substr(endpoint.rfind(':') + 1)));
}

// Issue 29 item 2: a daemon restarted after serving peers listens again at once. The connections it served leave its
// listen port in TIME_WAIT for a minute; without SO_REUSEADDR (UCX_CM_REUSEADDR) the bind failed meanwhile with
// "Device is busy".
TEST_CASE("cluster transport (UCX): a listener restarted on its port binds at once although the connections it served "
          "are in TIME_WAIT",
          "[integration][cluster]") {
  UcxOptions server = LoopbackOptions(true);
  server.lanes = 4;
  auto first = MakeTransport(server);
  const std::string endpoint = first->endpoint();
  const uint16_t port = PortOf(endpoint);
  constexpr uint64_t kBytes = 1 << 20;
  auto pool = PatternBuffer(kBytes);
  {
    auto region = first->Register(pool.data(), kBytes);
    REQUIRE(region.ok());
    auto remote = RemoteRegion::Parse(region->descriptor());
    REQUIRE(remote.ok());
    UcxOptions client_options = LoopbackOptions(false);
    client_options.lanes = 4;
    auto client = MakeTransport(client_options);
    auto peer = client->Connect(endpoint);
    INFO(peer.status().ToString());
    REQUIRE(peer.ok());
    std::vector<uint8_t> buf(4096);
    REQUIRE(GetSync(*client, *peer, *remote, 0, buf.data(), buf.size()).ok());
    region->Reset();
    first.reset();  // the server goes first: its ends of the connections wait in TIME_WAIT on its listen port
  }
  REQUIRE(Eventually([&] { return TimeWaitOnPort(port) > 0; }));  // what this test is about is there

  server.listen_port = port;
  auto again = UcxTransport::Create(server);
  INFO(again.status().ToString());
  REQUIRE(again.ok());
  CHECK((*again)->endpoint() == endpoint);
  // And it serves.
  auto region = (*again)->Register(pool.data(), kBytes);
  REQUIRE(region.ok());
  auto remote = RemoteRegion::Parse(region->descriptor());
  REQUIRE(remote.ok());
  auto client = MakeTransport(LoopbackOptions(false));
  auto peer = client->Connect(endpoint);
  REQUIRE(peer.ok());
  std::vector<uint8_t> buf(kBytes);
  REQUIRE(GetSync(*client, *peer, *remote, 0, buf.data(), buf.size()).ok());
  CHECK(MatchesPattern(buf.data(), 0, kBytes));
  // A second live listener on the same address and port is still refused.
  auto twice = UcxTransport::Create(server);
  CHECK(!twice.ok());
}

// Issue 29 item 2: UCX aborted a daemon (async.c: "Assertion handler->async == async") in its lanes' progress loop.
// Connections come and go on every lane at once here, as when peers restart: clients of 4 lanes connect, read and
// hang up, some of their lanes refused by the accept filter (the client then closes the other lanes while the server
// hands them to its lanes), in three threads. The server must live through it and still serve.
// Hidden ([.]: run it by name or with [ucx-churn]): UCX 1.13.1 itself still aborts here at times. Seen 2026-12-06 in
// one of two CI runs on the dev VM, after the lanes' hand-off fix: "tcp_sockcm_ep.c:416 Assertion ... failed" in
// uct_tcp_sockcm_ep_progress_send from __ucs_async_poll_missed inside ucp_worker_progress: an event the async
// context missed is replayed for a connection-manager endpoint that was rejected or closed meanwhile (fixed in later
// UCX, which purges missed events of a removed handler). A host that churns connections at the listener can so abort
// a node; docs/operations.md "Cluster threat model" says what that costs and what guards it.
TEST_CASE("cluster transport (UCX): connections made, refused and dropped on every lane at once never abort the server",
          "[integration][cluster][ucx-churn][.]") {
  UcxOptions server = LoopbackOptions(true);
  server.lanes = 4;
  auto a = MakeTransport(server);
  std::atomic<uint32_t> knocks{0};
  a->set_accept_filter([&knocks](const sockaddr&) { return knocks.fetch_add(1) % 7 != 3; });
  constexpr uint64_t kBytes = 1 << 20;
  auto pool = PatternBuffer(kBytes);
  auto region = a->Register(pool.data(), kBytes);
  REQUIRE(region.ok());
  auto remote = RemoteRegion::Parse(region->descriptor());
  REQUIRE(remote.ok());
  const std::string endpoint = a->endpoint();
  std::atomic<int> connected{0}, refused{0}, read_ok{0};
  auto churn = [&](int rounds) {
    UcxOptions o = LoopbackOptions(false);
    o.lanes = 4;
    o.get_deadline = 2s;
    for (int i = 0; i < rounds; ++i) {
      auto b = MakeTransport(o);
      auto peer = b->Connect(endpoint);
      if (!peer.ok()) {
        ++refused;
        continue;  // b goes with its lanes' endpoints half made
      }
      ++connected;
      std::vector<uint8_t> buf(64 << 10);
      if (GetSync(*b, *peer, *remote, 4096, buf.data(), buf.size()).ok() &&
          MatchesPattern(buf.data(), 4096, buf.size())) {
        ++read_ok;
      }
      if (i % 2 == 0) b->Disconnect(*peer);  // else it hangs up by going away
    }
  };
  std::thread t1(churn, 40), t2(churn, 40), t3(churn, 40);
  t1.join();
  t2.join();
  t3.join();
  INFO("connected " << connected << ", refused " << refused << ", reads " << read_ok);
  CHECK(connected + refused == 120);
  CHECK(connected > 0);
  CHECK(read_ok == connected);
  // Still serving.
  auto b = MakeTransport(LoopbackOptions(false));
  knocks = 0;
  auto peer = b->Connect(endpoint);
  REQUIRE(peer.ok());
  std::vector<uint8_t> buf(kBytes);
  REQUIRE(GetSync(*b, *peer, *remote, 0, buf.data(), buf.size()).ok());
  CHECK(MatchesPattern(buf.data(), 0, kBytes));
}

}  // namespace
}  // namespace flexkv::cluster
