// Malformed ring descriptors: a raw-protocol client writes descriptors straight into
// its submit ring (every field out of range, bad offsets, lengths, opcodes, a wrapped ring) and
// gets error completions; the daemon stays up and a well-behaved session next to it is unaffected.
#include <sys/mman.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/integration/ring_sessions.h"

using namespace flexkv::testing::ring;  // NOLINT(google-build-using-namespace): the shared ring test fixtures


TEST_CASE("malformed ring descriptors get error completions, the daemon and other sessions are unaffected",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  GoodSession good(d);
  const uint64_t errors_before = ErrorsCounter(good.client());
  good.Start();
  REQUIRE(good.AwaitRounds(1));

  RawSession raw(d.socket(), /*register_kv=*/true);
  const uint64_t arena = raw.arena_bytes();

  // A cached chain of two blocks and two pinned match handles on it.
  const std::vector<BlockKey> chain = KeysFor(1, 2);
  CHECK(raw.StoreOk(1, chain, kKeysAt).done_blocks == 2);
  const CompletionDescriptor h1 = raw.MatchOk(2, chain, kKeysAt, /*pin=*/true);
  const CompletionDescriptor h2 = raw.MatchOk(3, chain, kKeysAt, /*pin=*/true);
  REQUIRE(h1.matched_blocks == 2);
  REQUIRE(h2.matched_blocks == 2);
  REQUIRE(h1.match_handle != 0);
  REQUIRE(h2.match_handle != 0);
  REQUIRE(h1.match_handle != h2.match_handle);
  const std::vector<uint32_t> ids{0, 1, 2, 3, 4, 5, 6, 7};
  raw.PutArena(kIdsAt, ids.data(), ids.size() * sizeof(uint32_t));
  const uint32_t bad_ids[2] = {0, kKvBlocks};
  raw.PutArena(kBadIdsAt, bad_ids, sizeof(bad_ids));
  const uint32_t huge_id = std::numeric_limits<uint32_t>::max();
  raw.PutArena(kHugeIdAt, &huge_id, sizeof(huge_id));

  struct Case {
    const char* what;
    SubmitDescriptor d;
    StatusCode expect;
    const char* mentions;  // in the message; may be empty
  };
  std::vector<Case> cases;
  uint64_t next_id = 1000;
  auto add = [&](const char* what, RingOp op, uint32_t count, StatusCode expect, const char* mentions,
                 const std::function<void(SubmitDescriptor&)>& tweak) {
    SubmitDescriptor s = Desc(next_id++, Op(op), count);
    if (op != RingOp::kLoad) s.keys_offset = kKeysAt;  // a Load's word there is its launch deadline (layout 6)
    s.block_ids_offset = kIdsAt;
    if (tweak) tweak(s);
    cases.push_back({what, s, expect, mentions});
  };
  using SC = StatusCode;
  // Opcodes, flags, reserved fields, counts.
  add("opcode 0", RingOp::kMatch, 1, SC::kInvalidArgument, "opcode 0", [](auto& s) { s.opcode = 0; });
  add("opcode 6", RingOp::kMatch, 1, SC::kInvalidArgument, "opcode 6", [](auto& s) { s.opcode = 6; });
  add("opcode 99", RingOp::kMatch, 1, SC::kInvalidArgument, "opcode 99", [](auto& s) { s.opcode = 99; });
  add("opcode 0xffff", RingOp::kMatch, 1, SC::kInvalidArgument, "opcode 65535", [](auto& s) { s.opcode = 0xffff; });
  add("flags on Store", RingOp::kStore, 1, SC::kInvalidArgument, "flags", [](auto& s) { s.flags = 1; });
  add("flags 0x80 on Match", RingOp::kMatch, 1, SC::kInvalidArgument, "flags 0x80", [](auto& s) { s.flags = 0x80; });
  add("flag 0x4 on Load", RingOp::kLoad, 1, SC::kInvalidArgument, "flags 0x4", [&](auto& s) {
    s.flags = 0x4;
    s.match_handle = h1.match_handle;
  });
  add("flags on Release", RingOp::kRelease, 0, SC::kInvalidArgument, "flags", [&](auto& s) {
    s.flags = 0x8000;
    s.match_handle = h1.match_handle;
  });
  add("event_set on Match", RingOp::kMatch, 1, SC::kInvalidArgument, "event_set", [](auto& s) { s.event_set = 1; });
  add("event_set on Release", RingOp::kRelease, 0, SC::kInvalidArgument, "event_set", [&](auto& s) {
    s.event_set = ~0U;
    s.match_handle = h1.match_handle;
  });
  add("parent on Match", RingOp::kMatch, 1, SC::kInvalidArgument, "parent", [](auto& s) { s.parent.hi = 42; });
  add("parent on Release", RingOp::kRelease, 0, SC::kInvalidArgument, "parent", [&](auto& s) {
    s.parent.lo = 1;
    s.match_handle = h1.match_handle;
  });
  add("Match count 0", RingOp::kMatch, 0, SC::kInvalidArgument, "count 0", nullptr);
  add("Store count 0", RingOp::kStore, 0, SC::kInvalidArgument, "count 0", nullptr);
  add("Load launch_deadline_ns above INT64_MAX", RingOp::kLoad, 1, SC::kInvalidArgument, "launch_deadline_ns", [&](auto& s) {
    s.match_handle = h1.match_handle;
    s.launch_deadline_ns = std::numeric_limits<uint64_t>::max();
  });
  add("Load count 0", RingOp::kLoad, 0, SC::kInvalidArgument, "count 0", [&](auto& s) { s.match_handle = h1.match_handle; });
  add("Match count 2^31", RingOp::kMatch, 1u << 31, SC::kInvalidArgument, "count 2147483648", nullptr);
  add("Store count UINT32_MAX", RingOp::kStore, std::numeric_limits<uint32_t>::max(), SC::kInvalidArgument, "count",
      nullptr);
  // Arena offsets and lengths.
  add("keys_offset past the arena end", RingOp::kMatch, 1, SC::kOutOfRange, "keys", [&](auto& s) {
    s.keys_offset = arena + 16;
  });
  add("keys_offset at the arena end", RingOp::kMatch, 1, SC::kOutOfRange, "keys", [&](auto& s) {
    s.keys_offset = arena;
  });
  add("keys straddling the arena end", RingOp::kMatch, 1, SC::kOutOfRange, "keys", [&](auto& s) {
    s.keys_offset = arena - 8;
  });
  add("keys_offset + count*16 overflowing", RingOp::kMatch, 2, SC::kOutOfRange, "keys", [](auto& s) {
    s.keys_offset = std::numeric_limits<uint64_t>::max() - 15;
  });
  add("keys_offset UINT64_MAX - 7 on Store", RingOp::kStore, 1, SC::kOutOfRange, "keys", [](auto& s) {
    s.keys_offset = std::numeric_limits<uint64_t>::max() - 7;
  });
  if (arena < (16u << 20)) {
    add("keys longer than the arena", RingOp::kMatch, 1u << 20, SC::kOutOfRange, "keys", nullptr);
  }
  add("misaligned keys_offset 3", RingOp::kMatch, 1, SC::kOutOfRange, "unaligned", [](auto& s) { s.keys_offset = 3; });
  add("misaligned keys_offset 4 on Store", RingOp::kStore, 1, SC::kOutOfRange, "keys", [](auto& s) {
    s.keys_offset = 4;
  });
  add("block_ids_offset past the arena on Store", RingOp::kStore, 1, SC::kOutOfRange, "block ids", [&](auto& s) {
    s.block_ids_offset = arena;
  });
  add("block_ids_offset overflowing on Store", RingOp::kStore, 4, SC::kOutOfRange, "block ids", [](auto& s) {
    s.block_ids_offset = std::numeric_limits<uint64_t>::max() - 3;
  });
  add("misaligned block_ids_offset on Store", RingOp::kStore, 1, SC::kOutOfRange, "block ids", [](auto& s) {
    s.block_ids_offset = kIdsAt + 2;
  });
  add("block ids straddling the arena end on Load", RingOp::kLoad, 2, SC::kOutOfRange, "block ids", [&](auto& s) {
    s.block_ids_offset = arena - 4;
    s.match_handle = h1.match_handle;
  });
  // Block ids and match handles.
  add("Store block id == num_blocks", RingOp::kStore, 2, SC::kOutOfRange, "block id 8", [&](auto& s) {
    s.block_ids_offset = kBadIdsAt;
  });
  add("Store block id UINT32_MAX", RingOp::kStore, 1, SC::kOutOfRange, "block id 4294967295", [&](auto& s) {
    s.block_ids_offset = kHugeIdAt;
  });
  add("Load block id == num_blocks", RingOp::kLoad, 2, SC::kOutOfRange, "block id 8", [&](auto& s) {
    s.block_ids_offset = kBadIdsAt;
    s.match_handle = h1.match_handle;
  });
  add("Load block id UINT32_MAX", RingOp::kLoad, 1, SC::kOutOfRange, "block id 4294967295", [&](auto& s) {
    s.block_ids_offset = kHugeIdAt;
    s.match_handle = h1.match_handle;
  });
  add("Load count larger than the handle's blocks", RingOp::kLoad, 3, SC::kOutOfRange, "exceeds", [&](auto& s) {
    s.match_handle = h1.match_handle;
  });
  add("Load with handle 0", RingOp::kLoad, 1, SC::kNotFound, "match handle 0", nullptr);
  add("Load with an unknown handle", RingOp::kLoad, 1, SC::kNotFound, "match handle", [](auto& s) {
    s.match_handle = 0xdeadbeefcafeULL;
  });
  add("Release of handle 0", RingOp::kRelease, 0, SC::kNotFound, "match handle 0", nullptr);
  add("Release of an unknown handle", RingOp::kRelease, 0, SC::kNotFound, "match handle", [](auto& s) {
    s.match_handle = std::numeric_limits<uint64_t>::max();
  });
  add("Release of h2", RingOp::kRelease, 0, SC::kOk, "", [&](auto& s) { s.match_handle = h2.match_handle; });
  add("Release of h2 again", RingOp::kRelease, 0, SC::kNotFound, "match handle", [&](auto& s) {
    s.match_handle = h2.match_handle;
  });
  add("Load from the released h2", RingOp::kLoad, 1, SC::kNotFound, "match handle", [&](auto& s) {
    s.match_handle = h2.match_handle;
  });
  REQUIRE(cases.size() < raw.submit_entries());

  std::vector<SubmitDescriptor> batch;
  for (const Case& c : cases) batch.push_back(c.d);
  raw.Submit(batch);  // all at once, one doorbell
  auto got = raw.CollectByUserData(cases.size());
  size_t failures = 0;
  for (const Case& c : cases) {
    INFO("case: " << c.what);
    auto it = got.find(c.d.user_data);
    REQUIRE(it != got.end());
    const CompletionDescriptor& r = it->second;
    INFO("status " << r.status_code << ", message: " << MessageOf(r));
    CHECK(r.status_code == Code(c.expect));
    CHECK(r.opcode == c.d.opcode);
    CHECK(MessageTerminated(r));
    if (c.expect != SC::kOk) {
      ++failures;
      CHECK_FALSE(MessageOf(r).empty());
      CHECK_THAT(MessageOf(r), Catch::Contains(c.mentions));
      CHECK(r.matched_blocks == 0);
      CHECK(r.done_blocks == 0);
      CHECK(r.match_handle == 0);
    }
  }
  raw.ExpectNoMoreCompletions();
  CHECK(raw.hdr().submit_head.value.load() == raw.tail());

  // The abused session still works: h1 survived the abuse, loads its two blocks and releases.
  std::memset(raw.kv_block(4), 0, BlockBytes() * 2);
  SubmitDescriptor load = Desc(5000, Op(RingOp::kLoad), 2);
  load.block_ids_offset = kIdsAt + 4 * sizeof(uint32_t);  // ids {4, 5}
  load.match_handle = h1.match_handle;
  CompletionDescriptor loaded = raw.SubmitOne(load);
  INFO(MessageOf(loaded));
  CHECK(loaded.status_code == 0);
  CHECK(loaded.done_blocks == 2);
  CHECK(std::memcmp(raw.kv_block(0), raw.kv_block(4), BlockBytes() * 2) == 0);
  SubmitDescriptor release = Desc(5001, Op(RingOp::kRelease), 0);
  release.match_handle = h1.match_handle;
  CHECK(raw.SubmitOne(release).status_code == 0);
  CHECK(raw.SubmitOne(release).status_code == Code(SC::kNotFound));
  ++failures;
  auto sessions = good.client().ListSessions();
  REQUIRE(sessions.ok());
  for (const auto& s : *sessions) {
    INFO("session " << s.session_id << " " << s.client_name);
    if (s.session_id == raw.session_id()) {
      CHECK(s.pinned_blocks == 0);
      CHECK(s.inflight_requests == 0);
    }
  }

  ExpectHealthyAfterAbuse(d, good, errors_before, failures);
}

TEST_CASE("a wrapped submit ring gets one INVALID_ARGUMENT completion naming the tail, the session keeps working",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  GoodSession good(d);
  const uint64_t errors_before = ErrorsCounter(good.client());
  good.Start();
  REQUIRE(good.AwaitRounds(1));
  RawSession raw(d.socket(), /*register_kv=*/true);
  const uint32_t entries = raw.submit_entries();

  // Some valid traffic first so that head and tail are not at zero.
  CHECK(raw.MatchOk(1, KeysFor(2, 1), kKeysAt, false).matched_blocks == 0);

  struct Wrap {
    const char* what;
    uint32_t delta;  // tail - head
  };
  const Wrap wraps[] = {
      {"tail = head + entries + 5", entries + 5},
      {"tail = head + entries + 1", entries + 1},
      {"tail one behind head", std::numeric_limits<uint32_t>::max()},
      {"tail half the index space away", 1u << 31},
  };
  int32_t seed = 100;
  for (const Wrap& w : wraps) {
    INFO(w.what);
    // Fill the ring with valid-looking descriptors: none of them may run.
    std::vector<SubmitDescriptor> junk(entries, Desc(777, Op(RingOp::kMatch), 1));
    std::memcpy(raw.submit_ring(), junk.data(), raw.submit_ring_bytes());
    const uint32_t head = raw.hdr().submit_head.value.load();
    REQUIRE(head == raw.tail());
    raw.SetTail(head + w.delta);
    auto got = raw.Collect(1);
    REQUIRE(got.size() == 1);
    INFO(MessageOf(got[0]));
    CHECK(got[0].status_code == Code(StatusCode::kInvalidArgument));
    CHECK(got[0].user_data == 0);
    CHECK(MessageTerminated(got[0]));
    CHECK_THAT(MessageOf(got[0]), Catch::Contains("submit_tail " + std::to_string(head + w.delta)));
    raw.ExpectNoMoreCompletions();
    // The daemon resynchronised its head to the bogus tail; the session goes on from there.
    CHECK(raw.hdr().submit_head.value.load() == head + w.delta);

    const std::vector<BlockKey> chain = KeysFor(seed++, 2);
    const CompletionDescriptor stored = raw.StoreOk(10, chain, kKeysAt);
    CHECK(stored.done_blocks == 2);
    CHECK(raw.MatchOk(11, chain, kKeysAt, false).matched_blocks == 2);
  }

  // The boundary: exactly `entries` descriptors in flight is a full ring, not a wrapped one.
  {
    const std::vector<BlockKey> chain = KeysFor(seed - 1, 2);
    raw.PutArena(kKeysAt, chain.data(), chain.size() * sizeof(BlockKey));
    std::vector<SubmitDescriptor> full;
    for (uint32_t i = 0; i < entries; ++i) {
      SubmitDescriptor m = Desc(100000 + i, Op(RingOp::kMatch), 2);
      m.keys_offset = kKeysAt;
      full.push_back(m);
    }
    raw.Submit(full);
    auto got = raw.CollectByUserData(entries);
    size_t ok = 0;
    for (const auto& [id, c] : got) ok += c.status_code == 0 && c.matched_blocks == 2 ? 1 : 0;
    CHECK(ok == entries);
    raw.ExpectNoMoreCompletions();
  }

  ExpectHealthyAfterAbuse(d, good, errors_before, std::size(wraps));
}
