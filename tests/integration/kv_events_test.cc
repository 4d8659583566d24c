// The KV event stream against a real flexkvd (issue 20, acceptance 1): a subscriber that disconnects and
// resubscribes ends with exactly the daemon's keys (checked against status and a full match sweep) under a store and
// evict load, across a kill -9 and restart of the daemon; a subscriber that does not keep up is cut off with the
// reason while the stores go on.
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/vfs.h>
#include <sys/wait.h>

#include <catch2/catch.hpp>
#include <atomic>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "flexkv/client.h"
#include "flexkv/kv_events.h"
#include "flexkv/v1/control.grpc.pb.h"
#include "tests/support/daemon_checks.h"
#include "tests/support/process.h"

using namespace std::chrono_literals;
using flexkv::BlockKey;
using flexkv::KvBlockEvent;
using flexkv::StatusCode;
using flexkv::testing::DaemonUnderTest;
using flexkv::testing::SsdTierOf;
using flexkv::testing::WaitSsdIdle;

namespace {

constexpr size_t kChainBlocks = 6;

flexkv::AttachOptions SmallAttach(const std::string& name) {
  flexkv::AttachOptions o;
  o.client_name = name;
  o.model_namespace = "llama3-8b";
  o.geometry = flexkv::Llama3_8B();
  o.geometry.num_layers = 2;  // 128 KiB blocks
  return o;
}

std::vector<BlockKey> Chain(int seed, size_t blocks = kChainBlocks) {
  std::vector<int32_t> tokens(blocks * 16);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = seed * 100000 + static_cast<int32_t>(i);
  return flexkv::ComputeBlockKeys("llama3-8b", tokens, 16);
}

// Attached: the gRPC Match of the sweep is a session's call.
std::unique_ptr<flexkv::Client> ConnectTo(const std::string& socket) {
  auto c = flexkv::Client::Connect({socket, 5000ms, 10000ms});
  REQUIRE(c.ok());
  auto attached = (*c)->Attach(SmallAttach("observer"));
  INFO(attached.status().ToString());
  REQUIRE(attached.ok());
  return std::move(*c);
}

// Stores chains [first, last) with one attached client; counts the stores that did not end OK.
struct StoreLoad {
  StoreLoad(const std::string& socket, int first, int last) {
    thread = std::thread([this, socket, first, last] {
      auto c = flexkv::Client::Connect({socket, 5000ms, 10000ms});
      if (!c.ok() || !(*c)->Attach(SmallAttach("loader")).ok() ||
          !(*c)->CreateHostKv(flexkv::KvLayout::kBlockFirst, 16).ok()) {
        failed.fetch_add(1);
        return;
      }
      const std::vector<uint32_t> ids = {0, 1, 2, 3, 4, 5};
      for (int seed = first; seed < last; ++seed) {
        const std::vector<BlockKey> keys = Chain(seed);
        auto t = (*c)->Store(flexkv::BlockKeyChain(keys), ids);
        if (!t.ok()) {
          failed.fetch_add(1);
          continue;
        }
        auto r = (*c)->Wait(*t, 10s);
        if (!r.ok() || !r->status.ok()) failed.fetch_add(1);
        stored.fetch_add(1);
      }
    });
  }
  void Join() { thread.join(); }
  std::thread thread;
  std::atomic<int> failed{0}, stored{0};
};

struct KeyHash {
  size_t operator()(const BlockKey& k) const { return static_cast<size_t>(k.lo ^ (k.hi * 0x9e3779b97f4a7c15ull)); }
};

// What a router keeps: the keys per tier, rebuilt from the snapshot at every (re)subscription.
struct View {
  uint64_t instance = 0;
  uint64_t position = 0;
  uint64_t last_seq = 0;  // the last event seq applied (checks that they increase)
  bool in_snapshot = false;
  std::unordered_set<BlockKey, KeyHash> dram, ssd;
  uint64_t batches = 0;
  uint64_t ssd_stored = 0, ssd_removed = 0;  // events (not the snapshot)

  void Apply(const flexkv::KvEventBatch& b) {
    ++batches;
    if (b.instance_id != instance) {  // a restart: nothing of the old view holds
      instance = b.instance_id;
      dram.clear();
      ssd.clear();
    }
    if (b.snapshot && !in_snapshot) {  // a (re)subscription: the snapshot replaces the view
      in_snapshot = true;
      dram.clear();
      ssd.clear();
    }
    for (const KvBlockEvent& e : b.events) {
      auto& set = e.tier == KvBlockEvent::Tier::kSsd ? ssd : dram;
      if (!b.snapshot) {
        REQUIRE(e.seq > last_seq);
        last_seq = e.seq;
      }
      if (!b.snapshot && e.tier == KvBlockEvent::Tier::kSsd) {
        (e.kind == KvBlockEvent::Kind::kStored ? ssd_stored : ssd_removed) += 1;
      }
      switch (e.kind) {
        case KvBlockEvent::Kind::kStored: set.insert(e.key); break;
        case KvBlockEvent::Kind::kRemoved: set.erase(e.key); break;
        case KvBlockEvent::Kind::kCleared: set.clear(); break;
      }
    }
    if (b.snapshot_end) {
      in_snapshot = false;
      last_seq = b.snapshot_seq;
    }
    position = b.position;
  }
};

std::unique_ptr<flexkv::KvEventSubscription> Subscribe(const std::string& socket, uint32_t max_batch = 0) {
  flexkv::KvSubscribeOptions o;
  o.max_batch_events = max_batch;
  auto s = flexkv::KvEventSubscription::Open({socket, 10000ms, 10000ms}, o);
  INFO(s.status().ToString());
  REQUIRE(s.ok());
  return std::move(*s);
}

// Reads until the view has every event up to the daemon's last one now (no more load is running).
void CatchUp(flexkv::Client& c, flexkv::KvEventSubscription& sub, View* view) {
  auto st = c.GetStatus();
  REQUIRE(st.ok());
  const uint64_t target = st->kv_events.last_seq;
  while (view->batches == 0 || view->in_snapshot || view->position < target) {
    auto b = sub.Next();
    INFO(b.status().ToString());
    REQUIRE(b.ok());
    view->Apply(*b);
  }
}

// The view against the daemon: the DRAM block count of its status, and a match sweep over every chain stored: the
// first h keys of a chain (its cached prefix) are in the view and no other of its keys is.
void CheckExact(flexkv::Client& c, const View& view, int chains) {
  auto st = c.GetStatus();
  REQUIRE(st.ok());
  CHECK(st->pool.unverified_blocks == 0);
  CHECK(view.dram.size() == st->index_blocks);
  size_t matched = 0;
  for (int seed = 0; seed < chains; ++seed) {
    const std::vector<BlockKey> keys = Chain(seed);
    auto h = c.MatchViaControl(keys);
    INFO(h.status().ToString());
    REQUIRE(h.ok());
    for (size_t i = 0; i < keys.size(); ++i) {
      INFO("chain " << seed << " block " << i << " of the " << *h << " cached");
      CHECK((view.dram.count(keys[i]) == 1) == (i < *h));
    }
    matched += *h;
  }
  CHECK(matched == view.dram.size());  // nothing in the view that is not in a stored chain's cached prefix
  CHECK(view.ssd.empty());             // no SSD tier here
}

void WaitVerified(flexkv::Client& c) {
  for (int i = 0; i < 3000; ++i) {
    auto st = c.GetStatus();
    REQUIRE(st.ok());
    if (st->pool.unverified_blocks == 0) return;
    std::this_thread::sleep_for(10ms);
  }
  FAIL("the restored blocks were not verified");
}

}  // namespace

TEST_CASE("kv events: a resubscribing subscriber ends with exactly the daemon's keys across evictions and a kill -9",
          "[integration]") {
  const std::string dir = std::filesystem::temp_directory_path() /
                          ("flexkv-kvevents-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const std::vector<std::string> args = {"--pool-size", "32MiB"};  // 256 blocks: the load evicts
  int chains = 0;
  View view;
  uint64_t first_instance = 0;
  {
    DaemonUnderTest d(args, dir);
    REQUIRE(d.WaitReady());
    auto c = ConnectTo(d.socket());
    auto sub = Subscribe(d.socket(), 64);
    // Phase 1: stores and evictions while the subscriber reads; halfway it drops its subscription, the load goes
    // on, and it subscribes again (a gap it cannot replay: the snapshot rebuilds its view).
    {
      StoreLoad load(d.socket(), 0, 120);
      while (load.stored.load() < 40) {
        auto b = sub->Next();
        REQUIRE(b.ok());
        view.Apply(*b);
      }
      sub.reset();
      while (load.stored.load() < 70) std::this_thread::sleep_for(1ms);
      sub = Subscribe(d.socket(), 64);
      while (load.stored.load() < 120) {
        auto b = sub->Next();
        REQUIRE(b.ok());
        view.Apply(*b);
      }
      load.Join();
      CHECK(load.failed.load() == 0);
    }
    chains = 120;
    CatchUp(*c, *sub, &view);
    first_instance = view.instance;
    CHECK(view.dram.size() > 100);
    CheckExact(*c, view, chains);
    auto st = c->GetStatus();
    REQUIRE(st.ok());
    CHECK(st->counters.at("evicted_blocks") > 0);

    // kill -9 with the subscriber attached: its stream ends with UNAVAILABLE.
    StoreLoad more(d.socket(), 120, 160);
    while (more.stored.load() < 10) std::this_thread::sleep_for(1ms);
    d.process().Signal(SIGKILL);
    REQUIRE(d.process().Wait(10s).has_value());
    more.Join();
    chains = 160;
    for (;;) {
      auto b = sub->Next();
      if (!b.ok()) {
        CHECK(b.status().code() == StatusCode::kUnavailable);
        break;
      }
      view.Apply(*b);
    }
    c.reset();
  }
  // The restarted daemon re-attaches the pool; the subscriber sees a new instance and rebuilds from the snapshot
  // (the restored blocks come in it, or as events once verified) while a new load stores and evicts.
  DaemonUnderTest restarted(args, dir);
  REQUIRE(restarted.WaitReady());
  auto c = ConnectTo(restarted.socket());
  auto sub = Subscribe(restarted.socket(), 64);
  // Restored blocks are neither matchable nor evictable until verified: a store into a full pool waits for that.
  WaitVerified(*c);
  {
    StoreLoad load(restarted.socket(), 160, 240);
    while (load.stored.load() < 80) {
      auto b = sub->Next();
      REQUIRE(b.ok());
      view.Apply(*b);
    }
    load.Join();
    CHECK(load.failed.load() == 0);
  }
  chains = 240;
  WaitVerified(*c);
  CatchUp(*c, *sub, &view);
  CHECK(view.instance != first_instance);
  CheckExact(*c, view, chains);

  // One more resubscription, with no load: the snapshot alone is the same view.
  View fresh;
  sub = Subscribe(restarted.socket(), 0);
  CatchUp(*c, *sub, &fresh);
  CHECK(fresh.dram == view.dram);
  sub.reset();
  c.reset();
  std::filesystem::remove_all(dir);
}

TEST_CASE("kv events: a subscriber that falls behind is cut off with the reason while the stores go on",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "32MiB", "--kv-events-buffer", "256"});
  REQUIRE(d.WaitReady());
  auto c = ConnectTo(d.socket());
  auto slow = Subscribe(d.socket(), 16);
  View view;
  for (;;) {  // the (empty) snapshot
    auto b = slow->Next();
    REQUIRE(b.ok());
    view.Apply(*b);
    if (b->snapshot_end) break;
  }
  // Stores and evictions far beyond the buffer and what the transport holds for a reader that does not read.
  StoreLoad load(d.socket(), 0, 2500);
  load.Join();
  CHECK(load.failed.load() == 0);
  CHECK(load.stored.load() == 2500);
  flexkv::Status ended;
  for (int i = 0; i < 100000; ++i) {
    auto b = slow->Next();
    if (!b.ok()) {
      ended = b.status();
      break;
    }
  }
  INFO(ended.ToString());
  CHECK(ended.code() == StatusCode::kResourceExhausted);
  CHECK_THAT(ended.message(), Catch::Contains("fell behind by"));
  CHECK_THAT(ended.message(), Catch::Contains("resubscribe"));
  auto st = c->GetStatus();
  REQUIRE(st.ok());
  CHECK(st->kv_events.cut_off >= 1);
  CHECK(st->kv_events.buffer_events == 256);
  // Resubscribing works, and gives the daemon's keys.
  View again;
  auto sub = Subscribe(d.socket(), 0);
  CatchUp(*c, *sub, &again);
  CHECK(again.dram.size() == st->index_blocks);
}

TEST_CASE("kv events: bad subscription and flag values are refused with the reason", "[integration]") {
  SECTION("max_batch_events above the limit") {
    DaemonUnderTest d({"--pool-size", "32MiB"});
    REQUIRE(d.WaitReady());
    flexkv::KvSubscribeOptions o;
    o.max_batch_events = 1u << 20;
    auto s = flexkv::KvEventSubscription::Open({d.socket(), 5000ms, 5000ms}, o);
    REQUIRE_FALSE(s.ok());
    CHECK(s.status().code() == StatusCode::kInvalidArgument);
  }
  SECTION("a ZMQ endpoint that is not one") {
    auto r = flexkv::testing::RunCommand({flexkv::testing::FlexkvdPath(), "--kv-events-zmq", "bogus:/x", "--socket",
                                          "/tmp/flexkv-kvevents-never.sock"});
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.output, Catch::Contains("--kv-events-zmq"));
    CHECK_THAT(r.output, Catch::Contains("tcp://"));
  }
}

namespace {


}  // namespace

TEST_CASE("kv events: SSD write-backs and evictions reach the subscriber, and a restart's SSD blocks are in the snapshot",
          "[integration]") {
  struct statfs fs {};
  REQUIRE(statfs("/var/tmp", &fs) == 0);
  if (static_cast<uint64_t>(fs.f_type) == 0x01021994) {
    WARN("/var/tmp is tmpfs: the SSD tier needs a disk filesystem; skipped");
    return;
  }
  char tmpl[] = "/var/tmp/flexkv-kvevents-ssd-XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  const std::string dir = tmpl;
  std::filesystem::permissions(dir, std::filesystem::perms(0755));
  std::filesystem::create_directories(dir + "/ssd");
  // 64 DRAM blocks, about 120 SSD slots, every stored block written: both tiers store and evict.
  const std::vector<std::string> args = {"--pool-size", "8MiB", "--ssd-path", dir + "/ssd", "--ssd-size", "16MiB",
                                         "--ssd-write-policy", "all"};
  {
    DaemonUnderTest d(args, dir);
    REQUIRE(d.WaitReady());
    auto c = ConnectTo(d.socket());
    auto sub = Subscribe(d.socket(), 64);
    View view;
    {
      StoreLoad load(d.socket(), 0, 100);  // 600 blocks
      load.Join();
      CHECK(load.failed.load() == 0);
    }
    WaitSsdIdle(*c);
    CatchUp(*c, *sub, &view);
    auto st = c->GetStatus();
    REQUIRE(st.ok());
    const auto* t = SsdTierOf(*st);
    REQUIRE(t != nullptr);
    CHECK(view.ssd.size() == t->used_blocks);
    CHECK(view.dram.size() == st->index_blocks);
    // Every write-back the tier counts is one stored event, every block it lost (overwritten to make room, dropped)
    // one removed event.
    CHECK(view.ssd_stored > 0);
    CHECK(view.ssd_stored == t->counters.at("written_back_blocks"));
    CHECK(view.ssd_removed == t->counters.at("evicted_blocks") + t->counters.at("data_loss_blocks"));
    d.process().Signal(SIGKILL);
    REQUIRE(d.process().Wait(10s).has_value());
  }
  DaemonUnderTest restarted(args, dir);
  REQUIRE(restarted.WaitReady());
  auto c = ConnectTo(restarted.socket());
  WaitSsdIdle(*c);
  View view;
  auto sub = Subscribe(restarted.socket(), 0);
  CatchUp(*c, *sub, &view);
  auto st = c->GetStatus();
  REQUIRE(st.ok());
  const auto* t = SsdTierOf(*st);
  REQUIRE(t != nullptr);
  CHECK(t->used_blocks > 0);
  CHECK(view.ssd.size() == t->used_blocks);
  CHECK(view.dram.size() == st->index_blocks);
  sub.reset();
  c.reset();
  std::filesystem::remove_all(dir);
}

TEST_CASE("kv events: SIGTERM ends a subscription with UNAVAILABLE and the daemon still stops cleanly",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "32MiB"});
  REQUIRE(d.WaitReady());
  auto sub = Subscribe(d.socket(), 0);
  auto first = sub->Next();
  REQUIRE(first.ok());
  CHECK(first->snapshot_end);
  d.process().Signal(SIGTERM);
  flexkv::Status ended;
  for (int i = 0; i < 1000; ++i) {  // an idle stream sends a batch a second until the daemon stops
    auto b = sub->Next();
    if (!b.ok()) {
      ended = b.status();
      break;
    }
  }
  INFO(ended.ToString());
  CHECK(ended.code() == StatusCode::kUnavailable);
  auto status = d.process().Wait(30s);
  REQUIRE(status.has_value());
  CHECK(WIFEXITED(*status));
  CHECK(WEXITSTATUS(*status) == 0);
}

namespace {

// 4 KiB blocks (one layer, one KV head of 64): a pool of tens of thousands of blocks in little memory.
flexkv::AttachOptions TinyAttach(const std::string& name) {
  flexkv::AttachOptions o = SmallAttach(name);
  o.geometry.num_layers = 1;
  o.geometry.kv_heads_per_rank = 1;
  o.geometry.head_dim = 64;
  return o;
}

std::unique_ptr<flexkv::Client> TinyClient(const std::string& socket, const std::string& name) {
  auto c = flexkv::Client::Connect({socket, 5000ms, 10000ms});
  REQUIRE(c.ok());
  auto attached = (*c)->Attach(TinyAttach(name));
  INFO(attached.status().ToString());
  REQUIRE(attached.ok());
  REQUIRE((*c)->CreateHostKv(flexkv::KvLayout::kBlockFirst, 16).ok());
  return std::move(*c);
}

void StoreChain(flexkv::Client& c, int seed) {
  static const std::vector<uint32_t> ids = {0, 1, 2, 3, 4, 5};
  auto t = c.Store(flexkv::BlockKeyChain(Chain(seed)), ids);
  REQUIRE(t.ok());
  auto r = c.Wait(*t, 10s);
  REQUIRE(r.ok());
  INFO(r->status.ToString());
  REQUIRE(r->status.ok());
}

}  // namespace

// Regression (issue 20 review): the handler sent the snapshot without reading the ring meanwhile, so a snapshot that
// took longer to send than the ring lasts under the store load overran it: the subscriber was cut off right after the
// snapshot, resubscribed, got a snapshot as long, and so on forever. Here the stores go on in step with the
// subscriber's reading (one store of 6 blocks per 12 snapshot keys read: the events come at half the rate it reads,
// whatever the machine's speed), so that the 32 000-key snapshot brings far more events than the 4096-event ring holds,
// while the events of what the subscriber can read between two of the handler's writes (the transport's window: a
// few thousand keys) fit the ring.
TEST_CASE("kv events: a subscriber that keeps up finishes its snapshot under a steady store load with a small buffer",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "192MiB", "--kv-events-buffer", "4096"});  // 49 152 blocks of 4 KiB
  REQUIRE(d.WaitReady());
  auto c = TinyClient(d.socket(), "steady");
  int seed = 0;
  for (; seed < 5334; ++seed) StoreChain(*c, seed);  // 32 004 blocks
  View view;
  int resubscribed = 0;
  std::string why;
  bool finished = false;
  while (!finished && resubscribed < 3) {
    auto sub = Subscribe(d.socket(), 64);
    uint64_t snapshot_keys = 0;
    uint64_t target = 0;  // once the snapshot is in: the daemon's last seq then, which the stream must reach
    while (!finished) {
      auto b = sub->Next();
      if (!b.ok()) {
        INFO(b.status().ToString());
        REQUIRE(b.status().code() == StatusCode::kResourceExhausted);
        why = b.status().ToString();
        ++resubscribed;
        break;
      }
      view.Apply(*b);
      if (b->snapshot) {
        const uint64_t due = snapshot_keys / 12;
        snapshot_keys += b->events.size();
        for (uint64_t i = due; i < snapshot_keys / 12; ++i) StoreChain(*c, seed++);
      }
      if (b->snapshot_end) {
        auto st = c->GetStatus();
        REQUIRE(st.ok());
        target = st->kv_events.last_seq;
        CHECK(target > 2 * 4096);  // the snapshot did bring more events than the ring holds
      }
      finished = target != 0 && !view.in_snapshot && view.position >= target;
    }
  }
  INFO("resubscribed " << resubscribed << " times; last: " << why);
  REQUIRE(finished);
  CHECK(resubscribed == 0);
  // The view is the daemon's: its block count and a fresh subscription's snapshot.
  auto st = c->GetStatus();
  REQUIRE(st.ok());
  CHECK(view.dram.size() == st->index_blocks);
  View fresh;
  auto again = Subscribe(d.socket(), 0);
  CatchUp(*c, *again, &fresh);
  CHECK(fresh.dram == view.dram);
}

// Regression (issue 20 review): the watchdog started only after the snapshot, so a subscriber that stopped reading in
// the middle of it pinned a handler thread (and the snapshot's memory) for as long as it stayed connected. A raw gRPC
// client with a small window subscribes and never reads: the daemon ends the call on its own.
TEST_CASE("kv events: a subscriber that never reads its snapshot is cut off and its handler ends", "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  // Blocks of a namespace with a long name: each snapshot event is about 300 bytes, so the first batch of 1024
  // (300 KiB) is more than the 64 KiB window lets through.
  const std::string ns(200, 'n');
  {
    auto loader = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
    REQUIRE(loader.ok());
    flexkv::AttachOptions o = SmallAttach("long-namespace");
    o.model_namespace = ns;
    REQUIRE((*loader)->Attach(o).ok());
    REQUIRE((*loader)->CreateHostKv(flexkv::KvLayout::kBlockFirst, 16).ok());
    const std::vector<uint32_t> ids = {0, 1, 2, 3, 4, 5};
    for (int seed = 0; seed < 60; ++seed) {  // 360 blocks of the 512 the pool holds
      std::vector<int32_t> tokens(kChainBlocks * 16);
      for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = seed * 100000 + static_cast<int32_t>(i);
      auto t = (*loader)->Store(flexkv::BlockKeyChain(flexkv::ComputeBlockKeys(ns, tokens, 16)), ids);
      REQUIRE(t.ok());
      auto r = (*loader)->Wait(*t, 10s);
      REQUIRE(r.ok());
      REQUIRE(r->status.ok());
    }
    REQUIRE((*loader)->Detach().ok());
  }
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 10);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto channel = grpc::CreateCustomChannel("unix:" + d.socket(), grpc::InsecureChannelCredentials(), args);
  auto stub = flexkv::v1::Control::NewStub(channel);
  grpc::ClientContext ctx;
  flexkv::v1::SubscribeKvEventsRequest req;
  auto stalled = stub->SubscribeKvEvents(&ctx, req);  // never read
  auto observer = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
  REQUIRE(observer.ok());
  const auto subscribers = [&] {
    auto st = (*observer)->GetStatus();
    REQUIRE(st.ok());
    return st->kv_events.subscribers;
  };
  bool seen = false, gone = false;
  for (int i = 0; i < 600 && !gone; ++i) {  // the watchdog's 10 s and then some; 60 s at most
    const uint32_t n = subscribers();
    seen = seen || n == 1;
    gone = seen && n == 0;
    if (!gone) std::this_thread::sleep_for(100ms);
  }
  CHECK(seen);
  CHECK(gone);
  CHECK_THAT(d.process().Stderr(), Catch::Contains("in the middle of its snapshot"));
  ctx.TryCancel();
  CHECK(stalled->Finish().error_code() == grpc::StatusCode::CANCELLED);
}
