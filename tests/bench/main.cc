// flexkv-bench: benchmarks that print what they measured next to a baseline from the same run.
//   flexkv-bench control [--socket S] [--iterations N] [--json]   gRPC unary round trip (GetStatus)
//   flexkv-bench ring [--socket S] [--clients N] [--iterations N] [--grpc-iterations N] [--blocks B] [--json]
//                     [--sweep] [--spin-us U] [--pin] [--breakdown]
//       Match round trip through the session rings (Match + Wait) from N concurrent client processes, and
//       the same lookup as a gRPC unary call (MatchViaControl) from the same processes as the baseline.
//       Without --socket it starts its own flexkvd (next to this executable) in a temporary directory, with
//       a 256MiB pool, and stops it with SIGTERM at the end. --sweep adds runs with 1, 2, 4 and 8 clients.
//
// `ring` runs each client as a separate process (this executable, hidden subcommand `ring-worker`,
// posix_spawn'ed so no gRPC state crosses a fork). Protocol between the parent and a worker:
//   worker stdout: READY | RING_DONE | RESULT <phase> <start_ns> <end_ns> <n> <sample_ns>... | ERROR <text>
//   worker fd 0:  ring start barrier (the parent closes the write end: EOF releases every worker at once)
//   worker fd 3:  gRPC start barrier (same), so the two phases never overlap across workers
// Timestamps are CLOCK_MONOTONIC (steady_clock), comparable across processes.
#include <fmt/format.h>
#include <sched.h>
#include <sys/wait.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "bench_json.h"
#include "bench_process.h"
#include "cluster_bench.h"
#include "flexkv/client.h"
#include "index_bench.h"
#include "kv_events_bench.h"
#include "trace_bench.h"
#include "host_transfer_bench.h"
#include "ssd_bench.h"
#include "transfer_bench.h"
#include "transfer_tp.h"
#include "transfer_two_way.h"

namespace {

using namespace flexkv::bench;  // bench_process.h
using flexkv::NowNs;

int RunControl(const std::string& socket, int iterations, bool json) {
  auto client = flexkv::Client::Connect({socket, std::chrono::milliseconds(5000), std::chrono::milliseconds(10000)});
  if (!client.ok()) {
    std::fprintf(stderr, "flexkv-bench: %s\n", client.status().ToString().c_str());
    return 3;
  }
  for (int i = 0; i < 100; ++i) (void)(*client)->GetStatus();  // warm up
  std::vector<int64_t> samples;
  samples.reserve(static_cast<size_t>(iterations));
  for (int i = 0; i < iterations; ++i) {
    const int64_t t0 = NowNs();
    auto s = (*client)->GetStatus();
    const int64_t t1 = NowNs();
    if (!s.ok()) {
      std::fprintf(stderr, "flexkv-bench: GetStatus: %s\n", s.status().ToString().c_str());
      return 1;
    }
    samples.push_back(t1 - t0);
  }
  const Percentiles p = Summarize(std::move(samples));
  if (json) {
    fmt::print("{}", DumpLine(Json{{"bench", "control"},
                                   {"call", "GetStatus"},
                                   {"iterations", iterations},
                                   {"p50_us", Rounded(p.p50_us, 2)},
                                   {"p99_us", Rounded(p.p99_us, 2)},
                                   {"p999_us", Rounded(p.p999_us, 2)},
                                   {"mean_us", Rounded(p.mean_us, 2)}}));
  } else {
    fmt::print("gRPC GetStatus over the unix socket, {} calls: p50 {:.1f} us, p99 {:.1f} us, p99.9 {:.1f} us\n",
               iterations, p.p50_us, p.p99_us, p.p999_us);
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------------------------
// ring

constexpr const char* kRingNamespace = "flexkv-bench-ring";
constexpr uint64_t kRingSeed = 20261202;

// Small geometry so the setup store is quick: 16 tokens, 2 layers, K/V, 1 head of 64, bf16 = 8 KiB per block.
flexkv::Geometry RingGeometry() {
  flexkv::Geometry g;
  g.tokens_per_block = 16;
  g.num_layers = 2;
  g.kv_planes = 2;
  g.kv_heads_per_rank = 1;
  g.head_dim = 64;
  g.dtype_bytes = 2;
  g.tp_size = 1;
  return g;
}

std::vector<flexkv::BlockKey> RingKeys(uint32_t blocks) {
  const flexkv::Geometry g = RingGeometry();
  std::mt19937_64 rng(kRingSeed);
  std::vector<int32_t> tokens(uint64_t{blocks} * g.tokens_per_block);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % 128000);
  return flexkv::ComputeBlockKeys(kRingNamespace, tokens, g.tokens_per_block);
}

struct RingWorkerOptions {
  std::string socket;
  int index = 0;
  int iterations = 20000;
  int grpc_iterations = 5000;
  int warmup = 2000;
  uint32_t blocks = 4;
  bool breakdown = false;  // also time Match (submit) alone, and poll with TryWait instead of Wait
};

int RunRingWorker(const RingWorkerOptions& o) {
  auto fail = [](const std::string& what, const flexkv::Status& s) {
    Emit(fmt::format("ERROR {}: {}\n", what, s.ToString()));
    return 1;
  };
  auto client = flexkv::Client::Connect({o.socket, std::chrono::milliseconds(10000), std::chrono::milliseconds(10000)});
  if (!client.ok()) return fail("Connect", client.status());
  flexkv::Client& c = **client;
  flexkv::AttachOptions attach;
  attach.client_name = fmt::format("flexkv-bench-ring-{}", o.index);
  attach.dp_rank = static_cast<uint32_t>(o.index);
  attach.model_namespace = kRingNamespace;
  attach.geometry = RingGeometry();
  auto session = c.Attach(attach);
  if (!session.ok()) return fail("Attach", session.status());
  const std::vector<flexkv::BlockKey> keys = RingKeys(o.blocks);
  const auto timeout = std::chrono::seconds(10);

  auto one_match = [&]() -> std::optional<flexkv::Status> {
    auto t = c.Match(keys);
    if (!t.ok()) return t.status();
    auto r = c.Wait(*t, timeout);
    if (!r.ok()) return r.status();
    if (!r->status.ok()) return r->status;
    if (r->matched_blocks != o.blocks) {
      return flexkv::Status::Internal(fmt::format("matched {} of {} blocks (the setup store did not stick?)",
                                                  r->matched_blocks, o.blocks));
    }
    return std::nullopt;
  };

  for (int i = 0; i < o.warmup; ++i) {
    if (auto err = one_match()) return fail("warm-up Match", *err);
  }
  Emit("READY\n");
  AwaitBarrier(0);

  std::vector<int64_t> ring(static_cast<size_t>(o.iterations));
  std::vector<int64_t> submit;
  if (o.breakdown) submit.resize(static_cast<size_t>(o.iterations));
  const int64_t ring_start = NowNs();
  for (int i = 0; o.breakdown && i < o.iterations; ++i) {
    // Breakdown: Match() alone, then the wait as a TryWait poll (no futex, no Wait bookkeeping).
    const int64_t t0 = NowNs();
    auto t = c.Match(keys);
    const int64_t ts = NowNs();
    if (!t.ok()) return fail("Match", t.status());
    std::optional<flexkv::OpResult> r;
    while (!r) {
      auto polled = c.TryWait(*t);
      if (!polled.ok()) return fail("TryWait", polled.status());
      r = std::move(*polled);
    }
    const int64_t t1 = NowNs();
    if (!r->status.ok() || r->matched_blocks != o.blocks) return fail("Match result", r->status);
    submit[static_cast<size_t>(i)] = ts - t0;
    ring[static_cast<size_t>(i)] = t1 - t0;
  }
  for (int i = 0; !o.breakdown && i < o.iterations; ++i) {
    const int64_t t0 = NowNs();
    auto t = c.Match(keys);
    if (!t.ok()) return fail("Match", t.status());
    auto r = c.Wait(*t, timeout);
    const int64_t t1 = NowNs();
    if (!r.ok()) return fail("Wait", r.status());
    if (!r->status.ok() || r->matched_blocks != o.blocks) {
      return fail("Match result", r->status.ok() ? flexkv::Status::Internal(fmt::format("matched {} of {} blocks",
                                                                                         r->matched_blocks, o.blocks))
                                                 : r->status);
    }
    ring[static_cast<size_t>(i)] = t1 - t0;
  }
  const int64_t ring_end = NowNs();
  Emit("RING_DONE\n");
  AwaitBarrier(3);

  for (int i = 0; i < std::min(o.grpc_iterations, 200); ++i) {
    auto m = c.MatchViaControl(keys);
    if (!m.ok()) return fail("warm-up MatchViaControl", m.status());
  }
  std::vector<int64_t> grpc(static_cast<size_t>(o.grpc_iterations));
  const int64_t grpc_start = NowNs();
  for (int i = 0; i < o.grpc_iterations; ++i) {
    const int64_t t0 = NowNs();
    auto m = c.MatchViaControl(keys);
    const int64_t t1 = NowNs();
    if (!m.ok()) return fail("MatchViaControl", m.status());
    if (*m != o.blocks) return fail("MatchViaControl", flexkv::Status::Internal(fmt::format("matched {} of {}", *m, o.blocks)));
    grpc[static_cast<size_t>(i)] = t1 - t0;
  }
  const int64_t grpc_end = NowNs();

  auto result_line = [](const char* phase, int64_t start, int64_t end, const std::vector<int64_t>& s) {
    return SampleLine(fmt::format("RESULT {} {} {}", phase, start, end), s);
  };
  Emit(result_line("ring", ring_start, ring_end, ring));
  Emit(result_line("grpc", grpc_start, grpc_end, grpc));
  if (o.breakdown) Emit(result_line("submit", ring_start, ring_end, submit));
  (void)c.Detach();
  return 0;
}

struct RingOptions {
  std::string socket;
  int clients = 2;
  int iterations = 20000;
  int grpc_iterations = 5000;
  int warmup = 2000;
  uint32_t blocks = 4;
  bool json = false;
  bool sweep = false;
  bool breakdown = false;
  bool pin = false;     // spawned flexkvd on CPU 0, this process and the workers on the other CPUs
  double spin_us = -1;  // < 0: the daemon's default
};

struct PhaseStats {
  Percentiles p{};
  double per_s = 0;
  size_t samples = 0;
};

struct RingRun {
  int clients = 0;
  PhaseStats ring, grpc;
  std::optional<PhaseStats> submit;  // --breakdown: Match() alone
};

PhaseStats Merge(const std::vector<std::vector<int64_t>>& samples, const std::vector<std::pair<int64_t, int64_t>>& spans) {
  PhaseStats st;
  std::vector<int64_t> all;
  for (const auto& s : samples) all.insert(all.end(), s.begin(), s.end());
  st.samples = all.size();
  st.p = Summarize(std::move(all));
  if (!spans.empty()) {
    int64_t first = spans[0].first, last = spans[0].second;
    for (const auto& [a, b] : spans) {
      first = std::min(first, a);
      last = std::max(last, b);
    }
    if (last > first) st.per_s = static_cast<double>(st.samples) / (static_cast<double>(last - first) / 1e9);
  }
  return st;
}

// One measured run with `clients` worker processes against `socket`.
std::optional<RingRun> RunRingOnce(const std::string& self, const std::string& socket, const RingOptions& o,
                                   int clients, int grpc_iterations) {
  auto ring_barrier = StartBarrier::Create();
  auto grpc_barrier = StartBarrier::Create();
  if (!ring_barrier || !grpc_barrier) return std::nullopt;
  std::vector<Child> workers;
  auto abort_all = [&](const std::string& why) -> std::optional<RingRun> {
    std::fprintf(stderr, "flexkv-bench: %s\n", why.c_str());
    for (auto& w : workers) w.Kill();
    return std::nullopt;
  };
  for (int i = 0; i < clients; ++i) {
    std::vector<std::string> argv = {self,
                                     "ring-worker",
                                     "--socket",
                                     socket,
                                     "--index",
                                     std::to_string(i),
                                     "--iterations",
                                     std::to_string(o.iterations),
                                     "--grpc-iterations",
                                     std::to_string(grpc_iterations),
                                     "--warmup",
                                     std::to_string(o.warmup),
                                     "--blocks",
                                     std::to_string(o.blocks)};
    if (o.breakdown) argv.push_back("--breakdown");
    auto w = Spawn(argv, {{ring_barrier->read_end(), 0}, {grpc_barrier->read_end(), 3}});
    if (!w) return abort_all("could not start a ring-worker");
    workers.push_back(std::move(*w));
  }

  auto await_all = [&](const std::string& want, std::chrono::milliseconds timeout) -> std::optional<std::string> {
    for (size_t i = 0; i < workers.size(); ++i) {
      auto line = workers[i].ReadLine(timeout);
      if (!line) return fmt::format("worker {} ended or timed out before {}", i, want);
      if (*line != want) return fmt::format("worker {}: {}", i, *line);
    }
    return std::nullopt;
  };
  if (auto err = await_all("READY", std::chrono::seconds(120))) return abort_all(*err);
  ring_barrier->Release();  // go
  if (auto err = await_all("RING_DONE", std::chrono::seconds(1800))) return abort_all(*err);
  grpc_barrier->Release();  // go
  std::map<std::string, std::vector<std::vector<int64_t>>> samples;
  std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> spans;
  for (size_t i = 0; i < workers.size(); ++i) {
    while (auto line = workers[i].ReadLine(std::chrono::seconds(1800))) {
      char phase[16] = {};
      long long start = 0, end = 0;
      size_t n = 0;
      int consumed = 0;
      if (std::sscanf(line->c_str(), "RESULT %15s %lld %lld %zu%n", phase, &start, &end, &n, &consumed) != 4) {
        return abort_all(fmt::format("worker {}: {}", i, line->substr(0, 200)));
      }
      samples[phase].push_back(ParseSamples(line->c_str() + consumed, n));
      spans[phase].emplace_back(start, end);
    }
  }
  for (size_t i = 0; i < workers.size(); ++i) {
    const int status = workers[i].Wait();
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::fprintf(stderr, "flexkv-bench: worker %zu exited with status 0x%x\n", i, status);
      return std::nullopt;
    }
  }
  RingRun run;
  run.clients = clients;
  run.ring = Merge(samples["ring"], spans["ring"]);
  run.grpc = Merge(samples["grpc"], spans["grpc"]);
  if (samples.count("submit") != 0) run.submit = Merge(samples["submit"], spans["submit"]);
  if (run.ring.samples != static_cast<size_t>(clients) * static_cast<size_t>(o.iterations) ||
      run.grpc.samples != static_cast<size_t>(clients) * static_cast<size_t>(grpc_iterations)) {
    std::fprintf(stderr, "flexkv-bench: the workers reported %zu ring and %zu gRPC samples; expected %d and %d\n",
                 run.ring.samples, run.grpc.samples, clients * o.iterations, clients * grpc_iterations);
    return std::nullopt;
  }
  return run;
}

// Stores the prefix the workers match, from a short-lived session of this process (its own gRPC channel; the
// workers are exec'ed, so they inherit none of it).
bool StorePrefix(const std::string& socket, uint32_t prefix) {
  auto client = flexkv::Client::Connect({socket, std::chrono::milliseconds(10000), std::chrono::milliseconds(10000)});
  if (!client.ok()) {
    std::fprintf(stderr, "flexkv-bench: %s\n", client.status().ToString().c_str());
    return false;
  }
  flexkv::Client& c = **client;
  flexkv::AttachOptions attach;
  attach.client_name = "flexkv-bench-ring-setup";
  attach.model_namespace = kRingNamespace;
  attach.geometry = RingGeometry();
  auto session = c.Attach(attach);
  if (!session.ok()) {
    std::fprintf(stderr, "flexkv-bench: Attach: %s\n", session.status().ToString().c_str());
    return false;
  }
  auto kv = c.CreateHostKv(flexkv::KvLayout::kBlockFirst, prefix);
  if (!kv.ok()) {
    std::fprintf(stderr, "flexkv-bench: CreateHostKv: %s\n", kv.status().ToString().c_str());
    return false;
  }
  for (uint64_t i = 0; i < kv->bytes; ++i) kv->data[i] = static_cast<uint8_t>(i * 131 + 7);
  const auto keys = RingKeys(prefix);
  std::vector<uint32_t> ids(prefix);
  for (uint32_t i = 0; i < prefix; ++i) ids[i] = i;
  auto t = c.Store(flexkv::BlockKeyChain(keys), ids);
  auto r = t.ok() ? c.Wait(*t, std::chrono::seconds(30)) : flexkv::Result<flexkv::OpResult>(t.status());
  if (!r.ok() || !r->status.ok()) {
    std::fprintf(stderr, "flexkv-bench: Store: %s\n", (r.ok() ? r->status : r.status()).ToString().c_str());
    return false;
  }
  auto m = c.MatchViaControl(keys);
  if (!m.ok() || *m != prefix) {
    std::fprintf(stderr, "flexkv-bench: the stored prefix does not match: %s\n",
                 m.ok() ? fmt::format("{} of {} blocks", *m, prefix).c_str() : m.status().ToString().c_str());
    return false;
  }
  (void)c.Detach();
  return true;
}

// The "ring", "grpc" and ratio fields of one run.
Json RunJson(const RingRun& r) {
  auto path = [](const auto& side) {
    return Json{{"p50_us", Rounded(side.p.p50_us, 3)},   {"p99_us", Rounded(side.p.p99_us, 3)},
                {"p999_us", Rounded(side.p.p999_us, 3)}, {"mean_us", Rounded(side.p.mean_us, 3)},
                {"matches_per_s", Whole(side.per_s)}, {"samples", side.samples}};
  };
  return Json{{"ring", path(r.ring)},
              {"grpc", path(r.grpc)},
              {"ratio_p50", Rounded(r.ring.p.p50_us > 0 ? r.grpc.p.p50_us / r.ring.p.p50_us : 0.0, 1)},
              {"ratio_p99", Rounded(r.ring.p.p99_us > 0 ? r.grpc.p.p99_us / r.ring.p.p99_us : 0.0, 1)}};
}

int RunRing(RingOptions o) {
  const std::string self = SelfExe();
  if (self.empty()) {
    std::fprintf(stderr, "flexkv-bench: cannot resolve /proc/self/exe\n");
    return 3;
  }
  std::unique_ptr<OwnDaemon> own;
  std::string socket = o.socket;
  if (socket.empty()) {
    std::vector<std::string> args = {"--pool-size", "256MiB"};
    if (o.spin_us >= 0) {
      args.push_back("--spin-us");
      args.push_back(fmt::format("{}", o.spin_us));
    }
    cpu_set_t all;
    CPU_ZERO(&all);
    if (o.pin) {
      // The daemon inherits CPU 0 only (all its threads: the mask is set before exec); then this process,
      // and so every worker it starts, moves to the other CPUs.
      if (sched_getaffinity(0, sizeof(all), &all) != 0 || CPU_COUNT(&all) < 2 || !CPU_ISSET(0, &all)) {
        std::fprintf(stderr, "flexkv-bench: --pin needs CPU 0 and at least one other CPU in this process's mask\n");
        return 2;
      }
      cpu_set_t zero;
      CPU_ZERO(&zero);
      CPU_SET(0, &zero);
      sched_setaffinity(0, sizeof(zero), &zero);
    }
    own = OwnDaemon::Start("/tmp/flexkv-bench-XXXXXX", args);
    if (o.pin) {
      cpu_set_t rest = all;
      CPU_CLR(0, &rest);
      sched_setaffinity(0, sizeof(rest), &rest);
    }
    if (!own) return 3;
    socket = own->socket();
  } else if (o.spin_us >= 0 || o.pin) {
    std::fprintf(stderr, "flexkv-bench: --spin-us and --pin apply only to the flexkvd this bench starts (no --socket)\n");
    return 2;
  }
  const uint32_t prefix = std::max<uint32_t>(64, o.blocks);
  if (!StorePrefix(socket, prefix)) {
    if (own) own->DumpLog();
    return 3;
  }
  auto main_run = RunRingOnce(self, socket, o, o.clients, o.grpc_iterations);
  if (!main_run) {
    if (own) own->DumpLog();
    return 1;
  }
  std::vector<RingRun> sweep;
  if (o.sweep) {
    for (int n : {1, 2, 4, 8}) {
      auto r = RunRingOnce(self, socket, o, n, o.grpc_iterations);
      if (!r) {
        if (own) own->DumpLog();
        return 1;
      }
      sweep.push_back(*r);
    }
  }
  const RingRun& r = *main_run;
  const double ratio = r.ring.p.p50_us > 0 ? r.grpc.p.p50_us / r.ring.p.p50_us : 0.0;
  if (o.json) {
    Json report{{"bench", "ring"},
                {"clients", r.clients},
                {"blocks_per_match", o.blocks},
                {"iterations_per_client", o.iterations},
                {"grpc_iterations_per_client", o.grpc_iterations},
                {"daemon", own ? "spawned" : "external"},
                {"pinned", o.pin},
                {"spin_us", o.spin_us >= 0 && own ? Json(o.spin_us) : Json(nullptr)}};
    report.update(RunJson(r));
    if (r.submit) {
      report["breakdown"] = {{"wait", "TryWait poll"},
                             {"submit_p50_us", Rounded(r.submit->p.p50_us, 3)},
                             {"submit_p99_us", Rounded(r.submit->p.p99_us, 3)},
                             {"submit_p999_us", Rounded(r.submit->p.p999_us, 3)},
                             {"submit_mean_us", Rounded(r.submit->p.mean_us, 3)}};
    }
    if (o.sweep) {
      Json runs = Json::array();
      for (const RingRun& s : sweep) {
        runs.push_back({{"clients", s.clients},
                        {"matches_per_s", Whole(s.ring.per_s)},
                        {"p50_us", Rounded(s.ring.p.p50_us, 3)},
                        {"p99_us", Rounded(s.ring.p.p99_us, 3)},
                        {"p999_us", Rounded(s.ring.p.p999_us, 3)},
                        {"grpc_matches_per_s", Whole(s.grpc.per_s)},
                        {"grpc_p50_us", Rounded(s.grpc.p.p50_us, 3)}});
      }
      report["sweep"] = std::move(runs);
    }
    fmt::print("{}", DumpLine(report));
  } else {
    fmt::print("Match round trip, {} keys per match, {} client process(es), {} ring / {} gRPC matches each ({} daemon{})\n",
               o.blocks, r.clients, o.iterations, o.grpc_iterations, own ? "spawned" : "external",
               o.pin ? ", pinned to CPU 0, clients on the other CPUs" : "");
    fmt::print("{:<22} {:>10} {:>10} {:>10} {:>10} {:>14}\n", "path", "p50 us", "p99 us", "p99.9 us", "mean us",
               "matches/s");
    fmt::print("{:<22} {:>10.2f} {:>10.2f} {:>10.2f} {:>10.2f} {:>14.0f}\n",
               o.breakdown ? "rings (Match+TryWait)" : "rings (Match+Wait)", r.ring.p.p50_us,
               r.ring.p.p99_us, r.ring.p.p999_us, r.ring.p.mean_us, r.ring.per_s);
    fmt::print("{:<22} {:>10.2f} {:>10.2f} {:>10.2f} {:>10.2f} {:>14.0f}\n", "gRPC unary (baseline)", r.grpc.p.p50_us,
               r.grpc.p.p99_us, r.grpc.p.p999_us, r.grpc.p.mean_us, r.grpc.per_s);
    if (r.submit) {
      fmt::print("{:<22} {:>10.2f} {:>10.2f} {:>10.2f} {:>10.2f}\n", "  of which Match()", r.submit->p.p50_us,
                 r.submit->p.p99_us, r.submit->p.p999_us, r.submit->p.mean_us);
    }
    fmt::print("ratio gRPC/rings: p50 {:.1f}x, p99 {:.1f}x\n", ratio,
               r.ring.p.p99_us > 0 ? r.grpc.p.p99_us / r.ring.p.p99_us : 0.0);
    if (o.sweep) {
      fmt::print("\n{:>8} {:>16} {:>10} {:>10} {:>10} {:>16}\n", "clients", "ring matches/s", "p50 us", "p99 us",
                 "p99.9 us", "gRPC matches/s");
      for (const RingRun& s : sweep) {
        fmt::print("{:>8} {:>16.0f} {:>10.2f} {:>10.2f} {:>10.2f} {:>16.0f}\n", s.clients, s.ring.per_s,
                   s.ring.p.p50_us, s.ring.p.p99_us, s.ring.p.p999_us, s.grpc.per_s);
      }
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // GPU <-> host-pool copy bench (CUDA builds; elsewhere it says so and exits 2).
  if (argc >= 2 && std::strcmp(argv[1], "transfer") == 0) {
    for (int i = 2; i < argc; ++i) {
      if (std::strcmp(argv[i], "--host") == 0) return RunHostTransferBench(argc - 1, argv + 1);
      if (std::strcmp(argv[i], "--two-way") == 0) return RunTwoWayStudy(argc - 1, argv + 1);
      if (std::strcmp(argv[i], "--tp-ranks") == 0) return RunTpStudy(argc - 1, argv + 1);
    }
    return RunTransferBench(argc - 1, argv + 1);
  }
  // Trace replay through a spawned flexkvd (trace_bench.h) and the in-process index bench (index_bench.h).
  if (argc >= 2 && std::strcmp(argv[1], "trace") == 0) return RunTraceBench(argc - 1, argv + 1);
  if (argc >= 2 && std::strcmp(argv[1], "trace-worker") == 0) return RunTraceWorker(argc - 1, argv + 1);
  if (argc >= 2 && std::strcmp(argv[1], "index") == 0) return RunIndexBench(argc - 1, argv + 1);
  if (argc >= 2 && std::strcmp(argv[1], "events") == 0) return RunKvEventsBench(argc - 1, argv + 1);
  // The SSD tier's store against fio, same directory, same run (ssd_bench.h).
  if (argc >= 2 && std::strcmp(argv[1], "ssd") == 0) return RunSsdBench(argc - 1, argv + 1);
  // The cluster tier between two flexkvd in network namespaces, against ucx_perftest (cluster_bench.h; root).
  if (argc >= 2 && std::strcmp(argv[1], "cluster") == 0) return RunClusterBench(argc - 1, argv + 1);
  if (argc >= 2 && std::strcmp(argv[1], "cluster-dir-worker") == 0) return RunClusterDirWorker(argc - 1, argv + 1);
  CLI::App app{"flexkv-bench: flexkvd benchmarks"};
  app.require_subcommand(1);
  std::string socket;
  bool json = false;
  int iterations = 20000;
  auto* control = app.add_subcommand("control", "gRPC unary round trip (GetStatus) over the control socket");
  control->add_option("--socket", socket, "Control socket (default: $FLEXKV_SOCKET or the default)");
  control->add_option("--iterations", iterations)->check(CLI::Range(1, 100000000));
  control->add_flag("--json", json);

  RingOptions ro;
  auto* ring = app.add_subcommand("ring", "Match round trip through the session rings vs the same lookup over gRPC");
  ring->add_option("--socket", ro.socket, "Use this flexkvd (default: start one in a temporary directory)");
  ring->add_option("--clients", ro.clients, "Concurrent client processes (default 2)")->check(CLI::Range(1, 256));
  ring->add_option("--iterations", ro.iterations, "Ring matches per client (default 20000)")->check(CLI::Range(1, 100000000));
  ring->add_option("--grpc-iterations", ro.grpc_iterations, "gRPC matches per client (default 5000)")
      ->check(CLI::Range(1, 100000000));
  ring->add_option("--warmup", ro.warmup, "Untimed ring matches per client first (default 2000)")->check(CLI::Range(0, 100000000));
  ring->add_option("--blocks", ro.blocks, "Keys per match (default 4)")->check(CLI::Range(1u, 4096u));
  ring->add_flag("--json", ro.json, "One JSON object");
  ring->add_flag("--sweep", ro.sweep, "Also run with 1, 2, 4 and 8 clients and report matches/s for each");
  ring->add_flag("--pin", ro.pin, "Pin the flexkvd this bench starts to CPU 0 and the client processes to the other CPUs");
  ring->add_flag("--breakdown", ro.breakdown,
                 "Diagnosis: time Match() (submit) separately and poll with TryWait instead of Wait");
  ring->add_option("--spin-us", ro.spin_us, "--spin-us of the flexkvd this bench starts")->check(CLI::Range(0.0, 100000.0));

  RingWorkerOptions wo;
  app.add_subcommand("transfer", "GPU <-> host-pool copies vs contiguous copies (flexkv-bench transfer --help); "
                                 "--geometry NAME: one cache hit of a (hybrid) geometry preset, per component; "
                                 "--host: the host store copy with and without block checksums");
  app.add_subcommand("trace", "Replay a Mooncake trace through a spawned flexkvd: hit ratio vs block LRU; --geometry: "
                             "a hybrid model's pool vs its all-FULL reference (trace --help)");
  app.add_subcommand("events", "KV event stream's cost on the store path: store round trips with and without a "
                               "subscriber (events --help)");
  app.add_subcommand("index", "PrefixIndex throughput, memory per block and restart time at scale (index --help)");
  app.add_subcommand("ssd", "SSD tier: write-back and promotion throughput against fio (io_uring, O_DIRECT, same block "
                            "size, directory and queue depth), rebuild time after kill -9 (ssd --help)");
  app.add_subcommand("cluster", "Cluster tier (root): pulls between two flexkvd in network namespaces against "
                                "ucx_perftest, the etcd directory's latency, a simulated N-node trace (cluster --help)");
  auto* worker = app.add_subcommand("ring-worker", "internal: one client process of `ring`");
  worker->group("");  // hidden
  worker->add_option("--socket", wo.socket)->required();
  worker->add_option("--index", wo.index);
  worker->add_option("--iterations", wo.iterations);
  worker->add_option("--grpc-iterations", wo.grpc_iterations);
  worker->add_option("--warmup", wo.warmup);
  worker->add_option("--blocks", wo.blocks);
  worker->add_flag("--breakdown", wo.breakdown);
  CLI11_PARSE(app, argc, argv);
  if (control->parsed()) return RunControl(socket, iterations, json);
  if (ring->parsed()) return RunRing(ro);
  if (worker->parsed()) return RunRingWorker(wo);
  return 2;
}
