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

#include "common/clock.h"
#include "flexkv/client.h"
#include "flexkv/kv_events.h"
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

// A subscriber reading the stream in a thread of this process while it lives.
struct Reader {
  explicit Reader(const std::string& socket) {
    auto s = KvEventSubscription::Open({socket, std::chrono::milliseconds(5000), std::chrono::milliseconds(5000)}, {});
    if (!s.ok()) {
      std::fprintf(stderr, "flexkv-bench: subscribe: %s\n", s.status().ToString().c_str());
      return;
    }
    sub = std::move(*s);
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
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
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
  std::vector<double> off_p50, on_p50, off_p99, on_p99, off_rate, on_rate;
  uint64_t events = 0;
  for (int round = 0; round < o.rounds; ++round) {
    for (int with = 0; with < 2; ++with) {
      std::unique_ptr<Reader> reader;
      if (with == 1) reader = std::make_unique<Reader>(socket);
      const int64_t t0 = NowNs();
      std::vector<int64_t> samples = StoreRound(**client, o, &seed);
      const double seconds = static_cast<double>(NowNs() - t0) / 1e9;
      const Percentiles p = Summarize(samples);
      (with ? on_p50 : off_p50).push_back(p.p50_us);
      (with ? on_p99 : off_p99).push_back(p.p99_us);
      (with ? on_rate : off_rate).push_back(static_cast<double>(samples.size()) * o.blocks / seconds);
      if (reader) {
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
  fmt::print("  no subscriber        p50 {:8.1f} us  p99 {:8.1f} us  {:10.0f} blocks/s\n", median(off_p50),
             median(off_p99), median(off_rate));
  fmt::print("  one gRPC subscriber  p50 {:8.1f} us  p99 {:8.1f} us  {:10.0f} blocks/s  ({} events read)\n",
             median(on_p50), median(on_p99), median(on_rate), events);
  fmt::print("  cost: p50 {:+.1f}%  throughput {:+.1f}%\n", (median(on_p50) / median(off_p50) - 1) * 100,
             (median(on_rate) / median(off_rate) - 1) * 100);
  return 0;
}
