// flexkv-bench trace-worker: one client process (DP rank) of `flexkv-bench trace`; the protocol with the parent is
// at the top of trace_bench.cc.
#include <fmt/format.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "bench_process.h"
#include "common/hybrid_ids.h"
#include "common/mapped_region.h"
#include "flexkv/client.h"
#include "trace_bench.h"
#include "trace_replay.h"

namespace {

using namespace flexkv::bench;  // bench_process.h, trace_bench.h, trace_replay.h
using flexkv::NowNs;

// ---------------------------------------------------------------------------------------------------------------
// Turn page (trace_replay.h), waited on with process-shared futexes.


long Futex(std::atomic<uint32_t>* word, int op, uint32_t val, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, timeout, nullptr, 0);
}

// Waits until it is request `i`'s turn; false when a worker aborted.
bool AwaitTurn(TurnPage* page, uint32_t i) {
  const timespec tick{0, 100000000};
  for (;;) {
    if (page->abort.load(std::memory_order_acquire) != 0) return false;
    const uint32_t t = page->turn.load(std::memory_order_acquire);
    if (t == i) return true;
    Futex(&page->turn, FUTEX_WAIT, t, &tick);
  }
}

void PassTurn(TurnPage* page, uint32_t next) {
  page->turn.store(next, std::memory_order_release);
  Futex(&page->turn, FUTEX_WAKE, INT32_MAX, nullptr);
}

enum class Order { kStrict, kMatch, kFree };

// ---------------------------------------------------------------------------------------------------------------
// Worker

struct WorkerOptions {
  std::string socket, trace;
  int index = 0;
  int clients = 1;
  uint64_t block_bytes = 4096;
  std::string order = "strict";
  // A model preset (trace --geometry): its geometry scaled down by `scale` (ScaledGeometry), stores every
  // chunk_blocks of prefill (HybridPoolSim::Replay's boundaries). Empty: TraceGeometry(block_bytes).
  std::string preset;
  uint64_t scale = 1;
  uint32_t chunk_blocks = 16;
  uint32_t gap_us = 0;  // idle time before each request's Match, once it is its turn (trace --gap-us)
  // "every": each hybrid store carries every window block computed since the last store (window_keys); "trailing":
  // the trailing window only (trace --window-stores).
  std::string window_stores = "trailing";
};

int WorkerMain(const WorkerOptions& o) {
  const Order order = o.order == "free" ? Order::kFree : o.order == "match" ? Order::kMatch : Order::kStrict;
  flexkv::MappedRegion turn_map;
  TurnPage* page = nullptr;
  if (order != Order::kFree) {
    auto map = flexkv::MappedRegion::Shared("the turn page (fd 4)", 4, sizeof(TurnPage));
    if (!map.ok()) {
      Emit(fmt::format("ERROR {}\n", map.status().message()));
      return 1;
    }
    turn_map = std::move(*map);
    page = turn_map.as<TurnPage>();
  }
  auto fail = [&](const std::string& what, const flexkv::Status& s) {
    if (page != nullptr) {
      page->abort.store(1, std::memory_order_release);
      Futex(&page->turn, FUTEX_WAKE, INT32_MAX, nullptr);
    }
    Emit(fmt::format("ERROR {}: {}\n", what, s.ToString()));
    return 1;
  };
  auto trace = LoadTrace(o.trace);
  if (!trace) return fail("trace", flexkv::Status::InvalidArgument(o.trace));
  struct Mine {
    uint32_t index;  // in the trace
    std::vector<uint64_t> ids;
    std::vector<flexkv::BlockKey> keys;
  };
  std::vector<Mine> mine;
  uint32_t longest = 1;
  for (size_t i = static_cast<size_t>(o.index); i < trace->size(); i += static_cast<size_t>(o.clients)) {
    Mine m;
    m.index = static_cast<uint32_t>(i);
    m.ids = std::move((*trace)[i].hash_ids);
    m.keys = TraceKeys(m.ids);
    longest = std::max(longest, static_cast<uint32_t>(m.ids.size()));
    mine.push_back(std::move(m));
  }
  trace.reset();

  auto client = flexkv::Client::Connect({o.socket, std::chrono::milliseconds(20000), std::chrono::milliseconds(20000)});
  if (!client.ok()) return fail("Connect", client.status());
  flexkv::Client& c = **client;
  flexkv::AttachOptions attach;
  attach.client_name = fmt::format("flexkv-bench-trace-{}", o.index);
  attach.dp_rank = static_cast<uint32_t>(o.index);
  attach.model_namespace = kTraceNamespace;
  attach.geometry = TraceGeometry(o.block_bytes);
  if (!o.preset.empty()) {
    auto g = TracePreset(o.preset, kTraceTokensPerBlock);
    if (!g.ok()) return fail("--geometry", g.status());
    attach.geometry = ScaledGeometry(*g, o.scale);
  }
  const flexkv::Geometry& geometry = attach.geometry;
  auto session = c.Attach(attach);
  if (!session.ok()) return fail("Attach", session.status());
  // One buffer per component, engine block (or state slot) j at position j of the prompt (state: the snapshot
  // after block j - 1). Each block's first 8 bytes carry its trace id, so a later Load can check what it got.
  const bool hybrid = geometry.is_hybrid();
  const size_t ncomp = geometry.component_count();
  std::vector<flexkv::HostKvBuffers> kv;
  std::vector<uint64_t> bb;
  for (size_t comp = 0; comp < ncomp; ++comp) {
    const bool state = geometry.component_kind(comp) == flexkv::ComponentKind::kState;
    auto buffers = hybrid ? c.CreateHostKv(static_cast<uint32_t>(comp), flexkv::KvLayout::kBlockFirst,
                                           state ? longest + 1 : longest)
                          : c.CreateHostKv(flexkv::KvLayout::kBlockFirst, longest);
    if (!buffers.ok()) return fail("CreateHostKv", buffers.status());
    kv.push_back(*buffers);
    bb.push_back(hybrid ? session->component_slot_bytes.at(comp) : session->block_bytes);
  }
  bool has_state = false;
  for (size_t comp = 0; comp < ncomp; ++comp) has_state |= geometry.component_kind(comp) == flexkv::ComponentKind::kState;
  auto tag_at = [&](size_t comp, uint32_t j) { return kv[comp].data + uint64_t{j} * bb[comp]; };
  std::vector<uint32_t> block_ids(longest + 1);
  for (uint32_t i = 0; i <= longest; ++i) block_ids[i] = i;
  auto ids = [&](uint32_t begin, uint32_t end) { return std::span<const uint32_t>(block_ids.data() + begin, end - begin); };
  // The ids of prefix end e in each component (Load), or of the store at boundary b (Store: the same shape, the
  // state slot b). A sliding window's are its blocks [e - min(w, e), e).
  auto component_ids = [&](uint32_t e) {
    std::vector<std::span<const uint32_t>> out;
    for (size_t comp = 0; comp < ncomp; ++comp) {
      switch (geometry.component_kind(comp)) {
        case flexkv::ComponentKind::kFull: out.push_back(ids(0, e)); break;
        case flexkv::ComponentKind::kSlidingWindow: out.push_back(ids(e - std::min(geometry.window_blocks(comp), e), e)); break;
        case flexkv::ComponentKind::kState: out.push_back(ids(e, e + 1)); break;
      }
    }
    return out;
  };
  std::string ready = fmt::format("READY {}", session->capacity_blocks);
  for (uint64_t cap : session->component_capacity) ready += fmt::format(" {}", cap);
  Emit(ready + "\n");
  AwaitBarrier(0);

  const bool every_window = o.window_stores == "every";
  const auto timeout = std::chrono::seconds(60);
  auto run = [&](flexkv::Result<flexkv::Ticket> t) -> flexkv::Result<flexkv::OpResult> {
    if (!t.ok()) return t.status();
    return c.Wait(*t, timeout);
  };
  std::vector<int64_t> lat_match, lat_load, lat_release, lat_store;
  uint64_t blocks = 0, hits = 0, loaded = 0, stored = 0, shortfalls = 0, mismatches = 0;
  std::map<std::string, uint64_t> shortfall_codes;  // by status code name; the first message of each kept
  std::map<std::string, std::string> shortfall_first;
  const int64_t start = NowNs();
  for (const Mine& m : mine) {
    const auto n = static_cast<uint32_t>(m.ids.size());
    blocks += n;
    if (page != nullptr && !AwaitTurn(page, m.index)) return fail("turn", flexkv::Status::Internal("another worker failed"));
    if (o.gap_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(o.gap_us));
    int64_t t0 = NowNs();
    auto mr = run(c.Match(m.keys, /*pin=*/true));
    lat_match.push_back(NowNs() - t0);
    if (!mr.ok()) return fail("Match", mr.status());
    if (!mr->status.ok()) return fail("Match result", mr->status);
    if (order == Order::kMatch) PassTurn(page, m.index + 1);
    const uint32_t h = mr->matched_blocks;
    hits += h;
    if (h > 0) {
      const uint64_t poison = ~uint64_t{0};
      const std::vector<std::span<const uint32_t>> want = component_ids(h);
      for (size_t comp = 0; comp < ncomp; ++comp) {
        for (uint32_t j : want[comp]) std::memcpy(tag_at(comp, j), &poison, sizeof(poison));
      }
      t0 = NowNs();
      auto lr = run(hybrid ? c.Load(mr->match_handle, want) : c.Load(mr->match_handle, ids(0, h)));
      lat_load.push_back(NowNs() - t0);
      if (!lr.ok()) return fail("Load", lr.status());
      if (!lr->status.ok()) return fail("Load result", lr->status);
      loaded += hybrid ? h : lr->done_blocks;
      for (size_t comp = 0; comp < ncomp; ++comp) {
        for (uint32_t j : want[comp]) {
          if (!hybrid && j >= lr->done_blocks) break;
          uint64_t tag = 0;
          std::memcpy(&tag, tag_at(comp, j), sizeof(tag));
          // A state slot j holds the snapshot after block j - 1.
          const uint64_t expect = geometry.component_kind(comp) == flexkv::ComponentKind::kState ? m.ids[j - 1] : m.ids[j];
          if (tag != expect) ++mismatches;
        }
      }
      t0 = NowNs();
      auto rr = run(c.Release(mr->match_handle));
      lat_release.push_back(NowNs() - t0);
      if (!rr.ok()) return fail("Release", rr.status());
      if (!rr->status.ok()) return fail("Release result", rr->status);
    }
    if (h < n) {
      for (size_t comp = 0; comp < ncomp; ++comp) {
        const bool state = geometry.component_kind(comp) == flexkv::ComponentKind::kState;
        for (uint32_t j = state ? 1 : 0; j < (state ? n + 1 : n); ++j) {
          std::memcpy(tag_at(comp, j), &m.ids[state ? j - 1 : j], sizeof(uint64_t));
        }
      }
      // A hybrid engine stores at each chunk boundary of its prefill (the window and state it holds there) and at
      // the prompt's end; a full-attention one once (HybridPoolSim::Replay).
      const uint32_t chunk = hybrid ? o.chunk_blocks : 0;
      uint32_t chunk_start = h;  // the first block computed since the last store
      for (uint32_t b = chunk == 0 ? n : std::min(n, h + chunk);; chunk_start = b, b = std::min(n, b + chunk)) {
        const std::span<const flexkv::BlockKey> prefix(m.keys.data(), b);
        const uint32_t boundary[1] = {b};
        const std::span<const uint32_t> boundaries(boundary, has_state ? 1 : 0);
        // The engine has every window block it computed since its last store (a connector saves each chunk's new
        // blocks before they slide out of the window): with --window-stores every the store carries them all,
        // [chunk_start, b), when they are more than the trailing window (window_keys).
        uint32_t window_keys = 0;
        std::vector<std::span<const uint32_t>> parts = component_ids(b);
        if (hybrid && every_window && b - chunk_start > flexkv::MinWindowKeys(geometry, b)) {
          window_keys = b - chunk_start;
          for (size_t comp = 0; comp < ncomp; ++comp) {
            if (geometry.component_kind(comp) == flexkv::ComponentKind::kSlidingWindow) parts[comp] = ids(chunk_start, b);
          }
        }
        t0 = NowNs();
        auto sr = run(hybrid ? c.Store(flexkv::BlockKeyChain(prefix), parts, boundaries, window_keys)
                             : c.Store(flexkv::BlockKeyChain(prefix), ids(0, b)));
        lat_store.push_back(NowNs() - t0);
        if (!sr.ok()) return fail("Store", sr.status());
        stored += sr->done_blocks;
        // RESOURCE_EXHAUSTED (everything pinned) or ABORTED (another rank is storing the same block): counted.
        if (!sr->status.ok()) {
          ++shortfalls;
          const std::string code = flexkv::StatusCodeName(sr->status.code());
          if (shortfall_codes[code]++ == 0) shortfall_first[code] = sr->status.message();
        }
        if (b == n) break;
      }
    }
    if (order == Order::kStrict) PassTurn(page, m.index + 1);
  }
  const int64_t end = NowNs();
  Emit(fmt::format("RESULT {} {} {} {} {} {} {} {} {}\n", start, end, mine.size(), blocks, hits, loaded, stored,
                   shortfalls, mismatches));
  Emit(SampleLine("LAT match", lat_match));
  Emit(SampleLine("LAT load", lat_load));
  Emit(SampleLine("LAT release", lat_release));
  Emit(SampleLine("LAT store", lat_store));
  for (const auto& [code, count] : shortfall_codes) {
    std::string first = shortfall_first[code];
    std::replace(first.begin(), first.end(), '\n', ' ');
    Emit(fmt::format("SHORTFALL {} {} {}\n", code, count, first.substr(0, 200)));
  }
  Emit("DONE\n");
  (void)c.Detach();
  return 0;
}

}  // namespace

int RunTraceWorker(int argc, char** argv) {
  CLI::App app{"internal: one client process of `flexkv-bench trace`"};
  WorkerOptions o;
  app.add_option("--socket", o.socket)->required();
  app.add_option("--trace", o.trace)->required();
  app.add_option("--index", o.index);
  app.add_option("--clients", o.clients);
  app.add_option("--block-bytes", o.block_bytes);
  app.add_option("--order", o.order);
  app.add_option("--geometry", o.preset);
  app.add_option("--scale", o.scale);
  app.add_option("--chunk-blocks", o.chunk_blocks);
  app.add_option("--gap-us", o.gap_us);
  app.add_option("--window-stores", o.window_stores)->check(CLI::IsMember({"every", "trailing"}));
  CLI11_PARSE(app, argc, argv);
  return WorkerMain(o);
}
