// Block content checksums end to end: bytes changed in the pool file while flexkvd was stopped, slot entries
// swapped, and bytes changed under a running daemon are never served; each lost block is counted in
// data_loss_blocks, and every intact block still loads byte-exact.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "flexkv/client.h"
#include "tests/support/process.h"

using namespace std::chrono_literals;
using flexkv::testing::ChildProcess;
using flexkv::testing::DaemonUnderTest;
using flexkv::testing::RunCommand;

namespace {

constexpr uint32_t kChains = 6;
constexpr uint32_t kBlocksPerChain = 16;

ChildProcess Client(const DaemonUnderTest& d, const std::vector<std::string>& steps) {
  return flexkv::testing::SpawnTestClient(d.socket(), "checksum", {"--kv-blocks", "64", "--layers", "2"}, steps);
}

std::vector<std::string> Lines(ChildProcess& p, std::chrono::milliseconds timeout = 30s) { return p.ReadLines(timeout); }

// The first 8 bytes of block i of SEED as flexkv-test-client fills it (tests/support/test_client.cc).
uint64_t FirstWord(uint64_t seed, uint32_t i) {
  std::mt19937_64 rng(seed * 1000003 + i);
  return rng();
}

// The pool file mapped by the test (docs/protocol.md "Pool file"): which slot holds block i of chain SEED.
class PoolFile {
 public:
  explicit PoolFile(const std::string& path) {
    fd_ = open(path.c_str(), O_RDWR | O_CLOEXEC);
    REQUIRE(fd_ >= 0);
    struct stat st {};
    REQUIRE(fstat(fd_, &st) == 0);
    bytes_ = static_cast<size_t>(st.st_size);
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    REQUIRE(p != MAP_FAILED);
    base_ = static_cast<uint8_t*>(p);
    std::memcpy(&block_bytes_, base_ + 40, 8);
    std::memcpy(&capacity_, base_ + 48, 8);
    std::memcpy(&table_offset_, base_ + 56, 8);
    std::memcpy(&data_offset_, base_ + 64, 8);
    for (uint64_t s = 0; s < capacity_; ++s) {
      uint32_t state = 0;
      std::memcpy(&state, Entry(s), 4);
      if (state != 0x434F4D54) continue;
      uint64_t word = 0;
      std::memcpy(&word, Data(s), 8);
      by_word_[word] = s;
    }
  }
  ~PoolFile() {
    munmap(base_, bytes_);
    close(fd_);
  }
  PoolFile(const PoolFile&) = delete;
  PoolFile& operator=(const PoolFile&) = delete;

  uint64_t SlotOf(uint64_t seed, uint32_t i) const {
    auto it = by_word_.find(FirstWord(seed, i));
    REQUIRE(it != by_word_.end());
    return it->second;
  }
  uint8_t* Entry(uint64_t slot) const { return base_ + table_offset_ + slot * 64; }
  uint8_t* Data(uint64_t slot) const { return base_ + data_offset_ + slot * block_bytes_; }
  uint64_t block_bytes() const { return block_bytes_; }

 private:
  int fd_ = -1;
  size_t bytes_ = 0;
  uint8_t* base_ = nullptr;
  uint64_t block_bytes_ = 0, capacity_ = 0, table_offset_ = 0, data_offset_ = 0;
  std::map<uint64_t, uint64_t> by_word_;
};

void StoreChains(const DaemonUnderTest& d) {
  std::vector<std::string> steps;
  for (uint32_t seed = 1; seed <= kChains; ++seed) steps.push_back("store:" + std::to_string(seed) + ":16");
  ChildProcess writer = Client(d, steps);
  const auto lines = Lines(writer);
  REQUIRE(lines.size() == 1 + kChains);
  for (uint32_t c = 1; c <= kChains; ++c) CHECK(lines[c] == "STORED 0 16 OK");
}

std::unique_ptr<flexkv::Client> Connect(const DaemonUnderTest& d) {
  auto c = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
  REQUIRE(c.ok());
  return std::move(*c);
}

// Waits until the restarted daemon has verified every restored block; returns its status then.
flexkv::DaemonStatus VerifiedStatus(const DaemonUnderTest& d) {
  auto c = Connect(d);
  for (int i = 0; i < 600; ++i) {
    auto s = c->GetStatus();
    REQUIRE(s.ok());
    if (s->pool.unverified_blocks == 0) return *s;
    std::this_thread::sleep_for(50ms);
  }
  FAIL("the restored blocks were not verified within 30 s");
  return {};
}

// "LOADED <hits> <loaded> <equal> <status>" of a load of chain SEED.
std::string LoadLine(const DaemonUnderTest& d, uint32_t seed) {
  ChildProcess reader = Client(d, {"load:" + std::to_string(seed) + ":16"});
  const auto lines = Lines(reader);
  REQUIRE(lines.size() == 2);
  return lines[1];
}

std::string Loaded(uint32_t hits) { return "LOADED " + std::to_string(hits) + " " + std::to_string(hits) + " 1 OK"; }

}  // namespace

TEST_CASE("bytes changed in the pool file while flexkvd was stopped are never served after the restart",
          "[integration][regression][checksum]") {
  // Before the fix every flipped block was served as valid after the restart.
  char tmpl[] = "/tmp/flexkvd-csum-XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  const std::string dir = tmpl;
  {
    DaemonUnderTest d({"--pool-size", "64MiB"}, dir);
    REQUIRE(d.WaitReady());
    StoreChains(d);
  }  // SIGTERM
  {
    PoolFile pool(dir + "/pool");
    // One flipped bit in the last block of chains 1-4, one in block 8 of chain 5; chain 6 untouched.
    for (uint32_t seed = 1; seed <= 4; ++seed) pool.Data(pool.SlotOf(seed, 15))[pool.block_bytes() - 3] ^= 0x04;
    pool.Data(pool.SlotOf(5, 8))[4096] ^= 0x01;
  }
  {
    DaemonUnderTest d({"--pool-size", "64MiB"}, dir);
    REQUIRE(d.WaitReady());
    const flexkv::DaemonStatus s = VerifiedStatus(d);
    CHECK(s.counters.at("data_loss_blocks") == 5);
    CHECK(s.index_blocks == 4 * 15 + 8 + 16);
    for (uint32_t seed = 1; seed <= 4; ++seed) CHECK(LoadLine(d, seed) == Loaded(15));
    CHECK(LoadLine(d, 5) == Loaded(8));  // stops before the changed block: its descendants went with it
    CHECK(LoadLine(d, 6) == Loaded(16));
    const std::string log = d.process().Stderr();
    INFO(log);
    CHECK_THAT(log, Catch::Contains("5 failed their content checksum"));
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("two slot-table entries swapped while flexkvd was stopped are both dropped, not served for each other",
          "[integration][regression][checksum]") {
  // Before the fix each entry's checksum was still valid in the other slot, and each block was served under the
  // other's key.
  char tmpl[] = "/tmp/flexkvd-csum-XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  const std::string dir = tmpl;
  {
    DaemonUnderTest d({"--pool-size", "64MiB"}, dir);
    REQUIRE(d.WaitReady());
    StoreChains(d);
  }
  {
    PoolFile pool(dir + "/pool");
    uint8_t* e1 = pool.Entry(pool.SlotOf(1, 15));
    uint8_t* e2 = pool.Entry(pool.SlotOf(2, 15));
    uint8_t tmp[64];
    std::memcpy(tmp, e1, 64);
    std::memcpy(e1, e2, 64);
    std::memcpy(e2, tmp, 64);
  }
  {
    DaemonUnderTest d({"--pool-size", "64MiB"}, dir);
    REQUIRE(d.WaitReady());
    const flexkv::DaemonStatus s = VerifiedStatus(d);
    CHECK(s.counters.at("data_loss_blocks") == 2);
    CHECK(LoadLine(d, 1) == Loaded(15));
    CHECK(LoadLine(d, 2) == Loaded(15));
    CHECK(LoadLine(d, 3) == Loaded(16));
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("flexkvctl scrub finds bytes changed under a running daemon and drops them - intact blocks still load "
          "byte-exact",
          "[integration][regression][checksum]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  StoreChains(d);
  {
    PoolFile pool(d.dir() + "/pool");
    pool.Data(pool.SlotOf(1, 10))[77] ^= 0x40;
    pool.Data(pool.SlotOf(2, 0))[pool.block_bytes() / 2] ^= 0x01;
    pool.Data(pool.SlotOf(3, 15))[0] ^= 0x80;
  }
  const auto scrub = RunCommand({flexkv::testing::FlexkvctlPath(), "--socket", d.socket(), "scrub", "--json"}, 60s);
  INFO(scrub.output);
  REQUIRE(scrub.exit_code == 0);
  CHECK_THAT(scrub.output, Catch::Contains("\"checked_blocks\":96") && Catch::Contains("\"failed_blocks\":3") &&
                               Catch::Contains("\"dropped_blocks\":" + std::to_string(6 + 16 + 1)));
  CHECK(LoadLine(d, 1) == Loaded(10));
  CHECK(LoadLine(d, 2) == "LOADED 0 0 1 OK");
  CHECK(LoadLine(d, 3) == Loaded(15));
  for (uint32_t seed = 4; seed <= kChains; ++seed) CHECK(LoadLine(d, seed) == Loaded(16));
  auto status = Connect(d)->GetStatus();
  REQUIRE(status.ok());
  CHECK(status->counters.at("data_loss_blocks") == 3);
  // The dropped blocks can be stored again and are then served.
  ChildProcess again = Client(d, {"store:1:16", "load:1:16"});
  const auto lines = Lines(again);
  REQUIRE(lines.size() == 3);
  CHECK(lines[1] == "STORED 10 6 OK");
  CHECK(lines[2] == Loaded(16));
  // A second scrub finds nothing more.
  const auto clean = RunCommand({flexkv::testing::FlexkvctlPath(), "--socket", d.socket(), "scrub", "--json"}, 60s);
  CHECK_THAT(clean.output, Catch::Contains("\"failed_blocks\":0"));
}

TEST_CASE("Scrub is an admin call: refused to another uid", "[integration][security][checksum]") {
  if (geteuid() != 0) {
    WARN("not root: cannot run flexkvctl as another uid; skipped");
    return;
  }
  DaemonUnderTest d({"--pool-size", "64MiB", "--socket-group", "nogroup"});
  REQUIRE(d.WaitReady());
  StoreChains(d);
  const auto nobody = RunCommand({"/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                  flexkv::testing::FlexkvctlPath(), "--socket", d.socket(), "scrub"});
  INFO(nobody.output);
  CHECK(nobody.exit_code == 1);
  CHECK_THAT(nobody.output, Catch::Contains("PERMISSION_DENIED") && Catch::Contains("Scrub is an admin call"));
  const auto admin = RunCommand({flexkv::testing::FlexkvctlPath(), "--socket", d.socket(), "scrub", "--json"});
  INFO(admin.output);
  CHECK(admin.exit_code == 0);
  CHECK_THAT(admin.output, Catch::Contains("\"checked_blocks\":96"));
}
