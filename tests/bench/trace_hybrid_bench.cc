// flexkv-bench trace --geometry PRESET: replays the trace for a (hybrid) geometry through a real flexkvd (a scaled
// copy of the geometry, trace_worker.cc) and in-process (HybridPoolSim, trace_bench.h, at the daemon's sub-pool
// sizes), next to the all-FULL reference at the same byte budget, and reports per component the bytes stored and
// loaded per hit token and how many prefixes each pool holds at the end (docs/performance.md, "Trace replay of
// hybrid geometries").
//
// Definitions (printed with the figures):
//   budget        --capacity-blocks N blocks of the all-FULL reference (AllFullReference), in the model's bytes
//                 at 512 tokens a block; the hybrid pool splits the same bytes between its sub-pools.
//   hit ratio     hit blocks (the prefix end e of the hit rule) / prompt blocks, as in the daemon replay.
//   prompts held  of the trace's distinct prompts, those that would be a whole hit (e = n) at the end of the run:
//                 the "prefixes held" of the issue.
//   usable ends   distinct cached prefix ends at which the hit rule holds at the end of the run (for the
//                 reference: every cached block).
//   per hit token bytes a component stored (loaded) over the run / (hit blocks x 512).
//   --split       the budget's split between sub-pools: flexkvd's default, or (demand, weights) given to the
//                 daemon as --swa-share / --state-share, so the daemon and the simulation always split alike.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <unordered_set>
#include <vector>

#include "bench_json.h"
#include "common/units.h"
#include "daemon/cache/pool.h"
#include "trace_bench.h"
#include "trace_replay.h"

namespace flexkv::bench {
namespace {

constexpr uint32_t kTokensPerBlock = kTraceTokensPerBlock;

struct SimRun {
  std::vector<SimComponent> components;
  std::vector<uint64_t> slot_bytes;
  std::vector<double> shares;
  uint64_t blocks = 0, hit_blocks = 0, stores = 0, refused_stores = 0;
  std::vector<uint64_t> stored, loaded, held, evictions, unanchored;
  uint64_t usable_ends = 0, prompts_held = 0;
  double hit_ratio() const { return blocks == 0 ? 0.0 : static_cast<double>(hit_blocks) / static_cast<double>(blocks); }
  // Bytes of component c per hit token (stored or loaded entries x slot bytes).
  double PerHitToken(uint64_t entries, size_t c) const {
    return hit_blocks == 0 ? 0.0
                           : static_cast<double>(entries) * static_cast<double>(slot_bytes[c]) /
                                 static_cast<double>(hit_blocks * kTokensPerBlock);
  }
};

double Ratio(uint64_t a, uint64_t b) { return b == 0 ? 0.0 : static_cast<double>(a) / static_cast<double>(b); }

std::vector<uint64_t> SlotBytes(const Geometry& g) {
  std::vector<uint64_t> out;
  for (size_t i = 0; i < g.component_count(); ++i) out.push_back(g.Component(i).host_block_bytes());
  return out;
}

// Replays every request in trace order; `prompts` are the indices of the distinct prompts (checked at the end).
SimRun Replay(const Geometry& g, std::span<const uint32_t> capacities, std::span<const std::vector<BlockKey>> keys,
              std::span<const size_t> prompts, uint32_t chunk_blocks, bool every_window) {
  SimRun run;
  run.components = SimComponentsOf(g, capacities);
  run.slot_bytes = SlotBytes(g);
  const size_t n = run.components.size();
  run.stored.assign(n, 0);
  run.loaded.assign(n, 0);
  HybridPoolSim sim(run.components);
  for (const std::vector<BlockKey>& k : keys) {
    const HybridPoolSim::Request r = sim.Replay(k, chunk_blocks, every_window);
    run.blocks += k.size();
    run.hit_blocks += r.hit_end;
    run.stores += r.stores;
    run.refused_stores += r.refused_stores;
    for (size_t c = 0; c < n; ++c) {
      run.stored[c] += r.stored[c];
      run.loaded[c] += r.loaded[c];
    }
  }
  for (size_t c = 0; c < n; ++c) {
    run.held.push_back(sim.held(c));
    run.evictions.push_back(sim.evictions(c));
    run.unanchored.push_back(sim.unanchored(c));
  }
  run.usable_ends = sim.UsableEndsHeld();
  for (size_t p : prompts) run.prompts_held += sim.UsableEnd(keys[p]) == keys[p].size() ? 1 : 0;
  return run;
}

// The pool that never evicts: its hit ratio is the geometry's bound at this chunking, and the bytes each component
// holds at the end are its demand (the default split is in proportion to it).
SimRun Unbounded(const Geometry& g, std::span<const std::vector<BlockKey>> keys, uint32_t chunk_blocks,
                 bool every_window) {
  uint64_t total = 0;
  for (const auto& k : keys) total += k.size();
  const std::vector<uint32_t> unbounded(g.component_count(),
                                        static_cast<uint32_t>(std::min<uint64_t>(total + 1, UINT32_MAX)));
  return Replay(g, unbounded, keys, {}, chunk_blocks, every_window);
}

// Each component's share of the budget, from its capacity.
std::vector<double> SharesOf(std::span<const uint32_t> capacity, std::span<const uint64_t> slot_bytes, uint64_t budget) {
  std::vector<double> shares;
  for (size_t c = 0; c < capacity.size(); ++c) {
    shares.push_back(static_cast<double>(capacity[c]) * static_cast<double>(slot_bytes[c]) / static_cast<double>(budget));
  }
  return shares;
}

Json DaemonJson(const HybridDaemonRun& d, const Geometry& g) {
  Json comps = Json::array();
  for (size_t c = 0; c < d.capacity.size(); ++c) {
    comps.push_back(Json{{"component", c},
                         {"kind", ComponentKindName(g.component_kind(c))},
                         {"capacity", d.capacity[c]},
                         {"used", c < d.used.size() ? d.used[c] : 0},
                         {"unanchored", c < d.unanchored.size() ? d.unanchored[c] : 0},
                         {"evictions", c < d.evicted.size() ? d.evicted[c] : 0}});
  }
  return Json{{"hit_ratio", Rounded(Ratio(d.hit_blocks, d.blocks), 4)},
              {"hit_blocks", d.hit_blocks},
              {"full_blocks_stored", d.stored_full},
              {"store_shortfalls", d.shortfalls},
              {"load_mismatches", d.mismatches},
              {"seconds", Rounded(d.seconds, 3)},
              {"components", comps}};
}

Json HybridRunJson(const SimRun& r, const Geometry& g) {
  Json comps = Json::array();
  for (size_t c = 0; c < r.components.size(); ++c) {
    comps.push_back(Json{{"component", c},
                         {"kind", ComponentKindName(g.component_kind(c))},
                         {"window_blocks", r.components[c].window_blocks},
                         {"slot_bytes", r.slot_bytes[c]},
                         {"share", Rounded(r.shares.empty() ? 1.0 : r.shares[c], 4)},
                         {"capacity", r.components[c].capacity},
                         {"held", r.held[c]},
                         {"unanchored", r.unanchored[c]},
                         {"evictions", r.evictions[c]},
                         {"stored_entries", r.stored[c]},
                         {"loaded_entries", r.loaded[c]},
                         {"stored_bytes_per_hit_token", Rounded(r.PerHitToken(r.stored[c], c), 1)},
                         {"loaded_bytes_per_hit_token", Rounded(r.PerHitToken(r.loaded[c], c), 1)}});
  }
  return Json{{"hit_ratio", Rounded(r.hit_ratio(), 4)},
              {"hit_blocks", r.hit_blocks},
              {"prompts_held", r.prompts_held},
              {"full_blocks_held", r.held[0]},
              {"usable_ends_held", r.usable_ends},
              {"stores", r.stores},
              {"refused_stores", r.refused_stores},
              {"components", comps}};
}

void PrintComponents(const char* label, const SimRun& r, const Geometry& g) {
  for (size_t c = 0; c < r.components.size(); ++c) {
    fmt::print("  {:<9} {:>2} {:<15} {:>10} {:>6.3f} {:>9} {:>9} {:>10} {:>10} {:>12.0f} {:>12.0f}\n", label, c,
               ComponentKindName(g.component_kind(c)), FormatByteSize(r.slot_bytes[c]),
               r.shares.empty() ? 1.0 : r.shares[c], r.components[c].capacity, r.held[c], r.unanchored[c],
               r.evictions[c], r.PerHitToken(r.stored[c], c), r.PerHitToken(r.loaded[c], c));
  }
}

// The --split shares for sweeping one kind: `share` to the sliding windows when the model has any, else to the states.
PoolSplit SweptSplit(const Geometry& g, double share) {
  bool window = false;
  for (size_t c = 1; c < g.component_count(); ++c) window = window || g.component_kind(c) == ComponentKind::kSlidingWindow;
  return window ? PoolSplit{share, 0} : PoolSplit{0, share};
}

// The window-churn case at one budget (HybridTraceOptions::window_churn): the ideal split (the swept share with the
// most hit blocks in the simulation), the default split fixed, and flexkvd with that split fixed and sized by demand.
// Returns false after printing why a daemon run failed.
bool WindowChurnCase(const HybridTraceOptions& o, const Geometry& model, uint32_t cap, uint64_t budget, uint64_t scale,
                     std::span<const std::vector<BlockKey>> keys, std::span<const size_t> prompts, Json* json) {
  const std::vector<uint64_t> slots = SlotBytes(model);
  const auto sim_at = [&](const PoolSplit& split) -> std::optional<SimRun> {
    auto capacity = flexkv::SplitBudget(model, budget, split);
    if (!capacity.ok()) return std::nullopt;
    std::vector<uint32_t> c;
    for (uint64_t v : *capacity) c.push_back(static_cast<uint32_t>(std::min<uint64_t>(v, UINT32_MAX)));
    SimRun r = Replay(model, c, keys, prompts, o.chunk_blocks, o.every_window);
    r.shares = SharesOf(c, slots, budget);
    return r;
  };
  Json sweep = Json::array();
  std::optional<SimRun> ideal;
  double ideal_share = 0;
  for (int k = 1; k <= 19; ++k) {
    const double share = 0.05 * k;
    std::optional<SimRun> r = sim_at(SweptSplit(model, share));
    if (!r) continue;
    sweep.push_back(Json{{"share", Rounded(share, 2)}, {"hit_blocks", r->hit_blocks}});
    if (!ideal || r->hit_blocks > ideal->hit_blocks) {
      ideal = std::move(r);
      ideal_share = share;
    }
  }
  const std::optional<SimRun> fixed = sim_at(PoolSplit{});
  if (!ideal || !fixed) {
    std::fprintf(stderr, "flexkv-bench: --window-churn: the budget %s cannot hold the model's sub-pools\n",
                 FormatByteSize(budget).c_str());
    return false;
  }
  double default_share = 0;
  for (size_t c = 1; c < fixed->shares.size(); ++c) default_share += fixed->shares[c];
  const PoolSplit default_split = SweptSplit(model, default_share);
  // flexkvd twice: the default split fixed (given as --swa-share / --state-share: an operator's share stays fixed),
  // and no share given (the sub-pools start at the default split and follow demand).
  std::optional<HybridDaemonRun> daemon_fixed, daemon_demand;
  if (o.daemon) {
    daemon_fixed = o.daemon(cap, budget / scale, scale, default_split.swa_share, default_split.state_share);
    if (!daemon_fixed) return false;
    daemon_demand = o.daemon(cap, budget / scale, scale, 0, 0);
    if (!daemon_demand) return false;
  }
  const auto of_ideal = [&](uint64_t hits) { return Ratio(hits, ideal->hit_blocks); };
  const auto end_shares = [&](const HybridDaemonRun& d) {
    std::vector<double> shares;
    const std::vector<uint64_t>& active = d.active_end.size() == slots.size() ? d.active_end : d.capacity;
    for (size_t c = 0; c < slots.size() && c < active.size(); ++c) {
      shares.push_back(static_cast<double>(active[c] * slots[c]) / static_cast<double>(budget));
    }
    return shares;
  };
  if (o.json) {
    const auto daemon_json = [&](const std::optional<HybridDaemonRun>& d) {
      if (!d) return Json(nullptr);
      Json j = DaemonJson(*d, model);
      j["of_ideal"] = Rounded(of_ideal(d->hit_blocks), 4);
      Json shares = Json::array();
      for (double v : end_shares(*d)) shares.push_back(Rounded(v, 4));
      j["shares_at_end"] = shares;
      return j;
    };
    *json = Json{{"capacity_blocks", cap},
                 {"budget_bytes", budget},
                 {"blocks", ideal->blocks},
                 {"sweep", sweep},
                 {"ideal_share", Rounded(ideal_share, 2)},
                 {"ideal_hit_blocks", ideal->hit_blocks},
                 {"default_share", Rounded(default_share, 4)},
                 {"default_fixed_sim_hit_blocks", fixed->hit_blocks},
                 {"default_fixed_sim_of_ideal", Rounded(of_ideal(fixed->hit_blocks), 4)},
                 {"flexkvd_default_fixed", daemon_json(daemon_fixed)},
                 {"flexkvd_by_demand", daemon_json(daemon_demand)}};
    return true;
  }
  fmt::print("{} window churn at {} tokens a block, budget {} all-FULL blocks = {}: {} requests, {} blocks, a store "
             "every {} block(s); shares are of the budget held by the non-FULL sub-pools\n",
             o.preset, kTokensPerBlock, cap, FormatByteSize(budget), keys.size(), ideal->blocks, o.chunk_blocks);
  fmt::print("  {:<34} {:>8} {:>12} {:>10} {:>9}\n", "", "share", "hit blocks", "hit ratio", "of ideal");
  fmt::print("  {:<34} {:>8.2f} {:>12} {:>10.4f} {:>9.3f}\n", "ideal (sim, best swept share)", ideal_share,
             ideal->hit_blocks, ideal->hit_ratio(), 1.0);
  fmt::print("  {:<34} {:>8.3f} {:>12} {:>10.4f} {:>9.3f}\n", "default split fixed (sim)", default_share,
             fixed->hit_blocks, fixed->hit_ratio(), of_ideal(fixed->hit_blocks));
  for (const auto& [label, d] : {std::pair{"default split fixed (flexkvd)", &daemon_fixed},
                                 std::pair{"sized by demand (flexkvd)", &daemon_demand}}) {
    if (!*d) continue;
    const std::vector<double> shares = end_shares(**d);
    double share = 0;
    for (size_t c = 1; c < shares.size(); ++c) share += shares[c];
    fmt::print("  {:<34} {:>8.3f} {:>12} {:>10.4f} {:>9.3f}   (share at the end; {} load mismatches, {:.1f} s)\n",
               label, share, (*d)->hit_blocks, Ratio((*d)->hit_blocks, (*d)->blocks), of_ideal((*d)->hit_blocks),
               (*d)->mismatches, (*d)->seconds);
  }
  fmt::print("  swept (share: hit blocks):");
  for (const Json& j : sweep) fmt::print(" {:.2f}: {}", j["share"].get<double>(), j["hit_blocks"].get<uint64_t>());
  fmt::print("\n");
  return true;
}

}  // namespace

int RunHybridTraceReport(const HybridTraceOptions& o, std::span<const TraceRequest> trace, Json* json) {
  auto model = TracePreset(o.preset, kTokensPerBlock);
  if (!model.ok()) {
    std::fprintf(stderr, "flexkv-bench: %s\n", model.status().message().c_str());
    return 2;
  }
  auto reference = AllFullReference(*model);
  if (!reference.ok()) {
    std::fprintf(stderr, "flexkv-bench: --geometry %s: %s\n", o.preset.c_str(), reference.status().message().c_str());
    return 2;
  }
  std::vector<std::vector<BlockKey>> keys;
  std::vector<size_t> prompts;
  {
    std::unordered_set<BlockKey, BlockKeyHash> seen;
    for (size_t i = 0; i < trace.size(); ++i) {
      keys.push_back(TraceKeys(trace[i].hash_ids));
      if (!keys.back().empty() && seen.insert(keys.back().back()).second) prompts.push_back(i);
    }
  }
  const SimRun unbounded = Unbounded(*model, keys, o.chunk_blocks, o.every_window);
  const uint64_t ref_block = reference->host_block_bytes();
  const uint64_t scale = TraceScale(*model, 4096);
  const std::vector<uint64_t> slots = SlotBytes(*model);
  // --split as the daemon's --swa-share / --state-share (0: its default), so that the daemon and the simulation
  // split alike.
  PoolSplit pool_split;
  if (o.split != "daemon" && model->is_hybrid()) {
    std::vector<double> weights;
    if (o.split == "demand") {
      for (size_t c = 0; c < slots.size(); ++c) {
        weights.push_back(static_cast<double>(unbounded.held[c]) * static_cast<double>(slots[c]));
      }
    } else {
      auto parsed = ParseSplitWeights(o.split, slots.size());
      if (!parsed.ok()) {
        std::fprintf(stderr, "flexkv-bench: %s\n", parsed.status().message().c_str());
        return 2;
      }
      weights = *parsed;
    }
    double sum = 0;
    for (double w : weights) sum += w;
    for (size_t c = 0; c < weights.size(); ++c) {
      const ComponentKind k = model->component_kind(c);
      if (k == ComponentKind::kSlidingWindow) pool_split.swa_share += weights[c] / sum;
      if (k == ComponentKind::kState) pool_split.state_share += weights[c] / sum;
    }
  }

  Json runs = Json::array();
  for (uint32_t cap : o.capacities) {
    const uint64_t budget = uint64_t{cap} * ref_block;
    if (o.window_churn && model->is_hybrid()) {
      Json churn;
      if (!WindowChurnCase(o, *model, cap, budget, scale, keys, prompts, &churn)) return 1;
      if (o.json) runs.push_back(std::move(churn));
      continue;
    }
    const std::vector<uint32_t> ref_cap = {cap};
    const SimRun ref = Replay(*reference, ref_cap, keys, prompts, o.chunk_blocks, false);
    // The hybrid pool's sub-pools: the daemon run's, else the daemon's SplitBudget in-process.
    std::optional<HybridDaemonRun> daemon;
    if (o.daemon && model->is_hybrid()) {
      daemon = o.daemon(cap, budget / scale, scale, pool_split.swa_share, pool_split.state_share);
      if (!daemon) return 1;
    }
    std::vector<uint32_t> split;
    const std::string split_from = fmt::format("--split {} (swa share {:.3f}, state share {:.3f}; 0: flexkvd's default)",
                                               o.split, pool_split.swa_share, pool_split.state_share);
    if (daemon && daemon->capacity.size() == slots.size()) {
      for (uint64_t v : daemon->capacity) split.push_back(static_cast<uint32_t>(v));
    } else {
      auto daemon_split = flexkv::SplitBudget(*model, budget, pool_split);
      if (!daemon_split.ok()) {
        std::fprintf(stderr, "flexkv-bench: %s\n", daemon_split.status().message().c_str());
        return 2;
      }
      for (uint64_t v : *daemon_split) split.push_back(static_cast<uint32_t>(std::min<uint64_t>(v, UINT32_MAX)));
    }
    SimRun hyb = Replay(*model, split, keys, prompts, o.chunk_blocks, o.every_window);
    hyb.shares = SharesOf(split, slots, budget);
    if (o.json) {
      runs.push_back(Json{{"capacity_blocks", cap},
                          {"budget_bytes", budget},
                          {"reference", HybridRunJson(ref, *reference)},
                          {"hybrid", HybridRunJson(hyb, *model)},
                          {"split", o.split},
                          {"window_stores", o.every_window ? "every" : "trailing"},
                          {"swa_share", Rounded(pool_split.swa_share, 4)},
                          {"state_share", Rounded(pool_split.state_share, 4)},
                          {"flexkvd", daemon ? DaemonJson(*daemon, *model) : Json(nullptr)},
                          {"prompts_held_ratio", Rounded(Ratio(hyb.prompts_held, ref.prompts_held), 3)},
                          {"full_blocks_held_ratio", Rounded(Ratio(hyb.held[0], ref.held[0]), 3)},
                          {"usable_ends_held_ratio", Rounded(Ratio(hyb.usable_ends, ref.usable_ends), 3)}});
      continue;
    }
    fmt::print("{} at {} tokens a block, budget {} all-FULL blocks = {}; stores every {} blocks of prefill and at the "
               "prompt's end, each with {}; sim = in-process replay in trace order, hybrid sub-pools from {}\n",
               o.preset, kTokensPerBlock, cap, FormatByteSize(budget), o.chunk_blocks,
               o.every_window ? "every window block computed since the last store (--window-stores every)"
                              : "the trailing window (--window-stores trailing)",
               split_from);
    fmt::print("  {:<22} {:>9} {:>14} {:>16} {:>16} {:>9}\n", "", "hit ratio", "prompts held", "FULL blocks held",
               "usable ends held", "refused");
    fmt::print("  {:<22} {:>9.4f} {:>14} {:>16} {:>16} {:>9}\n", "reference (all FULL)", ref.hit_ratio(),
               ref.prompts_held, ref.held[0], ref.usable_ends, ref.refused_stores);
    fmt::print("  {:<22} {:>9.4f} {:>14} {:>16} {:>16} {:>9}\n", "hybrid, sim", hyb.hit_ratio(), hyb.prompts_held,
               hyb.held[0], hyb.usable_ends, hyb.refused_stores);
    if (daemon) {
      fmt::print("  {:<22} {:>9.4f} {:>14} {:>16} {:>16} {:>9}   ({} load mismatches, {:.2f} s, geometry scaled 1/{})\n",
                 "hybrid, flexkvd", Ratio(daemon->hit_blocks, daemon->blocks), "-",
                 daemon->used.empty() ? 0 : daemon->used[0], "-", daemon->shortfalls, daemon->mismatches,
                 daemon->seconds, scale);
    }
    fmt::print("  {:<22} {:>9} {:>13.2f}x {:>15.2f}x {:>15.2f}x   (of {} distinct prompts)\n", "hybrid / reference",
               "", Ratio(hyb.prompts_held, ref.prompts_held), Ratio(hyb.held[0], ref.held[0]),
               Ratio(hyb.usable_ends, ref.usable_ends), prompts.size());
    fmt::print("  {:<22} {:>9.4f}   (the hybrid's hits at these store boundaries with no eviction)\n",
               "hybrid bound", unbounded.hit_ratio());
    fmt::print("  {:<9} {:>2} {:<15} {:>10} {:>6} {:>9} {:>9} {:>10} {:>10} {:>12} {:>12}\n", "pool", "c", "kind",
               "slot", "share", "capacity", "held", "unanchored", "evictions", "stored B/ht", "loaded B/ht");
    PrintComponents("reference", ref, *reference);
    PrintComponents("hybrid", hyb, *model);
    for (size_t c = 0; daemon && c < daemon->capacity.size(); ++c) {
      fmt::print("  {:<9} {:>2} {:<15} {:>10} {:>6} {:>9} {:>9} {:>10} {:>10}\n", "flexkvd", c,
                 ComponentKindName(model->component_kind(c)), FormatByteSize(slots[c]), "", daemon->capacity[c],
                 c < daemon->used.size() ? daemon->used[c] : 0, c < daemon->unanchored.size() ? daemon->unanchored[c] : 0,
                 c < daemon->evicted.size() ? daemon->evicted[c] : 0);
    }
  }
  if (o.json) {
    *json = Json{{"geometry", o.preset},
                 {"daemon_scale", scale},
                 {"tokens_per_block", kTokensPerBlock},
                 {"simulation", true},
                 {"chunk_blocks", o.chunk_blocks},
                 {"window_churn", o.window_churn},
                 {"distinct_prompts", prompts.size()},
                 {"hybrid_bound_hit_ratio", Rounded(unbounded.hit_ratio(), 4)},
                 {"reference_block_bytes", ref_block},
                 {"runs", runs}};
  }
  return 0;
}

}  // namespace flexkv::bench
