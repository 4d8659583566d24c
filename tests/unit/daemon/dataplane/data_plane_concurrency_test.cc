// The data plane under several sessions at once, without gRPC: DataPlane, Cache and Lifecycle (host backend) built
// in-process, driven from several client threads through the client's real ring code (client/session_rings.*),
// with the poller and the copy workers running. This is the data-plane part of the ThreadSanitizer pass of
// scripts/test.sh (the integration tests go through gRPC, which Debian does not build with TSan). It asserts what
// the threads see (loaded bytes are the stored ones; errors only where expected) and that sessions torn down with
// requests in flight leak no pin, slot or request.
//
// Client and daemon map the rings and the KV memfd at different addresses, as two processes would, so TSan checks
// the daemon's own threads (poller, copy workers, EndSession, RegisterKv, StatsOf) against each other, not the
// ring protocol across the shared mapping.
#include <sys/mman.h>
#include <sys/socket.h>
#include <fcntl.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "client/session_rings.h"
#include "common/ring_layout.h"
#include "common/unique_fd.h"
#include "daemon/cache/cache.h"
#include "daemon/dataplane/data_plane.h"
#include "daemon/lifecycle/lifecycle.h"
#include "daemon/transfer/engine_memory_backends.h"
#include "daemon/transfer/host/host_backend.h"
#include "daemon/transfer/host/host_kv.h"
#include "flexkv/block_key.h"
#include "flexkv/client.h"

using namespace std::chrono_literals;
using flexkv::BlockKey;
using flexkv::OpResult;
using flexkv::Result;
using flexkv::RingOp;
using flexkv::StatusCode;
using flexkv::UniqueFd;

namespace {

constexpr char kNamespace[] = "dp-concurrency";
constexpr uint32_t kKvBlocks = 64;        // per session: each of its two client threads uses 32 of them
constexpr uint32_t kSharedChains = 8;     // chains every session stores and loads
constexpr auto kWait = 30s;               // per request; generous for TSan on 2 cores, never reached when healthy

// 2 layers x K/V x 16 tokens x 1 head x 32 dims x bf16: 4 KiB blocks.
flexkv::Geometry SmallGeometry() {
  flexkv::Geometry g;
  g.tokens_per_block = 16;
  g.num_layers = 2;
  g.kv_planes = 2;
  g.kv_heads_per_rank = 1;
  g.head_dim = 32;
  g.dtype_bytes = 2;
  g.tp_size = 1;
  return g;
}

uint64_t BlockBytes() { return SmallGeometry().host_block_bytes(); }

std::vector<BlockKey> Chain(uint64_t chain, uint32_t blocks) {
  std::vector<int32_t> tokens(size_t{blocks} * SmallGeometry().tokens_per_block);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(chain * 7919 + i);
  return flexkv::ComputeBlockKeys(kNamespace, tokens, SmallGeometry().tokens_per_block);
}

// The bytes of a block depend on its key only, so a session can check a block that any other one stored.
uint64_t Word(const BlockKey& k, uint64_t w) { return k.lo ^ (k.hi * (2 * w + 1)) ^ (w << 48); }
void FillBlock(uint8_t* p, const BlockKey& k) {
  for (uint64_t w = 0; w < BlockBytes() / 8; ++w) {
    const uint64_t v = Word(k, w);
    std::memcpy(p + 8 * w, &v, 8);
  }
}
bool BlockHolds(const uint8_t* p, const BlockKey& k) {
  for (uint64_t w = 0; w < BlockBytes() / 8; ++w) {
    uint64_t v;
    std::memcpy(&v, p + 8 * w, 8);
    if (v != Word(k, w)) return false;
  }
  return true;
}

std::vector<uint32_t> Ids(uint32_t first, uint32_t count) {
  std::vector<uint32_t> ids(count);
  for (uint32_t i = 0; i < count; ++i) ids[i] = first + i;
  return ids;
}

// What client threads saw go wrong; checked on the test's thread (Catch2's assertions are not thread-safe).
class Failures {
 public:
  void Add(std::string what) {
    std::lock_guard lock(mu_);
    if (list_.size() < 20) list_.push_back(std::move(what));
  }
  std::vector<std::string> list() {
    std::lock_guard lock(mu_);
    return list_;
  }

 private:
  std::mutex mu_;
  std::vector<std::string> list_;
};

// flexkvd's data plane and cache, in this process, on a pool file in a fresh directory.
class InProcessDaemon {
 public:
  explicit InProcessDaemon(uint64_t pool_bytes)
      : dir_(MakeDir()),
        cache_(pool_bytes, dir_ + "/pool"),
        backends_(HostOnly()),
        data_plane_(&lifecycle_, backends_.get(), Options()) {
    cache_.AddObserver(std::make_shared<flexkv::FunctionCacheObserver>([this](const flexkv::PoolRegion& pool) { return backends_->RegisterPool(pool); }, nullptr));
    REQUIRE(cache_.RecoverPool(/*discard=*/false).ok());
    REQUIRE(cache_.Admit(kNamespace, SmallGeometry()).ok());
    REQUIRE(data_plane_.Start().ok());
  }
  ~InProcessDaemon() {
    data_plane_.Stop();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  InProcessDaemon(const InProcessDaemon&) = delete;
  InProcessDaemon& operator=(const InProcessDaemon&) = delete;

  flexkv::DataPlane& data_plane() { return data_plane_; }
  flexkv::Cache& cache() { return cache_; }
  flexkv::Lifecycle& lifecycle() { return lifecycle_; }

 private:
  static flexkv::DataPlaneOptions Options() {
    flexkv::DataPlaneOptions o;
    o.submit_entries = 64;
    o.completion_entries = 64;
    o.arena_bytes = 64 << 10;
    return o;
  }
  static std::unique_ptr<flexkv::EngineMemoryBackends> HostOnly() {
    auto backends = std::make_unique<flexkv::EngineMemoryBackends>();
    backends->Add(std::make_unique<flexkv::HostBackend>(/*copy_threads=*/2));
    return backends;
  }
  static std::string MakeDir() {
    std::string tmpl = (std::filesystem::exists("/dev/shm") ? "/dev/shm" : "/tmp") + std::string("/flexkv-dp-XXXXXX");
    REQUIRE(mkdtemp(tmpl.data()) != nullptr);
    return tmpl;
  }

  const std::string dir_;
  flexkv::Cache cache_;
  flexkv::Lifecycle lifecycle_;
  std::unique_ptr<flexkv::EngineMemoryBackends> backends_;  // outlive the data plane, which waits for their copies
  flexkv::DataPlane data_plane_;  // last: stopped before the cache goes
};

// One engine's session: the rings the data plane opened, mapped by the client's SessionRings, a socketpair
// standing in for the session channel, and host KV buffers in a sealed memfd.
class TestSession {
 public:
  TestSession(flexkv::DataPlane& dp, flexkv::Cache* cache, uint64_t id) : dp_(dp), id_(id) {
    auto fds = dp.OpenSession(id, cache, SmallGeometry(), flexkv::SessionAccess{});
    REQUIRE(fds.ok());
    REQUIRE(fds->size() == 2);
    int sv[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    daemon_end_.reset(sv[0]);
    client_end_.reset(sv[1]);
    auto rings = flexkv::SessionRings::Map(std::move((*fds)[0]), std::move((*fds)[1]),
                                           flexkv::UniqueFd(fcntl(client_end_.get(), F_DUPFD_CLOEXEC, 0)));
    REQUIRE(rings.ok());
    rings_ = std::move(*rings);
    kv_bytes_ = flexkv::KvBytesRequired(SmallGeometry(), kKvBlocks);
    kv_memfd_.reset(memfd_create("flexkv-test-kv", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    REQUIRE(kv_memfd_);
    REQUIRE(ftruncate(kv_memfd_.get(), static_cast<off_t>(kv_bytes_)) == 0);
    REQUIRE(fallocate(kv_memfd_.get(), 0, 0, static_cast<off_t>(kv_bytes_)) == 0);  // the daemon refuses sparse KV
    REQUIRE(fcntl(kv_memfd_.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) == 0);
    void* p = mmap(nullptr, kv_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, kv_memfd_.get(), 0);
    REQUIRE(p != MAP_FAILED);
    kv_ = static_cast<uint8_t*>(p);
  }
  ~TestSession() {
    if (kv_ != nullptr) munmap(kv_, kv_bytes_);
  }
  TestSession(const TestSession&) = delete;
  TestSession& operator=(const TestSession&) = delete;

  uint64_t id() const { return id_; }
  // Offers the KV memfd to the daemon (BLOCK_FIRST: block b is contiguous at b * BlockBytes()).
  flexkv::Status RegisterKv() {
    UniqueFd dup(fcntl(kv_memfd_.get(), F_DUPFD_CLOEXEC, 0));
    auto r = dp_.RegisterKv(id_, {flexkv::HostKvMemory{std::move(dup), flexkv::KvLayout::kBlockFirst, kKvBlocks}});
    return r.status();
  }
  // What the session registry does when a session ends: the data plane lets it go, the channel closes.
  void End() {
    dp_.EndSession(id_);
    daemon_end_.reset();
  }
  uint8_t* kv_block(uint32_t b) { return kv_ + uint64_t{b} * BlockBytes(); }

  // Submits, retrying while the rings or the arena are full (other threads of the session hold them).
  Result<flexkv::Ticket> Submit(RingOp op, uint16_t flags, uint32_t count, std::span<const BlockKey> keys,
                                std::span<const uint32_t> ids, uint64_t handle) {
    const auto deadline = std::chrono::steady_clock::now() + kWait;
    for (;;) {
      auto t = rings_->Submit(op, flags, count, keys, ids, handle, flexkv::kRootParent);
      if (t.ok() || t.status().code() != StatusCode::kResourceExhausted ||
          std::chrono::steady_clock::now() > deadline) {
        return t;
      }
      std::this_thread::sleep_for(50us);
    }
  }
  Result<OpResult> Wait(flexkv::Ticket t) { return rings_->Wait(t, kWait); }
  Result<OpResult> Run(RingOp op, uint16_t flags, uint32_t count, std::span<const BlockKey> keys,
                       std::span<const uint32_t> ids, uint64_t handle) {
    auto t = Submit(op, flags, count, keys, ids, handle);
    if (!t.ok()) return t.status();
    return Wait(*t);
  }

 private:
  flexkv::DataPlane& dp_;
  const uint64_t id_;
  UniqueFd daemon_end_, client_end_;
  std::unique_ptr<flexkv::SessionRings> rings_;
  UniqueFd kv_memfd_;
  uint8_t* kv_ = nullptr;
  uint64_t kv_bytes_ = 0;
};

struct Tally {
  std::atomic<uint64_t> rounds{0}, stored_blocks{0}, loaded_blocks{0}, store_conflicts{0}, refused_as_expected{0};
  std::atomic<uint64_t> victims{0}, victim_ok{0}, victim_unavailable{0}, victim_inflight_at_end{0};
};

std::string Describe(const char* what, const Result<OpResult>& r) {
  if (!r.ok()) return std::string(what) + ": " + r.status().ToString();
  return std::string(what) + ": " + r->status.ToString() + " matched " + std::to_string(r->matched_blocks) + " done " +
         std::to_string(r->done_blocks);
}

// One client thread's rounds: Store a chain (its own, or one of the shared ones that other sessions store at the
// same time), Match it with pin, Load what matched into other blocks and compare the bytes, Release. Now and then
// a request that must be refused (a Load past its handle's blocks, a second Release).
void ClientRounds(TestSession& s, uint32_t thread_index, uint64_t seed, int rounds, Failures& failures, Tally& tally) {
  std::mt19937_64 rng(seed);
  const uint32_t src = thread_index * 32, dst = src + 8;  // 8 sources, then up to 9 destinations
  for (int r = 0; r < rounds; ++r) {
    const bool shared = rng() % 3 == 0;
    const uint64_t chain = shared ? rng() % kSharedChains : 1000 + seed * 1000 + static_cast<uint64_t>(r);
    const uint32_t n = 1 + static_cast<uint32_t>(rng() % 8);
    const std::vector<BlockKey> keys = Chain(chain, n);
    for (uint32_t i = 0; i < n; ++i) FillBlock(s.kv_block(src + i), keys[i]);
    const std::vector<uint32_t> src_ids = Ids(src, n);

    auto stored = s.Run(RingOp::kStore, 0, n, keys, src_ids, 0);
    if (!stored.ok() || (!stored->status.ok() && stored->status.code() != StatusCode::kAborted)) {
      failures.Add(Describe("Store", stored));
      continue;
    }
    if (stored->status.ok() && stored->matched_blocks + stored->done_blocks != n) {
      failures.Add(Describe("Store covered fewer blocks than asked", stored));
    }
    if (stored->status.code() == StatusCode::kAborted) tally.store_conflicts++;  // another session is storing it
    tally.stored_blocks += stored->done_blocks;

    auto matched = s.Run(RingOp::kMatch, flexkv::kMatchFlagPin, n, keys, {}, 0);
    if (!matched.ok() || !matched->status.ok() || matched->matched_blocks > n ||
        (matched->matched_blocks > 0) != (matched->match_handle != 0)) {
      failures.Add(Describe("Match", matched));
      continue;
    }
    const uint32_t m = matched->matched_blocks;
    const uint64_t handle = matched->match_handle;
    if (m == 0) continue;  // evicted meanwhile (small pool), or a shared chain still being stored elsewhere
    for (uint32_t i = 0; i < m; ++i) std::memset(s.kv_block(dst + i), 0, BlockBytes());
    const std::vector<uint32_t> dst_ids = Ids(dst, m + 1);
    if (r % 5 == 0) {
      auto past = s.Run(RingOp::kLoad, 0, m + 1, {}, dst_ids, handle);
      if (!past.ok() || past->status.code() != StatusCode::kOutOfRange) {
        failures.Add(Describe("Load past the handle's blocks", past));
      } else {
        tally.refused_as_expected++;
      }
    }
    auto loaded = s.Run(RingOp::kLoad, 0, m, {}, std::span(dst_ids).first(m), handle);
    if (!loaded.ok() || !loaded->status.ok() || loaded->done_blocks != m) {
      failures.Add(Describe("Load", loaded));
    } else {
      for (uint32_t i = 0; i < m; ++i) {
        if (!BlockHolds(s.kv_block(dst + i), keys[i])) {
          failures.Add("loaded block " + std::to_string(i) + " of chain " + std::to_string(chain) +
                       " differs from what was stored");
        }
      }
      tally.loaded_blocks += m;
    }
    auto released = s.Run(RingOp::kRelease, 0, 0, {}, {}, handle);
    if (!released.ok() || !released->status.ok()) failures.Add(Describe("Release", released));
    if (r % 7 == 0) {
      auto again = s.Run(RingOp::kRelease, 0, 0, {}, {}, handle);
      if (!again.ok() || again->status.code() != StatusCode::kNotFound) {
        failures.Add(Describe("second Release", again));
      } else {
        tally.refused_as_expected++;
      }
    }
    tally.rounds++;
  }
}

// A session that registers its KV buffers while its first requests already run, pins a chain and never releases
// it, then keeps Loads, Stores and pinning Matches in flight until the test ends the session under it. Every
// request ends: OK with the right bytes, the refusal that fits, or UNAVAILABLE once the session is gone.
struct VictimSignals {
  std::atomic<bool> pinned{false};   // set by the victim: it holds its pin, requests follow
  std::atomic<bool> gave_up{false};  // set by the victim: it failed (recorded in Failures) and stopped
  std::atomic<bool> ended{false};    // set by the test just before it ends the session
};

void VictimBurst(TestSession& s, uint64_t seed, VictimSignals& signals, Failures& failures, Tally& tally) {
  const std::vector<BlockKey> own = Chain(50000 + seed, 4);
  for (uint32_t i = 0; i < 4; ++i) FillBlock(s.kv_block(i), own[i]);
  const std::vector<uint32_t> src = Ids(0, 4);
  auto give_up = [&](std::string what) {
    failures.Add(std::move(what));
    signals.gave_up = true;
  };
  // Store the chain (FAILED_PRECONDITION until RegisterKv, racing on the test's thread, lands) and pin it. The pool
  // is small and busy: other sessions may evict the chain between the two, so again until all 4 blocks are pinned.
  const auto deadline = std::chrono::steady_clock::now() + kWait;
  std::optional<OpResult> held;
  while (!held) {
    if (std::chrono::steady_clock::now() > deadline) return give_up("victim: its chain was not stored and pinned in time");
    auto stored = s.Run(RingOp::kStore, 0, 4, own, src, 0);
    if (!stored.ok() || (!stored->status.ok() && stored->status.code() != StatusCode::kFailedPrecondition)) {
      return give_up(Describe("victim Store", stored));
    }
    if (!stored->status.ok()) {
      std::this_thread::sleep_for(100us);
      continue;
    }
    auto matched = s.Run(RingOp::kMatch, flexkv::kMatchFlagPin, 4, own, {}, 0);
    if (!matched.ok() || !matched->status.ok()) return give_up(Describe("victim Match", matched));
    if (matched->matched_blocks == 4) {
      held = *matched;
    } else if (matched->matched_blocks > 0) {
      auto released = s.Run(RingOp::kRelease, 0, 0, {}, {}, matched->match_handle);
      if (!released.ok() || !released->status.ok()) return give_up(Describe("victim Release", released));
    }
  }
  signals.pinned = true;  // the handle is never released: ending the session must
  std::mt19937_64 rng(seed);
  uint64_t chain = 60000 + seed * 1000;
  while (!signals.ended.load()) {
    struct InFlight {
      RingOp op;
      flexkv::Ticket ticket;
      uint32_t dst;  // Load: its first destination block
    };
    std::vector<InFlight> tickets;
    std::vector<std::vector<BlockKey>> keep;  // keys of the Stores in this burst
    uint32_t loads = 0;
    for (int i = 0; i < 24; ++i) {
      RingOp op = std::array{RingOp::kLoad, RingOp::kStore, RingOp::kMatch}[rng() % 3];
      // Loads in flight together write distinct blocks (8 + 4k): overlapping ones would race in the engine's memory,
      // which is the engine's business, not the daemon's.
      if (op == RingOp::kLoad && 8 + 4 * (loads + 1) > kKvBlocks) op = RingOp::kMatch;
      const uint32_t dst = op == RingOp::kLoad ? 8 + 4 * loads++ : 0;
      if (op == RingOp::kStore) keep.push_back(Chain(chain++, 4));  // never loaded: its bytes do not matter
      const std::vector<uint32_t> dst_ids = Ids(dst, 4);
      Result<flexkv::Ticket> t =
          op == RingOp::kLoad    ? s.Submit(op, 0, 4, {}, dst_ids, held->match_handle)
          : op == RingOp::kStore ? s.Submit(op, 0, 4, keep.back(), src, 0)
                                 : s.Submit(op, flexkv::kMatchFlagPin, 4, own, {}, 0);  // pins only the end releases
      if (!t.ok()) {
        failures.Add("victim submit: " + t.status().ToString());
        return;
      }
      tickets.push_back({op, *t, dst});
    }
    for (const auto& [op, t, dst] : tickets) {
      auto r = s.Wait(t);
      if (!r.ok()) {
        // Its completion will never come: the client sees the session channel close.
        if (r.status().code() == StatusCode::kUnavailable && signals.ended.load()) {
          tally.victim_unavailable++;
        } else {
          failures.Add("victim wait: " + r.status().ToString());
        }
        continue;
      }
      // Its pins only the end releases: once they reach the session's pin cap, a Match with pin is refused.
      const bool capped = op == RingOp::kMatch && r->status.code() == StatusCode::kResourceExhausted &&
                          r->status.message().starts_with("session pin cap");
      const bool fine = r->status.ok() || capped ||
                        (op == RingOp::kLoad && r->status.code() == StatusCode::kNotFound && signals.ended.load());
      if (!fine) failures.Add(Describe("victim request", r));
      if (r->status.ok()) tally.victim_ok++;
      if (op == RingOp::kLoad && r->status.ok()) {
        for (uint32_t i = 0; i < 4; ++i) {
          if (!BlockHolds(s.kv_block(dst + i), own[i])) failures.Add("victim loaded a block that differs");
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("data plane: sessions store, match, load and release concurrently, torn-down sessions leak nothing",
          "[unit][dataplane]") {
  InProcessDaemon daemon(1u << 20);  // 256 blocks: evictions happen, pinned blocks stay
  flexkv::DataPlane& dp = daemon.data_plane();
  Failures failures;
  Tally tally;

  constexpr int kSessions = 3, kThreadsPerSession = 2, kRounds = 400, kMinVictims = 8;
  std::vector<std::unique_ptr<TestSession>> sessions;
  for (int i = 0; i < kSessions; ++i) {
    sessions.push_back(std::make_unique<TestSession>(dp, &daemon.cache(), 1 + i));
    REQUIRE(sessions.back()->RegisterKv().ok());
  }
  // Registering twice is refused, also while other sessions work.
  CHECK(sessions[0]->RegisterKv().code() == StatusCode::kAlreadyExists);

  std::vector<std::thread> clients;
  std::atomic<int> clients_done{0};
  for (int i = 0; i < kSessions; ++i) {
    for (int t = 0; t < kThreadsPerSession; ++t) {
      const uint64_t seed = static_cast<uint64_t>(1 + i * kThreadsPerSession + t);
      clients.emplace_back([&, i, t, seed] {
        ClientRounds(*sessions[i], t, seed, kRounds, failures, tally);
        clients_done++;
      });
    }
  }

  // Meanwhile, sessions come, register, work and are ended under load, for as long as the clients run.
  for (int v = 0; v < kMinVictims || clients_done.load() < kSessions * kThreadsPerSession; ++v) {
    TestSession victim(dp, &daemon.cache(), 100 + v);
    VictimSignals signals;
    std::thread burst(VictimBurst, std::ref(victim), static_cast<uint64_t>(v), std::ref(signals), std::ref(failures),
                      std::ref(tally));
    std::this_thread::sleep_for(std::chrono::microseconds(200 * v));
    const flexkv::Status registered = victim.RegisterKv();
    CHECK(registered.ok());
    const auto deadline = std::chrono::steady_clock::now() + kWait;
    while (!signals.pinned.load() && !signals.gave_up.load() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(100us);
    }
    // End it as soon as requests are in flight (or when it is not getting anywhere).
    flexkv::DataPlane::SessionStats at_end;
    for (;;) {
      // What GetStatus, ListSessions, a metrics scrape and the watchdog read while the data plane works.
      (void)daemon.cache().GetStats();
      (void)dp.StatsOf(sessions[v % kSessions]->id());
      (void)dp.errors();
      (void)dp.last_turn_ms();
      at_end = dp.StatsOf(victim.id());
      if (at_end.inflight_requests > 0 || signals.gave_up.load() || std::chrono::steady_clock::now() >= deadline) break;
      std::this_thread::yield();
    }
    signals.ended = true;
    victim.End();
    burst.join();
    tally.victims++;
    if (at_end.inflight_requests > 0) tally.victim_inflight_at_end++;
    CHECK(at_end.pinned_blocks >= 4);  // the handle it never released, at least
  }
  for (auto& c : clients) c.join();

  for (const std::string& f : failures.list()) FAIL_CHECK(f);
  INFO(tally.rounds << " rounds, " << tally.stored_blocks << " blocks stored, " << tally.loaded_blocks
                    << " loaded and checked, " << tally.store_conflicts << " store conflicts, "
                    << tally.refused_as_expected << " refusals as expected; victims: " << tally.victims << ", "
                    << tally.victim_inflight_at_end << " ended with requests in flight, " << tally.victim_ok
                    << " requests OK, " << tally.victim_unavailable << " UNAVAILABLE after the end");
  CHECK(tally.rounds > 0);
  CHECK(tally.loaded_blocks > 0);
  CHECK(tally.refused_as_expected > 0);
  CHECK(tally.victim_inflight_at_end > 0);
  CHECK(dp.errors() >= tally.refused_as_expected);

  // The live sessions hold nothing; once every session has ended and every copy finished, neither does the cache.
  for (auto& s : sessions) {
    const auto stats = dp.StatsOf(s->id());
    CHECK(stats.pinned_blocks == 0);
    CHECK(stats.inflight_requests == 0);
    s->End();
  }
  const auto deadline = std::chrono::steady_clock::now() + kWait;
  while ((daemon.lifecycle().inflight() != 0 || daemon.cache().GetStats().pinned != 0) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  CHECK(daemon.lifecycle().inflight() == 0);
  const flexkv::Cache::Stats cache = daemon.cache().GetStats();
  CHECK(cache.pinned == 0);
  CHECK(cache.used == cache.blocks);  // no reservation of an aborted store left behind
  CHECK(cache.blocks <= cache.capacity);
  CHECK(cache.blocks > 0);
}
