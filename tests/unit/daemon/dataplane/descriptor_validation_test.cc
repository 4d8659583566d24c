// ValidateDescriptor and ValidateHandleUse (daemon/dataplane/descriptor_validation.h): valid descriptors of
// every opcode are accepted with their payload copied out of the arena; each kind of bad field is refused
// with its code and a message naming the field and the value.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "common/clock.h"
#include "daemon/dataplane/descriptor_validation.h"

namespace {

using flexkv::BlockKey;
using flexkv::DescriptorLimits;
using flexkv::DescriptorPayload;
using flexkv::RingOp;
using flexkv::StatusCode;
using flexkv::SubmitDescriptor;

constexpr uint64_t kArenaBytes = 4096;
constexpr uint32_t kRegistered = 8;
constexpr uint64_t kKeysAt = 64;   // 4 keys
constexpr uint64_t kIdsAt = 256;   // ids 0..7
constexpr uint64_t kBadIdAt = 512; // {3, kRegistered}
constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

// An arena with four recognisable keys at kKeysAt and block ids at kIdsAt and kBadIdAt.
struct Arena {
  alignas(64) uint8_t bytes[kArenaBytes] = {};
  Arena() {
    for (uint64_t i = 0; i < 4; ++i) {
      const BlockKey k{0x1000 + i, 0xabc0 + i};
      std::memcpy(bytes + kKeysAt + 16 * i, &k, sizeof(k));
    }
    for (uint32_t i = 0; i < kRegistered; ++i) std::memcpy(bytes + kIdsAt + 4 * i, &i, 4);
    const uint32_t bad[2] = {3, kRegistered};
    std::memcpy(bytes + kBadIdAt, bad, sizeof(bad));
  }
  std::span<const uint8_t> span() const { return {bytes, kArenaBytes}; }
};

DescriptorLimits Limits(uint32_t registered = kRegistered) {
  DescriptorLimits l;
  l.max_blocks_per_request = 64;
  l.registered_blocks = registered;
  return l;
}

SubmitDescriptor Desc(RingOp op, uint32_t count, uint16_t flags = 0) {
  SubmitDescriptor d{};
  d.user_data = 7;
  d.opcode = static_cast<uint16_t>(op);
  d.flags = flags;
  d.count = count;
  d.keys_offset = kKeysAt;
  d.block_ids_offset = kIdsAt;
  d.match_handle = 1;
  return d;
}

// The refusal of `d`, checked for its code and for `mentions` in its message.
void ExpectRefused(const SubmitDescriptor& d, StatusCode code, const std::string& mentions,
                   const DescriptorLimits& limits = Limits()) {
  const Arena arena;
  const auto r = flexkv::ValidateDescriptor(d, arena.span(), limits);
  REQUIRE_FALSE(r.ok());
  INFO(r.status().ToString());
  CHECK(r.status().code() == code);
  CHECK_THAT(r.status().message(), Catch::Contains(mentions));
}

}  // namespace

TEST_CASE("descriptor validation: valid descriptors of every opcode are accepted with their payload copied",
          "[unit]") {
  const Arena arena;
  SECTION("Match, with and without pin") {
    for (const uint16_t flags : {uint16_t{0}, flexkv::kMatchFlagPin}) {
      const auto r = flexkv::ValidateDescriptor(Desc(RingOp::kMatch, 4, flags), arena.span(), Limits());
      REQUIRE(r.ok());
      REQUIRE(r->keys.size() == 4);
      CHECK(r->keys[0] == BlockKey{0x1000, 0xabc0});
      CHECK(r->keys[3] == BlockKey{0x1003, 0xabc3});
      CHECK(r->block_ids.empty());
    }
  }
  SECTION("Store: keys and ids") {
    const auto r = flexkv::ValidateDescriptor(Desc(RingOp::kStore, 4), arena.span(), Limits());
    REQUIRE(r.ok());
    CHECK(r->keys.size() == 4);
    CHECK(r->block_ids == std::vector<uint32_t>{0, 1, 2, 3});
  }
  SECTION("Load, layer-wise too: ids only") {
    for (const uint16_t flags : {uint16_t{0}, flexkv::kLoadFlagLayerwise}) {
      const auto r = flexkv::ValidateDescriptor(Desc(RingOp::kLoad, kRegistered, flags), arena.span(), Limits());
      REQUIRE(r.ok());
      CHECK(r->keys.empty());
      CHECK(r->block_ids == std::vector<uint32_t>{0, 1, 2, 3, 4, 5, 6, 7});
    }
  }
  SECTION("Release: count, offsets and registration do not matter") {
    SubmitDescriptor d = Desc(RingOp::kRelease, 0);
    d.keys_offset = kMax;
    d.block_ids_offset = 3;
    const auto r = flexkv::ValidateDescriptor(d, arena.span(), Limits(/*registered=*/0));
    REQUIRE(r.ok());
    CHECK(r->keys.empty());
    CHECK(r->block_ids.empty());
  }
  SECTION("ranges that end exactly at the arena end, and count == max") {
    // A Store key must not be all zero: the last 16 bytes hold key {5, 1} (its upper half overlaps block id 0).
    Arena tail;
    const uint64_t lo = 5;
    const uint32_t hi_low_half = 1;
    std::memcpy(tail.bytes + kArenaBytes - 16, &lo, 8);
    std::memcpy(tail.bytes + kArenaBytes - 8, &hi_low_half, 4);
    SubmitDescriptor d = Desc(RingOp::kStore, 1);
    d.keys_offset = kArenaBytes - 16;
    d.block_ids_offset = kArenaBytes - 4;
    CHECK(flexkv::ValidateDescriptor(d, tail.span(), Limits()).ok());
    DescriptorLimits wide = Limits();
    wide.max_blocks_per_request = 4096 / 16;
    SubmitDescriptor all = Desc(RingOp::kMatch, 4096 / 16);
    all.keys_offset = 0;
    CHECK(flexkv::ValidateDescriptor(all, arena.span(), wide).ok());
  }
  SECTION("Match needs no registered KV buffers") {
    CHECK(flexkv::ValidateDescriptor(Desc(RingOp::kMatch, 1), arena.span(), Limits(/*registered=*/0)).ok());
  }
}

TEST_CASE("descriptor validation: event sets off Loads, opcodes and flags are refused with INVALID_ARGUMENT", "[unit]") {
  SubmitDescriptor d = Desc(RingOp::kMatch, 1);
  d.event_set = 42;
  ExpectRefused(d, StatusCode::kInvalidArgument, "event_set is 42 on opcode 1; expected 0 (only a Load names");
  SubmitDescriptor release = Desc(RingOp::kRelease, 0);
  release.event_set = UINT32_MAX;
  ExpectRefused(release, StatusCode::kInvalidArgument, "event_set is 4294967295");

  for (const uint16_t opcode : {uint16_t{0}, uint16_t{6}, uint16_t{0xffff}}) {
    SubmitDescriptor d = Desc(RingOp::kMatch, 1);
    d.opcode = opcode;
    ExpectRefused(d, StatusCode::kInvalidArgument, "opcode " + std::to_string(opcode) + " is unknown; expected 1..5");
  }
  // A Prefetch pins nothing: a match handle on one is refused; so is an all-zero key (as in a Store).
  SubmitDescriptor prefetch = Desc(RingOp::kMatch, 1);
  prefetch.opcode = static_cast<uint16_t>(RingOp::kPrefetch);
  prefetch.match_handle = 3;
  ExpectRefused(prefetch, StatusCode::kInvalidArgument, "match_handle is 3 on a Prefetch; expected 0");

  ExpectRefused(Desc(RingOp::kMatch, 1, 0x2), StatusCode::kInvalidArgument, "flags 0x2 are not valid for opcode 1");
  ExpectRefused(Desc(RingOp::kLoad, 1, 0x8000), StatusCode::kInvalidArgument, "flags 0x8000");
  ExpectRefused(Desc(RingOp::kStore, 1, flexkv::kMatchFlagPin), StatusCode::kInvalidArgument,
                "expected a subset of 0x0");
  ExpectRefused(Desc(RingOp::kRelease, 0, 1), StatusCode::kInvalidArgument, "flags 0x1");
}

TEST_CASE("descriptor validation: counts outside 1..max are refused with INVALID_ARGUMENT", "[unit]") {
  for (const RingOp op : {RingOp::kMatch, RingOp::kLoad, RingOp::kStore}) {
    ExpectRefused(Desc(op, 0), StatusCode::kInvalidArgument, "count 0 is out of range; expected 1..64");
    ExpectRefused(Desc(op, 65), StatusCode::kInvalidArgument, "count 65");
    ExpectRefused(Desc(op, std::numeric_limits<uint32_t>::max()), StatusCode::kInvalidArgument, "count 4294967295");
  }
}

TEST_CASE("descriptor validation: arena ranges outside, overflowing or unaligned are refused with OUT_OF_RANGE",
          "[unit]") {
  struct Bad {
    const char* what;
    RingOp op;
    uint32_t count;
    uint64_t keys_offset, ids_offset;
    const char* mentions;
  };
  const Bad cases[] = {
      {"keys past the end", RingOp::kMatch, 1, kArenaBytes + 16, kIdsAt, "keys [4112, +16) are outside the 4096-byte arena"},
      {"keys at the end", RingOp::kMatch, 1, kArenaBytes, kIdsAt, "keys [4096, +16)"},
      {"keys straddling the end", RingOp::kStore, 2, kArenaBytes - 16, kIdsAt, "keys [4080, +32)"},
      {"keys offset + length overflowing", RingOp::kMatch, 2, kMax - 15, kIdsAt, "keys [18446744073709551600, +32)"},
      {"keys unaligned", RingOp::kMatch, 1, 3, kIdsAt, "keys at offset 3 are unaligned; expected a multiple of 8"},
      {"keys 4-aligned only", RingOp::kStore, 1, 4, kIdsAt, "keys at offset 4 are unaligned"},
      {"ids past the end", RingOp::kLoad, 1, kKeysAt, kArenaBytes, "block ids [4096, +4)"},
      {"ids straddling the end", RingOp::kLoad, 2, kKeysAt, kArenaBytes - 4, "block ids [4092, +8)"},
      {"ids overflowing", RingOp::kStore, 4, kKeysAt, kMax - 3, "block ids [18446744073709551612, +16)"},
      {"ids unaligned", RingOp::kStore, 1, kKeysAt, kIdsAt + 2, "block ids at offset 258 are unaligned"},
  };
  for (const Bad& b : cases) {
    INFO(b.what);
    SubmitDescriptor d = Desc(b.op, b.count);
    d.keys_offset = b.keys_offset;
    d.block_ids_offset = b.ids_offset;
    ExpectRefused(d, StatusCode::kOutOfRange, b.mentions);
  }
  // Offsets an opcode does not use are not looked at.
  SubmitDescriptor match = Desc(RingOp::kMatch, 1);
  match.block_ids_offset = kMax;
  CHECK(flexkv::ValidateDescriptor(match, Arena().span(), Limits()).ok());
  SubmitDescriptor load = Desc(RingOp::kLoad, 1);
  load.block_ids_offset = kIdsAt;
  CHECK(flexkv::ValidateDescriptor(load, Arena().span(), Limits()).ok());
}

TEST_CASE("descriptor validation: a Load's launch deadline is 0 or a monotonic time up to INT64_MAX", "[unit]") {
  // Layout 6: the word of keys_offset is a Load's launch_deadline_ns; whether it passed is decided at the launch.
  for (const uint64_t deadline : {uint64_t{0}, uint64_t{1}, static_cast<uint64_t>(flexkv::NowNs()),
                                  static_cast<uint64_t>(INT64_MAX)}) {
    INFO(deadline);
    SubmitDescriptor load = Desc(RingOp::kLoad, 2);
    load.launch_deadline_ns = deadline;
    CHECK(flexkv::ValidateDescriptor(load, Arena().span(), Limits()).ok());
  }
  for (const uint64_t deadline : {static_cast<uint64_t>(INT64_MAX) + 1, kMax}) {
    SubmitDescriptor load = Desc(RingOp::kLoad, 2);
    load.launch_deadline_ns = deadline;
    ExpectRefused(load, StatusCode::kInvalidArgument,
                  fmt::format("launch_deadline_ns {} of a Load; expected 0 (none) or a CLOCK_MONOTONIC time in ns of "
                              "at most 9223372036854775807", deadline));
  }
  // The same word is a Match's and Store's keys_offset: checked as an arena range there, not as a deadline.
  SubmitDescriptor match = Desc(RingOp::kMatch, 1);
  match.keys_offset = static_cast<uint64_t>(INT64_MAX) + 1;
  ExpectRefused(match, StatusCode::kOutOfRange, "keys [");
}

TEST_CASE("descriptor validation: block ids at or past the registered blocks are refused with OUT_OF_RANGE",
          "[unit]") {
  for (const RingOp op : {RingOp::kLoad, RingOp::kStore}) {
    SubmitDescriptor d = Desc(op, 2);
    d.block_ids_offset = kBadIdAt;
    ExpectRefused(d, StatusCode::kOutOfRange, "block id 8 at 1 is outside the 8 registered blocks; expected 0..7");
    // Fewer registered blocks than the ids reach.
    ExpectRefused(Desc(op, 8), StatusCode::kOutOfRange, "block id 4 at 4 is outside the 4 registered blocks",
                  Limits(/*registered=*/4));
  }
}

TEST_CASE("descriptor validation: only a Store carries a parent key - any other opcode with one is refused",
          "[unit]") {
  Arena arena;
  for (const RingOp op : {RingOp::kMatch, RingOp::kLoad, RingOp::kRelease}) {
    SubmitDescriptor d = Desc(op, op == RingOp::kRelease ? 0 : 1);
    d.parent = BlockKey{1, 0};
    ExpectRefused(d, StatusCode::kInvalidArgument,
                  "parent is 00000000000000000000000000000001 on a " +
                      std::string(op == RingOp::kMatch ? "Match" : op == RingOp::kLoad ? "Load" : "Release") +
                      "; expected all zero (only a Store has a parent)");
  }
  // A Store's parent is any key: whether it is cached is the index's question, not the descriptor's.
  SubmitDescriptor store = Desc(RingOp::kStore, 2);
  store.parent = BlockKey{kMax, kMax};
  CHECK(flexkv::ValidateDescriptor(store, arena.span(), Limits()).ok());
  store.parent = flexkv::kRootParent;
  CHECK(flexkv::ValidateDescriptor(store, arena.span(), Limits()).ok());
}

TEST_CASE("descriptor validation: Load and Store without registered KV buffers get FAILED_PRECONDITION", "[unit]") {
  ExpectRefused(Desc(RingOp::kStore, 1), StatusCode::kFailedPrecondition,
                "Store: no KV buffers registered (RegisterKv)", Limits(0));
  DescriptorLimits gpu = Limits(0);
  gpu.kv_missing = "tp rank 1 of 2 has not registered its GPU KV buffers";
  ExpectRefused(Desc(RingOp::kLoad, 1), StatusCode::kFailedPrecondition,
                "Load: tp rank 1 of 2 has not registered its GPU KV buffers", gpu);
  // The descriptor's own errors come first.
  ExpectRefused(Desc(RingOp::kStore, 0), StatusCode::kInvalidArgument, "count 0", Limits(0));
}

TEST_CASE("descriptor validation: the first bad field is reported, in the documented order", "[unit]") {
  SubmitDescriptor d = Desc(RingOp::kStore, 0, 1);
  d.opcode = 9;
  d.event_set = 1;
  d.parent = BlockKey{5, 0};
  d.keys_offset = 3;
  ExpectRefused(d, StatusCode::kInvalidArgument, "event_set is 1");
  d.event_set = 0;
  ExpectRefused(d, StatusCode::kInvalidArgument, "opcode 9");
  d.opcode = static_cast<uint16_t>(RingOp::kMatch);
  ExpectRefused(d, StatusCode::kInvalidArgument, "parent is");
  d.opcode = static_cast<uint16_t>(RingOp::kStore);
  ExpectRefused(d, StatusCode::kInvalidArgument, "flags 0x1");
  d.flags = 0;
  ExpectRefused(d, StatusCode::kInvalidArgument, "count 0");
  d.count = 1;
  ExpectRefused(d, StatusCode::kOutOfRange, "keys at offset 3");
  d.keys_offset = kKeysAt;
  d.block_ids_offset = kBadIdAt + 4;  // id kRegistered
  ExpectRefused(d, StatusCode::kOutOfRange, "block id 8 at 0");
}

TEST_CASE("descriptor validation: match handles the session does not hold, or Loads past their blocks, are refused",
          "[unit]") {
  using flexkv::ValidateHandleUse;
  CHECK(ValidateHandleUse(Desc(RingOp::kLoad, 2), 2).ok());
  CHECK(ValidateHandleUse(Desc(RingOp::kLoad, 1), 2).ok());
  CHECK(ValidateHandleUse(Desc(RingOp::kRelease, 0), 2).ok());
  // Match and Store do not use a handle.
  CHECK(ValidateHandleUse(Desc(RingOp::kMatch, 3), std::nullopt).ok());
  CHECK(ValidateHandleUse(Desc(RingOp::kStore, 3), std::nullopt).ok());

  SubmitDescriptor unknown = Desc(RingOp::kLoad, 1);
  unknown.match_handle = 0xdeadbeef;
  const flexkv::Status not_held = ValidateHandleUse(unknown, std::nullopt);
  CHECK(not_held.code() == StatusCode::kNotFound);
  CHECK(not_held.message() == "match handle 3735928559 is not held by this session");
  SubmitDescriptor release = Desc(RingOp::kRelease, 0);
  release.match_handle = 0;
  CHECK(ValidateHandleUse(release, std::nullopt).code() == StatusCode::kNotFound);

  const flexkv::Status too_many = ValidateHandleUse(Desc(RingOp::kLoad, 3), 2);
  CHECK(too_many.code() == StatusCode::kOutOfRange);
  CHECK(too_many.message() == "count 3 exceeds the 2 blocks of match handle 1");
}

TEST_CASE("descriptor validation: the payload is a copy, later writes to the arena do not reach it", "[unit]") {
  // The client owns the arena and may rewrite it at any time: what was checked must be what is used.
  Arena arena;
  const auto r = flexkv::ValidateDescriptor(Desc(RingOp::kLoad, 2), arena.span(), Limits());
  REQUIRE(r.ok());
  const uint32_t huge = std::numeric_limits<uint32_t>::max();
  std::memcpy(arena.bytes + kIdsAt, &huge, 4);
  CHECK(r->block_ids == std::vector<uint32_t>{0, 1});
}

// Regression: the all-zero key is what the pool records as a root block's parent, so a chain holding
// it matched 3 blocks before a restart and 0 after. Before the fix, this Store was accepted.
TEST_CASE("descriptor validation: a Store of the all-zero key is refused with INVALID_ARGUMENT", "[unit][regression]") {
  Arena arena;
  std::memset(arena.bytes + kKeysAt + 16 * 2, 0, sizeof(BlockKey));  // key 2 of 4
  const auto store = flexkv::ValidateDescriptor(Desc(RingOp::kStore, 4), arena.span(), Limits());
  REQUIRE_FALSE(store.ok());
  INFO(store.status().ToString());
  CHECK(store.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(store.status().message(), Catch::Contains("key 2 of the Store is all zero"));
  // A Store before it is fine, and a Match of it is harmless (it finds nothing): both accepted.
  CHECK(flexkv::ValidateDescriptor(Desc(RingOp::kStore, 2), arena.span(), Limits()).ok());
  CHECK(flexkv::ValidateDescriptor(Desc(RingOp::kMatch, 4), arena.span(), Limits()).ok());
}

namespace {

// gpt-oss's shape at a window of 2 blocks, and a state component.
flexkv::Geometry HybridGeometry() {
  flexkv::Geometry g = flexkv::GptOss20B();
  g.components[0].window_tokens = 32;  // 2 blocks of 16 tokens
  flexkv::ComponentSpec state;
  state.kind = flexkv::ComponentKind::kState;
  state.num_layers = 2;
  state.state_bytes_per_layer = 64;
  g.components.push_back(state);
  return g;
}

DescriptorLimits HybridLimits(const flexkv::Geometry& g, std::vector<uint32_t> blocks = {8, 8, 8}) {
  DescriptorLimits l = Limits();
  l.geometry = &g;
  l.component_blocks = std::move(blocks);
  return l;
}

}  // namespace

TEST_CASE("descriptor validation: a hybrid Store carries every component's ids and its state boundaries",
          "[unit][hybrid]") {
  const flexkv::Geometry g = HybridGeometry();
  // Store of 4 keys with 2 boundaries: FULL 4 ids, window 2 ids, boundaries {2, 4}, state 2 ids = 10 values.
  Arena arena;
  const uint32_t ids[10] = {0, 1, 2, 3, 4, 5, 2, 4, 6, 7};
  std::memcpy(arena.bytes + 1024, ids, sizeof(ids));
  SubmitDescriptor d = Desc(RingOp::kStore, 4);
  d.block_ids_offset = 1024;
  d.state_count = 2;
  auto r = flexkv::ValidateDescriptor(d, arena.span(), HybridLimits(g));
  REQUIRE(r.ok());
  CHECK(r->block_ids.size() == 10);
  CHECK(r->boundaries == std::vector<uint32_t>{2, 4});

  SECTION("boundaries out of order or range") {
    const uint32_t bad[2][2] = {{4, 2}, {0, 3}};
    for (const auto& b : bad) {
      std::memcpy(arena.bytes + 1024 + 6 * 4, b, sizeof(b));
      auto refused = flexkv::ValidateDescriptor(d, arena.span(), HybridLimits(g));
      REQUIRE_FALSE(refused.ok());
      CHECK(refused.status().code() == StatusCode::kInvalidArgument);
      CHECK_THAT(refused.status().message(), Catch::Contains("state boundary"));
    }
  }
  SECTION("an id of a component above what it registered names the component") {
    auto refused = flexkv::ValidateDescriptor(d, arena.span(), HybridLimits(g, {8, 8, 7}));
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.status().code() == StatusCode::kOutOfRange);
    CHECK_THAT(refused.status().message(), Catch::Contains("component 2 (state)"));
  }
  SECTION("more boundaries than keys") {
    d.state_count = 5;
    ExpectRefused(d, StatusCode::kInvalidArgument, "state_count 5 is above count 4", HybridLimits(g));
  }
  SECTION("the id array must fit the arena") {
    d.block_ids_offset = kArenaBytes - 16;
    ExpectRefused(d, StatusCode::kOutOfRange, "block ids", HybridLimits(g));
  }
}

TEST_CASE("descriptor validation: state_count only on a hybrid Store, hybrid Loads layer-wise or with events",
          "[unit][hybrid]") {
  const flexkv::Geometry g = HybridGeometry();
  SubmitDescriptor store = Desc(RingOp::kStore, 4);
  store.state_count = 1;
  ExpectRefused(store, StatusCode::kInvalidArgument, "state_count is 1 on a Store");  // full-attention session
  SubmitDescriptor match = Desc(RingOp::kMatch, 4);
  match.state_count = 1;
  ExpectRefused(match, StatusCode::kInvalidArgument, "state_count is 1 on a Match", HybridLimits(g));
  // A hybrid Load of 4: FULL 4, window 2, state 1 = 7 ids, all below 8; the same layer-wise or naming an event set
  // (the word of a Store's window_keys), never both.
  const Arena arena;
  auto r = flexkv::ValidateDescriptor(Desc(RingOp::kLoad, 4), arena.span(), HybridLimits(g));
  REQUIRE(r.ok());
  CHECK(r->block_ids.size() == 7);
  auto layerwise = flexkv::ValidateDescriptor(Desc(RingOp::kLoad, 4, flexkv::kLoadFlagLayerwise), arena.span(),
                                              HybridLimits(g));
  REQUIRE(layerwise.ok());
  CHECK(layerwise->block_ids == r->block_ids);
  SubmitDescriptor with_events = Desc(RingOp::kLoad, 4);
  with_events.event_set = 2;
  CHECK(flexkv::ValidateDescriptor(with_events, arena.span(), HybridLimits(g)).ok());
  with_events.flags = flexkv::kLoadFlagLayerwise;
  ExpectRefused(with_events, StatusCode::kInvalidArgument, "has the layer-wise flag; expected one completion kind",
                HybridLimits(g));
}

TEST_CASE("descriptor validation: a Load names an event set alone, never with the layer-wise flag",
          "[unit]") {
  const Arena arena;
  SubmitDescriptor load = Desc(RingOp::kLoad, 2);
  load.event_set = 3;
  CHECK(flexkv::ValidateDescriptor(load, arena.span(), Limits()).ok());  // the set itself is looked up by the handler
  SubmitDescriptor both = Desc(RingOp::kLoad, 2, flexkv::kLoadFlagLayerwise);
  both.event_set = 3;
  ExpectRefused(both, StatusCode::kInvalidArgument, "has the layer-wise flag; expected one completion kind");
  SubmitDescriptor store = Desc(RingOp::kStore, 2);
  store.event_set = 1;
  ExpectRefused(store, StatusCode::kInvalidArgument, "event_set is 1 on opcode 3");
}

TEST_CASE("descriptor validation: a Load from first_block carries the ids of blocks first_block to count only", "[unit]") {
  const Arena arena;
  SubmitDescriptor load = Desc(RingOp::kLoad, 5);
  load.first_block = 3;
  auto r = flexkv::ValidateDescriptor(load, arena.span(), Limits());
  REQUIRE(r.ok());
  CHECK(r->block_ids == std::vector<uint32_t>{0, 1});  // the first two ids of the arena, for blocks 3 and 4
  load.first_block = 5;
  ExpectRefused(load, StatusCode::kInvalidArgument, "first_block 5 of a Load of 5 blocks; expected below 5");
  // Its ids must still fit the arena and be registered: [kBadIdAt] is {3, kRegistered}.
  load.first_block = 3;
  load.block_ids_offset = kBadIdAt;
  ExpectRefused(load, StatusCode::kOutOfRange, "block id 8 at 1");
  SubmitDescriptor release = Desc(RingOp::kRelease, 0);
  release.first_block = 1;
  ExpectRefused(release, StatusCode::kInvalidArgument, "state_count is 1 on a Release");
}

TEST_CASE("descriptor validation: a hybrid Load from first_block, and window_keys only on a hybrid Store",
          "[unit][hybrid]") {
  const flexkv::Geometry g = HybridGeometry();  // window of 2 blocks, one state
  Arena arena;
  // A Load of e = 4 from block 3: FULL 1 id, window 1 id (block 3), state 1 id.
  SubmitDescriptor load = Desc(RingOp::kLoad, 4);
  load.first_block = 3;
  auto r = flexkv::ValidateDescriptor(load, arena.span(), HybridLimits(g));
  REQUIRE(r.ok());
  CHECK(r->block_ids.size() == 3);
  load.first_block = 4;  // only the state moves
  r = flexkv::ValidateDescriptor(load, arena.span(), HybridLimits(g));
  REQUIRE(r.ok());
  CHECK(r->block_ids.size() == 1);
  load.first_block = 5;
  ExpectRefused(load, StatusCode::kInvalidArgument, "first_block 5 of a Load of 4 blocks; expected at most 4",
                HybridLimits(g));

  // A Store of 4 keys with window ids for all 4 and one boundary at 3: FULL 4, window 4, boundary, state 1.
  const uint32_t ids[10] = {0, 1, 2, 3, 4, 5, 6, 7, 3, 2};
  std::memcpy(arena.bytes + 1024, ids, sizeof(ids));
  SubmitDescriptor store = Desc(RingOp::kStore, 4);
  store.block_ids_offset = 1024;
  store.state_count = 1;
  store.window_keys = 4;
  r = flexkv::ValidateDescriptor(store, arena.span(), HybridLimits(g));
  REQUIRE(r.ok());
  CHECK(r->block_ids.size() == 10);
  CHECK(r->boundaries == std::vector<uint32_t>{3});
  store.window_keys = 1;
  ExpectRefused(store, StatusCode::kInvalidArgument, "window_keys 1 of a Store of 4 keys; expected 0 or 2..4",
                HybridLimits(g));
  store.window_keys = 5;
  ExpectRefused(store, StatusCode::kInvalidArgument, "expected 0 or 2..4", HybridLimits(g));
  // Not on a full-attention Store (the word is a Load's event_set there), nor without a window.
  SubmitDescriptor plain = Desc(RingOp::kStore, 4);
  plain.window_keys = 4;
  ExpectRefused(plain, StatusCode::kInvalidArgument, "event_set is 4 on opcode 3");
  const flexkv::Geometry no_window = flexkv::Qwen3Next80B();
  store.window_keys = 4;
  ExpectRefused(store, StatusCode::kInvalidArgument, "has no sliding window", HybridLimits(no_window, {8, 8}));
}
