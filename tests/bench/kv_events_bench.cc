// See kv_events_bench.h.
#include "kv_events_bench.h"

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "common/clock.h"
#include "daemon/events/kv_event_stream.h"
#include "flexkv/client.h"
#include "flexkv/kv_events.h"
#include "flexkv/v1/control.grpc.pb.h"
#include "bench_process.h"

namespace flexkv::bench {
namespace {

struct Options {
  std::string socket;
  int rounds = 5;
  int stores = 2000;      // per round
  uint32_t blocks = 8;    // per store
  uint32_t layers = 2;    // 128 KiB blocks
  std::string pool_size = "64MiB";
  bool zmq = false;
};

std::vector<BlockKey> Chain(int seed, uint32_t blocks) {
  std::vector<int32_t> tokens(static_cast<size_t>(blocks) * 16);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = seed * 1000003 + static_cast<int32_t>(i);
  return ComputeBlockKeys("flexkv-bench-events", tokens, 16);
}

// One round: `o.stores` stores of new chains (the pool is small: most evict); the store round trips in ns.
std::vector<int64_t> StoreRound(Client& c, const Options& o, int* next_seed) {
  std::vector<uint32_t> ids(o.blocks);
  for (uint32_t i = 0; i < o.blocks; ++i) ids[i] = i;
  std::vector<int64_t> samples;
  samples.reserve(static_cast<size_t>(o.stores));
  for (int i = 0; i < o.stores; ++i) {
    const std::vector<BlockKey> keys = Chain((*next_seed)++, o.blocks);
    const int64_t t0 = NowNs();
    auto t = c.Store(BlockKeyChain(keys), ids);
    if (!t.ok()) continue;
    auto r = c.Wait(*t, std::chrono::seconds(10));
    if (r.ok() && r->status.ok()) samples.push_back(NowNs() - t0);
  }
  return samples;
}

// A subscriber reading the stream in a thread of this process while it lives (`read` false: subscribed but never
// reading, so that the daemon appends every event but soon stops sending: the append's cost alone).
struct Reader {
  Reader(const std::string& socket, bool read) {
    auto s = KvEventSubscription::Open({socket, std::chrono::milliseconds(5000), std::chrono::milliseconds(5000)}, {});
    if (!s.ok()) {
      std::fprintf(stderr, "flexkv-bench: subscribe: %s\n", s.status().ToString().c_str());
      return;
    }
    sub = std::move(*s);
    if (!read) return;
    thread = std::thread([this] {
      for (;;) {
        auto b = sub->Next();
        if (!b.ok()) {
          if (b.status().code() != StatusCode::kCancelled) error = b.status().ToString();
          return;
        }
        events.fetch_add(b->events.size(), std::memory_order_relaxed);
      }
    });
  }
  ~Reader() {
    if (sub) sub->Cancel();
    if (thread.joinable()) thread.join();
  }
  std::unique_ptr<KvEventSubscription> sub;
  std::thread thread;
  std::atomic<uint64_t> events{0};
  std::string error;
};

// Threads of a process (/proc/<pid>/status), 0 when unknown.
size_t ThreadsOf(pid_t pid) {
  FILE* f = std::fopen(fmt::format("/proc/{}/status", pid).c_str(), "r");
  if (f == nullptr) return 0;
  char line[256];
  size_t threads = 0;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, "Threads: %zu", &threads) == 1) break;
  }
  std::fclose(f);
  return threads;
}

// A hostile client (issue 29 item 4): `n` event subscriptions of this process's uid, half with a snapshot, on 8
// connections with a small receive window, none ever read. The daemon refuses those past its per-uid limit; the rest
// stay open, unread, while the stores run. Ended and refused calls are counted as their status comes.
struct HostileSubscribers {
  HostileSubscribers(const std::string& socket, int n) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 10);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    std::vector<std::unique_ptr<v1::Control::Stub>> stubs;
    for (int i = 0; i < 8; ++i) {
      stubs.push_back(v1::Control::NewStub(
          grpc::CreateCustomChannel("unix:" + socket, grpc::InsecureChannelCredentials(), args)));
    }
    for (int i = 0; i < n; ++i) {
      auto call = std::make_unique<Call>();
      v1::SubscribeKvEventsRequest req;
      req.set_skip_snapshot(i % 2 == 1);
      call->reader = stubs[static_cast<size_t>(i) % stubs.size()]->PrepareAsyncSubscribeKvEvents(&call->ctx, req, &cq);
      call->reader->StartCall(nullptr);
      call->reader->Finish(&call->status, call.get());
      calls.push_back(std::move(call));
    }
    Poll(std::chrono::milliseconds(1000));  // the refusals come at once
  }
  ~HostileSubscribers() {
    for (auto& c : calls) c->ctx.TryCancel();
    while (ended < calls.size() && Poll(std::chrono::milliseconds(10000))) {
    }
    cq.Shutdown();
    void* tag;
    bool ok;
    while (cq.Next(&tag, &ok)) {
    }
  }
  // Takes what came within `wait`; false when nothing did.
  bool Poll(std::chrono::milliseconds wait) {
    const auto until = std::chrono::system_clock::now() + wait;
    bool any = false;
    for (;;) {
      void* tag = nullptr;
      bool ok = false;
      if (cq.AsyncNext(&tag, &ok, until) != grpc::CompletionQueue::GOT_EVENT) return any;
      if (tag == nullptr) continue;  // a call started
      any = true;
      ++ended;
      if (static_cast<Call*>(tag)->status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) ++refused;
      if (ended == calls.size()) return true;
    }
  }
  struct Call {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientAsyncReader<v1::KvEventBatch>> reader;
    grpc::Status status;
  };
  grpc::CompletionQueue cq;
  std::vector<std::unique_ptr<Call>> calls;
  size_t ended = 0, refused = 0;
};

// --append: the stream's Append alone, in this process (no daemon): ns per event with no subscriber (a relaxed load),
// with one reader draining the ring in another thread, and with one subscribed that never reads.
int RunAppendBench(uint64_t events) {
  const auto run = [events](int readers, bool reading) {
    KvEventStream stream(65536, 1);
    std::atomic<bool> stop{false};
    std::vector<std::unique_ptr<KvEventStream::Reader>> subs;
    std::vector<std::thread> threads;
    for (int r = 0; r < readers; ++r) {
      subs.push_back(std::make_unique<KvEventStream::Reader>(&stream));
      subs.back()->StartAtHead();
      if (!reading) continue;
      threads.emplace_back([&stream, &stop, reader = subs.back().get()] {
        std::vector<KvEvent> out;
        uint64_t behind = 0;
        while (!stop.load(std::memory_order_relaxed)) {
          out.clear();
          if (reader->Read(1024, &out, &behind) == KvEventStream::Reader::Result::kOverrun) reader->StartAtHead();
          // As the daemon's readers do: a batch that was not full lets events gather for 2 ms.
          if (out.size() < 1024) std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
      });
    }
    KvEvent e;
    e.kind = KvEventKind::kStored;
    const int64_t t0 = NowNs();
    for (uint64_t i = 0; i < events; ++i) {
      e.key.lo = i;
      stream.Append(e);
    }
    const int64_t t1 = NowNs();
    stop.store(true);
    for (auto& t : threads) t.join();
    return static_cast<double>(t1 - t0) / static_cast<double>(events);
  };
  const double none = run(0, false), idle = run(1, false), busy = run(1, true);
  fmt::print("KvEventStream::Append, {} events: no subscriber {:.1f} ns/event, one subscribed not reading {:.1f} ns, "
             "one reading in another thread {:.1f} ns\n", events, none, idle, busy);
  return 0;
}

}  // namespace
}  // namespace flexkv::bench

int RunKvEventsBench(int argc, char** argv) {
  using namespace flexkv;
  using namespace flexkv::bench;
  Options o;
  CLI::App app{"flexkv-bench events: store round trips with and without a KV event subscriber", "flexkv-bench events"};
  app.add_option("--socket", o.socket, "Use this flexkvd (default: start one in a temporary directory)");
  app.add_option("--rounds", o.rounds, "Rounds per variant, interleaved (default 5)")->check(CLI::Range(1, 1000));
  app.add_option("--stores", o.stores, "Stores per round (default 2000)")->check(CLI::Range(1, 10000000));
  app.add_option("--blocks", o.blocks, "Blocks per store (default 8)")->check(CLI::Range(1u, 1024u));
  app.add_option("--layers", o.layers, "Layers of the Llama-3-8B-shaped geometry (default 2: 128 KiB blocks)")
      ->check(CLI::Range(1u, 128u));
  app.add_option("--pool-size", o.pool_size, "--pool-size of the flexkvd this bench starts (default 64MiB: stores evict)");
  app.add_flag("--zmq", o.zmq, "The flexkvd this bench starts also publishes on ZMQ (--kv-events-zmq ipc://...)");
  int hostile = 1000;
  app.add_option("--hostile", hostile,
                 "Unread subscriptions of the hostile variant (one uid, half with a snapshot; 0: no such variant; "
                 "default 1000)")
      ->check(CLI::Range(0, 100000));
  bool append_only = false;
  uint64_t append_events = 20000000;
  app.add_flag("--append", append_only, "Only the stream's Append in this process (ns per event), no daemon");
  app.add_option("--append-events", append_events, "Events appended per --append variant (default 20M)")
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 34));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (append_only) return RunAppendBench(append_events);
  std::unique_ptr<OwnDaemon> own;
  std::string socket = o.socket;
  if (socket.empty()) {
    std::vector<std::string> args = {"--pool-size", o.pool_size};
    if (o.zmq) {
      args.push_back("--kv-events-zmq");
      args.push_back(fmt::format("ipc:///tmp/flexkv-bench-events-{}.sock", getpid()));
    }
    own = OwnDaemon::Start("/tmp/flexkv-bench-events-XXXXXX", args);
    if (!own) return 1;
    socket = own->socket();
  }
  auto client = Client::Connect({socket, std::chrono::milliseconds(10000), std::chrono::milliseconds(10000)});
  if (!client.ok()) {
    std::fprintf(stderr, "flexkv-bench: %s\n", client.status().ToString().c_str());
    return 1;
  }
  AttachOptions attach;
  attach.client_name = "flexkv-bench-events";
  attach.model_namespace = "flexkv-bench-events";
  attach.geometry = Llama3_8B();
  attach.geometry.num_layers = o.layers;
  if (auto s = (*client)->Attach(attach); !s.ok()) {
    std::fprintf(stderr, "flexkv-bench: Attach: %s\n", s.status().ToString().c_str());
    return 1;
  }
  if (auto kv = (*client)->CreateHostKv(KvLayout::kBlockFirst, o.blocks); !kv.ok()) {
    std::fprintf(stderr, "flexkv-bench: CreateHostKv: %s\n", kv.status().ToString().c_str());
    return 1;
  }
  int seed = 0;
  (void)StoreRound(**client, o, &seed);  // warm-up: the pool fills, stores evict from now on
  // Variants: 0 no subscriber, 1 a subscriber that reads everything, 2 one subscribed that does not read, 3 a hostile
  // client's `hostile` unread subscriptions (refused past the per-uid limit), with an engine's Connect and Attach timed.
  const int variants = hostile > 0 ? 4 : 3;
  std::vector<double> p50[4], p99[4], rate[4], attach_ms;
  uint64_t events = 0;
  size_t hostile_refused = 0, hostile_open = 0, hostile_threads = 0;
  for (int round = 0; round < o.rounds; ++round) {
    for (int with = 0; with < variants; ++with) {
      std::unique_ptr<Reader> reader;
      std::unique_ptr<HostileSubscribers> attackers;
      if (with == 1 || with == 2) reader = std::make_unique<Reader>(socket, with == 1);
      if (with == 3) {
        attackers = std::make_unique<HostileSubscribers>(socket, hostile);
        hostile_refused = attackers->refused;
        hostile_open = attackers->calls.size() - attackers->ended;
        if (own) hostile_threads = ThreadsOf(own->pid());
        const int64_t a0 = NowNs();
        auto engine = Client::Connect({socket, std::chrono::milliseconds(5000), std::chrono::milliseconds(5000)});
        AttachOptions a = attach;
        a.client_name = "flexkv-bench-events-late";
        if (!engine.ok() || !(*engine)->Attach(a).ok()) {
          std::fprintf(stderr, "flexkv-bench: an engine could not attach beside the hostile subscribers\n");
          attach_ms.push_back(-1);
        } else {
          attach_ms.push_back(static_cast<double>(NowNs() - a0) / 1e6);
        }
      }
      const int64_t t0 = NowNs();
      std::vector<int64_t> samples = StoreRound(**client, o, &seed);
      const double seconds = static_cast<double>(NowNs() - t0) / 1e9;
      const Percentiles p = Summarize(samples);
      p50[with].push_back(p.p50_us);
      p99[with].push_back(p.p99_us);
      rate[with].push_back(static_cast<double>(samples.size()) * o.blocks / seconds);
      if (reader && with == 1) {
        events += reader->events.load();
        if (!reader->error.empty()) std::fprintf(stderr, "flexkv-bench: subscriber ended: %s\n", reader->error.c_str());
      }
    }
  }
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  auto st = (*client)->GetStatus();
  fmt::print("store of {} blocks ({} KiB each), {} stores per round, {} rounds per variant (medians){}\n", o.blocks,
             (*client)->GetStatus().ok() && st.ok() ? st->pool.block_bytes / 1024 : 0, o.stores, o.rounds,
             o.zmq ? "; the daemon also publishes on ZMQ" : "");
  const std::string hostile_name = fmt::format("{} unread streams, one uid", hostile);
  const char* names[4] = {"no subscriber", "one gRPC subscriber reading", "subscribed, not reading",
                          hostile_name.c_str()};
  for (int v = 0; v < variants; ++v) {
    fmt::print("  {:<29} p50 {:8.1f} us  p99 {:8.1f} us  {:10.0f} blocks/s", names[v], median(p50[v]), median(p99[v]),
               median(rate[v]));
    if (v > 0) {
      fmt::print("  (p50 {:+.1f}%, throughput {:+.1f}%)", (median(p50[v]) / median(p50[0]) - 1) * 100,
                 (median(rate[v]) / median(rate[0]) - 1) * 100);
    }
    if (v == 1) fmt::print("  {} events read", events);
    if (v == 3) fmt::print("  (store rate {:.2f} of no subscriber)", median(rate[3]) / median(rate[0]));
    fmt::print("\n");
  }
  if (variants == 4) {
    fmt::print("  hostile client: {} of {} subscriptions refused (RESOURCE_EXHAUSTED), {} open and unread{}; an "
               "engine's Connect + Attach beside them {:.1f} ms (median; deadline 5000 ms)\n",
               hostile_refused, hostile, hostile_open,
               own ? fmt::format(", daemon threads {}", hostile_threads) : std::string(), median(attach_ms));
  }
  fmt::print("  (the reader runs in this process: on a machine with few cores its CPU competes with the store path; "
             "'not reading' is the append's cost alone)\n");
  return 0;
}
