// flexkv-bench trace: see trace_bench.h.
//   flexkv-bench trace --trace FILE [--capacity-blocks N] [--clients K] [--block-bytes 4KiB] [--json]
//                      [--sweep [--capacities 1000,2000,...] [--plot docs/trace_sweep.png]]
//                      [--geometry PRESET [--chunk-blocks C] [--split daemon|demand|w0,w1,...]
//                       [--window-stores trailing|every|both]]
//                      [--ssd-blocks M [--ssd-dir DIR] [--ssd-write-policy cold|all] [--ssd-writeback-window W]
//                       [--ssd-queue-depth Q]] [--gap-us G]
// --geometry adds the hybrid report (trace_hybrid_bench.cc): the model's pool, simulated, next to its all-FULL
// reference at the same byte budget.
// --ssd-blocks M compares, in one run, (a) flexkvd with N DRAM blocks alone, (b) flexkvd with N DRAM blocks and an
// SSD tier of M blocks (a fresh --ssd-path: a new directory under /var/tmp, removed afterwards, or --ssd-dir) and
// (c) the reference block-LRU over N + M blocks; see RunSsdComparison.
// Starts its own flexkvd (next to this executable) in a temporary directory under /dev/shm with
// --pool-size = N × block bytes, and K client processes (this executable, hidden subcommand `trace-worker`,
// posix_spawn'ed). Requests go to worker (request index mod K) — round-robin, as a router would — and each
// worker replays its requests in trace order as fast as it can (timestamps are not followed):
//   Match(pin) → Load the hits → Release → Store all keys (the daemon skips the cached prefix).
// --order says how the workers' requests interleave (a turn counter in a shared memfd, fd 4 of a worker):
//   strict  request i starts when request i-1 has ended (stored): the trace's order exactly, so the hit ratio is
//           comparable with the reference simulations (which run in trace order); K ranks share one cache.
//   match   request i's Match is submitted when request i-1's Match has returned; loads and stores overlap.
//   free    no coordination: each worker runs through its share as fast as it can (ranks drift apart, so a
//           request often runs before the earlier requests whose prefix it shares: fewer hits).
// Protocol between the parent and a worker:
//   worker stdout: READY <capacity_blocks> [<slots of each component>...] | RESULT <start_ns> <end_ns> <requests> <blocks> <hits> <loaded>
//                  <stored> <store_shortfalls> <load_mismatches> | LAT <op> <n> <ns>...
//                  | SHORTFALL <code> <n> <first message> | DONE | ERROR <text>
//   worker fd 0:  start barrier (the parent closes the write end)
//   worker fd 4:  the turn page (--order strict|match): TurnPage (trace_replay.h)
// The worker is trace_worker.cc; the hybrid report (--geometry) trace_hybrid_bench.cc.
#include "trace_bench.h"

#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bench_json.h"
#include "bench_process.h"
#include "common/mapped_region.h"
#include "common/units.h"
#include "daemon/cache/prefix_index.h"
#include "daemon/tiers/ssd/ssd_format.h"
#include "flexkv/client.h"
#include "trace_replay.h"
#include "trace_router_sim.h"

namespace flexkv::bench {

flexkv::Geometry TraceGeometry(uint64_t block_bytes) {
  flexkv::Geometry g;
  g.tokens_per_block = kTraceTokensPerBlock;
  g.num_layers = 1;
  g.kv_planes = 1;
  g.kv_heads_per_rank = 1;
  g.head_dim = static_cast<uint32_t>(block_bytes / kTraceTokensPerBlock);
  g.dtype_bytes = 1;
  g.tp_size = 1;
  return g;
}

std::vector<flexkv::BlockKey> TraceKeys(std::span<const uint64_t> ids) {
  std::vector<int32_t> tokens;
  tokens.reserve(ids.size() * kTraceTokensPerBlock);
  for (uint64_t id : ids) flexkv::bench::AppendBlockTokens(id, kTraceTokensPerBlock, &tokens);
  return flexkv::ComputeBlockKeys(kTraceNamespace, tokens, kTraceTokensPerBlock);
}

std::optional<std::vector<TraceRequest>> LoadTrace(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    std::fprintf(stderr, "flexkv-bench: cannot open trace %s\n", path.c_str());
    return std::nullopt;
  }
  std::vector<TraceRequest> out;
  std::string line;
  size_t lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto r = flexkv::bench::ParseTraceLine(line);
    if (!r.ok()) {
      std::fprintf(stderr, "flexkv-bench: %s:%zu: %s\n", path.c_str(), lineno, r.status().message().c_str());
      return std::nullopt;
    }
    for (uint64_t id : r->hash_ids) {
      if (id >= (uint64_t{1} << 22)) {
        std::fprintf(stderr, "flexkv-bench: %s:%zu: hash id %llu is >= 2^22 (block tokens would collide)\n",
                     path.c_str(), lineno, static_cast<unsigned long long>(id));
        return std::nullopt;
      }
    }
    out.push_back(std::move(*r));
  }
  if (out.empty()) {
    std::fprintf(stderr, "flexkv-bench: %s holds no requests\n", path.c_str());
    return std::nullopt;
  }
  return out;
}

}  // namespace flexkv::bench

namespace {

using namespace flexkv::bench;  // bench_process.h, trace_bench.h
using flexkv::NowNs;

// ---------------------------------------------------------------------------------------------------------------
// Parent (processes and the daemon: bench_process.h)

struct TraceOptions {
  std::string trace;
  uint32_t capacity = 10000;
  int clients = 2;
  std::string block_bytes_text = "4KiB";
  uint64_t block_bytes = 4096;
  bool json = false;
  bool sweep = false;
  std::vector<uint32_t> capacities = {1000, 2000, 5000, 10000, 20000, 50000};
  std::string plot = "trace_sweep.png";
  std::string order = "strict";
  std::string geometry;  // a preset: also the hybrid report (trace_hybrid_bench.cc)
  uint32_t chunk_blocks = 16;
  std::string split = "daemon";
  // With --geometry: what each store's windows carry: every window block computed since the engine's last store
  // ("every", ring layout 5's window_keys), the trailing window ("trailing", as before: the default, so that earlier
  // figures replay alike), or both, one after the other.
  std::string window_stores = "trailing";
  uint32_t window_churn = 0;  // --window-churn PASSES: the window-churn case (0: off)
  // --ssd-blocks: the DRAM / DRAM + SSD / block-LRU(N + M) comparison (RunSsdComparison); 0: absent.
  uint32_t ssd_blocks = 0;
  std::string ssd_dir;  // empty: a new directory under /var/tmp, removed afterwards
  bool ssd_write_all = false;  // --ssd-write-policy all
  double ssd_writeback_window = 0;  // 0: the daemon's default (0.25)
  uint32_t ssd_queue_depth = 0;     // 0: the daemon's default (32)
  uint32_t gap_us = 0;              // each request waits this long once it is its turn (pacing; 0: none)
  uint32_t nodes = 1;               // > 1: the three-router comparison over that many nodes (RunRouterComparison)
  double max_load_ratio = 2.0;      // the prefix-aware router's overload limit
  uint32_t cluster_chunk_blocks = 8;  // the simulated daemons' --cluster-chunk-blocks (what they publish)
};

// The model a daemon replay stores (trace --geometry): empty preset = TraceGeometry(block_bytes) at
// capacity x block_bytes.
struct DaemonModel {
  std::string preset;
  uint64_t scale = 1, pool_bytes = 0;
  uint32_t chunk_blocks = 0;
  double swa_share = 0, state_share = 0;  // the daemon's --swa-share / --state-share (0: its default)
  // The daemon's --ssd-* flags; not empty: the replay starts once the SSD tier serves, and the tier's status is
  // read at the end (TraceRun::ssd).
  std::vector<std::string> ssd_args;
  bool every_window = false;  // trace-worker --window-stores every (else trailing)
};

struct TraceRun {
  uint32_t capacity = 0;
  uint64_t daemon_capacity = 0;
  std::vector<uint64_t> component_capacity, component_used, component_unanchored, component_evicted;
  std::vector<uint64_t> component_active_end;
  uint64_t requests = 0, blocks = 0, hits = 0, loaded = 0, stored = 0, shortfalls = 0, mismatches = 0;
  double seconds = 0;
  HitCount reference, bound, sim;
  uint64_t reference_raw_hits = 0;
  std::map<std::string, Percentiles> lat;
  std::map<std::string, std::pair<uint64_t, std::string>> shortfall_codes;  // code -> (stores, first message)
  std::optional<flexkv::DaemonStatus::Tier> ssd;  // with DaemonModel::ssd_args: tiers[0] after the replay
  std::optional<flexkv::DaemonStatus::Tier> ssd_settled;  // the same 2 s later (in flight drained?)
  uint64_t dram_pinned_end = 0, dram_pinned_settled = 0, dram_used_end = 0;
  double ssd_wait_s = 0;                          // from READY until the tier served
  double hit_ratio() const { return blocks == 0 ? 0.0 : static_cast<double>(hits) / static_cast<double>(blocks); }
};

// The daemon's policy (prefix-closed, leaf-LRU PrefixIndex) replayed in-process, one request at a time: the
// number a single-rank replay through flexkvd should reproduce exactly.
HitCount SimulatePrefixIndex(const std::vector<TraceRequest>& trace, const std::vector<std::vector<flexkv::BlockKey>>& keys,
                             uint32_t capacity) {
  flexkv::PrefixIndex index(capacity);
  HitCount c;
  for (size_t i = 0; i < trace.size(); ++i) {
    c.hits += index.Match(keys[i], /*pin=*/false, nullptr);
    c.blocks += keys[i].size();
    auto r = index.Reserve(flexkv::kRootParent, keys[i]);
    index.Commit(r.slots);
  }
  return c;
}

// The value of `metric`{component="c",...} in Prometheus text, per component c (0 where absent).
std::vector<uint64_t> ComponentMetric(const std::string& text, const std::string& metric, size_t components) {
  std::vector<uint64_t> out(components, 0);
  size_t at = 0;
  while ((at = text.find(metric + "{", at)) != std::string::npos) {
    const size_t eol = std::min(text.find('\n', at), text.size());
    const std::string line = text.substr(at, eol - at);
    at = eol;
    const size_t c = line.find("component=\"");
    const size_t sp = line.rfind(' ');
    if (c == std::string::npos || sp == std::string::npos) continue;
    const size_t i = std::strtoull(line.c_str() + c + 11, nullptr, 10);
    if (i < components) out[i] = static_cast<uint64_t>(std::strtod(line.c_str() + sp + 1, nullptr));
  }
  return out;
}

std::optional<TraceRun> RunOnce(const std::string& self, const TraceOptions& o, uint32_t capacity,
                                const std::vector<TraceRequest>& trace,
                                const std::vector<std::vector<flexkv::BlockKey>>& keys, const DaemonModel& model = {}) {
  TraceRun run;
  run.capacity = capacity;
  run.bound = flexkv::bench::InfiniteCacheBound(trace);
  {
    flexkv::bench::BlockLru lru(capacity);
    for (const TraceRequest& r : trace) {
      run.reference.hits += lru.Access(r.hash_ids);
      run.reference.blocks += r.hash_ids.size();
    }
    run.reference_raw_hits = lru.raw_hits();
  }
  run.sim = SimulatePrefixIndex(trace, keys, capacity);

  const char* base = std::filesystem::is_directory("/dev/shm") ? "/dev/shm" : "/tmp";
  const uint64_t pool_bytes = model.preset.empty() ? uint64_t{capacity} * o.block_bytes : model.pool_bytes;
  std::vector<std::string> daemon_args = {"--pool-size", std::to_string(pool_bytes)};
  daemon_args.insert(daemon_args.end(), model.ssd_args.begin(), model.ssd_args.end());
  if (model.swa_share > 0) daemon_args.insert(daemon_args.end(), {"--swa-share", fmt::format("{:.6f}", model.swa_share)});
  if (model.state_share > 0) {
    daemon_args.insert(daemon_args.end(), {"--state-share", fmt::format("{:.6f}", model.state_share)});
  }
  auto own = OwnDaemon::Start(std::string(base) + "/flexkv-bench-trace-XXXXXX", daemon_args);
  if (!own) return std::nullopt;

  auto barrier = StartBarrier::Create();
  if (!barrier) return std::nullopt;
  flexkv::UniqueFd turn_fd(memfd_create("flexkv-bench-trace-turn", MFD_CLOEXEC));
  if (!turn_fd || ftruncate(turn_fd.get(), sizeof(TurnPage)) != 0) {
    std::fprintf(stderr, "flexkv-bench: memfd for the turn page: %s\n", std::strerror(errno));
    return std::nullopt;
  }
  std::vector<Child> workers;
  auto abort_all = [&](const std::string& why) -> std::optional<TraceRun> {
    std::fprintf(stderr, "flexkv-bench: %s\n", why.c_str());
    for (auto& w : workers) w.Kill();
    own->DumpLog();
    return std::nullopt;
  };
  for (int i = 0; i < o.clients; ++i) {
    auto w = Spawn({self, "trace-worker", "--socket", own->socket(), "--trace", o.trace, "--index", std::to_string(i),
                    "--clients", std::to_string(o.clients), "--block-bytes", std::to_string(o.block_bytes),
                    "--order", o.order, "--geometry", model.preset, "--scale", std::to_string(model.scale),
                    "--chunk-blocks", std::to_string(model.chunk_blocks), "--gap-us", std::to_string(o.gap_us),
                    "--window-stores", model.every_window ? "every" : "trailing"},
                   {{barrier->read_end(), 0}, {turn_fd.get(), 4}});
    if (!w) return abort_all("could not start a trace-worker");
    workers.push_back(std::move(*w));
  }
  for (size_t i = 0; i < workers.size(); ++i) {
    auto line = workers[i].ReadLine(std::chrono::seconds(120));
    unsigned long long cap = 0;
    int consumed = 0;
    if (!line || std::sscanf(line->c_str(), "READY %llu%n", &cap, &consumed) != 1) {
      return abort_all(fmt::format("worker {}: {}", i, line ? *line : std::string("ended before READY")));
    }
    run.daemon_capacity = cap;
    run.component_capacity.clear();
    for (const char* p = line->c_str() + consumed; *p != '\0';) {
      char* end = nullptr;
      const unsigned long long v = std::strtoull(p, &end, 10);
      if (end == p) break;
      run.component_capacity.push_back(v);
      p = end;
    }
  }
  if (!model.ssd_args.empty()) {
    // The tier opens its store when the first pool exists (the workers' Attach): wait until it serves, so that
    // the replay's first evictions already find it.
    auto client = flexkv::Client::Connect({own->socket(), std::chrono::milliseconds(5000), std::chrono::milliseconds(20000)});
    if (!client.ok()) return abort_all(fmt::format("Connect: {}", client.status().ToString()));
    const int64_t t0 = NowNs();
    for (;;) {
      auto st = (*client)->GetStatus();
      if (!st.ok()) return abort_all(fmt::format("GetStatus: {}", st.status().ToString()));
      if (st->tiers.empty()) return abort_all("the daemon reports no tier below DRAM although --ssd-path was given");
      if (st->tiers[0].state == "serving") break;
      if (st->tiers[0].state.starts_with("failed") || NowNs() - t0 > 30LL * 1000000000) {
        return abort_all(fmt::format("SSD tier not serving: {}", st->tiers[0].state));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    run.ssd_wait_s = static_cast<double>(NowNs() - t0) / 1e9;
  }
  barrier->Release();  // go
  std::map<std::string, std::vector<int64_t>> lat;
  int64_t first = 0, last = 0;
  for (size_t i = 0; i < workers.size(); ++i) {
    bool done = false;
    while (auto line = workers[i].ReadLine(std::chrono::seconds(3600))) {
      if (*line == "DONE") {
        done = true;
        break;
      }
      long long start = 0, end = 0;
      unsigned long long req = 0, blk = 0, hit = 0, ld = 0, st = 0, sf = 0, mm = 0;
      char op[16] = {};
      size_t n = 0;
      int consumed = 0;
      if (std::sscanf(line->c_str(), "RESULT %lld %lld %llu %llu %llu %llu %llu %llu %llu", &start, &end, &req, &blk,
                      &hit, &ld, &st, &sf, &mm) == 9) {
        first = first == 0 ? start : std::min<int64_t>(first, start);
        last = std::max<int64_t>(last, end);
        run.requests += req;
        run.blocks += blk;
        run.hits += hit;
        run.loaded += ld;
        run.stored += st;
        run.shortfalls += sf;
        run.mismatches += mm;
      } else if (char code[64] = {};
                 std::sscanf(line->c_str(), "SHORTFALL %63s %zu%n", code, &n, &consumed) == 2) {
        auto& [count, first_msg] = run.shortfall_codes[code];
        if (count == 0) first_msg = line->substr(std::min(line->size(), static_cast<size_t>(consumed) + 1));
        count += n;
      } else if (std::sscanf(line->c_str(), "LAT %15s %zu%n", op, &n, &consumed) == 2) {
        const std::vector<int64_t> s = ParseSamples(line->c_str() + consumed, n);
        lat[op].insert(lat[op].end(), s.begin(), s.end());
      } else {
        return abort_all(fmt::format("worker {}: {}", i, line->substr(0, 300)));
      }
    }
    if (!done) return abort_all(fmt::format("worker {} ended without DONE", i));
  }
  for (auto& w : workers) {
    const int status = w.Wait();
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::fprintf(stderr, "flexkv-bench: trace-worker exited with status 0x%x\n", status);
      return std::nullopt;
    }
  }
  run.seconds = static_cast<double>(last - first) / 1e9;
  for (auto& [op, v] : lat) run.lat[op] = Summarize(std::move(v));
  if (run.component_capacity.size() > 1) {  // a hybrid pool: its sub-pools at the end, from the daemon's metrics
    auto client = flexkv::Client::Connect({own->socket(), std::chrono::milliseconds(5000), std::chrono::milliseconds(20000)});
    auto text = client.ok() ? (*client)->GetMetrics() : flexkv::Result<std::string>(client.status());
    if (!text.ok()) return abort_all(fmt::format("GetMetrics: {}", text.status().ToString()));
    const size_t n = run.component_capacity.size();
    run.component_used = ComponentMetric(*text, "flexkv_component_used_slots", n);
    run.component_unanchored = ComponentMetric(*text, "flexkv_component_unanchored_slots", n);
    run.component_evicted = ComponentMetric(*text, "flexkv_component_evicted_total", n);
    run.component_active_end = ComponentMetric(*text, "flexkv_component_capacity_slots", n);
  }
  if (!model.ssd_args.empty()) {  // the SSD tier's counters right after the replay
    auto client = flexkv::Client::Connect({own->socket(), std::chrono::milliseconds(5000), std::chrono::milliseconds(20000)});
    auto st = client.ok() ? (*client)->GetStatus() : flexkv::Result<flexkv::DaemonStatus>(client.status());
    if (!st.ok()) return abort_all(fmt::format("GetStatus: {}", st.status().ToString()));
    if (st->tiers.empty()) return abort_all("the daemon reports no tier below DRAM after the replay");
    run.ssd = st->tiers[0];
    run.dram_pinned_end = st->pool.pinned_blocks;
    run.dram_used_end = st->pool.used_blocks;
    std::this_thread::sleep_for(std::chrono::seconds(2));
    st = (*client)->GetStatus();
    if (st.ok() && !st->tiers.empty()) {
      run.ssd_settled = st->tiers[0];
      run.dram_pinned_settled = st->pool.pinned_blocks;
    }
  }
  if (run.requests != trace.size()) {
    std::fprintf(stderr, "flexkv-bench: the workers replayed %llu of %zu requests\n",
                 static_cast<unsigned long long>(run.requests), trace.size());
    return std::nullopt;
  }
  return run;
}

Json RunJson(const TraceRun& r, int clients, const std::string& order, uint64_t block_bytes) {
  Json latency = Json::object();
  for (const char* op : {"match", "load", "release", "store"}) {
    auto it = r.lat.find(op);
    const Percentiles p = it == r.lat.end() ? Percentiles{} : it->second;
    latency[op] = {{"n", p.n},
                   {"p50", Rounded(p.p50_us, 1)},
                   {"p99", Rounded(p.p99_us, 1)},
                   {"p999", Rounded(p.p999_us, 1)},
                   {"mean", Rounded(p.mean_us, 1)}};
  }
  const double raw_ratio =
      r.reference.blocks == 0 ? 0.0 : static_cast<double>(r.reference_raw_hits) / static_cast<double>(r.reference.blocks);
  return Json{{"capacity_blocks", r.capacity},
              {"daemon_capacity_blocks", r.daemon_capacity},
              {"block_bytes", block_bytes},
              {"clients", clients},
              {"order", order},
              {"requests", r.requests},
              {"blocks", r.blocks},
              {"hit_blocks", r.hits},
              {"hit_ratio", Rounded(r.hit_ratio(), 4)},
              {"reference_lru_hit_ratio", Rounded(r.reference.ratio(), 4)},
              {"reference_lru_raw_hit_ratio", Rounded(raw_ratio, 4)},
              {"infinite_cache_bound", Rounded(r.bound.ratio(), 4)},
              {"prefix_index_sim_hit_ratio", Rounded(r.sim.ratio(), 4)},
              {"beats_reference", r.hit_ratio() >= r.reference.ratio()},
              {"requests_per_s", Whole(r.seconds > 0 ? static_cast<double>(r.requests) / r.seconds : 0.0)},
              {"seconds", Rounded(r.seconds, 3)},
              {"blocks_loaded", r.loaded},
              {"blocks_stored", r.stored},
              {"store_shortfalls", r.shortfalls},
              {"load_mismatches", r.mismatches},
              {"latency_us", latency}};
}

void PrintRunText(const TraceRun& r, int clients, const std::string& order) {
  fmt::print("capacity {} blocks ({} client processes, order {}): flexkvd hit ratio {:.4f}, reference block-LRU {:.4f}, "
             "infinite-cache bound {:.4f} (in-process PrefixIndex replay {:.4f})\n",
             r.capacity, clients, order, r.hit_ratio(), r.reference.ratio(), r.bound.ratio(), r.sim.ratio());
  fmt::print("  {} requests, {} blocks in {:.2f} s = {:.0f} requests/s; loaded {} stored {} blocks; {} store "
             "shortfalls; {} load mismatches\n",
             r.requests, r.blocks, r.seconds, r.seconds > 0 ? static_cast<double>(r.requests) / r.seconds : 0.0,
             r.loaded, r.stored, r.shortfalls, r.mismatches);
  fmt::print("  {:<8} {:>8} {:>10} {:>10} {:>10} {:>10}\n", "op", "n", "p50 us", "p99 us", "p99.9 us", "mean us");
  for (const auto& [op, p] : r.lat) {
    fmt::print("  {:<8} {:>8} {:>10.1f} {:>10.1f} {:>10.1f} {:>10.1f}\n", op, p.n, p.p50_us, p.p99_us, p.p999_us,
               p.mean_us);
  }
}

bool WritePlot(const std::vector<TraceRun>& runs, const std::string& png, int clients, const std::string& order) {
  char tmpl[] = "/tmp/flexkv-bench-plot-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return false;
  const std::string dir = tmpl;
  const std::string dat = dir + "/sweep.dat", gp = dir + "/sweep.gp";
  {
    std::ofstream d(dat);
    d << "# capacity flexkvd reference_lru bound\n";
    for (const TraceRun& r : runs) {
      d << r.capacity << ' ' << r.hit_ratio() << ' ' << r.reference.ratio() << ' ' << r.bound.ratio() << '\n';
    }
    std::ofstream g(gp);
    g << "set terminal pngcairo size 900,560 noenhanced\n"
      << "set output '" << png << "'\n"
      << "set title 'Trace replay (" << runs.front().requests << " requests): block hit ratio vs host pool capacity (" << clients
      << " client processes, --order " << order << ")'\n"
      << "set xlabel 'pool capacity (blocks of 512 tokens)'\nset ylabel 'block hit ratio'\n"
      << "set logscale x\nset xrange [700:70000]\nset yrange [0:0.7]\nset grid\nset key bottom right\n"
      << "plot '" << dat << "' using 1:2 with linespoints lw 2 pt 7 title 'flexkvd (prefix-closed leaf LRU)', \\\n"
      << "     '' using 1:3 with linespoints lw 2 pt 5 title 'reference block LRU', \\\n"
      << "     '' using 1:4 with lines lw 2 dt 2 title 'infinite-cache bound'\n";
  }
  const std::string cmd = "gnuplot '" + gp + "'";
  const int rc = std::system(cmd.c_str());
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  if (rc != 0) {
    std::fprintf(stderr, "flexkv-bench: gnuplot failed (%d); install gnuplot-nox (Debian) to get the plot\n", rc);
    return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------------------------
// --ssd-blocks: DRAM alone, DRAM + SSD, block-LRU over both capacities

uint64_t Counter(const flexkv::DaemonStatus::Tier& t, const char* name) {
  auto it = t.counters.find(name);
  return it == t.counters.end() ? 0 : it->second;
}

// The SSD directory of run (b): `o.ssd_dir` (created if missing; it must not hold a block file, whose blocks the
// daemon would rebuild: not a fresh replay) or a new directory under /var/tmp (a disk filesystem: the tier refuses
// tmpfs). Removed on destruction when the bench made it.
class SsdDir {
 public:
  static std::optional<SsdDir> Make(const std::string& given) {
    SsdDir d;
    if (given.empty()) {
      char tmpl[] = "/var/tmp/flexkv-bench-trace-ssd-XXXXXX";
      if (mkdtemp(tmpl) == nullptr) {
        std::fprintf(stderr, "flexkv-bench: mkdtemp %s: %s\n", tmpl, std::strerror(errno));
        return std::nullopt;
      }
      d.path_ = tmpl;
      d.owned_ = true;
      return d;
    }
    std::error_code ec;
    std::filesystem::create_directories(given, ec);
    if (ec) {
      std::fprintf(stderr, "flexkv-bench: --ssd-dir %s: %s\n", given.c_str(), ec.message().c_str());
      return std::nullopt;
    }
    const std::string file = (std::filesystem::path(given) / flexkv::kSsdFileName).string();
    if (std::filesystem::exists(file, ec)) {
      std::fprintf(stderr, "flexkv-bench: --ssd-dir %s holds %s from an earlier run; its blocks would be rebuilt "
                   "(not a fresh replay): remove it or give another directory\n", given.c_str(), file.c_str());
      return std::nullopt;
    }
    d.path_ = std::filesystem::absolute(given).string();
    return d;
  }
  SsdDir(SsdDir&& other) noexcept : path_(std::move(other.path_)), owned_(std::exchange(other.owned_, false)) {}
  SsdDir& operator=(SsdDir&&) = delete;
  ~SsdDir() {
    if (!owned_) return;
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  bool owned() const { return owned_; }

 private:
  SsdDir() = default;
  std::string path_;
  bool owned_ = false;
};

int RunSsdComparison(const std::string& self, const TraceOptions& o, const std::vector<TraceRequest>& trace,
                     const std::vector<std::vector<flexkv::BlockKey>>& keys) {
  const uint32_t n = o.capacity, m = o.ssd_blocks;
  const uint64_t combined = uint64_t{n} + m;
  // Slots on disk: a 4 KiB header sector, then the block padded to 4 KiB; a 4 KiB file header first.
  const uint64_t stride = flexkv::kSsdAlign + flexkv::SsdRoundUp(o.block_bytes);
  const uint64_t ssd_bytes = flexkv::kSsdAlign + uint64_t{m} * stride;

  // (a) DRAM alone.
  const int64_t wall_a = NowNs();
  auto dram = RunOnce(self, o, n, trace, keys);
  if (!dram) return 1;
  const double wall_a_s = static_cast<double>(NowNs() - wall_a) / 1e9;

  // (b) DRAM + SSD, on a fresh directory.
  auto dir = SsdDir::Make(o.ssd_dir);
  if (!dir) return 2;
  DaemonModel with_ssd;
  with_ssd.ssd_args = {"--ssd-path", dir->path(), "--ssd-size", std::to_string(ssd_bytes)};
  with_ssd.ssd_args.push_back(o.ssd_write_all ? "--ssd-write-policy=all" : "--ssd-write-policy=cold");
  if (o.ssd_writeback_window > 0) {
    with_ssd.ssd_args.insert(with_ssd.ssd_args.end(), {"--ssd-writeback-window", fmt::format("{}", o.ssd_writeback_window)});
  }
  if (o.ssd_queue_depth > 0) {
    with_ssd.ssd_args.insert(with_ssd.ssd_args.end(), {"--ssd-queue-depth", std::to_string(o.ssd_queue_depth)});
  }
  const int64_t wall_b = NowNs();
  auto tiered = RunOnce(self, o, n, trace, keys, with_ssd);
  if (!tiered) return 1;
  const double wall_b_s = static_cast<double>(NowNs() - wall_b) / 1e9;
  const flexkv::DaemonStatus::Tier& t = *tiered->ssd;

  // (c) block-LRU over N + M, and the daemon's policy as one pool of N + M (in-process).
  const HitCount lru = ReferenceLru(trace, combined);
  const HitCount one_pool = SimulatePrefixIndex(trace, keys, static_cast<uint32_t>(std::min<uint64_t>(combined, UINT32_MAX)));
  const HitCount bound = InfiniteCacheBound(trace);
  // An inclusive tier (write policy all: every DRAM block is on SSD too) holds at most M distinct blocks.
  const HitCount lru_ssd_only = ReferenceLru(trace, m);

  const uint64_t promoted = Counter(t, "promoted_blocks");
  const std::string mode = o.ssd_write_all
                               ? std::string("write policy all")
                               : fmt::format("write policy cold, window {}", o.ssd_writeback_window > 0 ? o.ssd_writeback_window : 0.25);
  auto rps = [](const TraceRun& r) { return r.seconds > 0 ? static_cast<double>(r.requests) / r.seconds : 0.0; };
  if (o.json) {
    Json ssd = Json::object();
    ssd["state"] = t.state;
    ssd["capacity_blocks"] = t.capacity_blocks;
    ssd["used_blocks"] = t.used_blocks;
    ssd["capacity_bytes"] = t.capacity_bytes;
    ssd["block_bytes"] = t.block_bytes;
    for (const auto& [k, v] : t.counters) ssd[k] = v;
    ssd["files"] = Json::array();
    for (const auto& f : t.files) {
      ssd["files"].push_back({{"path", f.path}, {"filesystem", f.filesystem}, {"direct_io", f.direct_io}, {"slots", f.slots}});
    }
    ssd["notes"] = t.notes;
    Json b = RunJson(*tiered, o.clients, o.order, o.block_bytes);
    b["dram_hit_blocks"] = tiered->hits - std::min(tiered->hits, promoted);
    b["ssd_wait_s"] = Rounded(tiered->ssd_wait_s, 3);
    b["wall_s"] = Rounded(wall_b_s, 2);
    b["ssd"] = std::move(ssd);
    b["dram_used_end"] = tiered->dram_used_end;
    b["dram_pinned_end"] = tiered->dram_pinned_end;
    b["dram_pinned_2s_later"] = tiered->dram_pinned_settled;
    if (tiered->ssd_settled) {
      b["ssd_writes_in_flight_2s_later"] = Counter(*tiered->ssd_settled, "writes_in_flight");
      b["ssd_written_back_2s_later"] = Counter(*tiered->ssd_settled, "written_back_blocks");
    }
    Json codes = Json::object();
    for (const auto& [code, v] : tiered->shortfall_codes) codes[code] = {{"stores", v.first}, {"first", v.second}};
    b["store_shortfall_codes"] = std::move(codes);
    Json a = RunJson(*dram, o.clients, o.order, o.block_bytes);
    a["wall_s"] = Rounded(wall_a_s, 2);
    Json report{{"bench", "trace"},
                {"trace", o.trace},
                {"daemon", "spawned"},
                {"dram_blocks", n},
                {"ssd_blocks", m},
                {"ssd_size_bytes", ssd_bytes},
                {"ssd_capacity_blocks", t.capacity_blocks},
                {"ssd_mode", o.ssd_write_all ? "all" : "cold"},
                {"ssd_writeback_window", o.ssd_write_all ? Json(nullptr) : Json(o.ssd_writeback_window > 0 ? o.ssd_writeback_window : 0.25)},
                {"ssd_dir", dir->owned() ? Json(nullptr) : Json(dir->path())},
                {"block_bytes", o.block_bytes},
                {"clients", o.clients},
                {"order", o.order},
                {"gap_us", o.gap_us},
                {"dram", std::move(a)},
                {"dram_ssd", std::move(b)},
                {"block_lru_combined",
                 {{"capacity_blocks", combined}, {"hit_blocks", lru.hits}, {"blocks", lru.blocks},
                  {"hit_ratio", Rounded(lru.ratio(), 4)}}},
                {"prefix_index_sim_combined",
                 {{"capacity_blocks", combined}, {"hit_blocks", one_pool.hits}, {"blocks", one_pool.blocks},
                  {"hit_ratio", Rounded(one_pool.ratio(), 4)}}},
                {"block_lru_ssd_only",
                 {{"capacity_blocks", m}, {"hit_blocks", lru_ssd_only.hits}, {"blocks", lru_ssd_only.blocks},
                  {"hit_ratio", Rounded(lru_ssd_only.ratio(), 4)}}},
                {"infinite_cache_bound", Rounded(bound.ratio(), 4)}};
    fmt::print("{}", DumpLine(report));
  } else {
    fmt::print("trace {}: {} requests, {} blocks; {} client processes, order {}{}, {} B blocks\n", o.trace,
               trace.size(), bound.blocks, o.clients, o.order,
               o.gap_us > 0 ? fmt::format(", {} us gap before each request", o.gap_us) : std::string(), o.block_bytes);
    fmt::print("SSD tier: {} blocks asked (--ssd-size {}), capacity_blocks {} reported ({} B blocks, {} B slots), "
               "{}, in {}{}\n", m, ssd_bytes, t.capacity_blocks, t.block_bytes, stride, mode, dir->path(),
               dir->owned() ? " (removed afterwards)" : "");
    if (t.capacity_blocks != m) {
      fmt::print("  NOTE: the tier holds {} blocks, not the {} asked\n", t.capacity_blocks, m);
    }
    const std::string la = fmt::format("(a) flexkvd DRAM {}", n);
    const std::string lb = fmt::format("(b) flexkvd DRAM {} + SSD {}", n, t.capacity_blocks);
    const std::string lc = fmt::format("(c) block-LRU {}", combined);
    fmt::print("\n{:<36} {:>9} {:>10} {:>10} {:>9} {:>12} {:>17} {:>10} {:>7}\n", "", "hit ratio", "hit blocks",
               "blocks", "promoted", "written back", "evicted unwritten", "requests/s", "wall s");
    fmt::print("{:<36} {:>9.4f} {:>10} {:>10} {:>9} {:>12} {:>17} {:>10.0f} {:>7.1f}\n", la, dram->hit_ratio(),
               dram->hits, dram->blocks, "-", "-", "-", rps(*dram), wall_a_s);
    fmt::print("{:<36} {:>9.4f} {:>10} {:>10} {:>9} {:>12} {:>17} {:>10.0f} {:>7.1f}\n", lb, tiered->hit_ratio(),
               tiered->hits, tiered->blocks, promoted, Counter(t, "written_back_blocks"),
               Counter(t, "evicted_unwritten_blocks"), rps(*tiered), wall_b_s);
    fmt::print("{:<36} {:>9.4f} {:>10} {:>10} {:>9} {:>12} {:>17} {:>10} {:>7}\n", lc, lru.ratio(), lru.hits,
               lru.blocks, "-", "-", "-", "-", "-");
    fmt::print("{:<36} {:>9.4f} {:>10} {:>10}\n", fmt::format("    PrefixIndex sim {}", combined), one_pool.ratio(),
               one_pool.hits, one_pool.blocks);
    fmt::print("{:<36} {:>9.4f} {:>10} {:>10}\n", fmt::format("    block-LRU {} (SSD's alone)", m), lru_ssd_only.ratio(),
               lru_ssd_only.hits, lru_ssd_only.blocks);
    fmt::print("{:<36} {:>9.4f} {:>10} {:>10}\n", "    infinite-cache bound", bound.ratio(), bound.hits, bound.blocks);
    fmt::print("\n(b) detail: DRAM hits {} + SSD hits (promoted) {}; promotion requests {}, refused {}, failed {}; "
               "written back {} (refused {}, failed {}); DRAM evictions written {} / unwritten {}; SSD evictions {}; "
               "SSD used {} of {}; read {} B, written {} B; load mismatches {}; store shortfalls {}\n",
               tiered->hits - std::min(tiered->hits, promoted), promoted, Counter(t, "promotion_requests"),
               Counter(t, "promotion_refused_blocks"), Counter(t, "promotion_failed_blocks"),
               Counter(t, "written_back_blocks"), Counter(t, "writeback_refused_blocks"),
               Counter(t, "writeback_failed_blocks"), Counter(t, "evicted_written_blocks"),
               Counter(t, "evicted_unwritten_blocks"), Counter(t, "evicted_blocks"), t.used_blocks, t.capacity_blocks,
               Counter(t, "read_bytes"), Counter(t, "write_bytes"), tiered->mismatches, tiered->shortfalls);
    fmt::print("(b) at the end: DRAM used {} pinned {}; SSD reads/writes in flight {}/{}", tiered->dram_used_end,
               tiered->dram_pinned_end, Counter(t, "reads_in_flight"), Counter(t, "writes_in_flight"));
    if (tiered->ssd_settled) {
      const flexkv::DaemonStatus::Tier& u = *tiered->ssd_settled;
      fmt::print("; 2 s later: DRAM pinned {}, in flight {}/{}, written back {}", tiered->dram_pinned_settled,
                 Counter(u, "reads_in_flight"), Counter(u, "writes_in_flight"), Counter(u, "written_back_blocks"));
    }
    fmt::print("\n");
    for (const auto& [code, v] : tiered->shortfall_codes) {
      fmt::print("(b) store shortfalls {}: {} (first: {})\n", code, v.first, v.second);
    }
    for (const auto& [code, v] : dram->shortfall_codes) {
      fmt::print("(a) store shortfalls {}: {} (first: {})\n", code, v.first, v.second);
    }
    fmt::print("(a) reference block-LRU {} {:.4f}, PrefixIndex sim {} {:.4f}; load mismatches {}\n", n,
               dram->reference.ratio(), n, dram->sim.ratio(), dram->mismatches);
    for (const std::string& note : t.notes) fmt::print("SSD note: {}\n", note);
  }
  return dram->mismatches == 0 && tiered->mismatches == 0 ? 0 : 1;
}

}  // namespace

// trace --nodes N: the routers of trace_router_sim.h on the trace, beside one pool of N x capacity and the
// infinite-cache bound.
int RunRouterComparison(const TraceOptions& o, const std::vector<TraceRequest>& trace,
                        const std::vector<std::vector<flexkv::BlockKey>>& keys) {
  const auto start = std::chrono::steady_clock::now();
  auto runs =
      flexkv::bench::SimulateRouters(trace, keys, o.nodes, o.capacity, o.max_load_ratio, o.cluster_chunk_blocks);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const HitCount one_pool = SimulatePrefixIndex(trace, keys, o.capacity * o.nodes);
  const HitCount bound = flexkv::bench::InfiniteCacheBound(trace);
  bool consistent = true;
  for (const auto& r : runs) consistent &= r.index_consistent;
  if (o.json) {
    Json j;
    j["bench"] = "trace-routers";
    j["trace"] = o.trace;
    j["nodes"] = o.nodes;
    j["node_capacity_blocks"] = o.capacity;
    j["block_bytes"] = o.block_bytes;
    j["max_load_ratio"] = o.max_load_ratio;
    j["cluster_chunk_blocks"] = o.cluster_chunk_blocks;
    for (const auto& r : runs) {
      j["routers"].push_back({{"router", r.router}, {"hit_ratio", r.hit_ratio()}, {"hits", r.hits},
                              {"local_hits", r.local_hits}, {"pulled_blocks", r.pulled_blocks},
                              {"pulled_bytes", r.pulled_blocks * o.block_bytes}, {"blocks", r.blocks},
                              {"per_node_requests", r.per_node_requests}, {"imbalance", r.imbalance()},
                              {"directory_lookups", r.lookups}, {"directory_lookup_keys", r.lookup_keys},
                              {"index_consistent", r.index_consistent}});
    }
    j["one_pool_hit_ratio"] = one_pool.ratio();
    j["infinite_bound"] = bound.ratio();
    j["seconds"] = seconds;
    fmt::print("{}\n", j.dump());
  } else {
    fmt::print("trace {} ({} requests, {} blocks): {} nodes x {} blocks, block {} bytes (simulation: the daemon's "
               "PrefixIndex per node, in-process)\n",
               o.trace, trace.size(), runs.empty() ? 0 : runs[0].blocks, o.nodes, o.capacity, o.block_bytes);
    fmt::print("{:<32} {:>9} {:>11} {:>12} {:>14} {:>10}\n", "router", "hit ratio", "local hits", "pulled",
               "pulled bytes", "imbalance");
    for (const auto& r : runs) {
      fmt::print("{:<32} {:>9.4f} {:>11} {:>12} {:>14} {:>10.2f}\n", r.router, r.hit_ratio(), r.local_hits,
                 r.pulled_blocks, r.pulled_blocks * o.block_bytes, r.imbalance());
    }
    fmt::print("{:<32} {:>9.4f}   (one pool of {} blocks: the most {} nodes could hold without duplicates)\n",
               "one pool", one_pool.ratio(), uint64_t{o.capacity} * o.nodes, o.nodes);
    fmt::print("{:<32} {:>9.4f}\n", "infinite-cache bound", bound.ratio());
    if (runs.size() > 2 && runs[2].hit_ratio() > 0) {
      fmt::print("peer pulls as the daemon publishes (--cluster-chunk-blocks {}) / every key published: {:.4f}; "
                 "directory: {} round trips, {} keys asked ({:.1f} per request)\n",
                 o.cluster_chunk_blocks, runs[1].hit_ratio() / runs[2].hit_ratio(), runs[1].lookups,
                 runs[1].lookup_keys,
                 runs[1].requests == 0 ? 0.0
                                       : static_cast<double>(runs[1].lookup_keys) / static_cast<double>(runs[1].requests));
    }
    fmt::print("routing index consistent with every node's blocks: {}; {:.1f} s\n", consistent ? "yes" : "NO",
               seconds);
  }
  return consistent ? 0 : 1;
}

int RunTraceBench(int argc, char** argv) {
  CLI::App app{"flexkv-bench trace: replay a Mooncake-format trace through a flexkvd this bench starts"};
  TraceOptions o;
  app.add_option("--trace", o.trace, "Trace file (JSON lines with hash_ids)")->required();
  app.add_option("--capacity-blocks", o.capacity, "Pool capacity in blocks (default 10000)")
      ->check(CLI::Range(1u, 100000000u));
  app.add_option("--clients", o.clients, "Client processes (DP ranks), requests round-robin (default 2)")
      ->check(CLI::Range(1, 64));
  app.add_option("--block-bytes", o.block_bytes_text,
                 "Bytes per 512-token block, a multiple of 512 (default 4KiB; the hit ratio does not depend on it)");
  app.add_option("--order", o.order,
                 "Interleaving of the ranks' requests: strict (trace order, one request at a time; default), match "
                 "(lookups in trace order, loads/stores overlap) or free (no coordination)")
      ->check(CLI::IsMember({"strict", "match", "free"}));
  app.add_flag("--json", o.json, "One JSON object");
  app.add_flag("--sweep", o.sweep, "Run each of --capacities (instead of --capacity-blocks) and plot");
  app.add_option("--capacities", o.capacities, "Capacities of --sweep (default 1000,2000,5000,10000,20000,50000)")
      ->delimiter(',');
  app.add_option("--plot", o.plot, "PNG written by --sweep (gnuplot; default trace_sweep.png)");
  app.add_option("--geometry", o.geometry,
                 "Also replay this model's pool, simulated, next to its all-FULL reference at the same byte budget "
                 "(= the capacity in all-FULL blocks): llama3-8b, qwen3-8b, deepseek-mla, gpt-oss-20b, gemma3-27b, "
                 "qwen3-next, jamba");
  app.add_option("--chunk-blocks", o.chunk_blocks,
                 "With --geometry: the engine stores every this many blocks of prefill (chunked prefill; 0: only at "
                 "the prompt's end; default 16 = 8192 tokens)")
      ->check(CLI::Range(0u, 1000000u));
  app.add_option("--split", o.split,
                 "With --geometry: the budget's split between sub-pools: daemon (flexkvd's default), demand (in "
                 "proportion to what each component holds after the trace with no eviction) or one weight per "
                 "component, w0,w1,...; the flexkvd run gets it as --swa-share/--state-share");
  app.add_option("--window-stores", o.window_stores,
                 "With --geometry: each hybrid store carries every window block computed since the engine's last store "
                 "(every), the trailing window only (trailing, the default: the store before ring layout 5), or both, "
                 "reported one after the other in the same run")
      ->check(CLI::IsMember({"every", "trailing", "both"}));
  app.add_option("--window-churn", o.window_churn,
                 "With --geometry: the window-churn case - the trace repeated PASSES times (new ids each pass), a store "
                 "at every block boundary (--chunk-blocks 1: every FULL block with its window, as an engine that "
                 "stores every window block it holds), the window share swept in the simulation for the ideal split, "
                 "and flexkvd with its default split fixed and with its sub-pools sized by demand")
      ->check(CLI::Range(1u, 63u));
  app.add_option("--ssd-blocks", o.ssd_blocks,
                 "Also compare, in one run: flexkvd with --capacity-blocks DRAM blocks alone, the same with an SSD "
                 "tier of this many blocks, and block-LRU over both capacities")
      ->check(CLI::Range(1u, 100000000u));
  app.add_option("--ssd-dir", o.ssd_dir,
                 "With --ssd-blocks: the SSD tier's directory (created if missing, kept; must not hold a block file). "
                 "Default: a new directory under /var/tmp, removed afterwards");
  std::string write_policy;
  app.add_option("--ssd-write-policy", write_policy, "With --ssd-blocks: flexkvd --ssd-write-policy (cold, the default, or all)")
      ->check(CLI::IsMember({"cold", "all"}));
  app.add_option("--ssd-writeback-window", o.ssd_writeback_window,
                 "With --ssd-blocks: flexkvd --ssd-writeback-window (default: the daemon's, 0.25)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--ssd-queue-depth", o.ssd_queue_depth,
                 "With --ssd-blocks: flexkvd --ssd-queue-depth (default: the daemon's, 32)")
      ->check(CLI::Range(1u, 65536u));
  app.add_option("--gap-us", o.gap_us,
                 "Pacing: each request waits this many microseconds once it is its turn, before its Match (default 0: "
                 "as fast as possible); with --order strict the replay takes about requests x this longer, time the "
                 "SSD tier's mover gets to keep up")
      ->check(CLI::Range(0u, 10000000u));
  app.add_option("--nodes", o.nodes,
                 "> 1: no daemon; the trace over this many nodes of --capacity-blocks each (the daemon's PrefixIndex, "
                 "in-process) behind four routers - round-robin, round-robin with peer pulls as the daemon publishes and "
                 "as if every key were published, prefix-aware - hit "
                 "ratio and pulled bytes of each (default 1: the replay through flexkvd)")
      ->check(CLI::Range(1u, 64u));
  app.add_option("--cluster-chunk-blocks", o.cluster_chunk_blocks,
                 "With --nodes: the simulated daemons' --cluster-chunk-blocks, one published key in this many besides "
                 "each commit's last (default 8, the daemon's)")
      ->check(CLI::Range(1u, 1000000u));
  app.add_option("--max-load-ratio", o.max_load_ratio,
                 "With --nodes: the prefix-aware router skips nodes whose recent load exceeds this x (least + 1) "
                 "(default 2)")
      ->check(CLI::Range(1.0, 1000.0));
  CLI11_PARSE(app, argc, argv);
  o.ssd_write_all = write_policy == "all";
  if (o.ssd_blocks == 0 && (!o.ssd_dir.empty() || !write_policy.empty() || o.ssd_writeback_window > 0 ||
                            o.ssd_queue_depth > 0)) {
    std::fprintf(stderr, "flexkv-bench: --ssd-dir, --ssd-write-policy, --ssd-writeback-window and "
                 "--ssd-queue-depth need --ssd-blocks\n");
    return 2;
  }
  if (o.ssd_blocks > 0 && (o.sweep || !o.geometry.empty())) {
    std::fprintf(stderr, "flexkv-bench: --ssd-blocks compares one --capacity-blocks; it does not combine with "
                 "--sweep or --geometry (the hybrid replay models DRAM only)\n");
    return 2;
  }

  auto bb = flexkv::ParseByteSize(o.block_bytes_text);
  if (!bb.ok() || *bb < kTraceTokensPerBlock || *bb % kTraceTokensPerBlock != 0 ||
      *bb / kTraceTokensPerBlock > 65536) {
    std::fprintf(stderr, "flexkv-bench: --block-bytes %s: expected a multiple of 512 bytes, 512 B .. 32 MiB\n",
                 o.block_bytes_text.c_str());
    return 2;
  }
  o.block_bytes = *bb;
  if (!o.geometry.empty()) {
    auto g = flexkv::bench::TracePreset(o.geometry, kTraceTokensPerBlock);
    flexkv::Status valid = g.status();
    if (valid.ok() && o.split != "daemon" && o.split != "demand") {
      valid = flexkv::bench::ParseSplitWeights(o.split, g->component_count()).status();
    }
    if (!valid.ok()) {
      std::fprintf(stderr, "flexkv-bench: %s\n", valid.message().c_str());
      return 2;
    }
  }
  const std::string self = SelfExe();
  if (self.empty()) {
    std::fprintf(stderr, "flexkv-bench: cannot resolve /proc/self/exe\n");
    return 3;
  }
  o.trace = std::filesystem::absolute(o.trace).string();
  auto trace = LoadTrace(o.trace);
  if (!trace) return 2;
  // The window-churn trace, written for the workers into a directory removed at the end.
  struct ChurnDir {
    std::string path;
    ~ChurnDir() {
      std::error_code ec;
      if (!path.empty()) std::filesystem::remove_all(path, ec);
    }
  } churn_dir;
  if (o.window_churn > 0) {
    if (o.geometry.empty() || o.nodes > 1) {
      std::fprintf(stderr, "flexkv-bench: --window-churn needs --geometry (a hybrid preset) and one node\n");
      return 2;
    }
    auto repeated = flexkv::bench::RepeatTrace(*trace, o.window_churn);
    if (!repeated.ok()) {
      std::fprintf(stderr, "flexkv-bench: %s\n", repeated.status().message().c_str());
      return 2;
    }
    char tmpl[] = "/tmp/flexkv-bench-churn-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) {
      std::fprintf(stderr, "flexkv-bench: mkdtemp %s: %s\n", tmpl, std::strerror(errno));
      return 3;
    }
    churn_dir.path = tmpl;
    o.trace = churn_dir.path + "/window_churn.jsonl";
    std::FILE* f = std::fopen(o.trace.c_str(), "w");
    for (size_t i = 0; f != nullptr && i < repeated->size(); ++i) {
      const Json line{{"timestamp", (*repeated)[i].timestamp_ms}, {"hash_ids", (*repeated)[i].hash_ids}};
      std::fprintf(f, "%s\n", line.dump().c_str());
    }
    if (f == nullptr || std::fclose(f) != 0) {
      std::fprintf(stderr, "flexkv-bench: cannot write %s: %s\n", o.trace.c_str(), std::strerror(errno));
      return 3;
    }
    *trace = std::move(*repeated);
    o.chunk_blocks = 1;
  }
  std::vector<uint32_t> caps = o.sweep ? o.capacities : std::vector<uint32_t>{o.capacity};
  for (uint32_t cap : caps) {
    if (uint64_t{cap} * o.block_bytes < (uint64_t{1} << 20)) {
      std::fprintf(stderr, "flexkv-bench: %u blocks of %llu bytes is below flexkvd's 1MiB minimum pool; raise "
                   "--block-bytes\n", cap, static_cast<unsigned long long>(o.block_bytes));
      return 2;
    }
  }
  std::vector<std::vector<flexkv::BlockKey>> keys;
  keys.reserve(trace->size());
  for (const TraceRequest& r : *trace) keys.push_back(TraceKeys(r.hash_ids));

  if (o.nodes > 1) return RunRouterComparison(o, *trace, keys);
  if (o.ssd_blocks > 0) return RunSsdComparison(self, o, *trace, keys);
  std::vector<TraceRun> runs;
  for (uint32_t cap : caps) {
    auto r = RunOnce(self, o, cap, *trace, keys);
    if (!r) return 1;
    if (!o.json) PrintRunText(*r, o.clients, o.order);
    runs.push_back(std::move(*r));
  }
  bool plotted = false;
  if (o.sweep) plotted = WritePlot(runs, o.plot, o.clients, o.order);
  Json hybrid;
  if (!o.geometry.empty()) {
    // --window-stores both: the trailing windows (the old store) first, then every window block, in one run.
    std::vector<bool> modes;
    if (o.window_stores != "every") modes.push_back(false);
    if (o.window_stores != "trailing") modes.push_back(true);
    Json by_mode = Json::array();
    for (const bool every : modes) {
      flexkv::bench::HybridTraceOptions ho{o.trace, o.geometry, caps, o.chunk_blocks, o.split, o.json,
                                           o.window_churn > 0, {}};
      ho.every_window = every;
      ho.daemon = [&](uint32_t cap, uint64_t pool_bytes, uint64_t scale, double swa_share,
                      double state_share) -> std::optional<HybridDaemonRun> {
        DaemonModel model{o.geometry, scale, pool_bytes, o.chunk_blocks, swa_share, state_share, {}};
        model.every_window = every;
        auto r = RunOnce(self, o, cap, *trace, keys, model);
        if (!r) return std::nullopt;
        return HybridDaemonRun{r->blocks,
                               r->hits,
                               r->stored,
                               r->shortfalls,
                               r->mismatches,
                               r->seconds,
                               r->component_capacity,
                               r->component_used,
                               r->component_unanchored,
                               r->component_evicted,
                               r->component_active_end};
      };
      Json one;
      const int rc = flexkv::bench::RunHybridTraceReport(ho, *trace, &one);
      if (rc != 0) return rc;
      by_mode.push_back(std::move(one));
    }
    hybrid = by_mode.size() == 1 ? std::move(by_mode[0]) : std::move(by_mode);
  }
  if (o.json) {
    Json report{{"bench", "trace"}, {"trace", o.trace}, {"daemon", "spawned"}};
    if (!o.geometry.empty()) report["hybrid"] = std::move(hybrid);
    if (!o.sweep) {
      report.update(RunJson(runs[0], o.clients, o.order, o.block_bytes));
    } else {
      Json sweep = Json::array();
      for (const TraceRun& r : runs) sweep.push_back(RunJson(r, o.clients, o.order, o.block_bytes));
      report["sweep"] = std::move(sweep);
      report["plot"] = plotted ? Json(o.plot) : Json(nullptr);
    }
    fmt::print("{}", DumpLine(report));
  } else if (o.sweep) {
    fmt::print("\n{:>10} {:>10} {:>14} {:>10} {:>10}\n", "capacity", "flexkvd", "reference LRU", "bound", "requests/s");
    for (const TraceRun& r : runs) {
      fmt::print("{:>10} {:>10.4f} {:>14.4f} {:>10.4f} {:>10.0f}\n", r.capacity, r.hit_ratio(), r.reference.ratio(),
                 r.bound.ratio(), r.seconds > 0 ? static_cast<double>(r.requests) / r.seconds : 0.0);
    }
    if (plotted) fmt::print("plot: {}\n", o.plot);
  }
  bool ok = true;
  for (const TraceRun& r : runs) ok = ok && r.mismatches == 0;
  return ok ? 0 : 1;
}
