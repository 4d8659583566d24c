// DramTier: the DRAM pool as tier 0 - what it says about itself, whole-slot reads and writes, and the refusals.
#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include "daemon/tiers/dram/dram_tier.h"
#include "tests/unit/daemon/cache/temp_cache.h"

using flexkv::StatusCode;
using flexkv::testing::SmallGeometry;
using flexkv::testing::TempCache;

TEST_CASE("dram tier: has no slots before the pool exists", "[unit][tiers]") {
  TempCache t;
  REQUIRE(t.cache().RecoverPool(false).ok());
  flexkv::DramTier tier(&t.cache());
  CHECK(tier.capacity_slots() == 0);
  CHECK_FALSE(tier.region().has_value());
  std::vector<uint8_t> bytes(SmallGeometry().host_block_bytes());
  CHECK(tier.ReadSlot(0, bytes).code() == StatusCode::kFailedPrecondition);

  REQUIRE(t.cache().Admit("ns", SmallGeometry()).ok());
  CHECK(tier.capacity_slots() == 64);
  CHECK(tier.slot_bytes() == SmallGeometry().host_block_bytes());
  REQUIRE(tier.region().has_value());
  CHECK(tier.region()->base == t.cache().SlotData(0));
}

TEST_CASE("dram tier: a written slot reads back, in the pool's bytes", "[unit][tiers]") {
  TempCache t;
  REQUIRE(t.cache().RecoverPool(false).ok());
  REQUIRE(t.cache().Admit("ns", SmallGeometry()).ok());
  flexkv::DramTier tier(&t.cache());
  std::vector<uint8_t> in(tier.slot_bytes());
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<uint8_t>(i * 7 + 1);
  REQUIRE(tier.WriteSlot(5, in).ok());
  CHECK(t.cache().SlotData(5)[0] == in[0]);
  CHECK(t.cache().SlotData(5)[in.size() - 1] == in.back());
  std::vector<uint8_t> out(tier.slot_bytes());
  REQUIRE(tier.ReadSlot(5, out).ok());
  CHECK(out == in);
}

TEST_CASE("dram tier: a slot past the pool or a buffer of the wrong size is refused, naming both", "[unit][tiers]") {
  TempCache t;
  REQUIRE(t.cache().RecoverPool(false).ok());
  REQUIRE(t.cache().Admit("ns", SmallGeometry()).ok());
  flexkv::DramTier tier(&t.cache());
  std::vector<uint8_t> slot(tier.slot_bytes());
  const flexkv::Status past = tier.WriteSlot(64, slot);
  CHECK(past.code() == StatusCode::kOutOfRange);
  CHECK_THAT(past.message(), Catch::Contains("slot 64") && Catch::Contains("64 slots"));
  std::vector<uint8_t> small(tier.slot_bytes() - 1);
  const flexkv::Status size = tier.ReadSlot(0, small);
  CHECK(size.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(size.message(), Catch::Contains("expected the slot size"));
}
