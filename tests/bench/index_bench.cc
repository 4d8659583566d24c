// flexkv-bench index [--blocks 1M,10M] [--chain 64] [--passes 1] [--no-restart] [--json]
// In-process, one thread (flexkvd_lib linked in), for each size N:
//   insert   Reserve + Commit of N/chain chains of `chain` chained keys into an empty PrefixIndex(N)
//   memory   RSS delta (/proc/self/statm) from before PrefixIndex(N) to after the inserts, per block
//   match    Match (no pin) of every chain once, in random order: keys looked up per second
//   match+pin  Match with pin + Unpin of the same chains (the engine path)
//   reserve cached  Reserve of the same chains, all cached (walks and pins the prefix, reserves nothing):
//            a repeated store
//   The three above run `passes` times over all chains (same random order) and report the total rate.
//   evict    Reserve + Commit of new chains into the full index: each block evicts the LRU leaf
//   restart  a pool file with N committed slots (16-byte blocks, the smallest valid geometry), closed and
//            reopened: Pool::Open + Pool::Recover + PrefixIndex(N) + Restore of every block, as a restarted
//            flexkvd does (Cache::RecoverPool). The pool file lives in a temporary directory under /dev/shm.
#include "index_bench.h"

#include <sched.h>
#include <unistd.h>

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "bench_json.h"
#include "common/log.h"
#include "daemon/cache/pool.h"
#include "daemon/cache/prefix_index.h"
#include "flexkv/block_key.h"

namespace {

using Clock = std::chrono::steady_clock;
using flexkv::bench::DumpLine;
using flexkv::bench::Json;
using flexkv::bench::Rounded;
using flexkv::bench::Whole;

double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

uint64_t RssBytes() {
  std::ifstream f("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  f >> size >> resident;
  return resident * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
}

// `chains` chains of `len` chained keys; chain c's tokens are salt, c, then 0..len-1 (one token per block).
std::vector<flexkv::BlockKey> MakeKeys(uint64_t chains, uint32_t len, int32_t salt) {
  std::vector<flexkv::BlockKey> keys;
  keys.reserve(chains * len);
  std::vector<int32_t> tokens(len);
  for (uint64_t c = 0; c < chains; ++c) {
    for (uint32_t j = 0; j < len; ++j) {
      tokens[j] = static_cast<int32_t>((static_cast<uint64_t>(salt) * 1000003ULL + c * len + j) & 0x7FFFFFFF);
    }
    auto k = flexkv::ComputeBlockKeys(fmt::format("flexkv-bench-index-{}", salt), tokens, 1);
    keys.insert(keys.end(), k.begin(), k.end());
  }
  return keys;
}

struct IndexResult {
  uint64_t blocks = 0;
  uint32_t chain = 0;
  uint32_t passes = 1;
  double insert_s = 0, match_s = 0, match_pin_s = 0, reserve_cached_s = 0, evict_s = 0;
  uint64_t matched = 0, matched_pin = 0, reserve_cached = 0, evicted = 0, evict_inserts = 0;
  uint64_t rss_delta = 0;
  // restart
  bool restart = false;
  double create_fill_s = 0, open_s = 0, recover_s = 0, index_alloc_s = 0, restore_s = 0;
  uint64_t restored = 0, dropped = 0, pool_file_bytes = 0;
};

std::optional<IndexResult> RunOne(uint64_t n, uint32_t chain, uint32_t passes, bool restart) {
  IndexResult r;
  r.blocks = n;
  r.chain = chain;
  r.passes = passes;
  const uint64_t chains = n / chain;
  const uint64_t used = chains * chain;  // the index holds N slots; the chains fill N rounded down
  auto keys = MakeKeys(chains, chain, 1);
  std::vector<uint64_t> order(chains);
  std::iota(order.begin(), order.end(), uint64_t{0});
  std::shuffle(order.begin(), order.end(), std::mt19937_64(42));
  std::vector<flexkv::SlotId> slots;
  slots.reserve(chain);

  const uint64_t rss0 = RssBytes();
  auto index = std::make_unique<flexkv::PrefixIndex>(static_cast<uint32_t>(n));
  auto t0 = Clock::now();
  for (uint64_t c = 0; c < chains; ++c) {
    auto res = index->Reserve(flexkv::kRootParent, std::span<const flexkv::BlockKey>(keys.data() + c * chain, chain));
    index->Commit(res.slots);
  }
  auto t1 = Clock::now();
  r.insert_s = Seconds(t0, t1);
  r.rss_delta = RssBytes() - rss0;
  if (index->committed_blocks() != used) {
    std::fprintf(stderr, "flexkv-bench: index holds %u blocks after inserting %llu\n", index->committed_blocks(),
                 static_cast<unsigned long long>(used));
    return std::nullopt;
  }

  t0 = Clock::now();
  for (uint32_t p = 0; p < passes; ++p) {
    for (uint64_t c : order) {
      r.matched += index->Match(std::span<const flexkv::BlockKey>(keys.data() + c * chain, chain), false, nullptr);
    }
  }
  t1 = Clock::now();
  r.match_s = Seconds(t0, t1);
  t0 = Clock::now();
  for (uint32_t p = 0; p < passes; ++p) {
    for (uint64_t c : order) {
      slots.clear();
      r.matched_pin += index->Match(std::span<const flexkv::BlockKey>(keys.data() + c * chain, chain), true, &slots);
      index->Unpin(slots);
    }
  }
  t1 = Clock::now();
  r.match_pin_s = Seconds(t0, t1);
  t0 = Clock::now();
  for (uint32_t p = 0; p < passes; ++p) {
    for (uint64_t c : order) {
      auto res = index->Reserve(flexkv::kRootParent, std::span<const flexkv::BlockKey>(keys.data() + c * chain, chain));
      r.reserve_cached += res.cached;
    }
  }
  t1 = Clock::now();
  r.reserve_cached_s = Seconds(t0, t1);
  if (r.matched != used * passes || r.matched_pin != used * passes || r.reserve_cached != used * passes) {
    std::fprintf(stderr, "flexkv-bench: matched %llu / %llu, reserve found %llu cached, of %llu keys\n",
                 static_cast<unsigned long long>(r.matched), static_cast<unsigned long long>(r.matched_pin),
                 static_cast<unsigned long long>(r.reserve_cached), static_cast<unsigned long long>(used * passes));
    return std::nullopt;
  }

  // Fill the remainder so that every insert below evicts, then insert min(N, 2M) new blocks.
  if (used < n) {
    auto rest = MakeKeys(1, static_cast<uint32_t>(n - used), 3);
    auto res = index->Reserve(flexkv::kRootParent, rest);
    index->Commit(res.slots);
  }
  const uint64_t evict_chains = std::min<uint64_t>(chains, (uint64_t{2} << 20) / chain);
  keys.clear();
  keys.shrink_to_fit();
  auto fresh = MakeKeys(evict_chains, chain, 2);
  const uint64_t ev0 = index->evicted_blocks();
  t0 = Clock::now();
  for (uint64_t c = 0; c < evict_chains; ++c) {
    auto res = index->Reserve(flexkv::kRootParent, std::span<const flexkv::BlockKey>(fresh.data() + c * chain, chain));
    index->Commit(res.slots);
    r.evict_inserts += res.slots.size();
  }
  t1 = Clock::now();
  r.evict_s = Seconds(t0, t1);
  r.evicted = index->evicted_blocks() - ev0;
  fresh.clear();
  fresh.shrink_to_fit();
  index.reset();

  if (!restart) return r;
  r.restart = true;
  char tmpl[] = "/dev/shm/flexkv-bench-index-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) {
    std::fprintf(stderr, "flexkv-bench: mkdtemp under /dev/shm failed\n");
    return std::nullopt;
  }
  const std::string dir = tmpl;
  const std::string path = dir + "/pool";
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  } cleanup{dir};
  // 16 tokens × 1 layer × 1 plane × 1 head × head_dim 1 × 1 byte = 16 bytes: the smallest block Geometry allows
  // (a chunk must be a multiple of 16 bytes).
  flexkv::Geometry g;
  g.tokens_per_block = 16;
  g.num_layers = 1;
  g.kv_planes = 1;
  g.kv_heads_per_rank = 1;
  g.head_dim = 1;
  g.dtype_bytes = 1;
  g.tp_size = 1;
  const uint64_t budget = n * g.host_block_bytes();
  t0 = Clock::now();
  {
    auto pool = flexkv::Pool::Create(path, "flexkv-bench-index", g, budget);
    if (!pool.ok()) {
      std::fprintf(stderr, "flexkv-bench: Pool::Create: %s\n", pool.status().ToString().c_str());
      return std::nullopt;
    }
    // Committed slots in chains of `chain`, as a running daemon would have left them.
    std::vector<int32_t> tokens(chain);
    uint64_t slot = 0;
    for (uint64_t c = 0; slot < n; ++c) {
      const auto len = static_cast<uint32_t>(std::min<uint64_t>(chain, n - slot));
      tokens.resize(len);
      for (uint32_t j = 0; j < len; ++j) tokens[j] = static_cast<int32_t>((c * chain + j) & 0x7FFFFFFF);
      auto k = flexkv::ComputeBlockKeys("flexkv-bench-index-restart", tokens, 1);
      for (uint32_t j = 0; j < len; ++j, ++slot) {
        (*pool)->MarkCommitted(static_cast<flexkv::SlotId>(slot), k[j], j == 0 ? flexkv::BlockKey{} : k[j - 1], 1);
      }
    }
    r.pool_file_bytes = std::filesystem::file_size(path);
  }
  t1 = Clock::now();
  r.create_fill_s = Seconds(t0, t1);

  t0 = Clock::now();
  auto pool = flexkv::Pool::Open(path, budget);
  if (!pool.ok()) {
    std::fprintf(stderr, "flexkv-bench: Pool::Open: %s\n", pool.status().ToString().c_str());
    return std::nullopt;
  }
  t1 = Clock::now();
  r.open_s = Seconds(t0, t1);
  t0 = t1;
  auto committed = (*pool)->Recover(&r.dropped);
  t1 = Clock::now();
  r.recover_s = Seconds(t0, t1);
  t0 = t1;
  auto restored = std::make_unique<flexkv::PrefixIndex>((*pool)->capacity());
  t1 = Clock::now();
  r.index_alloc_s = Seconds(t0, t1);
  t0 = t1;
  for (const flexkv::Pool::Committed& c : committed) {
    if (restored->RestoreUnverified(c.slot, c.key, c.parent).ok()) ++r.restored;
  }
  t1 = Clock::now();
  r.restore_s = Seconds(t0, t1);
  if (r.restored != n) {
    std::fprintf(stderr, "flexkv-bench: restored %llu of %llu blocks\n", static_cast<unsigned long long>(r.restored),
                 static_cast<unsigned long long>(n));
    return std::nullopt;
  }
  return r;
}

std::optional<uint64_t> ParseCount(std::string s) {
  uint64_t mult = 1;
  if (!s.empty() && (s.back() == 'M' || s.back() == 'm')) {
    mult = 1000000;
    s.pop_back();
  } else if (!s.empty() && (s.back() == 'K' || s.back() == 'k')) {
    mult = 1000;
    s.pop_back();
  }
  if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  const uint64_t v = std::stoull(s) * mult;
  if (v == 0 || v > 1000000000ULL) return std::nullopt;
  return v;
}

double PerS(uint64_t n, double s) { return s > 0 ? static_cast<double>(n) / s : 0.0; }

}  // namespace

int RunIndexBench(int argc, char** argv) {
  CLI::App app{"flexkv-bench index: PrefixIndex match/insert/evict throughput, memory per block, restart time"};
  std::vector<std::string> sizes = {"1M", "10M"};
  uint32_t chain = 64;
  uint32_t passes = 1;
  bool no_restart = false, json = false;
  int cpu = -1;
  app.add_option("--blocks", sizes, "Index sizes, e.g. 1M,10M (K and M are powers of 1000)")->delimiter(',');
  app.add_option("--chain", chain, "Keys per chain (one stored prompt), default 64")->check(CLI::Range(1u, 4096u));
  app.add_option("--passes", passes, "Passes over all chains for match, match+pin and reserve cached (default 1)")
      ->check(CLI::Range(1u, 1000u));
  app.add_flag("--no-restart", no_restart, "Skip the pool-recovery (restart) measurement");
  app.add_option("--cpu", cpu, "Pin this thread to one CPU (default: not pinned)");
  app.add_flag("--json", json, "One JSON object");
  CLI11_PARSE(app, argc, argv);
  flexkv::log::SetLevel(flexkv::log::Level::kWarning);
  if (cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof(set), &set) != 0) {
      std::fprintf(stderr, "flexkv-bench: cannot pin to CPU %d\n", cpu);
      return 2;
    }
  }
  std::vector<IndexResult> results;
  for (const std::string& s : sizes) {
    auto n = ParseCount(s);
    if (!n || *n < chain || *n > 0xFFFFFFFEULL) {
      std::fprintf(stderr, "flexkv-bench: --blocks %s: expected a count of at least --chain (e.g. 1M)\n", s.c_str());
      return 2;
    }
    auto r = RunOne(*n, chain, passes, !no_restart);
    if (!r) return 1;
    if (!json) {
      fmt::print("{} blocks (chains of {}, {} pass{}), one thread:\n", r->blocks, r->chain, r->passes,
                 r->passes == 1 ? "" : "es");
      fmt::print("  insert (Reserve+Commit)  {:>12.0f} blocks/s  ({:.3f} s)\n", PerS(r->blocks / chain * chain, r->insert_s),
                 r->insert_s);
      fmt::print("  match (no pin)           {:>12.0f} keys/s    ({:.3f} s)\n", PerS(r->matched, r->match_s), r->match_s);
      fmt::print("  match+pin, unpin         {:>12.0f} keys/s    ({:.3f} s)\n", PerS(r->matched_pin, r->match_pin_s),
                 r->match_pin_s);
      fmt::print("  reserve, all cached      {:>12.0f} keys/s    ({:.3f} s)\n",
                 PerS(r->reserve_cached, r->reserve_cached_s), r->reserve_cached_s);
      fmt::print("  insert evicting the LRU  {:>12.0f} blocks/s  ({} evicted, {:.3f} s)\n",
                 PerS(r->evict_inserts, r->evict_s), r->evicted, r->evict_s);
      fmt::print("  memory                   {:>12.1f} bytes/block (RSS +{} MiB)\n",
                 static_cast<double>(r->rss_delta) / static_cast<double>(r->blocks), r->rss_delta >> 20);
      if (r->restart) {
        fmt::print("  restart: open {:.3f} s + recover {:.3f} s + index alloc {:.3f} s + restore {:.3f} s = {:.3f} s "
                   "({} blocks restored; pool file {} MiB, written in {:.2f} s)\n",
                   r->open_s, r->recover_s, r->index_alloc_s, r->restore_s,
                   r->open_s + r->recover_s + r->index_alloc_s + r->restore_s, r->restored, r->pool_file_bytes >> 20,
                   r->create_fill_s);
      }
    }
    results.push_back(*r);
  }
  if (json) {
    Json rows = Json::array();
    for (const IndexResult& r : results) {
      Json row{{"blocks", r.blocks},
               {"insert_per_s", Whole(PerS(r.blocks / chain * chain, r.insert_s))},
               {"match_keys_per_s", Whole(PerS(r.matched, r.match_s))},
               {"match_pin_keys_per_s", Whole(PerS(r.matched_pin, r.match_pin_s))},
               {"reserve_cached_keys_per_s", Whole(PerS(r.reserve_cached, r.reserve_cached_s))},
               {"passes", r.passes},
               {"insert_evict_per_s", Whole(PerS(r.evict_inserts, r.evict_s))},
               {"evicted", r.evicted},
               {"bytes_per_block", Rounded(static_cast<double>(r.rss_delta) / static_cast<double>(r.blocks), 1)},
               {"rss_delta_bytes", r.rss_delta}};
      if (r.restart) {
        row["restart"] = {{"open_s", Rounded(r.open_s, 3)},
                          {"recover_s", Rounded(r.recover_s, 3)},
                          {"index_alloc_s", Rounded(r.index_alloc_s, 3)},
                          {"restore_s", Rounded(r.restore_s, 3)},
                          {"total_s", Rounded(r.open_s + r.recover_s + r.index_alloc_s + r.restore_s, 3)},
                          {"restored", r.restored},
                          {"dropped", r.dropped},
                          {"pool_file_bytes", r.pool_file_bytes}};
      }
      rows.push_back(std::move(row));
    }
    fmt::print("{}", DumpLine(Json{{"bench", "index"}, {"threads", 1}, {"chain", chain}, {"results", rows}}));
  }
  return 0;
}
