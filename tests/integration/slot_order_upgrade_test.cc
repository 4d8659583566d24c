// Issue 32: a node upgraded to the rank-major slot order keeps what it cached. flexkvd started on the TP 2 pools
// and the SSD block file of the release before it (tests/fixtures/tp2_layer_major, see its README) flags each pool
// at once (the older release then refuses it rather than reading today's bytes in its order), rewrites every block
// as it verifies it, serves them all (matches), does nothing more at the next start; the SSD file's TP 2 blocks,
// written in the old order under the old geometry string, are promoted, checked in that order and rewritten in
// today's before they are served. A TP 2 engine cannot load on a machine without GPUs, so the bytes are read from
// the pool file once the daemon stopped (the unit tests, tests/unit/daemon/cache/slot_order_upgrade_test.cc, check
// the rewrite itself).
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "flexkv/client.h"
#include "tests/support/process.h"
#include "tests/support/temp_dir.h"

using namespace std::chrono_literals;
using flexkv::testing::DaemonUnderTest;

namespace {

constexpr uint32_t kVersionOffset = 8;  // docs/protocol.md, "Pool file": magic[8], then the version (u32, LE)
constexpr uint32_t kRankMajorFlag = 0x100;

std::string FixtureDir() { return std::string(FLEXKV_SLOT_ORDER_FIXTURE_DIR); }

void Unpack(const std::string& name, const std::string& to) {
  std::filesystem::create_directories(std::filesystem::path(to).parent_path());
  auto r = flexkv::testing::RunCommand({"/bin/sh", "-c", "gzip -dc '" + FixtureDir() + "/" + name + ".gz' > '" + to + "'"});
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
}

template <typename T>
T Read(const std::string& path, uint64_t offset) {
  std::ifstream f(path, std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  T value{};
  f.read(reinterpret_cast<char*>(&value), sizeof(value));
  REQUIRE(f.good());
  return value;
}
uint32_t ReadU32(const std::string& path, uint64_t offset) { return Read<uint32_t>(path, offset); }

flexkv::Geometry FullTp2() {
  flexkv::Geometry g;
  g.tokens_per_block = 16;
  g.num_layers = 3;
  g.kv_planes = 2;
  g.kv_heads_per_rank = 2;
  g.head_dim = 16;
  g.dtype_bytes = 2;
  g.tp_size = 2;
  return g;
}

std::vector<flexkv::BlockKey> Keys(const std::string& ns, int prompt, int blocks) {
  std::vector<int32_t> t(static_cast<size_t>(blocks) * 16);
  for (size_t i = 0; i < t.size(); ++i) t[i] = prompt * 1000 + static_cast<int32_t>(i);
  return flexkv::ComputeBlockKeys(ns, t, 16);
}

// The README's byte of chunk (l, p, r) of block b of prompt c at offset i.
uint8_t Pattern(uint32_t c, uint32_t b, uint32_t l, uint32_t p, uint32_t r, uint64_t i) {
  return static_cast<uint8_t>((c * 59 + b * 13 + l * 37 + p * 11 + r * 101 + i) % 251);
}

// The committed block of `key` in a single-component pool file (docs/protocol.md, "Pool file": block_bytes at 40,
// capacity at 48, data_offset at 64; the slot table at 4096, 64 bytes a slot: state, order, key), or empty.
std::vector<uint8_t> BlockInFile(const std::string& path, const flexkv::BlockKey& key) {
  const auto block_bytes = Read<uint64_t>(path, 40), capacity = Read<uint64_t>(path, 48);
  const auto data_offset = Read<uint64_t>(path, 64);
  for (uint64_t s = 0; s < capacity; ++s) {
    if (Read<uint32_t>(path, 4096 + s * 64) != 0x434F4D54u) continue;
    if (Read<uint64_t>(path, 4096 + s * 64 + 8) != key.lo || Read<uint64_t>(path, 4096 + s * 64 + 16) != key.hi) continue;
    CHECK(Read<uint32_t>(path, 4096 + s * 64 + 4) == 1);  // its entry says today's order
    std::vector<uint8_t> bytes(block_bytes);
    std::ifstream f(path, std::ios::binary);
    f.seekg(static_cast<std::streamoff>(data_offset + s * block_bytes));
    f.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(block_bytes));
    REQUIRE(f.good());
    return bytes;
  }
  return {};
}

// Whether the pool file holds prompt `prompt`'s `blocks` blocks in today's order: rank r's part first, [layer][plane].
void CheckBlocksInFile(const std::string& path, int prompt, int blocks) {
  const flexkv::Geometry g = FullTp2();
  const auto keys = Keys("fixture-tp2", prompt, blocks);
  const uint64_t chunk = g.chunk_bytes_per_rank();
  for (int b = 0; b < blocks; ++b) {
    CAPTURE(prompt, b);
    const auto bytes = BlockInFile(path, keys[static_cast<size_t>(b)]);
    REQUIRE(bytes.size() == g.host_block_bytes());
    uint64_t wrong = 0;
    for (uint32_t r = 0; r < 2; ++r)
      for (uint32_t l = 0; l < g.num_layers; ++l)
        for (uint32_t p = 0; p < 2; ++p)
          for (uint64_t i = 0; i < chunk; ++i) {
            const uint64_t at = ((uint64_t{r} * g.num_layers + l) * 2 + p) * chunk + i;
            wrong += bytes[at] != Pattern(static_cast<uint32_t>(prompt), static_cast<uint32_t>(b), l, p, r, i) ? 1 : 0;
          }
    CHECK(wrong == 0);
  }
}

// An engine's rank 0 of the fixture's TP 2 geometry, attached (matches need no KV buffers).
std::unique_ptr<flexkv::Client> Rank0(const std::string& socket) {
  auto c = flexkv::Client::Connect({socket, 5000ms, 10000ms});
  REQUIRE(c.ok());
  flexkv::AttachOptions o;
  o.client_name = "slot-order-upgrade";
  o.model_namespace = "fixture-tp2";
  o.geometry = FullTp2();
  o.tp_rank = 0;
  auto attached = (*c)->Attach(o);
  INFO(attached.status().ToString());
  REQUIRE(attached.ok());
  return std::move(*c);
}

uint32_t Matched(flexkv::Client& c, const std::vector<flexkv::BlockKey>& keys) {
  auto t = c.Match(keys, /*pin=*/false);
  REQUIRE(t.ok());
  auto m = c.Wait(*t, 30s);
  REQUIRE(m.ok());
  INFO(m->status.ToString());
  REQUIRE(m->status.ok());
  return m->matched_blocks;
}

// The daemon's log once it holds `line` (the verifier logs its summary just after the last block is settled), or
// as it is after 20 s.
std::string LogWith(DaemonUnderTest& d, const std::string& line) {
  std::string log;
  for (int i = 0; i < 400; ++i) {
    log = d.process().Stderr();
    if (log.find(line) != std::string::npos) break;
    std::this_thread::sleep_for(50ms);
  }
  return log;
}

// Waits until the restored blocks are verified (and so rewritten); the status then.
flexkv::DaemonStatus Verified(flexkv::Client& c) {
  for (int i = 0; i < 400; ++i) {
    auto s = c.GetStatus();
    REQUIRE(s.ok());
    if (s->pool.unverified_blocks == 0) return *s;
    std::this_thread::sleep_for(50ms);
  }
  FAIL("the restored blocks were not verified within 20 s");
  return {};
}

}  // namespace

TEST_CASE("slot order upgrade: a TP 2 pool of the older release is flagged, rewritten as verified, and served",
          "[integration]") {
  flexkv::testing::TempDir dir("flexkv-slot-order");
  const std::string pool = dir.path + "/pool";
  Unpack("full.pool", pool);
  REQUIRE(ReadU32(pool, kVersionOffset) == 2);
  {
    DaemonUnderTest d({"--pool-size", "4MiB"}, dir.path);
    REQUIRE(d.WaitReady());
    auto engine = Rank0(d.socket());
    const auto status = Verified(*engine);
    CHECK(status.index_blocks == 12);
    CHECK(Matched(*engine, Keys("fixture-tp2", 0, 8)) == 8);
    CHECK(Matched(*engine, Keys("fixture-tp2", 1, 4)) == 4);
    CHECK(Matched(*engine, Keys("fixture-tp2", 9, 4)) == 0);
    // The older release refuses the file from now on: its version names the order.
    CHECK(ReadU32(pool, kVersionOffset) == (2 | kRankMajorFlag));
    const std::string log = LogWith(d, "slot order rewritten");
    INFO(log);
    CHECK(log.find("before the rank-major slot order") != std::string::npos);
    CHECK(log.find("12 blocks (144 KiB) of an older release's layer-major slot order rewritten") != std::string::npos);
  }
  // Stopped (SIGTERM): the file holds every block in today's order, its entry saying so.
  CheckBlocksInFile(pool, 0, 8);
  CheckBlocksInFile(pool, 1, 4);
  // Restarted: nothing left to rewrite, everything served.
  DaemonUnderTest d({"--pool-size", "4MiB"}, dir.path);
  REQUIRE(d.WaitReady());
  auto engine = Rank0(d.socket());
  const auto status = Verified(*engine);
  CHECK(status.index_blocks == 12);
  CHECK(Matched(*engine, Keys("fixture-tp2", 0, 8)) == 8);
  const std::string log = LogWith(d, "restored blocks checked");
  INFO(log);
  CHECK(log.find("restored blocks checked") != std::string::npos);
  CHECK(log.find("layer-major slot order rewritten") == std::string::npos);
  CHECK(log.find("before the rank-major slot order") == std::string::npos);
}

TEST_CASE("slot order upgrade: a hybrid TP 2 pool of the older release is rewritten in every component", "[integration]") {
  flexkv::testing::TempDir dir("flexkv-slot-order");
  Unpack("hybrid.pool", dir.path + "/pool");
  DaemonUnderTest d({"--pool-size", "4MiB", "--swa-share", "0.25", "--state-share", "0.05"}, dir.path);
  REQUIRE(d.WaitReady());
  auto c = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
  REQUIRE(c.ok());
  const auto status = Verified(**c);
  CHECK(status.index_blocks == 4);
  const std::string log = LogWith(d, "slot order rewritten");
  INFO(log);
  CHECK(log.find("7 blocks (") != std::string::npos);  // 4 FULL blocks, 2 window entries, 1 state
  CHECK(log.find("of an older release's layer-major slot order rewritten") != std::string::npos);
  CHECK(ReadU32(dir.path + "/pool", kVersionOffset) == (3 | kRankMajorFlag));
}

TEST_CASE("slot order upgrade: TP 2 blocks on SSD in the older order are promoted, checked and rewritten",
          "[integration]") {
  flexkv::testing::TempDir dir("flexkv-slot-order");
  Unpack("ssd.blocks", dir.path + "/ssd/flexkv-ssd.blocks");
  {
    DaemonUnderTest d({"--pool-size", "4MiB", "--ssd-path", dir.path + "/ssd", "--ssd-size", "1036288"}, dir.path);
    REQUIRE(d.WaitReady());
    auto engine = Rank0(d.socket());
    // The SSD tier opens its files once the first Attach has created the pool.
    flexkv::DaemonStatus s;
    for (int i = 0; i < 200; ++i) {
      auto st = engine->GetStatus();
      REQUIRE(st.ok());
      s = *st;
      if (!s.tiers.empty() && s.tiers[0].state != "waiting for the first pool") break;
      std::this_thread::sleep_for(50ms);
    }
    REQUIRE(s.tiers.size() == 1);
    // The 6 blocks are under the older release's geometry string: found there, read, checked against the checksum
    // they were written with, rewritten before they are committed and served.
    CHECK(Matched(*engine, Keys("fixture-tp2", 3, 6)) == 6);
    auto after = engine->GetStatus();
    REQUIRE(after.ok());
    CHECK(after->index_blocks == 6);
    auto metrics = engine->GetMetrics();
    REQUIRE(metrics.ok());
    INFO(*metrics);
    CHECK(metrics->find("\nflexkv_ssd_promoted_layer_major_blocks_total 6\n") != std::string::npos);
    CHECK(Matched(*engine, Keys("fixture-tp2", 4, 6)) == 0);  // a prompt it never held
  }
  CheckBlocksInFile(dir.path + "/pool", 3, 6);
}

TEST_CASE("slot order upgrade: a hybrid model's TP 2 pieces on SSD in the older order are promoted and rewritten",
          "[integration]") {
  flexkv::testing::TempDir dir("flexkv-slot-order");
  Unpack("ssd.blocks", dir.path + "/ssd/flexkv-ssd.blocks");
  const std::vector<std::string> args = {"--pool-size", "4MiB", "--swa-share", "0.25", "--state-share", "0.05",
                                         "--ssd-path", dir.path + "/ssd", "--ssd-size", "1036288"};
  const auto keys = Keys("fixture-tp2-hybrid", 5, 4);
  flexkv::Geometry g = FullTp2();
  flexkv::ComponentSpec window;
  window.kind = flexkv::ComponentKind::kSlidingWindow;
  window.num_layers = 1;
  window.kv_heads_per_rank = 2;
  window.head_dim = 16;
  window.window_tokens = 32;
  flexkv::ComponentSpec state;
  state.kind = flexkv::ComponentKind::kState;
  state.num_layers = 2;
  state.state_bytes_per_layer = 64;
  g.components = {window, state};
  const auto attach = [&](const std::string& socket) {
    auto c = flexkv::Client::Connect({socket, 5000ms, 10000ms});
    REQUIRE(c.ok());
    flexkv::AttachOptions o;
    o.client_name = "slot-order-upgrade";
    o.model_namespace = "fixture-tp2-hybrid";
    o.geometry = g;
    auto attached = (*c)->Attach(o);
    INFO(attached.status().ToString());
    REQUIRE(attached.ok());
    return std::move(*c);
  };
  {
    DaemonUnderTest d(args, dir.path);
    REQUIRE(d.WaitReady());
    auto engine = attach(d.socket());
    for (int i = 0; i < 200; ++i) {
      auto st = engine->GetStatus();
      REQUIRE(st.ok());
      if (!st->tiers.empty() && st->tiers[0].state != "waiting for the first pool") break;
      std::this_thread::sleep_for(50ms);
    }
    // Its FULL blocks, the window at its end and the state there, each found under the older geometry string,
    // checked and rewritten: a whole hit of 4 blocks.
    CHECK(Matched(*engine, keys) == 4);
    auto metrics = engine->GetMetrics();
    REQUIRE(metrics.ok());
    INFO(*metrics);
    CHECK(metrics->find("\nflexkv_ssd_promoted_layer_major_blocks_total 7\n") != std::string::npos);
  }
  // Restarted on the pool they were promoted into: their new checksums hold (the restart check), none is rewritten
  // again, and they are served.
  DaemonUnderTest d(args, dir.path);
  REQUIRE(d.WaitReady());
  auto engine = attach(d.socket());
  Verified(*engine);
  CHECK(Matched(*engine, keys) == 4);
  const std::string log = LogWith(d, "restored blocks checked");
  INFO(log);
  CHECK(log.find(" 0 failed their content checksum") != std::string::npos);
  CHECK(log.find("layer-major slot order rewritten") == std::string::npos);
}
