// A store says where its first key hangs: through a real flexkvd, a store of the part of a prompt past its cached
// prefix lands under that prefix (a match from the prompt's first block reaches it), a store whose parent is not
// cached is refused with nothing stored, and stores in chunks under pressure leave no block unreachable.
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "flexkv/block_key.h"
#include "flexkv/c.h"
#include "flexkv/client.h"
#include "tests/support/process.h"

using namespace std::chrono_literals;
using flexkv::BlockKey;
using flexkv::BlockKeyChain;
using flexkv::StatusCode;
using flexkv::testing::DaemonUnderTest;

namespace {

constexpr char kNamespace[] = "parent-test";

// 4 KiB blocks: a pool of thousands of blocks stays small.
flexkv::Geometry TinyGeometry() {
  flexkv::Geometry g;
  g.tokens_per_block = 16;
  g.num_layers = 2;
  g.kv_planes = 2;
  g.kv_heads_per_rank = 1;
  g.head_dim = 32;
  g.dtype_bytes = 2;
  g.tp_size = 1;
  return g;
}

std::vector<BlockKey> PromptKeys(int32_t seed, uint32_t blocks) {
  std::vector<int32_t> tokens(size_t{blocks} * 16);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = seed * 1000003 + static_cast<int32_t>(i);
  return flexkv::ComputeBlockKeys(kNamespace, tokens, 16);
}

struct Engine {
  std::unique_ptr<flexkv::Client> client;
  flexkv::HostKvBuffers kv;
  std::vector<uint32_t> ids;  // 0, 1, ... one per KV block

  Engine(const DaemonUnderTest& d, uint32_t kv_blocks) {
    auto c = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
    REQUIRE(c.ok());
    client = std::move(*c);
    REQUIRE(client->Attach({"parent-test", 0, 0, kNamespace, TinyGeometry()}).ok());
    auto created = client->CreateHostKv(flexkv::KvLayout::kBlockFirst, kv_blocks);
    REQUIRE(created.ok());
    kv = *created;
    for (uint32_t i = 0; i < kv_blocks; ++i) ids.push_back(i);
  }

  flexkv::OpResult Store(const BlockKeyChain& keys) {
    auto t = client->Store(keys, std::span<const uint32_t>(ids).first(keys.size()));
    REQUIRE(t.ok());
    auto r = client->Wait(*t, 30s);
    REQUIRE(r.ok());
    return *r;
  }
  uint32_t Match(std::span<const BlockKey> keys) {
    auto t = client->Match(keys);
    REQUIRE(t.ok());
    auto r = client->Wait(*t, 30s);
    REQUIRE(r.ok());
    REQUIRE(r->status.ok());
    return r->matched_blocks;
  }
  uint64_t IndexBlocks() {
    auto s = client->GetStatus();
    REQUIRE(s.ok());
    return s->index_blocks;
  }
};

}  // namespace

TEST_CASE("a store of keys[20:30] after keys[0:20] hangs under keys[19] - a match from keys[0] reaches 30",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "16MiB"});
  REQUIRE(d.WaitReady());
  Engine e(d, 64);
  const auto keys = PromptKeys(1, 30);
  const BlockKeyChain prompt(keys);
  auto head = e.Store(prompt.Slice(0, 20));
  REQUIRE(head.status.ok());
  CHECK(head.done_blocks == 20);
  auto tail = e.Store(prompt.Slice(20, 30));
  INFO(tail.status.ToString());
  REQUIRE(tail.status.ok());
  CHECK(tail.matched_blocks == 0);
  CHECK(tail.done_blocks == 10);
  CHECK(e.Match(keys) == 30);
  CHECK(e.Match(std::span<const BlockKey>(keys).subspan(20)) == 0);  // not stored as roots
  // Storing the slice again skips what is cached under keys[19]; a longer one stores only the rest.
  auto again = e.Store(prompt.Slice(20, 30));
  CHECK(again.status.ok());
  CHECK(again.matched_blocks == 10);
  CHECK(again.done_blocks == 0);
  CHECK(e.IndexBlocks() == 30);
}

TEST_CASE("a store whose parent was never stored or was evicted is refused with FAILED_PRECONDITION - nothing stored",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "1MiB"});  // 256 blocks of 4 KiB
  REQUIRE(d.WaitReady());
  Engine e(d, 64);
  const auto keys = PromptKeys(2, 30);
  const BlockKeyChain prompt(keys);

  SECTION("never stored") {
    auto r = e.Store(prompt.Slice(20, 30));
    INFO(r.status.ToString());
    CHECK(r.status.code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(r.status.message(), Catch::Contains("parent key not cached") &&
                                       Catch::Contains("store from the prompt's first uncached block"));
    CHECK(r.done_blocks == 0);
    CHECK(e.IndexBlocks() == 0);
  }
  SECTION("evicted") {
    REQUIRE(e.Store(prompt.Slice(0, 20)).status.ok());
    for (int32_t seed = 100; seed < 105; ++seed) {  // 5 x 60 blocks through a 256-block pool: the prompt ages out
      const auto other = PromptKeys(seed, 60);
      REQUIRE(e.Store(BlockKeyChain(other)).status.ok());
    }
    REQUIRE(e.Match(keys) == 0);
    const uint64_t before = e.IndexBlocks();
    auto r = e.Store(prompt.Slice(20, 30));
    INFO(r.status.ToString());
    CHECK(r.status.code() == StatusCode::kFailedPrecondition);
    CHECK(r.done_blocks == 0);
    CHECK(e.IndexBlocks() == before);
    CHECK(e.Match(std::span<const BlockKey>(keys).subspan(20)) == 0);
    // The engine's remedy: store from the first uncached block, here the prompt's first.
    auto whole = e.Store(prompt.Slice(0, 30));
    CHECK(whole.status.ok());
    CHECK(whole.done_blocks == 30);
    CHECK(e.Match(keys) == 30);
  }
}

TEST_CASE("12,000 blocks stored in chunks of 500 through a 4,096-block pool are all reachable from the root",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "16MiB"});  // 4,096 blocks of 4 KiB
  REQUIRE(d.WaitReady());
  Engine e(d, 500);
  constexpr uint32_t kPrompts = 6, kPromptBlocks = 2000, kChunk = 500;
  std::vector<std::vector<BlockKey>> prompts;
  for (uint32_t p = 0; p < kPrompts; ++p) {
    prompts.push_back(PromptKeys(static_cast<int32_t>(1000 + p), kPromptBlocks));
    const BlockKeyChain prompt(prompts.back());
    for (uint32_t begin = 0; begin < kPromptBlocks; begin += kChunk) {  // the part of the prompt just computed
      auto r = e.Store(prompt.Slice(begin, begin + kChunk));
      INFO("prompt " << p << " chunk at " << begin << ": " << r.status.ToString());
      REQUIRE(r.status.ok());
      CHECK(r.done_blocks == kChunk);
    }
  }
  const uint64_t in_index = e.IndexBlocks();
  CHECK(in_index == 4096);
  uint64_t reachable = 0;  // the prompts share no block: each reachable block is counted once
  for (const auto& keys : prompts) reachable += e.Match(keys);
  CHECK(reachable == in_index);
}

TEST_CASE("C ABI: flexkv_store hangs its keys under the parent given, NULL being the root", "[integration]") {
  DaemonUnderTest d({"--pool-size", "16MiB"});
  REQUIRE(d.WaitReady());
  flexkv_client* c = nullptr;
  REQUIRE(flexkv_connect(d.socket().c_str(), 5000, &c, nullptr, 0) == FLEXKV_OK);
  const flexkv::Geometry tiny = TinyGeometry();
  const flexkv_geometry g{tiny.tokens_per_block, tiny.num_layers, tiny.kv_planes, tiny.kv_heads_per_rank,
                          tiny.head_dim,         tiny.dtype_bytes, tiny.tp_size};
  uint64_t sid = 0;
  REQUIRE(flexkv_attach(c, "c-abi", kNamespace, 0, 0, &g, &sid) == FLEXKV_OK);
  void* data = nullptr;
  uint64_t bytes = 0;
  REQUIRE(flexkv_create_host_kv(c, FLEXKV_LAYOUT_BLOCK_FIRST, 32, &data, &bytes) == FLEXKV_OK);
  const auto keys = PromptKeys(3, 30);
  const auto* k = reinterpret_cast<const flexkv_block_key*>(keys.data());
  std::vector<uint32_t> ids(30);
  for (uint32_t i = 0; i < 30; ++i) ids[i] = i;
  auto run = [&](const flexkv_block_key* parent, const flexkv_block_key* first, size_t n) {
    flexkv_ticket t{};
    REQUIRE(flexkv_store(c, parent, first, ids.data(), n, &t) == FLEXKV_OK);
    flexkv_op_result out{};
    REQUIRE(flexkv_wait(c, t, 10000000, &out) == FLEXKV_OK);
    return out;
  };
  auto matched = [&]() {
    flexkv_ticket t{};
    REQUIRE(flexkv_match(c, k, 30, 0, &t) == FLEXKV_OK);
    flexkv_op_result out{};
    REQUIRE(flexkv_wait(c, t, 10000000, &out) == FLEXKV_OK);
    return out.matched_blocks;
  };
  CHECK(run(&k[19], k + 20, 10).status_code == FLEXKV_FAILED_PRECONDITION);  // keys[19] not cached yet
  CHECK(run(nullptr, k, 20).status_code == FLEXKV_OK);
  CHECK(matched() == 20);
  const flexkv_op_result tail = run(&k[19], k + 20, 10);
  CHECK(tail.status_code == FLEXKV_OK);
  CHECK(tail.done_blocks == 10);
  CHECK(matched() == 30);
  flexkv_close(c);
}
