// Pool with an elastic active capacity: only the active grants of each sub-pool have memory behind them (the file
// is sparse), SetActive grows and shrinks that in place, the active capacities survive a reopen, and files written
// before elastic pools open fully active.
#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "daemon/cache/pool.h"
#include "tests/support/temp_dir.h"

using flexkv::BlockKey;
using flexkv::Geometry;
using flexkv::Pool;
using flexkv::StatusCode;

namespace {

// 2 layers x K/V x 16 tokens x 1 head x 512 dims x bf16: 64 KiB blocks, big enough that the file's allocated
// blocks show every grant.
Geometry Wide() {
  Geometry g = flexkv::testing::TinyGeometry();
  g.tokens_per_block = 16;
  g.num_layers = 2;
  g.head_dim = 512;
  return g;
}

constexpr uint64_t kSlotBytes = 64 << 10;
constexpr uint64_t kSlots = 64;                 // grants of 4 slots
constexpr uint64_t kBudget = kSlots * kSlotBytes;
constexpr uint64_t kMetaBytes = 2 << 20;        // header and slot table, up to the 2 MiB aligned data
constexpr uint64_t kActiveRecordOffset = 384;   // docs/protocol.md "Pool file"

struct TempDir : flexkv::testing::TempDir {
  TempDir() : flexkv::testing::TempDir("flexkv-pool-elastic-test") {}
};

// The bytes the filesystem has allocated for the file.
uint64_t Allocated(const std::string& path) {
  struct stat st {};
  REQUIRE(stat(path.c_str(), &st) == 0);
  return static_cast<uint64_t>(st.st_blocks) * 512;
}

// The file holds about `slots` slots' data besides its header and table (the filesystem may add a few blocks of
// its own bookkeeping).
void CheckAllocatedSlots(const std::string& path, uint64_t slots) {
  const uint64_t want = kMetaBytes + slots * kSlotBytes;
  const uint64_t have = Allocated(path);
  INFO("allocated " << have << " bytes, expected about " << want);
  CHECK(have >= want);
  CHECK(have <= want + kSlotBytes);
}

void Poke(const std::string& path, uint64_t offset, const void* bytes, size_t len) {
  const int fd = open(path.c_str(), O_WRONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  REQUIRE(pwrite(fd, bytes, len, static_cast<off_t>(offset)) == static_cast<ssize_t>(len));
  close(fd);
}

// What a flexkvd from before elastic pools wrote: nothing between the header and the sub-pool table.
void EraseActiveRecord(const std::string& path) {
  const std::vector<uint8_t> zeros(512 - kActiveRecordOffset, 0);
  Poke(path, kActiveRecordOffset, zeros.data(), zeros.size());
}

}  // namespace

TEST_CASE("elastic pool: a pool created with a smaller active size allocates only the active grants",
          "[unit][elastic]") {
  TempDir dir;
  const std::string path = dir.path + "/pool";
  auto pool = Pool::Create(path, "ns", Wide(), kBudget, 0, {}, 17 * kSlotBytes);
  REQUIRE(pool.ok());
  const flexkv::SubPool& sub = (*pool)->sub_pool(0);
  CHECK(sub.capacity == kSlots);
  CHECK(sub.grant == 4);
  CHECK(sub.active == 16);  // 17 slots rounded down to whole grants: a share is never exceeded
  CHECK((*pool)->active_bytes() == 16 * kSlotBytes);
  CHECK((*pool)->max_bytes() == kBudget);
  struct stat st {};
  REQUIRE(stat(path.c_str(), &st) == 0);
  CHECK(static_cast<uint64_t>(st.st_size) == kMetaBytes + kBudget);  // laid out for the maximum
  CheckAllocatedSlots(path, 16);
  (*pool)->SlotData(19)[kSlotBytes - 1] = 1;  // the last active byte is there
  CheckAllocatedSlots(path, 16);

  // At least one grant, at most the layout.
  CHECK((*pool)->ActiveSlotsFor(0) == std::vector<uint32_t>{4});
  CHECK((*pool)->ActiveSlotsFor(1) == std::vector<uint32_t>{4});
  CHECK((*pool)->ActiveSlotsFor(kBudget / 2) == std::vector<uint32_t>{32});
  CHECK((*pool)->ActiveSlotsFor(10 * kBudget) == std::vector<uint32_t>{64});
}

TEST_CASE("elastic pool: SetActive grows into the hole and shrinking gives the memory back", "[unit][elastic]") {
  TempDir dir;
  const std::string path = dir.path + "/pool";
  auto created = Pool::Create(path, "ns", Wide(), kBudget, 0, {}, 4 * kSlotBytes);
  REQUIRE(created.ok());
  Pool& pool = **created;
  CheckAllocatedSlots(path, 4);
  REQUIRE(pool.SetActive(0, 64).ok());
  CHECK(pool.sub_pool(0).active == 64);
  CheckAllocatedSlots(path, 64);
  // Slots keep their addresses: what was written before the resize is still there.
  pool.SlotData(2)[5] = 0x5A;
  REQUIRE(pool.SetActive(0, 8).ok());
  CHECK(pool.sub_pool(0).active == 8);
  CheckAllocatedSlots(path, 8);
  CHECK(pool.SlotData(2)[5] == 0x5A);
  REQUIRE(pool.SetActive(0, 12).ok());
  CheckAllocatedSlots(path, 12);
  CHECK(pool.SlotData(11)[0] == 0);  // a slot grown into again reads zeros, never an old block's bytes

  // Only whole grants (or the whole sub-pool), at least one.
  CHECK(pool.SetActive(0, 10).code() == StatusCode::kInvalidArgument);
  CHECK(pool.SetActive(0, 0).code() == StatusCode::kInvalidArgument);
  CHECK(pool.SetActive(0, 65).code() == StatusCode::kInvalidArgument);
  CHECK(pool.sub_pool(0).active == 12);
}

TEST_CASE("elastic pool: the active capacity survives a reopen, and a corrupt record refuses the file",
          "[unit][elastic]") {
  TempDir dir;
  const std::string path = dir.path + "/pool";
  {
    auto pool = Pool::Create(path, "ns", Wide(), kBudget);
    REQUIRE(pool.ok());
    CHECK((*pool)->sub_pool(0).active == kSlots);  // the default: all of it, as before elastic pools
    REQUIRE((*pool)->SetActive(0, 24).ok());
  }
  {
    auto pool = Pool::Open(path, kBudget);
    REQUIRE(pool.ok());
    CHECK((*pool)->sub_pool(0).active == 24);
    CHECK((*pool)->sub_pool(0).capacity == kSlots);
  }
  const uint8_t flipped = 0xFF;
  Poke(path, kActiveRecordOffset + 16, &flipped, 1);  // an active count, checksum left as it was
  auto corrupt = Pool::Open(path, kBudget);
  CHECK(corrupt.status().code() == StatusCode::kDataLoss);
  CHECK_THAT(corrupt.status().message(), Catch::Contains("active-capacity record") && Catch::Contains("--discard-pool"));
}

TEST_CASE("elastic pool: space left allocated beyond the active capacity (a crash mid-resize) is released at open",
          "[unit][elastic]") {
  TempDir dir;
  const std::string path = dir.path + "/pool";
  { REQUIRE(Pool::Create(path, "ns", Wide(), kBudget, 0, {}, 8 * kSlotBytes).ok()); }
  {
    const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
    REQUIRE(fd >= 0);
    REQUIRE(posix_fallocate(fd, static_cast<off_t>(kMetaBytes), static_cast<off_t>(kBudget)) == 0);
    close(fd);
  }
  CheckAllocatedSlots(path, kSlots);
  auto pool = Pool::Open(path, kBudget);
  REQUIRE(pool.ok());
  CHECK((*pool)->sub_pool(0).active == 8);
  CheckAllocatedSlots(path, 8);
}

TEST_CASE("elastic pool: a layout 2 file written before elastic pools opens fully active with its blocks",
          "[unit][elastic]") {
  TempDir dir;
  const std::string path = dir.path + "/pool";
  {
    auto pool = Pool::Create(path, "ns", Wide(), kBudget);
    REQUIRE(pool.ok());
    (*pool)->MarkCommitted(60, BlockKey{1, 1}, BlockKey{}, 0x60);
  }
  EraseActiveRecord(path);
  REQUIRE(Pool::FileLayoutVersion(path) == flexkv::kPoolLayoutVersion);
  auto pool = Pool::Open(path, kBudget);
  REQUIRE(pool.ok());
  CHECK((*pool)->sub_pool(0).active == kSlots);
  CheckAllocatedSlots(path, kSlots);  // nothing punched
  uint64_t dropped = 1;
  const auto entries = (*pool)->Recover(&dropped);
  CHECK(dropped == 0);
  REQUIRE(entries.size() == 1);
  CHECK(entries[0].slot == 60);
  // Resizing it writes the record from then on.
  (*pool)->MarkFree(60);
  REQUIRE((*pool)->SetActive(0, 32).ok());
  pool->reset();
  auto reopened = Pool::Open(path, kBudget);
  REQUIRE(reopened.ok());
  CHECK((*reopened)->sub_pool(0).active == 32);
}

TEST_CASE("elastic pool: a layout 3 (hybrid) file written before elastic pools opens fully active",
          "[unit][elastic][hybrid]") {
  TempDir dir;
  const std::string path = dir.path + "/pool";
  const Geometry g = flexkv::GptOss20B();
  constexpr uint64_t kHybridBudget = 64ull << 20;
  std::vector<uint32_t> capacity;
  {
    auto pool = Pool::Create(path, "ns", g, kHybridBudget, 0, flexkv::PoolSplit{0, 0, /*by_demand=*/false});
    REQUIRE(pool.ok());
    REQUIRE((*pool)->component_count() == 2);
    for (size_t c = 0; c < 2; ++c) capacity.push_back((*pool)->sub_pool(c).capacity);
    (*pool)->MarkCommitted(0, BlockKey{1, 1}, BlockKey{}, 0x10);
    (*pool)->MarkCommitted((*pool)->sub_pool(1).base + capacity[1] - 1, BlockKey{1, 1}, BlockKey{}, 0x11);
  }
  EraseActiveRecord(path);
  REQUIRE(Pool::FileLayoutVersion(path) == flexkv::kHybridPoolLayoutVersion);
  auto pool = Pool::Open(path, kHybridBudget);
  REQUIRE(pool.ok());
  for (size_t c = 0; c < 2; ++c) CHECK((*pool)->sub_pool(c).active == capacity[c]);
  uint64_t dropped = 1;
  CHECK((*pool)->Recover(&dropped).size() == 2);
  CHECK(dropped == 0);
}

TEST_CASE("elastic pool: Recover drops the entries of slots beyond the active capacity, and their descendants",
          "[unit][elastic]") {
  TempDir dir;
  const std::string path = dir.path + "/pool";
  const BlockKey a{1, 1}, b{2, 2}, c{3, 3}, d{4, 4};
  {
    auto pool = Pool::Create(path, "ns", Wide(), kBudget, 0, {}, 16 * kSlotBytes);
    REQUIRE(pool.ok());
    REQUIRE((*pool)->sub_pool(0).active == 16);
    // Entries beyond the active slots (the slot table covers every slot): what a torn shrink could leave.
    (*pool)->MarkCommitted(3, a, BlockKey{}, 0x3);
    (*pool)->MarkCommitted(40, b, a, 0x40);
    (*pool)->MarkCommitted(5, c, b, 0x5);  // under the dropped b: orphaned
    (*pool)->MarkCommitted(6, d, a, 0x6);
  }
  auto pool = Pool::Open(path, kBudget);
  REQUIRE(pool.ok());
  uint64_t dropped = 0;
  const auto entries = (*pool)->Recover(&dropped);
  CHECK(dropped == 2);
  REQUIRE(entries.size() == 2);
  CHECK(entries[0].key == a);
  CHECK(entries[1].key == d);
  CHECK_FALSE((*pool)->Entry(40).has_value());
}

TEST_CASE("elastic pool: the active record is where docs/protocol.md says, checksummed as it says", "[unit][elastic]") {
  TempDir dir;
  const std::string path = dir.path + "/pool";
  {
    auto pool = Pool::Create(path, "ns", Wide(), kBudget, 0, {}, 8 * kSlotBytes);
    REQUIRE(pool.ok());
    REQUIRE((*pool)->SetActive(0, 12).ok());
  }
  uint8_t record[56] = {};
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  REQUIRE(pread(fd, record, sizeof(record), kActiveRecordOffset) == static_cast<ssize_t>(sizeof(record)));
  close(fd);
  auto u32 = [&](size_t at) {
    uint32_t v;
    std::memcpy(&v, record + at, sizeof(v));
    return v;
  };
  CHECK(std::string(reinterpret_cast<const char*>(record), 8) == "FLEXKVAC");
  CHECK(u32(8) == 1);   // record version
  CHECK(u32(12) == 1);  // components
  CHECK(u32(16) == 12);
  CHECK(u32(20) == 0);
  uint64_t checksum;
  std::memcpy(&checksum, record + 48, sizeof(checksum));
  CHECK(checksum == XXH64(record, 48, 2));
}

namespace {

// In a child process with its own user and mount namespaces, mounts a tmpfs of `bytes` at `dir`. False when this
// machine does not allow it (no user namespaces).
bool MountSmallTmpfs(const std::string& dir, uint64_t bytes) {
  const uid_t uid = getuid();
  const gid_t gid = getgid();
  if (unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0) return false;
  std::ofstream("/proc/self/setgroups") << "deny";
  std::ofstream("/proc/self/uid_map") << "0 " << uid << " 1";
  std::ofstream("/proc/self/gid_map") << "0 " << gid << " 1";
  if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return false;
  const std::string size = "size=" + std::to_string(bytes);
  return mount("tmpfs", dir.c_str(), "tmpfs", 0, size.c_str()) == 0;
}

}  // namespace

TEST_CASE("elastic pool: a grow the filesystem cannot hold is RESOURCE_EXHAUSTED, naming the file, and changes nothing",
          "[unit][elastic]") {
  TempDir dir;
  // The child reports by exit code: 0 passed, 77 no namespaces here (skipped), other: the failed step.
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    if (!MountSmallTmpfs(dir.path, 5 << 20)) _exit(77);
    const std::string path = dir.path + "/pool";
    auto created = Pool::Create(path, "ns", Wide(), kBudget, 0, {}, 16 * kSlotBytes);  // 2 + 1 MiB of 5
    if (!created.ok()) _exit(1);
    Pool& pool = **created;
    struct stat before {};
    if (stat(path.c_str(), &before) != 0) _exit(2);
    const flexkv::Status full = pool.SetActive(0, 64);  // 3 MiB more
    if (full.code() != StatusCode::kResourceExhausted) _exit(3);
    if (full.message().find(path) == std::string::npos || full.message().find("tmpfs") == std::string::npos) {
      std::fprintf(stderr, "message: %s\n", full.message().c_str());
      _exit(4);
    }
    if (pool.sub_pool(0).active != 16) _exit(5);
    struct stat after {};
    if (stat(path.c_str(), &after) != 0 || after.st_blocks != before.st_blocks) _exit(6);
    if (!pool.SetActive(0, 32).ok() || pool.sub_pool(0).active != 32) _exit(7);  // 1 MiB more fits
    created->reset();
    auto reopened = Pool::Open(path, kBudget);
    if (!reopened.ok() || (*reopened)->sub_pool(0).active != 32) _exit(8);
    _exit(0);
  }
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  REQUIRE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 77) {
    WARN("skipped: no user and mount namespaces here to mount a small tmpfs");
    return;
  }
  CHECK(WEXITSTATUS(status) == 0);
}

// Regression: a demand-sized hybrid pool gives each component at least one grant (a 64th of the whole budget); a
// window or state whose default share is less got one on top of the FULL layers' rounded-down part, and the pool
// held more than its budget (16.2 MiB of 16 MiB): after a restart the daemon refused its own file ("holds 16.2 MiB but
// ... leave 16 MiB of the 16 MiB budget"). The others now give whole grants back.
TEST_CASE("elastic pool: a demand-sized hybrid pool's parts stay within its budget where a small share gets a grant",
          "[unit][elastic]") {
  flexkv::testing::TempDir dir("flexkv-pool-elastic");
  Geometry g;
  g.tokens_per_block = 16;
  g.num_layers = 3;
  g.kv_planes = 2;
  g.kv_heads_per_rank = 2;
  g.head_dim = 16;
  g.dtype_bytes = 2;
  g.tp_size = 2;
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
  for (uint64_t mib : {4u, 16u, 64u, 256u}) {
    CAPTURE(mib);
    const std::string path = dir.path + "/pool-" + std::to_string(mib);
    auto pool = Pool::Create(path, "ns", g, mib << 20);
    REQUIRE(pool.ok());
    REQUIRE((*pool)->demand_sized());
    CHECK((*pool)->active_bytes() <= (mib << 20));
    for (size_t c = 0; c < (*pool)->component_count(); ++c) CHECK((*pool)->sub_pool(c).active >= (*pool)->sub_pool(c).grant);
    // And every later split for its budget (ActiveSlotsFor) fits as well.
    uint64_t bytes = 0;
    const auto active = (*pool)->ActiveSlotsFor(mib << 20);
    for (size_t c = 0; c < active.size(); ++c) bytes += uint64_t{active[c]} * (*pool)->sub_pool(c).slot_bytes;
    CHECK(bytes <= (mib << 20));
  }
}
