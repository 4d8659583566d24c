// Pool: the pool file is created to the budget, committed slots come back after a reopen (parents first),
// and a file that does not fit is refused with the reason and the way out.
#include "common/block_checksum.h"
#include "daemon/cache/pool.h"
#include "tests/support/temp_dir.h"

#include <fcntl.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <string>

using flexkv::BlockKey;
using flexkv::Geometry;
using flexkv::Pool;
using flexkv::StatusCode;

namespace {

Geometry Small() { return flexkv::testing::TinyGeometry(); }

struct TempDir : flexkv::testing::TempDir {
  TempDir() : flexkv::testing::TempDir("flexkv-pool-test") {}
};

constexpr uint64_t kBudget = 192 * 10;

// Overwrites `len` bytes of the file at `offset`.
void Poke(const std::string& path, uint64_t offset, const void* bytes, size_t len) {
  const int fd = open(path.c_str(), O_WRONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  REQUIRE(pwrite(fd, bytes, len, static_cast<off_t>(offset)) == static_cast<ssize_t>(len));
  close(fd);
}

constexpr uint64_t kTableOffset = 4096;  // docs/protocol.md "Pool file": header 4 KiB, then 64 B per slot

}  // namespace

TEST_CASE("a new pool holds floor(budget / block bytes) slots of distinct memory", "[unit]") {
  TempDir dir;
  const std::string path = dir.path + "/sub/pool";
  auto pool = Pool::Create(path, "ns", Small(), kBudget + 100);
  REQUIRE(pool.ok());
  CHECK((*pool)->capacity() == 10);
  CHECK((*pool)->block_bytes() == 192);
  CHECK((*pool)->model_namespace() == "ns");
  CHECK((*pool)->path() == path);
  CHECK(std::filesystem::exists(path));
  CHECK_FALSE(std::filesystem::exists(path + ".new"));
  CHECK((*pool)->SlotData(1) == (*pool)->SlotData(0) + 192);
  (*pool)->SlotData(9)[191] = 0x5A;  // the last byte of the last slot is inside the mapping
  uint64_t dropped = 1;
  CHECK((*pool)->Recover(&dropped).empty());
  CHECK(dropped == 0);
}

TEST_CASE("a budget below one block is refused", "[unit]") {
  TempDir dir;
  auto pool = Pool::Create(dir.path + "/pool", "ns", Small(), 100);
  CHECK(pool.status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("committed slots and their bytes survive a reopen, parents before children, freed ones do not",
          "[unit]") {
  TempDir dir;
  const std::string path = dir.path + "/pool";
  const BlockKey a{1, 1}, b{2, 2}, c{3, 3}, gone{4, 4};
  {
    auto pool = Pool::Create(path, "ns", Small(), kBudget);
    REQUIRE(pool.ok());
    // Children in lower slots than their parents: recovery must reorder.
    (*pool)->SlotData(0)[0] = 0xC0;
    (*pool)->MarkCommitted(0, c, b, 0x100 + 0);
    (*pool)->MarkCommitted(5, b, a, 0x100 + 5);
    (*pool)->MarkCommitted(7, a, BlockKey{}, 0x100 + 7);
    (*pool)->MarkCommitted(3, gone, a, 0x100 + 3);
    (*pool)->MarkFree(3);
  }
  auto pool = Pool::Open(path, kBudget);
  REQUIRE(pool.ok());
  CHECK((*pool)->geometry().num_layers == 3);
  CHECK((*pool)->model_namespace() == "ns");
  uint64_t dropped = 0;
  auto entries = (*pool)->Recover(&dropped);
  CHECK(dropped == 0);
  REQUIRE(entries.size() == 3);
  CHECK((entries[0].key == a && entries[0].slot == 7));
  CHECK((entries[1].key == b && entries[1].slot == 5 && entries[1].parent == a));
  CHECK((entries[2].key == c && entries[2].slot == 0 && entries[2].parent == b));
  CHECK(entries[2].content_checksum == 0x100);
  CHECK(entries[0].content_checksum == 0x107);
  CHECK((*pool)->SlotData(0)[0] == 0xC0);
}

TEST_CASE("a slot entry binds its slot index: entries swapped or copied between slots fail their checksum",
          "[unit][regression][checksum]") {
  TempDir dir;
  const std::string path = dir.path + "/pool";
  const BlockKey a{1, 1}, b{2, 2}, x{7, 7};
  {
    auto pool = Pool::Create(path, "ns", Small(), kBudget);
    REQUIRE(pool.ok());
    (*pool)->MarkCommitted(0, a, BlockKey{}, 0xA);
    (*pool)->MarkCommitted(1, b, BlockKey{}, 0xB);
    (*pool)->MarkCommitted(2, x, BlockKey{}, 0xC);
  }
  // Swap the entries of slots 0 and 1 byte for byte: each is a valid entry, only in the other's slot.
  {
    const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
    REQUIRE(fd >= 0);
    uint8_t e0[64], e1[64];
    REQUIRE(pread(fd, e0, 64, kTableOffset) == 64);
    REQUIRE(pread(fd, e1, 64, kTableOffset + 64) == 64);
    REQUIRE(pwrite(fd, e1, 64, kTableOffset) == 64);
    REQUIRE(pwrite(fd, e0, 64, kTableOffset + 64) == 64);
    close(fd);
  }
  auto pool = Pool::Open(path, kBudget);
  REQUIRE(pool.ok());
  CHECK_FALSE((*pool)->Entry(0).has_value());
  CHECK_FALSE((*pool)->Entry(1).has_value());
  const auto kept = (*pool)->Entry(2);
  REQUIRE(kept.has_value());
  CHECK((kept->key == x && kept->content_checksum == 0xC));
  uint64_t dropped = 0;
  auto entries = (*pool)->Recover(&dropped);
  CHECK(dropped == 2);
  REQUIRE(entries.size() == 1);
  CHECK(entries[0].key == x);
}

TEST_CASE("a slot entry's content checksum is covered by the entry checksum, and ContentMatches reads the bytes",
          "[unit][checksum]") {
  TempDir dir;
  const std::string path = dir.path + "/pool";
  auto pool = Pool::Create(path, "ns", Small(), kBudget);
  REQUIRE(pool.ok());
  uint8_t* bytes = (*pool)->SlotData(4);
  for (uint64_t i = 0; i < (*pool)->block_bytes(); ++i) bytes[i] = static_cast<uint8_t>(i * 13);
  const uint64_t sum = flexkv::BlockChecksum(bytes, (*pool)->block_bytes());
  (*pool)->MarkCommitted(4, BlockKey{5, 5}, BlockKey{}, sum);
  CHECK((*pool)->ContentMatches(4, sum));
  bytes[77] ^= 0x10;
  CHECK_FALSE((*pool)->ContentMatches(4, sum));
  const uint64_t other = sum + 1;
  Poke(path, kTableOffset + 4 * 64 + 48, &other, sizeof(other));  // the content checksum field
  CHECK_FALSE((*pool)->Entry(4).has_value());
}

TEST_CASE("a slot entry whose checksum fails is dropped, and so are its descendants", "[unit]") {
  TempDir dir;
  const std::string path = dir.path + "/pool";
  const BlockKey a{1, 1}, b{2, 2}, c{3, 3}, other{9, 9};
  {
    auto pool = Pool::Create(path, "ns", Small(), kBudget);
    REQUIRE(pool.ok());
    (*pool)->MarkCommitted(0, a, BlockKey{}, 0x100 + 0);
    (*pool)->MarkCommitted(1, b, a, 0x100 + 1);
    (*pool)->MarkCommitted(2, c, b, 0x100 + 2);
    (*pool)->MarkCommitted(3, other, BlockKey{}, 0x100 + 3);
  }
  const uint64_t flipped = 0xFFFF;
  Poke(path, kTableOffset + 1 * 64 + 8, &flipped, sizeof(flipped));  // slot 1's key.lo, checksum left as it was
  auto pool = Pool::Open(path, kBudget);
  REQUIRE(pool.ok());
  uint64_t dropped = 0;
  auto entries = (*pool)->Recover(&dropped);
  CHECK(dropped == 2);  // slot 1 (checksum) and slot 2 (its parent is gone)
  REQUIRE(entries.size() == 2);
  for (const auto& e : entries) CHECK((e.key == a || e.key == other));
  // The dropped entries were cleared: a second recovery finds nothing more to drop.
  auto again = (*pool)->Recover(&dropped);
  CHECK(dropped == 0);
  CHECK(again.size() == 2);
}

TEST_CASE("Pool::Open refuses a file that is missing, not a pool, corrupt, of another version or budget",
          "[unit]") {
  TempDir dir;
  const std::string path = dir.path + "/pool";
  CHECK(Pool::Open(path, kBudget).status().code() == StatusCode::kNotFound);
  { REQUIRE(Pool::Create(path, "ns", Small(), kBudget).ok()); }

  SECTION("another budget: FAILED_PRECONDITION naming --pool-size") {
    auto r = Pool::Open(path, kBudget * 2);
    CHECK(r.status().code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(r.status().message(), Catch::Contains("--pool-size") && Catch::Contains("--discard-pool"));
  }
  SECTION("bad magic: DATA_LOSS") {
    Poke(path, 0, "NOTAPOOL", 8);
    auto r = Pool::Open(path, kBudget);
    CHECK(r.status().code() == StatusCode::kDataLoss);
    CHECK_THAT(r.status().message(), Catch::Contains("not a flexkvd pool file"));
  }
  SECTION("another layout version: FAILED_PRECONDITION") {
    const uint32_t version = flexkv::kDemandPoolLayoutVersion + 1;
    Poke(path, 8, &version, sizeof(version));
    auto r = Pool::Open(path, kBudget);
    CHECK(r.status().code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(r.status().message(), Catch::Contains("layout version"));
  }
  SECTION("a header byte changed: DATA_LOSS (checksum)") {
    const uint32_t layers = 4;
    Poke(path, 16, &layers, sizeof(layers));  // geometry[1] = num_layers
    auto r = Pool::Open(path, kBudget);
    CHECK(r.status().code() == StatusCode::kDataLoss);
    CHECK_THAT(r.status().message(), Catch::Contains("corrupt header"));
  }
  SECTION("a file shorter than its header: DATA_LOSS") {
    REQUIRE(truncate(path.c_str(), 100) == 0);
    CHECK(Pool::Open(path, kBudget).status().code() == StatusCode::kDataLoss);
  }
  SECTION("a file cut short after the header: DATA_LOSS") {
    REQUIRE(truncate(path.c_str(), 8192) == 0);
    auto r = Pool::Open(path, kBudget);
    CHECK(r.status().code() == StatusCode::kDataLoss);
    // The header is whole and consistent: the message says the file was truncated, not that the header is wrong.
    CHECK_THAT(r.status().message(), Catch::Contains("is 8192 bytes but its header says") &&
                                         Catch::Contains("truncated") && Catch::Contains("--discard-pool"));
  }
}

TEST_CASE("the uid that created the namespace is kept in the pool header across a reopen", "[unit][security]") {
  TempDir dir;
  const std::string path = dir.path + "/pool";
  {
    auto pool = Pool::Create(path, "ns", Small(), kBudget, 4242);
    REQUIRE(pool.ok());
    CHECK((*pool)->creator_uid() == 4242);
  }
  auto reopened = Pool::Open(path, kBudget);
  REQUIRE(reopened.ok());
  CHECK((*reopened)->creator_uid() == 4242);
  CHECK((*reopened)->model_namespace() == "ns");
  // The header checksum covers it: a creator rewritten on disk is a corrupt header, not a new owner.
  const uint32_t forged = 0;
  Poke(path, 340, &forged, sizeof(forged));
  auto tampered = Pool::Open(path, kBudget);
  CHECK(tampered.status().code() == StatusCode::kDataLoss);
}

TEST_CASE("SplitBudget: a hybrid pool's default split follows 4096 tokens of prefix, shares set by the operator win",
          "[unit][hybrid]") {
  constexpr uint64_t kGiB = uint64_t{1} << 30;
  auto share = [](const flexkv::Geometry& g, const std::vector<uint64_t>& cap, size_t c, uint64_t budget) {
    return static_cast<double>(cap[c] * g.Component(c).host_block_bytes()) / static_cast<double>(budget);
  };
  // Gemma 3: 256 FULL blocks of 1.25 MiB against one 64-block window of 6.5 MiB blocks: 416 / 736 of the pool.
  const flexkv::Geometry gemma = flexkv::Gemma3_27B();
  auto cap = flexkv::SplitBudget(gemma, 64 * kGiB, {});
  REQUIRE(cap.ok());
  REQUIRE(cap->size() == 2);
  CHECK(share(gemma, *cap, 1, 64 * kGiB) == Approx(416.0 / 736.0).epsilon(0.01));
  // Qwen3-Next: 256 FULL blocks of 384 KiB against one 73.7 MiB snapshot.
  const flexkv::Geometry qwen = flexkv::Qwen3Next80B();
  cap = flexkv::SplitBudget(qwen, 64 * kGiB, {});
  REQUIRE(cap.ok());
  const double full = 256.0 * qwen.host_block_bytes(), state = qwen.Component(1).host_block_bytes();
  CHECK(share(qwen, *cap, 1, 64 * kGiB) == Approx(state / (full + state)).epsilon(0.01));
  // The operator's share wins; a full-attention geometry is one sub-pool of the whole budget.
  cap = flexkv::SplitBudget(qwen, 64 * kGiB, flexkv::PoolSplit{0, 0.25});
  REQUIRE(cap.ok());
  CHECK(share(qwen, *cap, 1, 64 * kGiB) == Approx(0.25).epsilon(0.01));
  cap = flexkv::SplitBudget(flexkv::Llama3_8B(), 64 * kGiB, flexkv::PoolSplit{0.5, 0.5});
  REQUIRE(cap.ok());
  CHECK(*cap == std::vector<uint64_t>{64 * 512});
  // Refusals name what is wrong.
  auto bad = flexkv::SplitBudget(qwen, 64 * kGiB, flexkv::PoolSplit{0, 1.0});
  CHECK(bad.status().code() == StatusCode::kInvalidArgument);
  bad = flexkv::SplitBudget(qwen, 64ull << 20, {});  // 64 MiB: less than one 73.7 MiB snapshot
  CHECK(bad.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(bad.status().message(), Catch::Contains("component 1 (state)") && Catch::Contains("less than one slot"));
}

TEST_CASE("a hybrid pool reopens with its own split under automatic shares, and is refused for another budget or split",
          "[unit][hybrid]") {
  TempDir dir;
  const std::string path = dir.path + "/pool";
  const Geometry g = flexkv::GptOss20B();
  constexpr uint64_t kBudget = 64ull << 20;
  {
    auto pool = Pool::Create(path, "ns", g, kBudget, 0, flexkv::PoolSplit{0.3, 0});
    REQUIRE(pool.ok());
    CHECK((*pool)->component_count() == 2);
    CHECK((*pool)->sub_pool(1).capacity == static_cast<uint32_t>(0.3 * kBudget / g.Component(1).host_block_bytes()));
  }
  auto automatic = Pool::Open(path, kBudget);  // shares not given: the file's own split is kept
  REQUIRE(automatic.ok());
  CHECK((*automatic)->sub_pool(1).capacity == static_cast<uint32_t>(0.3 * kBudget / g.Component(1).host_block_bytes()));
  automatic->reset();
  auto other_split = Pool::Open(path, kBudget, flexkv::PoolSplit{0.1, 0});
  CHECK(other_split.status().code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(other_split.status().message(), Catch::Contains("--swa-share"));
  auto other_budget = Pool::Open(path, 2 * kBudget);
  CHECK(other_budget.status().code() == StatusCode::kFailedPrecondition);
}

TEST_CASE("a hybrid pool with automatic shares is sized by demand: each sub-pool laid out for the whole budget (layout 4)",
          "[unit][hybrid]") {
  TempDir dir;
  const std::string path = dir.path + "/pool";
  const Geometry g = flexkv::GptOss20B();
  constexpr uint64_t kBudget = 64ull << 20;
  const uint64_t full_slot = g.Component(0).host_block_bytes(), window_slot = g.Component(1).host_block_bytes();
  auto fixed = flexkv::SplitBudget(g, kBudget, {});
  REQUIRE(fixed.ok());
  {
    auto pool = Pool::Create(path, "ns", g, kBudget);
    REQUIRE(pool.ok());
    CHECK((*pool)->demand_sized());
    CHECK((*pool)->sub_pool(0).capacity == kBudget / full_slot);
    CHECK((*pool)->sub_pool(1).capacity == kBudget / window_slot);
    CHECK((*pool)->sub_pool(1).grant == ((*pool)->sub_pool(1).capacity + 63) / 64);
    // Active at first as the default split, rounded down to grants: within the budget.
    CHECK((*pool)->active_bytes() <= kBudget);
    for (size_t c = 0; c < 2; ++c) {
      const flexkv::SubPool& p = (*pool)->sub_pool(c);
      CHECK(p.active % p.grant == 0);
      CHECK(p.active + p.grant > (*fixed)[c]);
      CHECK(p.active <= (*fixed)[c] + p.grant);
    }
    // The window grows past its default share (what a fixed layout could never give it), the FULL part shrinks.
    REQUIRE((*pool)->sub_pool(0).grant == 3);  // 170 slots of 384 KiB each
    REQUIRE((*pool)->SetActive(0, 3 * 30).ok());
    REQUIRE((*pool)->SetActive(1, 3 * 26).ok());
    CHECK((*pool)->active_bytes() <= kBudget);
    // Resize keeps the split demand gave it: 90 : 78 slots, halved and rounded down to grants.
    CHECK((*pool)->ActiveSlotsFor(kBudget / 2) == std::vector<uint32_t>{45, 39});
  }
  REQUIRE(Pool::FileLayoutVersion(path) == flexkv::kDemandPoolLayoutVersion);
  auto reopened = Pool::Open(path, kBudget);
  REQUIRE(reopened.ok());
  CHECK((*reopened)->demand_sized());
  CHECK((*reopened)->sub_pool(1).active == 3 * 26);
  reopened->reset();
  auto with_share = Pool::Open(path, kBudget, flexkv::PoolSplit{0.2, 0});
  CHECK(with_share.status().code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(with_share.status().message(), Catch::Contains("sized by demand") && Catch::Contains("--swa-share"));
  auto other_budget = Pool::Open(path, 2 * kBudget);
  CHECK(other_budget.status().code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(other_budget.status().message(), Catch::Contains("--pool-size"));
}

TEST_CASE("a layout 3 pool made with automatic shares keeps its fixed split when reopened", "[unit][hybrid]") {
  TempDir dir;
  const std::string path = dir.path + "/pool";
  const Geometry g = flexkv::GptOss20B();
  constexpr uint64_t kBudget = 64ull << 20;
  auto fixed = flexkv::SplitBudget(g, kBudget, {});
  REQUIRE(fixed.ok());
  { REQUIRE(Pool::Create(path, "ns", g, kBudget, 0, flexkv::PoolSplit{0, 0, /*by_demand=*/false}).ok()); }
  REQUIRE(Pool::FileLayoutVersion(path) == flexkv::kHybridPoolLayoutVersion);
  auto pool = Pool::Open(path, kBudget);
  REQUIRE(pool.ok());
  CHECK(!(*pool)->demand_sized());
  CHECK((*pool)->sub_pool(0).capacity == (*fixed)[0]);
  CHECK((*pool)->sub_pool(1).capacity == (*fixed)[1]);
  CHECK((*pool)->sub_pool(1).grant == ((*fixed)[1] + 15) / 16);
}

TEST_CASE("a pool sized by demand starts near the default split although its grants are a 64th of the budget",
          "[unit][hybrid]") {
  TempDir dir;
  const std::string path = dir.path + "/pool";
  const Geometry g = flexkv::GptOss20B();  // 384 KiB slots: 682 of them per sub-pool, grants of 11
  constexpr uint64_t kBudget = 256ull << 20;
  auto fixed = flexkv::SplitBudget(g, kBudget, {});
  REQUIRE(fixed.ok());
  REQUIRE((*fixed)[1] == 20);  // the default window share: 3 % of the budget, under two grants
  auto pool = Pool::Create(path, "ns", g, kBudget);
  REQUIRE(pool.ok());
  REQUIRE((*pool)->sub_pool(1).grant == 11);
  // Rounding each part down would leave the window one grant (half its share); what it left goes to the window.
  CHECK((*pool)->sub_pool(1).active == 22);
  CHECK((*pool)->sub_pool(0).active == 660);
  CHECK((*pool)->active_bytes() <= kBudget);
}
