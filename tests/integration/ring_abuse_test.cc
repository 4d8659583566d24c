// Abuse of the rings beyond single bad descriptors: garbage over the submit ring and arena, requests before
// RegisterKv, and a client that wraps its tails and never reaps. The daemon answers or ignores, stays up, and a
// well-behaved session beside it is unaffected (fixtures: ring_sessions.h).
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

TEST_CASE("garbage over the submit ring and arena: the daemon survives and other sessions are unaffected",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  GoodSession good(d);
  const uint64_t errors_before = ErrorsCounter(good.client());
  good.Start();
  REQUIRE(good.AwaitRounds(1));
  RawSession raw(d.socket(), /*register_kv=*/true);
  const uint32_t entries = raw.submit_entries();
  const uint64_t arena = raw.arena_bytes();

  // A cached chain the structured garbage can hit, so Match with pin hands out real handles that
  // garbage Loads and Releases then use.
  const std::vector<BlockKey> chain = KeysFor(3, 4);
  raw.StoreOk(1, chain, kKeysAt);
  constexpr uint64_t kSmallIdsAt = 1u << 20;  // u32 ids mostly below kKvBlocks
  constexpr uint64_t kChainAt = 2u << 20;     // the cached chain's keys

  std::mt19937_64 rng(0x5eed1e55);
  std::mt19937_64 scribble_rng(0xbadc0ffee);  // consumed a timing-dependent number of times
  auto fill_random = [](std::mt19937_64& r, uint8_t* p, uint64_t bytes) {
    for (uint64_t i = 0; i + 8 <= bytes; i += 8) {
      const uint64_t v = r();
      std::memcpy(p + i, &v, 8);
    }
  };
  auto pick = [&](std::initializer_list<uint64_t> choices) {
    return *(choices.begin() + static_cast<std::ptrdiff_t>(rng() % choices.size()));
  };
  // Store blocks the garbage may commit, bounded so the pool (512 blocks) never evicts anything.
  uint32_t store_budget = 320;

  uint64_t expected_errors = 0;
  uint64_t ok_completions = 0;
  uint64_t total_completions = 0;
  for (int round = 0; round < 32; ++round) {
    const int mode = round % 4;  // 0: random tail; 1: random in-range tail, scribbling on; 2, 3: structured
    INFO("round " << round << " mode " << mode);
    fill_random(rng, raw.submit_ring(), raw.submit_ring_bytes());
    fill_random(rng, raw.arena(), arena);
    std::map<uint64_t, SubmitDescriptor> sent;  // structured rounds: user_data → descriptor
    const uint32_t head = raw.hdr().submit_head.value.load();
    REQUIRE(head == raw.tail());
    uint32_t tail = 0;
    if (mode == 0) {
      tail = static_cast<uint32_t>(rng());
    } else if (mode == 1) {
      tail = head + static_cast<uint32_t>(rng() % (entries + 1));
    } else {
      // Plausible descriptors: reserved fields zero, every other field from a menu of edge values.
      for (uint64_t i = 0; i < 8192; ++i) {
        const uint32_t id = static_cast<uint32_t>(rng() % (kKvBlocks + 1));
        std::memcpy(raw.arena() + kSmallIdsAt + 4 * i, &id, 4);
      }
      raw.PutArena(kChainAt, chain.data(), chain.size() * sizeof(BlockKey));
      const uint32_t n = 1 + static_cast<uint32_t>(rng() % 64);
      auto* ring = reinterpret_cast<SubmitDescriptor*>(raw.submit_ring());
      for (uint32_t i = 0; i < n; ++i) {
        SubmitDescriptor s{};
        s.user_data = (uint64_t{static_cast<uint32_t>(round)} << 32) | i;
        s.opcode = static_cast<uint16_t>(pick({0, 1, 1, 1, 2, 2, 2, 3, 3, 4, 4, 5, 6, 0xffff}));
        s.flags = static_cast<uint16_t>(pick({0, 0, 0, 0, 0, 0, 1, 1, 2, 0x8000}));
        s.count = static_cast<uint32_t>(pick({0, 1, 1, 2, 2, 3, 4, 5, 8, 16, 1u << 20, (1u << 20) + 1, rng()}));
        s.keys_offset = pick({kChainAt, kChainAt, kChainAt, kChainAt + 16, 8 * (rng() % (arena / 8)), arena - 16, arena - 8,
                              arena, 3, rng(), std::numeric_limits<uint64_t>::max() - 7});
        s.block_ids_offset = pick({kSmallIdsAt, kSmallIdsAt, kSmallIdsAt + 4 * (rng() % 4096), kSmallIdsAt + 4 * (rng() % 4096), 4 * (rng() % (arena / 4)),
                                   arena - 4, arena, 2, rng(), std::numeric_limits<uint64_t>::max() - 3});
        s.match_handle = pick({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, rng()});
        // Bit 0 of a Load's flags may ask for per-layer progress completions (a layout where it is
        // defined); those would break the one-completion-per-descriptor count, so leave it clear.
        if (s.opcode == Op(RingOp::kLoad)) s.flags = static_cast<uint16_t>(s.flags & ~1u);
        if (rng() % 20 == 0) s.event_set = static_cast<uint32_t>(rng() | 1);
        if (rng() % 20 == 0) (rng() % 2 == 0 ? s.parent.lo : s.parent.hi) = rng() | 1;
        if (s.opcode == Op(RingOp::kStore)) {
          // A Store that may pass validation takes up to `count` pool slots: charge it to the budget, and
          // turn it into a count-0 one once the budget is spent.
          auto in_arena = [&](uint64_t offset, uint64_t bytes, uint64_t align) {
            return offset % align == 0 && offset <= arena && bytes <= arena - offset;
          };
          const bool may_pass = s.flags == 0 && s.event_set == 0 &&
                                in_arena(s.keys_offset, uint64_t{s.count} * 16, 8) &&
                                in_arena(s.block_ids_offset, uint64_t{s.count} * 4, 4);
          if (may_pass) {
            if (s.count > 16 || s.count > store_budget) {
              s.count = 0;
            } else {
              store_budget -= s.count;
            }
          }
        }
        ring[(head + i) & (entries - 1)] = s;
        sent[s.user_data] = s;
      }
      tail = head + n;
    }
    const uint32_t delta = tail - head;
    const size_t expect = delta > entries ? 1 : delta;
    raw.SetTail(tail);
    std::function<void()> scribble;
    if (mode == 1) {
      // Keep rewriting the descriptors and the arena under the daemon while it works: it must copy
      // each descriptor once and then trust only the copy.
      scribble = [&] {
        fill_random(scribble_rng, raw.submit_ring(), raw.submit_ring_bytes());
        fill_random(scribble_rng, raw.arena(), 64 << 10);
      };
    }
    auto got = raw.Collect(expect, kDeadline, scribble);
    REQUIRE(got.size() == expect);
    raw.ExpectNoMoreCompletions(20ms);
    CHECK(raw.hdr().submit_head.value.load() == tail);
    total_completions += got.size();
    for (const CompletionDescriptor& c : got) {
      INFO("user_data " << c.user_data << " opcode " << c.opcode << " status " << c.status_code << " "
                        << MessageOf(c));
      CHECK(c.status_code >= 0);
      CHECK(c.status_code <= Code(StatusCode::kUnauthenticated));
      CHECK(MessageTerminated(c));
      if (c.status_code != 0) {
        ++expected_errors;
        CHECK_FALSE(MessageOf(c).empty());
      } else {
        ++ok_completions;
        CHECK(c.opcode >= 1);
        CHECK(c.opcode <= 5);
      }
      if (mode <= 1) {
        // Random bytes never leave the reserved word zero; a wrapped tail is refused outright.
        CHECK(c.status_code != 0);
        continue;
      }
      auto it = sent.find(c.user_data);
      REQUIRE(it != sent.end());
      const SubmitDescriptor& s = it->second;
      CHECK(c.opcode == s.opcode);
      const bool misplaced_parent = s.opcode != Op(RingOp::kStore) && s.parent != flexkv::BlockKey{};
      const bool misplaced_event_set = s.opcode != Op(RingOp::kLoad) && s.event_set != 0;
      if (misplaced_event_set || misplaced_parent || s.opcode < 1 || s.opcode > 5) {
        CHECK(c.status_code == Code(StatusCode::kInvalidArgument));
      }
      if (c.status_code != 0) continue;
      switch (static_cast<RingOp>(s.opcode)) {
        case RingOp::kMatch:
          CHECK(c.matched_blocks <= s.count);
          if ((s.flags & flexkv::kMatchFlagPin) == 0 || c.matched_blocks == 0) CHECK(c.match_handle == 0);
          if ((s.flags & flexkv::kMatchFlagPin) != 0 && c.matched_blocks > 0) CHECK(c.match_handle != 0);
          break;
        case RingOp::kStore:
          CHECK(uint64_t{c.matched_blocks} + c.done_blocks <= s.count);
          break;
        case RingOp::kLoad:
          CHECK(c.done_blocks == s.count);
          break;
        case RingOp::kRelease:
          break;
        case RingOp::kPrefetch:  // no cluster tier here: the local hits only
          CHECK(c.matched_blocks <= s.count);
          CHECK(c.done_blocks == 0);
          CHECK(c.bytes == 0);
          break;
      }
    }
  }
  INFO(total_completions << " completions, " << ok_completions << " OK");
  CHECK(ok_completions > 0);  // the structured garbage reached past validation sometimes

  // The abused session recovers with clean descriptors, and holds nothing in flight.
  std::memset(raw.arena(), 0, arena);
  const std::vector<BlockKey> after = KeysFor(4, 2);
  CHECK(raw.StoreOk(9000, after, kKeysAt).done_blocks == 2);
  CHECK(raw.MatchOk(9001, after, kKeysAt, false).matched_blocks == 2);
  auto sessions = good.client().ListSessions();
  REQUIRE(sessions.ok());
  CHECK(sessions->size() == 2);
  for (const auto& s : *sessions) {
    if (s.session_id == raw.session_id()) CHECK(s.inflight_requests == 0);
  }
  auto st = good.client().GetStatus();
  REQUIRE(st.ok());
  CHECK(st->counters.at("evicted_blocks") == 0);

  ExpectHealthyAfterAbuse(d, good, errors_before, expected_errors);
}

TEST_CASE("Store and Load before RegisterKv get FAILED_PRECONDITION, the poller keeps serving others",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  GoodSession good(d);
  const uint64_t errors_before = ErrorsCounter(good.client());
  good.Start();
  REQUIRE(good.AwaitRounds(1));
  RawSession with_kv(d.socket(), /*register_kv=*/true);
  RawSession no_kv(d.socket(), /*register_kv=*/false);
  const std::vector<BlockKey> chain = KeysFor(1, 2);
  CHECK(with_kv.StoreOk(1, chain, kKeysAt).done_blocks == 2);
  const std::vector<uint32_t> ids{0, 1};

  // Each on its own, so that one that never completes is named.
  no_kv.PutArena(kKeysAt, chain.data(), chain.size() * sizeof(BlockKey));
  no_kv.PutArena(kIdsAt, ids.data(), ids.size() * sizeof(uint32_t));
  SubmitDescriptor store = Desc(1, Op(RingOp::kStore), 2);
  store.keys_offset = kKeysAt;
  store.block_ids_offset = kIdsAt;
  const CompletionDescriptor stored = no_kv.SubmitOne(store);
  INFO(MessageOf(stored));
  CHECK(stored.status_code == Code(StatusCode::kFailedPrecondition));
  CHECK_THAT(MessageOf(stored), Catch::Contains("RegisterKv"));

  SubmitDescriptor load = Desc(2, Op(RingOp::kLoad), 1);
  load.block_ids_offset = kIdsAt;
  load.match_handle = 1;
  const CompletionDescriptor loaded = no_kv.SubmitOne(load);
  INFO(MessageOf(loaded));
  CHECK(loaded.status_code == Code(StatusCode::kFailedPrecondition));
  CHECK_THAT(MessageOf(loaded), Catch::Contains("RegisterKv"));

  // Match needs no KV buffers; the cache is shared within the namespace.
  CHECK(no_kv.MatchOk(3, chain, kKeysAt, false).matched_blocks == 2);
  CHECK(with_kv.MatchOk(4, chain, kKeysAt, false).matched_blocks == 2);

  ExpectHealthyAfterAbuse(d, good, errors_before, 2);
}

// Regression: PollSession used to post one error completion per wrapped tail without the back-pressure
// check, so a client that kept publishing wrapped tails and never reaped grew the daemon's overflow queue
// (and the session's inflight count) without bound.
TEST_CASE("wrapped tails from a client that never reaps do not grow the daemon backlog without bound",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  GoodSession good(d);
  const uint64_t errors_before = ErrorsCounter(good.client());
  good.Start();
  REQUIRE(good.AwaitRounds(1));
  RawSession raw(d.socket(), /*register_kv=*/true);
  const uint32_t completion_entries = raw.hdr().completion_entries;

  // Four times what the completion ring holds is enough to show the backlog stays bounded; the deadline is
  // generous because each wrapped tail is a round trip with the poller (2-core CI under load: ~3k per second).
  const int target = static_cast<int>(4 * completion_entries);
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  int published = 0;
  for (; published < target && std::chrono::steady_clock::now() < deadline; ++published) {
    const uint32_t head = raw.hdr().submit_head.value.load();
    const uint32_t tail = head + (1u << 31);
    raw.hdr().submit_tail.value.store(tail, std::memory_order_seq_cst);
    if (raw.hdr().daemon_parked.value.load(std::memory_order_seq_cst) != 0) raw.RingDoorbell();
    while (raw.hdr().submit_head.value.load() != tail && std::chrono::steady_clock::now() < deadline) {
    }
  }
  CHECK(published == target);
  auto sessions = good.client().ListSessions();
  REQUIRE(sessions.ok());
  bool seen = false;
  for (const auto& s : *sessions) {
    if (s.session_id != raw.session_id()) continue;
    seen = true;
    INFO("the abusive session has " << s.inflight_requests << " requests in flight after " << published
                                    << " wrapped tails");
    CHECK(s.inflight_requests <= completion_entries);
  }
  CHECK(seen);
  ExpectHealthyAfterAbuse(d, good, errors_before, 1);
}

// Regression: a store from KV pages the client never populated (or punched out after registering) made the
// daemon fault them in, charging the client's memory to the daemon (1 GiB sparse buffer -> 1 GiB of daemon RSS).
TEST_CASE("KV pages a client punched out are refused, never faulted in by the daemon", "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  RawSession s(d.socket(), /*register_kv=*/true);
  const std::vector<BlockKey> chain = KeysFor(31, 2);
  REQUIRE(madvise(s.kv_block(0), 2 * BlockBytes(), MADV_REMOVE) == 0);

  std::vector<uint32_t> ids{0, 1};
  s.PutArena(kKeysAt, chain.data(), chain.size() * sizeof(BlockKey));
  s.PutArena(kIdsAt, ids.data(), ids.size() * sizeof(uint32_t));
  SubmitDescriptor store = Desc(1, Op(RingOp::kStore), 2);
  store.keys_offset = kKeysAt;
  store.block_ids_offset = kIdsAt;
  const CompletionDescriptor refused = s.SubmitOne(store);
  INFO(MessageOf(refused));
  CHECK(refused.status_code == Code(StatusCode::kFailedPrecondition));
  CHECK_THAT(MessageOf(refused), Catch::Contains("allocated"));
  CHECK(s.MatchOk(2, chain, kKeysAt, false).matched_blocks == 0);  // nothing of it was published

  // Written again (the client pays for the pages), the same store goes through.
  std::memset(s.kv_block(0), 0x5A, 2 * BlockBytes());
  CHECK(s.StoreOk(3, chain, kKeysAt).done_blocks == 2);
}
