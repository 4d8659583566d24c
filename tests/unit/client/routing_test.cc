// RoutingIndex and ChoosePrefixAware: prefixes per node and tier, idempotent updates, node limits, the choice.
#include "flexkv/routing.h"

#include <array>
#include <catch2/catch.hpp>
#include <random>
#include <atomic>
#include <set>
#include <thread>
#include <vector>

using flexkv::BlockKey;
using flexkv::CacheTier;
using flexkv::RoutingIndex;

namespace {

std::vector<BlockKey> Keys(int prompt, int n) {
  std::vector<int32_t> tokens(static_cast<size_t>(n) * 16);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = prompt * 100000 + static_cast<int32_t>(i);
  return flexkv::ComputeBlockKeys("routing-test", tokens, 16);
}

std::span<const BlockKey> Head(const std::vector<BlockKey>& keys, size_t n) { return {keys.data(), n}; }

}  // namespace

TEST_CASE("routing index: each node's cached prefix, in any tier and in DRAM alone", "[unit][routing]") {
  RoutingIndex index;
  const uint32_t a = *index.AddNode("node-a");
  const uint32_t b = *index.AddNode("node-b");
  const uint32_t c = *index.AddNode("node-c");
  CHECK(index.node_count() == 3);
  const auto keys = Keys(1, 10);
  REQUIRE(index.Stored(a, CacheTier::kDram, Head(keys, 6)).ok());
  // B: blocks 0-3 in DRAM, 4-7 on SSD (its evicted tail written back).
  REQUIRE(index.Stored(b, CacheTier::kDram, Head(keys, 4)).ok());
  REQUIRE(index.Stored(b, CacheTier::kSsd, std::span(keys).subspan(4, 4)).ok());
  // C: a block in the middle only - not a prefix.
  REQUIRE(index.Stored(c, CacheTier::kDram, std::span(keys).subspan(2, 3)).ok());
  auto p = index.PrefixLengths(keys);
  REQUIRE(p.size() == 3);
  CHECK(p[a].node == a);
  CHECK(p[a].blocks == 6);
  CHECK(p[a].dram_blocks == 6);
  CHECK(p[b].blocks == 8);
  CHECK(p[b].dram_blocks == 4);
  CHECK(p[c].blocks == 0);
  CHECK(p[c].dram_blocks == 0);
  // A prompt that is a prefix of the cached one, and one that diverges after 3 blocks.
  p = index.PrefixLengths(Head(keys, 5));
  CHECK(p[a].blocks == 5);
  CHECK(p[b].blocks == 5);
  std::vector<BlockKey> other(keys.begin(), keys.begin() + 3);
  const auto tail = Keys(2, 4);
  other.insert(other.end(), tail.begin(), tail.end());
  p = index.PrefixLengths(other);
  CHECK(p[a].blocks == 3);
  CHECK(p[b].blocks == 3);
  CHECK(index.PrefixLengths({}).at(a).blocks == 0);
  CHECK(index.KeyCount(b, CacheTier::kDram) == 4);
  CHECK(index.KeyCount(b, CacheTier::kSsd) == 4);
  CHECK(index.size() == 8);
}

TEST_CASE("routing index: updates are idempotent, removals and clears leave exactly what is held", "[unit][routing]") {
  RoutingIndex index;
  const uint32_t a = *index.AddNode("a");
  const uint32_t b = *index.AddNode("b");
  const auto keys = Keys(3, 8);
  REQUIRE(index.Stored(a, CacheTier::kDram, keys).ok());
  REQUIRE(index.Stored(a, CacheTier::kDram, keys).ok());  // a snapshot replayed over what was seen
  REQUIRE(index.Stored(b, CacheTier::kDram, Head(keys, 2)).ok());
  CHECK(index.KeyCount(a, CacheTier::kDram) == 8);
  // A's last 3 blocks demoted to SSD: removed from DRAM, stored on SSD - the prefix stays 8 long.
  REQUIRE(index.Removed(a, CacheTier::kDram, std::span(keys).subspan(5)).ok());
  REQUIRE(index.Stored(a, CacheTier::kSsd, std::span(keys).subspan(5)).ok());
  auto p = index.PrefixLengths(keys);
  CHECK(p[a].blocks == 8);
  CHECK(p[a].dram_blocks == 5);
  // Removing what is not held changes nothing.
  REQUIRE(index.Removed(b, CacheTier::kSsd, keys).ok());
  CHECK(index.KeyCount(b, CacheTier::kDram) == 2);
  // A restarts empty: only B's two blocks remain in the index.
  REQUIRE(index.ClearNode(a).ok());
  CHECK(index.KeyCount(a, CacheTier::kDram) == 0);
  CHECK(index.KeyCount(a, CacheTier::kSsd) == 0);
  CHECK(index.size() == 2);
  p = index.PrefixLengths(keys);
  CHECK(p[a].blocks == 0);
  CHECK(p[b].blocks == 2);
  REQUIRE(index.Removed(b, CacheTier::kDram, Head(keys, 2)).ok());
  CHECK(index.size() == 0);
}

TEST_CASE("routing index: agrees with a per-node set model under random stores and removals", "[unit][routing]") {
  constexpr uint32_t kNodes = 5;
  RoutingIndex index;
  for (uint32_t n = 0; n < kNodes; ++n) REQUIRE(index.AddNode("n" + std::to_string(n)).ok());
  std::vector<std::vector<BlockKey>> prompts;
  for (int i = 0; i < 12; ++i) prompts.push_back(Keys(10 + i, 12));
  struct KeyLess {
    bool operator()(const BlockKey& x, const BlockKey& y) const { return x.hi != y.hi ? x.hi < y.hi : x.lo < y.lo; }
  };
  std::vector<std::array<std::set<BlockKey, KeyLess>, 2>> model(kNodes);
  std::mt19937 rng(7);
  for (int step = 0; step < 3000; ++step) {
    const uint32_t node = rng() % kNodes;
    const auto tier = static_cast<CacheTier>(rng() % 2);
    const auto& prompt = prompts[rng() % prompts.size()];
    const size_t from = rng() % prompt.size();
    const size_t len = 1 + rng() % (prompt.size() - from);
    auto run = std::span(prompt).subspan(from, len);
    if (rng() % 3 == 0) {
      REQUIRE(index.Removed(node, tier, run).ok());
      for (const auto& k : run) model[node][static_cast<size_t>(tier)].erase(k);
    } else {
      REQUIRE(index.Stored(node, tier, run).ok());
      model[node][static_cast<size_t>(tier)].insert(run.begin(), run.end());
    }
    if (step % 97 == 0) {
      const uint32_t cleared = rng() % kNodes;
      REQUIRE(index.ClearNode(cleared).ok());
      model[cleared][0].clear();
      model[cleared][1].clear();
    }
    const auto& probe = prompts[rng() % prompts.size()];
    const auto p = index.PrefixLengths(probe);
    for (uint32_t n = 0; n < kNodes; ++n) {
      uint32_t any = 0, dram = 0;
      while (any < probe.size() && (model[n][0].count(probe[any]) || model[n][1].count(probe[any]))) ++any;
      while (dram < probe.size() && model[n][0].count(probe[dram])) ++dram;
      INFO("step " << step << " node " << n);
      REQUIRE(p[n].blocks == any);
      REQUIRE(p[n].dram_blocks == dram);
      REQUIRE(index.KeyCount(n, CacheTier::kDram) == model[n][0].size());
      REQUIRE(index.KeyCount(n, CacheTier::kSsd) == model[n][1].size());
    }
  }
}

TEST_CASE("routing index: ReplaceNode leaves the node exactly the keys given and other nodes as they were",
          "[unit][routing]") {
  RoutingIndex index;
  const uint32_t a = *index.AddNode("a");
  const uint32_t b = *index.AddNode("b");
  const auto keys = Keys(7, 10);
  REQUIRE(index.Stored(a, CacheTier::kDram, Head(keys, 6)).ok());
  REQUIRE(index.Stored(a, CacheTier::kSsd, std::span(keys).subspan(6, 4)).ok());
  REQUIRE(index.Stored(b, CacheTier::kDram, Head(keys, 3)).ok());
  // The snapshot: blocks 0-1 in DRAM, 2-4 on SSD; the old keys 5-9 go (held by no one, they leave the index).
  REQUIRE(index.ReplaceNode(a, Head(keys, 2), std::span(keys).subspan(2, 3)).ok());
  auto p = index.PrefixLengths(keys);
  CHECK(p[a].blocks == 5);
  CHECK(p[a].dram_blocks == 2);
  CHECK(p[b].blocks == 3);
  CHECK(index.KeyCount(a, CacheTier::kDram) == 2);
  CHECK(index.KeyCount(a, CacheTier::kSsd) == 3);
  CHECK(index.KeyCount(b, CacheTier::kDram) == 3);
  CHECK(index.size() == 5);
  // A key given twice counts once; an empty view empties the node.
  const std::vector<BlockKey> twice = {keys[0], keys[0]};
  REQUIRE(index.ReplaceNode(a, twice, {}).ok());
  CHECK(index.KeyCount(a, CacheTier::kDram) == 1);
  CHECK(index.KeyCount(a, CacheTier::kSsd) == 0);
  REQUIRE(index.ReplaceNode(a, {}, {}).ok());
  CHECK(index.PrefixLengths(keys)[a].blocks == 0);
  CHECK(index.size() == 3);
  auto bad = index.ReplaceNode(9, Head(keys, 1), {});
  CHECK(bad.code() == flexkv::StatusCode::kInvalidArgument);
  CHECK_THAT(bad.message(), Catch::Contains("never added"));
  CHECK(index.size() == 3);
}

// Regression (issue 20 review): a feed applied a snapshot as ClearNode, Stored(DRAM), Stored(SSD), each under the lock
// on its own, so a router reading in between saw the node holding nothing, or its DRAM part alone.
TEST_CASE("routing index: a reader concurrent with ReplaceNode sees the old view or the new one and never a mix",
          "[unit][routing]") {
  RoutingIndex index;
  const uint32_t a = *index.AddNode("a");
  const auto keys = Keys(8, 16);
  // Two views of the same 16 blocks: all in DRAM, or the first 8 in DRAM and the rest on SSD.
  REQUIRE(index.ReplaceNode(a, keys, {}).ok());
  std::atomic<bool> done{false};
  std::atomic<uint64_t> reads{0}, torn{0};
  std::thread reader([&] {
    while (!done.load()) {
      const auto p = index.PrefixLengths(keys);
      const bool whole = p[a].blocks == 16 && (p[a].dram_blocks == 16 || p[a].dram_blocks == 8);
      if (!whole) torn.fetch_add(1);
      reads.fetch_add(1);
    }
  });
  for (int i = 0; i < 20000 || reads.load() < 20000; ++i) {
    const auto s = i % 2 == 0 ? index.ReplaceNode(a, Head(keys, 8), std::span(keys).subspan(8))
                              : index.ReplaceNode(a, keys, {});
    if (!s.ok()) {
      FAIL_CHECK(s.ToString());
      break;
    }
  }
  done.store(true);
  reader.join();
  CHECK(torn.load() == 0);
}

TEST_CASE("routing index: node names, limits and unknown nodes are refused with a reason", "[unit][routing]") {
  RoutingIndex index;
  CHECK(index.AddNode("").status().code() == flexkv::StatusCode::kInvalidArgument);
  REQUIRE(index.AddNode("x").ok());
  auto again = index.AddNode("x");
  CHECK(again.status().code() == flexkv::StatusCode::kAlreadyExists);
  CHECK(index.FindNode("x").value() == 0);
  CHECK(index.FindNode("y").status().code() == flexkv::StatusCode::kNotFound);
  CHECK(index.NodeName(0) == "x");
  CHECK(index.NodeName(7).empty());
  const auto keys = Keys(4, 2);
  auto s = index.Stored(3, CacheTier::kDram, keys);
  CHECK(s.code() == flexkv::StatusCode::kInvalidArgument);
  CHECK(s.message().find("never added") != std::string::npos);
  for (uint32_t n = 1; n < RoutingIndex::kMaxNodes; ++n) REQUIRE(index.AddNode("n" + std::to_string(n)).ok());
  CHECK(index.AddNode("one-too-many").status().code() == flexkv::StatusCode::kResourceExhausted);
  // Node 63 works (the top bit of the masks).
  REQUIRE(index.Stored(63, CacheTier::kSsd, keys).ok());
  const auto p = index.PrefixLengths(keys);
  CHECK(p[63].blocks == 2);
  CHECK(p[63].dram_blocks == 0);
  CHECK(p[62].blocks == 0);
}

TEST_CASE("routing choice: the longest prefix among nodes not overloaded, ties to the least loaded", "[unit][routing]") {
  using P = RoutingIndex::NodePrefix;
  std::vector<P> prefixes = {{0, 4, 4}, {1, 9, 9}, {2, 9, 2}, {3, 0, 0}};
  std::vector<double> loads = {1, 3, 2, 0};
  CHECK(flexkv::ChoosePrefixAware(prefixes, loads).value() == 2);  // 9 blocks on 1 and 2: 2 is less loaded
  loads = {1, 1, 5, 0};
  CHECK(flexkv::ChoosePrefixAware(prefixes, loads).value() == 1);  // 2 is over 2 x (0 + 1)
  loads = {1, 7, 5, 0};
  CHECK(flexkv::ChoosePrefixAware(prefixes, loads).value() == 0);  // both long prefixes overloaded
  prefixes = {{0, 0, 0}, {1, 0, 0}, {2, 0, 0}};
  loads = {3, 1, 2};
  CHECK(flexkv::ChoosePrefixAware(prefixes, loads).value() == 1);  // nothing cached: the least loaded
  CHECK(flexkv::ChoosePrefixAware(prefixes, std::vector<double>{1, 2}).status().code() ==
        flexkv::StatusCode::kInvalidArgument);
  CHECK(flexkv::ChoosePrefixAware({}, {}).status().code() == flexkv::StatusCode::kInvalidArgument);
}

TEST_CASE("routing choice: regression - a node that is not live is never chosen, its keys stay",
          "[unit][routing][regression]") {
  // Issue 29, item 8: a dead node holding the longest prefix was chosen; a request sent there fails.
  RoutingIndex index;
  const uint32_t a = *index.AddNode("node-a");
  const uint32_t b = *index.AddNode("node-b");
  const auto keys = Keys(3, 6);
  REQUIRE(index.Stored(a, CacheTier::kDram, keys).ok());
  REQUIRE(index.Stored(b, CacheTier::kDram, Head(keys, 2)).ok());
  const std::vector<double> idle{0, 0};
  CHECK(*flexkv::ChoosePrefixAware(index.PrefixLengths(keys), idle) == a);
  REQUIRE(index.SetLive(a, false).ok());
  auto p = index.PrefixLengths(keys);
  CHECK_FALSE(p[a].live);
  CHECK(p[a].blocks == 6);
  CHECK(*flexkv::ChoosePrefixAware(p, idle) == b);
  CHECK(*flexkv::ChoosePrefixAware(p, std::vector<double>{0, 100}) == b);  // the only live node qualifies
  REQUIRE(index.SetLive(b, false).ok());
  auto none = flexkv::ChoosePrefixAware(index.PrefixLengths(keys), idle);
  REQUIRE_FALSE(none.ok());
  CHECK(none.status().code() == flexkv::StatusCode::kUnavailable);
  REQUIRE(index.SetLive(a, true).ok());
  CHECK(*flexkv::ChoosePrefixAware(index.PrefixLengths(keys), idle) == a);
  CHECK(index.SetLive(9, true).code() == flexkv::StatusCode::kInvalidArgument);
}
