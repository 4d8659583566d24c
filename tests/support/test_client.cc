// flexkv-test-client: an engine stand-in that integration and chaos tests start as a separate process.
// Attaches, then runs the --do steps in order, printing one line per event on stdout:
//   ATTACHED <id> <block_bytes> <capacity_blocks>
//   STORED <already_cached> <stored> <STATUS>            (--do store:SEED:N)
//   LOADED <hits> <loaded> <equal 0|1> <STATUS>         (--do load:SEED:N)
//   PINNED <hits>                                        (--do pin:SEED:N, keeps the pins)
//   INFLIGHT                                             (--do inflight-load:SEED:N: submits, never waits)
//   SUBMITTED <k>  then  FLOODED <k> <ok>                (--do flood:SEED:COUNT: submits up to COUNT unpinned
//                                                         1-block Matches without waiting, until the rings refuse;
//                                                         sleeps 300 ms (time to SIGSTOP it), then reaps them all)
//   ERROR <CODE> <message>
// The block contents and tokens of SEED are a pure function of SEED, so another process can check them.
// A hybrid geometry (--swa-layers / --state-layers, docs/hybrid.md) stores and loads every component: a store
// of N blocks puts block i in FULL buffer block i, the window's blocks j in the window buffer's block j, and the
// state at each boundary (every --state-every blocks, and N) in state slot (boundary / state-every) % state slots.
// A load checks exactly FULL [0,e), the window [e-w,e) and the state at e, and that no other buffer byte changed:
//   LOADED <hits> <loaded> <equal 0|1> <STATUS> <untouched 0|1>
// (and prefetch:SEED:N, as for full attention).
// `--do hold` keeps the session until the process is killed.
// `--prefix-seed P --prefix-blocks K`: every prompt (store, load, pin) starts with the K blocks of P (tokens and
// bytes), as requests sharing a system prompt do; its blocks from K on are SEED's.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "flexkv/client.h"

namespace {

std::vector<int32_t> Tokens(uint64_t seed, uint32_t blocks, uint32_t tokens_per_block) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(uint64_t{blocks} * tokens_per_block);
  for (auto& x : t) x = static_cast<int32_t>(rng() % 128000);
  return t;
}

// Deterministic bytes of block i of SEED.
void FillBlock(uint64_t seed, uint32_t i, uint8_t* dst, uint64_t bytes) {
  std::mt19937_64 rng(seed * 1000003 + i);
  for (uint64_t off = 0; off < bytes; off += 8) {
    const uint64_t v = rng();
    std::memcpy(dst + off, &v, std::min<uint64_t>(8, bytes - off));
  }
}

// Component c's bytes for block (or state boundary) i of SEED: FULL blocks are FillBlock(seed), the others differ.
void FillComponent(uint64_t seed, size_t c, uint32_t i, uint8_t* dst, uint64_t bytes) {
  FillBlock(c == 0 ? seed : seed * 31 + c, i, dst, bytes);
}

bool IsPoison(const uint8_t* p, uint64_t bytes) {
  for (uint64_t i = 0; i < bytes; ++i) {
    if (p[i] != 0xA5) return false;
  }
  return true;
}

// The state boundaries of a store of n blocks: every `every` blocks, and n.
std::vector<uint32_t> Boundaries(uint32_t n, uint32_t every) {
  std::vector<uint32_t> b;
  for (uint32_t k = every; every > 0 && k < n; k += every) b.push_back(k);
  b.push_back(n);
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"flexkv test client"};
  std::string socket, name = "test-client", ns = "test-model";
  flexkv::Geometry g = flexkv::Llama3_8B();
  uint32_t dp_rank = 0, kv_blocks = 128;
  std::vector<std::string> steps;
  app.add_option("--socket", socket);
  app.add_option("--name", name);
  app.add_option("--namespace", ns);
  app.add_option("--dp-rank", dp_rank);
  app.add_option("--tokens-per-block", g.tokens_per_block);
  app.add_option("--layers", g.num_layers);
  app.add_option("--kv-planes", g.kv_planes);
  app.add_option("--heads", g.kv_heads_per_rank);
  app.add_option("--head-dim", g.head_dim);
  app.add_option("--dtype-bytes", g.dtype_bytes);
  app.add_option("--tp", g.tp_size);
  app.add_option("--kv-blocks", kv_blocks, "KV buffer blocks (BLOCKFIRST)");
  uint32_t swa_layers = 0, window_tokens = 0, state_layers = 0, state_bytes = 0, state_every = 0, state_slots = 8;
  app.add_option("--swa-layers", swa_layers, "hybrid: sliding-window layers (the FULL layers' shape)");
  app.add_option("--window-tokens", window_tokens, "hybrid: the sliding window");
  app.add_option("--state-layers", state_layers, "hybrid: state (Mamba) layers");
  app.add_option("--state-bytes", state_bytes, "hybrid: bytes of one layer's state");
  app.add_option("--state-every", state_every, "hybrid: also store a state every this many blocks (0: at the end only)");
  app.add_option("--state-slots", state_slots, "hybrid: the engine's state slots");
  uint64_t prefix_seed = 0;
  uint32_t prefix_blocks = 0;
  app.add_option("--prefix-seed", prefix_seed, "every prompt starts with this seed's first --prefix-blocks blocks");
  app.add_option("--prefix-blocks", prefix_blocks, "blocks of --prefix-seed every prompt starts with (default 0)");
  app.add_option("--do", steps,
                 "store:SEED:N, load:SEED:N, pin:SEED:N, inflight-load:SEED:N, prefetch:SEED:N, flood:SEED:COUNT, hold");
  CLI11_PARSE(app, argc, argv);
  if (swa_layers > 0) {
    flexkv::ComponentSpec swa;
    swa.kind = flexkv::ComponentKind::kSlidingWindow;
    swa.num_layers = swa_layers;
    swa.kv_planes = g.kv_planes;
    swa.kv_heads_per_rank = g.kv_heads_per_rank;
    swa.head_dim = g.head_dim;
    swa.dtype_bytes = g.dtype_bytes;
    swa.window_tokens = window_tokens;
    g.components.push_back(swa);
  }
  if (state_layers > 0) {
    flexkv::ComponentSpec state;
    state.kind = flexkv::ComponentKind::kState;
    state.num_layers = state_layers;
    state.state_bytes_per_layer = state_bytes;
    g.components.push_back(state);
  }

  setvbuf(stdout, nullptr, _IOLBF, 0);
  auto client = flexkv::Client::Connect({socket, std::chrono::milliseconds(5000), std::chrono::milliseconds(10000)});
  if (!client.ok()) {
    std::printf("ERROR %s %s\n", flexkv::StatusCodeName(client.status().code()), client.status().message().c_str());
    return 3;
  }
  flexkv::Client& c = **client;
  flexkv::AttachOptions options;
  options.client_name = name;
  options.model_namespace = ns;
  options.dp_rank = dp_rank;
  options.geometry = g;
  auto session = c.Attach(options);
  if (!session.ok()) {
    std::printf("ERROR %s %s\n", flexkv::StatusCodeName(session.status().code()), session.status().message().c_str());
    return 1;
  }
  std::printf("ATTACHED %llu %llu %llu\n", static_cast<unsigned long long>(session->session_id),
              static_cast<unsigned long long>(session->block_bytes),
              static_cast<unsigned long long>(session->capacity_blocks));
  const uint64_t block_bytes = g.host_block_bytes();
  flexkv::HostKvBuffers kv;
  auto need_kv = [&]() -> bool {
    if (kv.data != nullptr) return true;
    auto created = c.CreateHostKv(flexkv::KvLayout::kBlockFirst, kv_blocks);
    if (!created.ok()) {
      std::printf("ERROR %s %s\n", flexkv::StatusCodeName(created.status().code()), created.status().message().c_str());
      return false;
    }
    kv = *created;
    return true;
  };
  const auto timeout = std::chrono::seconds(30);
  // Hybrid geometries: one host buffer per component (FULL and windows kv_blocks blocks, states state_slots).
  std::vector<flexkv::HostKvBuffers> parts;
  auto need_parts = [&]() -> bool {
    if (!parts.empty()) return true;
    for (uint32_t comp = 0; comp < g.component_count(); ++comp) {
      const bool state = g.component_kind(comp) == flexkv::ComponentKind::kState;
      auto created = c.CreateHostKv(comp, flexkv::KvLayout::kBlockFirst, state ? state_slots : kv_blocks);
      if (!created.ok()) {
        std::printf("ERROR %s %s\n", flexkv::StatusCodeName(created.status().code()), created.status().message().c_str());
        return false;
      }
      parts.push_back(*created);
    }
    return true;
  };
  auto slot_bytes = [&](size_t comp) { return g.Component(comp).host_block_bytes(); };
  auto hybrid_store = [&](uint64_t seed, uint32_t n, const std::vector<flexkv::BlockKey>& keys) -> bool {
    const std::vector<uint32_t> boundaries = state_layers > 0 ? Boundaries(n, state_every) : std::vector<uint32_t>{};
    std::vector<std::vector<uint32_t>> ids(g.component_count());
    for (size_t comp = 0; comp < g.component_count(); ++comp) {
      const uint64_t bytes = slot_bytes(comp);
      switch (g.component_kind(comp)) {
        case flexkv::ComponentKind::kFull:
          for (uint32_t i = 0; i < n; ++i) ids[comp].push_back(i);
          break;
        case flexkv::ComponentKind::kSlidingWindow:
          for (uint32_t i = n - std::min(g.window_blocks(comp), n); i < n; ++i) ids[comp].push_back(i);
          break;
        case flexkv::ComponentKind::kState:
          if (boundaries.size() > state_slots) {
            std::printf("ERROR INVALID_ARGUMENT %zu state boundaries for %u state slots\n", boundaries.size(), state_slots);
            return false;
          }
          for (uint32_t k = 0; k < boundaries.size(); ++k) ids[comp].push_back(k);
          break;
      }
      for (size_t k = 0; k < ids[comp].size(); ++k) {
        const uint32_t what = g.component_kind(comp) == flexkv::ComponentKind::kState ? boundaries[k] : ids[comp][k];
        FillComponent(seed, comp, what, parts[comp].data + uint64_t{ids[comp][k]} * bytes, bytes);
      }
    }
    std::vector<std::span<const uint32_t>> spans(ids.begin(), ids.end());
    auto t = c.Store(flexkv::BlockKeyChain(keys), spans, boundaries);
    auto r = t.ok() ? c.Wait(*t, timeout) : flexkv::Result<flexkv::OpResult>(t.status());
    if (!r.ok()) {
      std::printf("ERROR %s %s\n", flexkv::StatusCodeName(r.status().code()), r.status().message().c_str());
      return false;
    }
    std::printf("STORED %u %u %s\n", r->matched_blocks, r->done_blocks, flexkv::StatusCodeName(r->status.code()));
    return true;
  };
  auto hybrid_load = [&](uint64_t seed, const std::vector<flexkv::BlockKey>& keys) -> bool {
    auto t = c.Match(keys, /*pin=*/true);
    auto m = t.ok() ? c.Wait(*t, timeout) : flexkv::Result<flexkv::OpResult>(t.status());
    if (!m.ok() || !m->status.ok()) {
      const flexkv::Status st = m.ok() ? m->status : m.status();
      std::printf("ERROR %s %s\n", flexkv::StatusCodeName(st.code()), st.message().c_str());
      return false;
    }
    const uint32_t e = m->matched_blocks;
    if (e == 0) {
      std::printf("LOADED 0 0 1 OK 1\n");
      return true;
    }
    for (const auto& part : parts) std::memset(part.data, 0xA5, part.bytes);  // poison every buffer
    std::vector<std::vector<uint32_t>> ids(g.component_count());
    for (size_t comp = 0; comp < g.component_count(); ++comp) {
      const flexkv::ComponentKind kind = g.component_kind(comp);
      const uint32_t n = kind == flexkv::ComponentKind::kFull            ? e
                         : kind == flexkv::ComponentKind::kSlidingWindow ? std::min(g.window_blocks(comp), e)
                                                                         : 1;
      for (uint32_t i = 0; i < n; ++i) ids[comp].push_back(g.component_kind(comp) == flexkv::ComponentKind::kState ? 0 : e - n + i);
    }
    std::vector<std::span<const uint32_t>> spans(ids.begin(), ids.end());
    auto lt = c.Load(m->match_handle, spans);
    auto l = lt.ok() ? c.Wait(*lt, timeout) : flexkv::Result<flexkv::OpResult>(lt.status());
    if (!l.ok()) {
      std::printf("ERROR %s %s\n", flexkv::StatusCodeName(l.status().code()), l.status().message().c_str());
      return false;
    }
    bool equal = l->status.ok(), untouched = true;
    for (size_t comp = 0; comp < g.component_count(); ++comp) {
      const uint64_t bytes = slot_bytes(comp);
      std::vector<uint8_t> expect(bytes);
      std::vector<bool> loaded(parts[comp].num_blocks, false);
      for (uint32_t id : ids[comp]) {
        loaded[id] = true;
        const bool state = g.component_kind(comp) == flexkv::ComponentKind::kState;
        FillComponent(seed, comp, state ? e : id, expect.data(), bytes);
        equal = equal && std::memcmp(expect.data(), parts[comp].data + uint64_t{id} * bytes, bytes) == 0;
      }
      for (uint32_t b = 0; b < parts[comp].num_blocks; ++b) {
        if (!loaded[b]) untouched = untouched && IsPoison(parts[comp].data + uint64_t{b} * bytes, bytes);
      }
    }
    auto rel = c.Release(m->match_handle);
    if (rel.ok()) (void)c.Wait(*rel, timeout);
    std::printf("LOADED %u %u %d %s %d\n", e, l->done_blocks, equal ? 1 : 0, flexkv::StatusCodeName(l->status.code()),
                untouched ? 1 : 0);
    return true;
  };
  auto prefetch = [&](const std::vector<flexkv::BlockKey>& keys) -> bool {
    auto t = c.Prefetch(keys);
    auto r = t.ok() ? c.Wait(*t, timeout) : flexkv::Result<flexkv::OpResult>(t.status());
    if (!r.ok()) {
      std::printf("ERROR %s %s\n", flexkv::StatusCodeName(r.status().code()), r.status().message().c_str());
      return false;
    }
    std::printf("PREFETCHED %u %u %llu %s %s\n", r->matched_blocks, r->done_blocks,
                static_cast<unsigned long long>(r->bytes), flexkv::StatusCodeName(r->status.code()),
                r->status.ok() ? r->source.c_str() : r->status.message().c_str());
    return true;
  };
  for (const std::string& step : steps) {
    if (step == "hold") {
      for (;;) pause();
    }
    unsigned long long seed = 0;
    unsigned n = 0;
    char op[32] = {};
    if (std::sscanf(step.c_str(), "flood:%llu:%u", &seed, &n) == 2 && n > 0) {
      const auto keys = flexkv::ComputeBlockKeys(ns, Tokens(seed, 1, g.tokens_per_block), g.tokens_per_block);
      std::vector<flexkv::Ticket> tickets;
      while (tickets.size() < n) {
        auto t = c.Match(keys, /*pin=*/false);
        if (!t.ok()) break;  // the rings are full (RESOURCE_EXHAUSTED): as many as they take
        tickets.push_back(*t);
      }
      std::printf("SUBMITTED %zu\n", tickets.size());
      usleep(300 * 1000);
      size_t ok = 0;
      for (const auto& t : tickets) {
        auto r = c.Wait(t, timeout);
        if (r.ok() && r->status.ok()) ++ok;
      }
      std::printf("FLOODED %zu %zu\n", tickets.size(), ok);
      continue;
    }
    if (std::sscanf(step.c_str(), "%31[a-z-]:%llu:%u", op, &seed, &n) != 3 || n == 0 || n > kv_blocks) {
      std::printf("ERROR INVALID_ARGUMENT bad step '%s'\n", step.c_str());
      return 2;
    }
    std::vector<int32_t> tokens = Tokens(seed, n, g.tokens_per_block);
    if (prefix_blocks > 0 && !g.is_hybrid()) {
      const std::vector<int32_t> shared = Tokens(prefix_seed, std::min(prefix_blocks, n), g.tokens_per_block);
      std::copy(shared.begin(), shared.end(), tokens.begin());
    }
    const auto fill = [&](uint64_t s, uint32_t i, uint8_t* dst, uint64_t bytes) {
      FillBlock(i < prefix_blocks ? prefix_seed : s, i, dst, bytes);
    };
    const auto keys = flexkv::ComputeBlockKeys(ns, tokens, g.tokens_per_block);
    if (g.is_hybrid()) {
      const std::string what = op;
      if (!need_parts()) return 1;
      if (what == "store" && !hybrid_store(seed, n, keys)) return 1;
      if (what == "load" && !hybrid_load(seed, keys)) return 1;
      if (what == "prefetch" && !prefetch(keys)) return 1;
      if (what != "store" && what != "load" && what != "prefetch") {
        std::printf("ERROR INVALID_ARGUMENT step '%s' is not supported for hybrid geometries\n", step.c_str());
        return 2;
      }
      continue;
    }
    if (!need_kv()) return 1;
    std::vector<uint32_t> ids(n);
    for (uint32_t i = 0; i < n; ++i) ids[i] = i;
    const std::string what = op;
    if (what == "store") {
      for (uint32_t i = 0; i < n; ++i) fill(seed, i, kv.data + uint64_t{i} * block_bytes, block_bytes);
      auto t = c.Store(flexkv::BlockKeyChain(keys), ids);
      auto r = t.ok() ? c.Wait(*t, timeout) : flexkv::Result<flexkv::OpResult>(t.status());
      if (!r.ok()) {
        std::printf("ERROR %s %s\n", flexkv::StatusCodeName(r.status().code()), r.status().message().c_str());
        return 1;
      }
      std::printf("STORED %u %u %s\n", r->matched_blocks, r->done_blocks, flexkv::StatusCodeName(r->status.code()));
    } else if (what == "prefetch") {
      if (!prefetch(keys)) return 1;
    } else if (what == "load" || what == "pin" || what == "inflight-load") {
      auto t = c.Match(keys, /*pin=*/true);
      auto m = t.ok() ? c.Wait(*t, timeout) : flexkv::Result<flexkv::OpResult>(t.status());
      if (!m.ok() || !m->status.ok()) {
        const flexkv::Status s = m.ok() ? m->status : m.status();
        std::printf("ERROR %s %s\n", flexkv::StatusCodeName(s.code()), s.message().c_str());
        return 1;
      }
      if (what == "pin") {
        std::printf("PINNED %u\n", m->matched_blocks);
        continue;
      }
      const uint32_t hits = m->matched_blocks;
      if (hits == 0) {
        std::printf("LOADED 0 0 1 OK\n");
        continue;
      }
      std::memset(kv.data, 0xA5, uint64_t{hits} * block_bytes);  // poison the destination
      auto lt = c.Load(m->match_handle, std::span(ids.data(), hits));
      if (what == "inflight-load") {
        std::printf("INFLIGHT\n");
        continue;
      }
      auto l = lt.ok() ? c.Wait(*lt, timeout) : flexkv::Result<flexkv::OpResult>(lt.status());
      if (!l.ok()) {
        std::printf("ERROR %s %s\n", flexkv::StatusCodeName(l.status().code()), l.status().message().c_str());
        return 1;
      }
      std::vector<uint8_t> expect(block_bytes);
      bool equal = true;
      for (uint32_t i = 0; i < l->done_blocks && equal; ++i) {
        fill(seed, i, expect.data(), block_bytes);
        equal = std::memcmp(expect.data(), kv.data + uint64_t{i} * block_bytes, block_bytes) == 0;
      }
      auto rel = c.Release(m->match_handle);
      if (rel.ok()) (void)c.Wait(*rel, timeout);
      std::printf("LOADED %u %u %d %s\n", hits, l->done_blocks, equal ? 1 : 0, flexkv::StatusCodeName(l->status.code()));
    } else {
      std::printf("ERROR INVALID_ARGUMENT unknown step '%s'\n", step.c_str());
      return 2;
    }
  }
  return 0;
}
