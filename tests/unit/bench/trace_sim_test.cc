// flexkv-bench trace: the pure parts (trace line parsing, block tokens, the reference LRU, the bound).
#include "tests/bench/trace_bench.h"

#include <catch2/catch.hpp>
#include <vector>

#include "flexkv/block_key.h"

using flexkv::bench::BlockLru;
using flexkv::bench::TraceRequest;

TEST_CASE("trace lines parse into hash id lists") {
  auto r = flexkv::bench::ParseTraceLine(
      R"({"timestamp": 27, "input_length": 1536, "output_length": 4, "hash_ids": [0, 1, 46]})");
  REQUIRE(r.ok());
  CHECK(r->timestamp_ms == 27);
  CHECK(r->hash_ids == std::vector<uint64_t>{0, 1, 46});
  CHECK(flexkv::bench::ParseTraceLine(R"({"hash_ids": []})")->hash_ids.empty());
  CHECK_FALSE(flexkv::bench::ParseTraceLine(R"({"timestamp": 1})").ok());
  CHECK_FALSE(flexkv::bench::ParseTraceLine(R"({"hash_ids": [1, 2)").ok());
  CHECK_FALSE(flexkv::bench::ParseTraceLine(R"({"hash_ids": [1, "x"]})").ok());
}

TEST_CASE("block tokens chain into keys that share exactly the common id prefix") {
  auto keys = [](std::vector<uint64_t> ids) {
    std::vector<int32_t> t;
    for (uint64_t id : ids) flexkv::bench::AppendBlockTokens(id, 512, &t);
    return flexkv::ComputeBlockKeys("ns", t, 512);
  };
  auto a = keys({5, 6, 7});
  auto b = keys({5, 6, 8});
  auto c = keys({9, 6, 7});
  REQUIRE(a.size() == 3);
  CHECK(a[0] == b[0]);
  CHECK(a[1] == b[1]);
  CHECK_FALSE(a[2] == b[2]);
  CHECK_FALSE(a[1] == c[1]);  // same id, different prefix: a different key
  CHECK_FALSE(a[2] == c[2]);
}

TEST_CASE("reference LRU counts leading hits and evicts the least recently used block") {
  BlockLru lru(3);
  const std::vector<uint64_t> r1 = {1, 2, 3};
  CHECK(lru.Access(r1) == 0);
  CHECK(lru.Access(r1) == 3);
  const std::vector<uint64_t> r2 = {1, 4};  // evicts 2 (LRU after touching 1)
  CHECK(lru.Access(r2) == 1);
  CHECK(lru.evictions() == 1);
  // Order now 3, 1, 4. 1 hits; 2 misses (evicting 3); 4 is present but after a miss: not a usable (prefix) hit.
  const std::vector<uint64_t> r3 = {1, 2, 4};
  CHECK(lru.Access(r3) == 1);
  CHECK(lru.raw_hits() == 3 + 1 + 2);
  CHECK(lru.size() == 3);
}

TEST_CASE("infinite-cache bound counts prefix hits only, and a big LRU reaches it") {
  std::vector<TraceRequest> trace(3);
  trace[0].hash_ids = {0, 1, 2};
  trace[1].hash_ids = {0, 1, 3};
  trace[2].hash_ids = {4, 1};  // id 1 again, but not as a prefix: the trace never does this; counted as a miss
  const auto bound = flexkv::bench::InfiniteCacheBound(trace);
  CHECK(bound.blocks == 8);
  CHECK(bound.hits == 2);
  const auto big = flexkv::bench::ReferenceLru(trace, 100);
  CHECK(big.hits == bound.hits);
  CHECK(flexkv::bench::ReferenceLru(trace, 0).hits == 0);
}
