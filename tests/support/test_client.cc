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
// `--do hold` keeps the session until the process is killed.
#include <unistd.h>

#include <CLI/CLI.hpp>
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
  app.add_option("--do", steps, "store:SEED:N, load:SEED:N, pin:SEED:N, inflight-load:SEED:N, flood:SEED:COUNT, hold");
  CLI11_PARSE(app, argc, argv);

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
    if (!need_kv()) return 1;
    const auto keys = flexkv::ComputeBlockKeys(ns, Tokens(seed, n, g.tokens_per_block), g.tokens_per_block);
    std::vector<uint32_t> ids(n);
    for (uint32_t i = 0; i < n; ++i) ids[i] = i;
    const std::string what = op;
    if (what == "store") {
      for (uint32_t i = 0; i < n; ++i) FillBlock(seed, i, kv.data + uint64_t{i} * block_bytes, block_bytes);
      auto t = c.Store(flexkv::BlockKeyChain(keys), ids);
      auto r = t.ok() ? c.Wait(*t, timeout) : flexkv::Result<flexkv::OpResult>(t.status());
      if (!r.ok()) {
        std::printf("ERROR %s %s\n", flexkv::StatusCodeName(r.status().code()), r.status().message().c_str());
        return 1;
      }
      std::printf("STORED %u %u %s\n", r->matched_blocks, r->done_blocks, flexkv::StatusCodeName(r->status.code()));
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
        FillBlock(seed, i, expect.data(), block_bytes);
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
