// Issue 18: upgrades keep the cache. A pool file and an SSD block file written by an earlier release
// (tests/fixtures/upgrade/, see its README) are served by today's flexkvd, their blocks byte-exact; copies whose
// format version is bumped are refused at start with the versions and what to do. The hidden test at the end writes
// the fixture.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "flexkv/client.h"
#include "tests/support/process.h"

using namespace std::chrono_literals;
using flexkv::testing::DaemonUnderTest;

namespace {

// What the fixture holds; changing any of these needs a new fixture (and then the old one is no test of anything).
constexpr const char* kNamespace = "upgrade-fixture";
constexpr const char* kPoolSize = "4MiB";
constexpr uint32_t kPrompts = 3;
constexpr uint32_t kBlocksPerPrompt = 4;
constexpr uint32_t kPoolVersionOffset = 8;  // docs/protocol.md, "Pool file": magic[8], then version (u32, LE)
constexpr const char* kSsdSize = "64MiB";
constexpr const char* kSsdBlockFile = "flexkv-ssd.blocks";  // one per --ssd-path (docs/ssd.md)
constexpr uint32_t kSsdVersionOffset = 8;                   // docs/ssd.md, "On-disk format": file header
constexpr uint32_t kSsdHeaderChecksumOffset = 56;           // XXH3-64 of bytes 0..55

std::string FixtureDir() { return FLEXKV_UPGRADE_FIXTURE_DIR; }

flexkv::Geometry FixtureGeometry() {
  flexkv::Geometry g;
  g.tokens_per_block = 16;
  g.num_layers = 2;
  g.kv_planes = 2;
  g.kv_heads_per_rank = 2;
  g.head_dim = 64;
  g.dtype_bytes = 2;
  g.tp_size = 1;
  return g;
}

// The tokens of prompt p: a pure function written out here, so that no generator a later release may change is
// involved.
std::vector<int32_t> PromptTokens(uint32_t p) {
  std::vector<int32_t> t(uint64_t{kBlocksPerPrompt} * FixtureGeometry().tokens_per_block);
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<int32_t>((p * 7919 + i * 104729 + 13) % 128000);
  return t;
}

// Byte j of block i of prompt p.
uint8_t BlockByte(uint32_t p, uint32_t i, uint64_t j) {
  return static_cast<uint8_t>((p * 131 + i * 17 + j * 7 + (j >> 8) * 3 + (j >> 16)) & 0xFF);
}

std::vector<flexkv::BlockKey> PromptKeys(uint32_t p) {
  return flexkv::ComputeBlockKeys(kNamespace, PromptTokens(p), FixtureGeometry().tokens_per_block);
}

struct Engine {
  std::unique_ptr<flexkv::Client> client;
  flexkv::HostKvBuffers kv;
};

Engine Attach(const std::string& socket) {
  auto client = flexkv::Client::Connect({socket, 5000ms, 10000ms});
  REQUIRE(client.ok());
  flexkv::AttachOptions options;
  options.client_name = "upgrade-fixture";
  options.model_namespace = kNamespace;
  options.geometry = FixtureGeometry();
  auto session = (*client)->Attach(options);
  INFO(session.status().ToString());
  REQUIRE(session.ok());
  auto kv = (*client)->CreateHostKv(flexkv::KvLayout::kBlockFirst, kBlocksPerPrompt);
  INFO(kv.status().ToString());
  REQUIRE(kv.ok());
  return Engine{std::move(*client), *kv};
}

uint64_t UnverifiedBlocks(flexkv::Client& c) {
  auto s = c.GetStatus();
  REQUIRE(s.ok());
  return s->pool.unverified_blocks;
}

std::string MakeTempDir() {
  char tmpl[] = "/tmp/flexkvd-upgrade-XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  return tmpl;
}

// The fixture's file `name`.gz, decompressed to `to`.
void Unpack(const std::string& name, const std::string& to) {
  auto r = flexkv::testing::RunCommand({"/bin/sh", "-c", "gzip -dc '" + FixtureDir() + "/" + name + ".gz' > '" + to + "'"});
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
}

// The fixture's pool, decompressed to `dir`/pool.
void UnpackFixture(const std::string& dir) { Unpack("pool", dir + "/pool"); }

// The fixture's SSD block file, decompressed into `dir`/ssd/ (the --ssd-path); no pool.
std::string UnpackSsdFixture(const std::string& dir) {
  std::filesystem::create_directories(dir + "/ssd");
  Unpack("ssd.blocks", dir + "/ssd/" + kSsdBlockFile);
  return dir + "/ssd/" + kSsdBlockFile;
}

std::vector<std::string> SsdArgs(const std::string& dir) {
  return {"--pool-size", kPoolSize, "--ssd-path", dir + "/ssd", "--ssd-size", kSsdSize};
}

// Every fixture block matches and loads byte-exact; a prompt the fixture never stored misses.
void CheckFixtureBlocks(Engine& e) {
  flexkv::Client& c = *e.client;
  const uint64_t block_bytes = FixtureGeometry().host_block_bytes();
  std::vector<uint32_t> ids(kBlocksPerPrompt);
  for (uint32_t i = 0; i < kBlocksPerPrompt; ++i) ids[i] = i;
  for (uint32_t p = 0; p < kPrompts; ++p) {
    INFO("prompt " << p);
    auto t = c.Match(PromptKeys(p), /*pin=*/true);
    REQUIRE(t.ok());
    auto m = c.Wait(*t, 30s);
    REQUIRE(m.ok());
    REQUIRE(m->status.ok());
    REQUIRE(m->matched_blocks == kBlocksPerPrompt);
    std::memset(e.kv.data, 0xA5, kBlocksPerPrompt * block_bytes);
    auto lt = c.Load(m->match_handle, ids);
    REQUIRE(lt.ok());
    auto l = c.Wait(*lt, 30s);
    REQUIRE(l.ok());
    REQUIRE(l->status.ok());
    REQUIRE(l->done_blocks == kBlocksPerPrompt);
    for (uint32_t i = 0; i < kBlocksPerPrompt; ++i) {
      const uint8_t* got = e.kv.data + i * block_bytes;
      uint64_t first_bad = block_bytes;
      for (uint64_t j = 0; j < block_bytes && first_bad == block_bytes; ++j) {
        if (got[j] != BlockByte(p, i, j)) first_bad = j;
      }
      INFO("block " << i << ": first differing byte " << first_bad);
      CHECK(first_bad == block_bytes);
    }
    auto rel = c.Release(m->match_handle);
    REQUIRE(rel.ok());
    REQUIRE(c.Wait(*rel, 30s).ok());
  }
  // The hits above are the fixture's blocks, not luck.
  auto t = c.Match(PromptKeys(kPrompts), /*pin=*/false);
  REQUIRE(t.ok());
  auto m = c.Wait(*t, 30s);
  REQUIRE(m.ok());
  CHECK(m->matched_blocks == 0);
}

const flexkv::DaemonStatus::Tier& SsdTier(const flexkv::DaemonStatus& s) {
  REQUIRE(s.tiers.size() == 1);
  return s.tiers[0];
}

// Without a pool at start, the tier opens its files in the background once an Attach has created the pool: the
// status once it has (serving or failed).
flexkv::DaemonStatus OpenedTierStatus(flexkv::Client& c) {
  for (int i = 0; i < 400; ++i) {
    auto s = c.GetStatus();
    REQUIRE(s.ok());
    if (SsdTier(*s).state != "waiting for the first pool") return *s;
    std::this_thread::sleep_for(50ms);
  }
  FAIL("the SSD tier did not open its files within 20 s of the first Attach");
  return {};
}

uint64_t TierCounter(const flexkv::DaemonStatus::Tier& t, const char* name) {
  const auto it = t.counters.find(name);
  return it == t.counters.end() ? 0 : it->second;
}

void PatchU32(const std::string& path, uint64_t offset, uint32_t value) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  REQUIRE(f.good());
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(reinterpret_cast<const char*>(&value), sizeof(value));
  REQUIRE(f.good());
}

uint32_t ReadU32(const std::string& path, uint64_t offset) {
  std::ifstream f(path, std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  uint32_t value = 0;
  f.read(reinterpret_cast<char*>(&value), sizeof(value));
  REQUIRE(f.good());
  return value;
}

}  // namespace

TEST_CASE("upgrade: a pool file written by an earlier release is re-attached and its blocks load byte-exact",
          "[integration][upgrade]") {
  const std::string dir = MakeTempDir();
  UnpackFixture(dir);
  {
    DaemonUnderTest d({"--pool-size", kPoolSize}, dir);
    REQUIRE(d.WaitReady());
    Engine e = Attach(d.socket());
    flexkv::Client& c = *e.client;
    REQUIRE(c.GetStatus()->pool.used_blocks == kPrompts * kBlocksPerPrompt);
    // Restored blocks are served once the restart check has read them (docs/operations.md).
    for (int i = 0; i < 600 && UnverifiedBlocks(c) > 0; ++i) std::this_thread::sleep_for(50ms);
    REQUIRE(UnverifiedBlocks(c) == 0);

    CheckFixtureBlocks(e);
    CHECK_THAT(d.process().Stderr(), Catch::Contains("re-attached pool " + dir + "/pool"));
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("upgrade: a pool file with a newer layout version is refused at start, naming both versions and what to do",
          "[integration][upgrade]") {
  const std::string dir = MakeTempDir();
  UnpackFixture(dir);
  const std::string pool = dir + "/pool";
  const uint32_t written = ReadU32(pool, kPoolVersionOffset);
  REQUIRE((written == 2 || written == 3));  // docs/protocol.md: 2 (dense), 3 (hybrid)
  const uint32_t newer = 99;
  PatchU32(pool, kPoolVersionOffset, newer);

  auto refused = flexkv::testing::RunCommand({flexkv::testing::FlexkvdPath(), "--socket", dir + "/flexkvd.sock",
                                              "--pool-path", pool, "--pool-size", kPoolSize});
  INFO(refused.output);
  CHECK(refused.exit_code == 1);
  CHECK_THAT(refused.output,
             Catch::Contains("pool file " + pool + " has layout version 99") &&
                 Catch::Contains("written by a newer flexkvd") && Catch::Contains("reads layout versions 2, 3 and 4") &&
                 Catch::Contains("run the flexkvd release that wrote it") && Catch::Contains("--discard-pool"));
  // Refused means untouched: the operator can still go back to the release that wrote it.
  CHECK(std::filesystem::exists(pool));
  CHECK(ReadU32(pool, kPoolVersionOffset) == newer);

  // The way out the message names works: the file is replaced and the daemon serves (the blocks are gone).
  {
    DaemonUnderTest d({"--pool-size", kPoolSize, "--discard-pool"}, dir);
    REQUIRE(d.WaitReady());
    Engine e = Attach(d.socket());
    auto t = e.client->Match(PromptKeys(0), /*pin=*/false);
    REQUIRE(t.ok());
    auto m = e.client->Wait(*t, 30s);
    REQUIRE(m.ok());
    CHECK(m->matched_blocks == 0);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("upgrade: an SSD block file written by an earlier release is served after a reboot, byte-exact",
          "[integration][upgrade]") {
  const std::string dir = MakeTempDir();
  UnpackSsdFixture(dir);  // no pool: as after a reboot, the blocks are on SSD only
  {
    DaemonUnderTest d(SsdArgs(dir), dir);
    REQUIRE(d.WaitReady());
    Engine e = Attach(d.socket());
    const flexkv::DaemonStatus s = OpenedTierStatus(*e.client);
    const auto& t = SsdTier(s);
    CHECK(t.state == "serving");
    CHECK(TierCounter(t, "rebuilt_blocks") == kPrompts * kBlocksPerPrompt);
    CHECK(TierCounter(t, "rebuild_corrupt_headers") == 0);
    CHECK(s.pool.used_blocks == 0);
    CheckFixtureBlocks(e);
    auto after = e.client->GetStatus();
    REQUIRE(after.ok());
    CHECK(TierCounter(SsdTier(*after), "promoted_blocks") == kPrompts * kBlocksPerPrompt);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("upgrade: an SSD block file of a newer format version is refused at start and left as it was",
          "[integration][upgrade]") {
  const std::string dir = MakeTempDir();
  UnpackFixture(dir);  // with the pool, the tier opens its files at start (without, at the first Attach)
  const std::string file = UnpackSsdFixture(dir);
  REQUIRE(ReadU32(file, kSsdVersionOffset) == 1);  // docs/ssd.md: format version 1
  // A header of another version with a good checksum: what a newer release writes, not damage.
  const uint32_t newer = 2;
  PatchU32(file, kSsdVersionOffset, newer);
  {
    std::ifstream f(file, std::ios::binary);
    char header[kSsdHeaderChecksumOffset];
    f.read(header, sizeof(header));
    REQUIRE(f.good());
    const uint64_t sum = XXH3_64bits(header, sizeof(header));
    PatchU32(file, kSsdHeaderChecksumOffset, static_cast<uint32_t>(sum));
    PatchU32(file, kSsdHeaderChecksumOffset + 4, static_cast<uint32_t>(sum >> 32));
  }
  std::vector<std::string> argv = {flexkv::testing::FlexkvdPath(), "--socket", dir + "/flexkvd.sock", "--pool-path",
                                   dir + "/pool"};
  for (const std::string& a : SsdArgs(dir)) argv.push_back(a);
  auto refused = flexkv::testing::RunCommand(argv);
  INFO(refused.output);
  CHECK(refused.exit_code == 1);
  CHECK_THAT(refused.output, Catch::Contains("ssd file " + file + ": it is of format version 2") &&
                                 Catch::Contains("written by a newer flexkvd; this flexkvd reads version 1") &&
                                 Catch::Contains("run the flexkvd release that wrote it") &&
                                 Catch::Contains("nothing was changed") &&
                                 Catch::Contains("--ssd-on-mismatch=discard"));
  CHECK(ReadU32(file, kSsdVersionOffset) == newer);

  // Without a pool (after a reboot) the tier opens its files at the first Attach: the tier is off with the same
  // message, DRAM serves, and the file is still left as it was.
  std::filesystem::remove(dir + "/pool");
  {
    DaemonUnderTest d(SsdArgs(dir), dir);
    REQUIRE(d.WaitReady());
    Engine e = Attach(d.socket());
    const flexkv::DaemonStatus s = OpenedTierStatus(*e.client);
    const auto& t = SsdTier(s);
    CHECK_THAT(t.state, Catch::StartsWith("failed: ") && Catch::Contains("it is of format version 2") &&
                            Catch::Contains("run the flexkvd release that wrote it"));
    CHECK(s.state == "serving");
  }
  CHECK(ReadU32(file, kSsdVersionOffset) == newer);
  std::filesystem::remove_all(dir);
}

// Writes the fixture's raw pool and SSD block file to $FLEXKV_UPGRADE_FIXTURE_OUT/{pool,ssd.blocks};
// tests/fixtures/upgrade/make_fixture.sh runs it and compresses them. Hidden: it is a tool, not a test.
TEST_CASE("upgrade: write the fixture pool", "[.][upgrade-fixture-writer]") {
  const char* out = std::getenv("FLEXKV_UPGRADE_FIXTURE_OUT");
  if (out == nullptr) {
    WARN("not writing the fixture: FLEXKV_UPGRADE_FIXTURE_OUT is not set (tests/fixtures/upgrade/make_fixture.sh sets it)");
    return;
  }
  const std::string dir = MakeTempDir();
  {
    std::filesystem::create_directories(dir + "/ssd");
    std::vector<std::string> args = SsdArgs(dir);
    args.push_back("--ssd-write-policy=all");  // every block on SSD too
    DaemonUnderTest d(args, dir);
    REQUIRE(d.WaitReady());
    Engine e = Attach(d.socket());
    const uint64_t block_bytes = FixtureGeometry().host_block_bytes();
    std::vector<uint32_t> ids(kBlocksPerPrompt);
    for (uint32_t p = 0; p < kPrompts; ++p) {
      for (uint32_t i = 0; i < kBlocksPerPrompt; ++i) {
        ids[i] = i;
        for (uint64_t j = 0; j < block_bytes; ++j) e.kv.data[i * block_bytes + j] = BlockByte(p, i, j);
      }
      auto t = e.client->Store(flexkv::BlockKeyChain(PromptKeys(p)), ids);
      REQUIRE(t.ok());
      auto r = e.client->Wait(*t, 30s);
      REQUIRE(r.ok());
      REQUIRE(r->status.ok());
      REQUIRE(r->done_blocks == kBlocksPerPrompt);
    }
    for (int i = 0; i < 600; ++i) {
      auto s = e.client->GetStatus();
      REQUIRE(s.ok());
      const auto& t = SsdTier(*s);
      if (TierCounter(t, "written_back_blocks") == kPrompts * kBlocksPerPrompt && TierCounter(t, "writes_in_flight") == 0) {
        break;
      }
      std::this_thread::sleep_for(50ms);
    }
    REQUIRE(TierCounter(SsdTier(*e.client->GetStatus()), "written_back_blocks") == kPrompts * kBlocksPerPrompt);
    e.client.reset();
    d.process().Signal(SIGTERM);
    auto status = d.process().Wait(30s);
    REQUIRE(status.has_value());
    REQUIRE(WIFEXITED(*status));
    REQUIRE(WEXITSTATUS(*status) == 0);
  }
  std::filesystem::copy_file(dir + "/pool", std::string(out) + "/pool",
                             std::filesystem::copy_options::overwrite_existing);
  std::filesystem::copy_file(dir + "/ssd/" + kSsdBlockFile, std::string(out) + "/ssd.blocks",
                             std::filesystem::copy_options::overwrite_existing);
  std::filesystem::remove_all(dir);
}
