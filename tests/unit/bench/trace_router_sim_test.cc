// The three-router trace simulation: one node makes the routers equal; scattered repeats show what each router
// gains; the routing index stays exactly every node's committed keys, evictions included.
#include "tests/bench/trace_router_sim.h"

#include <catch2/catch.hpp>
#include <vector>

#include "flexkv/block_key.h"

using flexkv::BlockKey;
using flexkv::bench::RouterRun;
using flexkv::bench::TraceRequest;

namespace {

// `rounds` rounds of `prompts` distinct prompts of `blocks` blocks each, in order p0, p1, ..., p0, p1, ...
struct Trace {
  std::vector<TraceRequest> requests;
  std::vector<std::vector<BlockKey>> keys;
};
Trace Repeats(int prompts, int rounds, int blocks) {
  Trace t;
  for (int r = 0; r < rounds; ++r) {
    for (int p = 0; p < prompts; ++p) {
      std::vector<int32_t> tokens(static_cast<size_t>(blocks) * 16);
      for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = p * 1000 + static_cast<int32_t>(i);
      TraceRequest req;
      req.hash_ids.assign(static_cast<size_t>(blocks), 0);
      t.requests.push_back(req);
      t.keys.push_back(flexkv::ComputeBlockKeys("router-sim", tokens, 16));
    }
  }
  return t;
}

}  // namespace

TEST_CASE("router simulation: with one node the three routers hit alike and pull nothing", "[unit][routing]") {
  const Trace t = Repeats(5, 6, 4);
  const auto runs = flexkv::bench::SimulateRouters(t.requests, t.keys, 1, 1000);
  REQUIRE(runs.size() == 3);
  for (const RouterRun& r : runs) {
    INFO(r.router);
    CHECK(r.hits == runs[0].hits);
    CHECK(r.pulled_blocks == 0);
    CHECK(r.requests == 30);
    CHECK(r.blocks == 120);
    CHECK(r.index_consistent);
  }
  CHECK(runs[0].hits == 100);  // every prompt misses once, hits its 4 blocks 5 times
}

TEST_CASE("router simulation: repeats scattered by round robin are hit by peer pulls and by prefix-aware routing",
          "[unit][routing]") {
  // 4 prompts over 3 nodes: round robin sends each prompt to every node in turn.
  const Trace t = Repeats(4, 9, 5);
  const auto runs = flexkv::bench::SimulateRouters(t.requests, t.keys, 3, 1000);
  const RouterRun& rr = runs[0];
  const RouterRun& pulls = runs[1];
  const RouterRun& aware = runs[2];
  CHECK(rr.router == "round-robin");
  CHECK(pulls.router == "round-robin + peer pulls");
  CHECK(aware.router == "prefix-aware");
  // Round robin: each prompt misses once on each of the 3 nodes.
  CHECK(rr.hits == uint64_t{4} * 5 * (9 - 3));
  CHECK(rr.pulled_blocks == 0);
  // With pulls: only the very first request of a prompt misses; the second and third nodes pull it.
  CHECK(pulls.hits == uint64_t{4} * 5 * (9 - 1));
  CHECK(pulls.pulled_blocks == uint64_t{4} * 5 * 2);
  CHECK(pulls.local_hits == rr.hits);
  // Prefix-aware: the same hits as pulling, nothing pulled, and the load still spread over the nodes.
  CHECK(aware.hits == uint64_t{4} * 5 * (9 - 1));
  CHECK(aware.pulled_blocks == 0);
  CHECK(aware.imbalance() <= 2.0);
  for (const RouterRun& r : runs) CHECK(r.index_consistent);
}

TEST_CASE("router simulation: the routing index follows evictions", "[unit][routing]") {
  // 12 prompts of 6 blocks, nodes of 20 blocks: every node evicts all the time.
  const Trace t = Repeats(12, 5, 6);
  const auto runs = flexkv::bench::SimulateRouters(t.requests, t.keys, 4, 20);
  for (const RouterRun& r : runs) {
    INFO(r.router);
    CHECK(r.index_consistent);
    CHECK(r.hits <= r.blocks);
  }
}
