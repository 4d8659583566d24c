// The client's SessionRings (client/session_rings.h) over a ring the test consumes itself, no daemon: what a
// request's descriptor carries, and what Wait makes of its completion (a Prefetch's bytes and source).
#include <sys/socket.h>

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "client/session_rings.h"
#include "common/ring/ring_consumer.h"
#include "common/ring_layout.h"

using namespace std::chrono_literals;
using flexkv::BlockKey;
using flexkv::CompletionDescriptor;
using flexkv::RingOp;
using flexkv::SubmitDescriptor;
using flexkv::UniqueFd;
using flexkv::ring::RingConsumer;

namespace {

// The daemon's end of one session's rings, and the client's SessionRings mapping them.
struct Rings {
  std::unique_ptr<RingConsumer> consumer;
  std::unique_ptr<flexkv::SessionRings> client;
  UniqueFd daemon_channel;  // held open: a closed channel reads as the daemon gone

  Rings() {
    auto created = RingConsumer::Create(flexkv::RingGeometry{64, 64, 1 << 20});
    REQUIRE(created.ok());
    consumer = std::move(created->consumer);
    int sv[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    daemon_channel.reset(sv[0]);
    auto mapped = flexkv::SessionRings::Map(std::move(created->memfd), std::move(created->doorbell), UniqueFd(sv[1]));
    REQUIRE(mapped.ok());
    client = std::move(*mapped);
  }

  SubmitDescriptor Take() {
    RingConsumer::Taken t = consumer->Take();
    REQUIRE(t.kind == RingConsumer::Taken::kDescriptor);
    return t.descriptor;
  }

  // Posts `c` as the answer to `d` and returns what Wait makes of it.
  flexkv::OpResult Answer(const SubmitDescriptor& d, flexkv::Ticket ticket, CompletionDescriptor c) {
    c.user_data = d.user_data;
    c.opcode = d.opcode;
    consumer->Post(c);
    auto r = client->Wait(ticket, 5s);
    REQUIRE(r.ok());
    return *r;
  }
};

std::vector<BlockKey> SomeKeys(size_t n) {
  std::vector<BlockKey> keys(n);
  for (size_t i = 0; i < n; ++i) keys[i] = BlockKey{0x1000 + i, 0x2000 + i};
  return keys;
}

CompletionDescriptor Completion(int32_t status, uint32_t matched, uint32_t done, uint64_t bytes, const char* message) {
  CompletionDescriptor c{};
  c.status_code = status;
  c.matched_blocks = matched;
  c.done_blocks = done;
  c.bytes = bytes;
  std::snprintf(c.message, sizeof(c.message), "%s", message);
  return c;
}

}  // namespace

TEST_CASE("session rings: a Prefetch descriptor carries opcode 5 and its keys, no flags, handle, parent or ids",
          "[unit]") {
  Rings rings;
  const std::vector<BlockKey> keys = SomeKeys(12);
  auto t = rings.client->Submit(RingOp::kPrefetch, 0, static_cast<uint32_t>(keys.size()), keys, {}, 0,
                                flexkv::kRootParent);
  REQUIRE(t.ok());
  const SubmitDescriptor d = rings.Take();
  CHECK(d.opcode == 5);
  CHECK(d.opcode == static_cast<uint16_t>(RingOp::kPrefetch));
  CHECK(d.flags == 0);
  CHECK(d.count == 12);
  CHECK(d.match_handle == 0);
  CHECK(d.parent == BlockKey{});
  CHECK(d.state_count == 0);
  CHECK(d.event_set == 0);
  const std::span<const uint8_t> arena = rings.consumer->arena();
  REQUIRE(d.keys_offset + keys.size() * sizeof(BlockKey) <= arena.size());
  CHECK(std::memcmp(arena.data() + d.keys_offset, keys.data(), keys.size() * sizeof(BlockKey)) == 0);
  CHECK(d.block_ids_offset == d.keys_offset + keys.size() * sizeof(BlockKey));  // no ids follow the keys
  rings.Answer(d, *t, Completion(0, 0, 0, 0, ""));
}

TEST_CASE("session rings: a Prefetch's result has the completion's bytes and its message as the source", "[unit]") {
  Rings rings;
  const std::vector<BlockKey> keys = SomeKeys(12);
  auto t = rings.client->Submit(RingOp::kPrefetch, 0, 12, keys, {}, 0, flexkv::kRootParent);
  REQUIRE(t.ok());
  flexkv::OpResult pulled = rings.Answer(rings.Take(), *t, Completion(0, 8, 4, 4 * 131072, "node-b"));
  CHECK(pulled.status.ok());
  CHECK(pulled.matched_blocks == 8);
  CHECK(pulled.done_blocks == 4);
  CHECK(pulled.bytes == 4 * 131072);
  CHECK(pulled.source == "node-b");
  CHECK(pulled.match_handle == 0);

  auto none = rings.client->Submit(RingOp::kPrefetch, 0, 12, keys, {}, 0, flexkv::kRootParent);
  REQUIRE(none.ok());
  flexkv::OpResult why = rings.Answer(rings.Take(), *none, Completion(0, 8, 0, 0, "peer node-a: deadline exceeded"));
  CHECK(why.status.ok());
  CHECK(why.done_blocks == 0);
  CHECK(why.bytes == 0);
  CHECK(why.source == "peer node-a: deadline exceeded");

  // A message that fills the field: the source stops at the field's end.
  auto longest = rings.client->Submit(RingOp::kPrefetch, 0, 12, keys, {}, 0, flexkv::kRootParent);
  REQUIRE(longest.ok());
  const std::string full(sizeof(CompletionDescriptor{}.message) - 1, 'n');
  flexkv::OpResult l = rings.Answer(rings.Take(), *longest, Completion(0, 0, 0, 0, full.c_str()));
  CHECK(l.source == full);
}

TEST_CASE("session rings: the message is a source only for a Prefetch that ended OK", "[unit]") {
  Rings rings;
  const std::vector<BlockKey> keys = SomeKeys(4);
  auto failed = rings.client->Submit(RingOp::kPrefetch, 0, 4, keys, {}, 0, flexkv::kRootParent);
  REQUIRE(failed.ok());
  flexkv::OpResult f = rings.Answer(
      rings.Take(), *failed,
      Completion(static_cast<int32_t>(flexkv::StatusCode::kResourceExhausted), 0, 0, 0, "too many prefetches"));
  CHECK(f.status.code() == flexkv::StatusCode::kResourceExhausted);
  CHECK(f.status.message() == "too many prefetches");
  CHECK(f.source.empty());

  auto match = rings.client->Submit(RingOp::kMatch, 0, 4, keys, {}, 0, flexkv::kRootParent);
  REQUIRE(match.ok());
  flexkv::OpResult m = rings.Answer(rings.Take(), *match, Completion(0, 4, 0, 0, "not a source"));
  CHECK(m.status.ok());
  CHECK(m.matched_blocks == 4);
  CHECK(m.source.empty());
  CHECK(m.bytes == 0);
}

TEST_CASE("session rings: a Load naming an event set carries it, WaitLaunched answers on launch, before the end",
          "[unit]") {
  Rings rings;
  const std::vector<uint32_t> ids = {4, 5, 6};
  auto t = rings.client->Submit(RingOp::kLoad, 0, 3, {}, ids, 77, flexkv::kRootParent, 0, /*event_set=*/12);
  REQUIRE(t.ok());
  const SubmitDescriptor d = rings.Take();
  CHECK(d.opcode == static_cast<uint16_t>(RingOp::kLoad));
  CHECK(d.event_set == 12);
  CHECK(d.flags == 0);
  CHECK(rings.client->WaitLaunched(*t, 1ms).code() == flexkv::StatusCode::kDeadlineExceeded);  // in flight
  CompletionDescriptor launched = Completion(0, 32, 0, 0, "");
  launched.user_data = d.user_data;
  launched.opcode = d.opcode;
  launched.flags = flexkv::kCompletionFlagLayerDone | flexkv::kCompletionFlagLaunched;
  rings.consumer->Post(launched);
  CHECK(rings.client->WaitLaunched(*t, 5s).ok());
  auto still = rings.client->TryWait(*t);  // launched is progress: the request has not ended
  REQUIRE(still.ok());
  CHECK_FALSE(still->has_value());
  const flexkv::OpResult r = rings.Answer(d, *t, Completion(0, 0, 3, 0, ""));
  CHECK(r.status.ok());
  CHECK(r.done_blocks == 3);
  CHECK(rings.client->WaitLaunched(*t, 1ms).ok());  // its result was taken: nothing left to wait for
}

TEST_CASE("session rings: a load that ends with an error before launch answers WaitLaunched with that error",
          "[unit]") {
  Rings rings;
  const std::vector<uint32_t> ids = {1};
  auto t = rings.client->Submit(RingOp::kLoad, 0, 1, {}, ids, 3, flexkv::kRootParent, 0, 5);
  REQUIRE(t.ok());
  const SubmitDescriptor d = rings.Take();
  CompletionDescriptor c = Completion(static_cast<int32_t>(flexkv::StatusCode::kFailedPrecondition), 0, 0, 0,
                                      "event_set 5 is busy");
  c.user_data = d.user_data;
  c.opcode = d.opcode;
  rings.consumer->Post(c);
  const flexkv::Status launched = rings.client->WaitLaunched(*t, 5s);
  CHECK(launched.code() == flexkv::StatusCode::kFailedPrecondition);
  CHECK(launched.message() == "event_set 5 is busy");
  auto r = rings.client->Wait(*t, 5s);  // the result stays for Wait
  REQUIRE(r.ok());
  CHECK(r->status.code() == flexkv::StatusCode::kFailedPrecondition);
}

TEST_CASE("session rings: a Load carries its launch deadline in the keys_offset word, and 0 without one", "[unit]") {
  Rings rings;
  const std::vector<uint32_t> ids = {4, 5, 6};
  const int64_t deadline = 123'456'789'012;
  auto with = rings.client->Submit(RingOp::kLoad, 0, 3, {}, ids, 77, flexkv::kRootParent, 0, 0, deadline);
  REQUIRE(with.ok());
  const SubmitDescriptor d = rings.Take();
  CHECK(d.launch_deadline_ns == static_cast<uint64_t>(deadline));
  CHECK(d.block_ids_offset % 4 == 0);
  // Without a deadline the word is 0, never the payload's arena offset (a layout-6 daemon would read a deadline).
  auto second = rings.client->Submit(RingOp::kLoad, 0, 3, {}, ids, 77, flexkv::kRootParent);
  REQUIRE(second.ok());
  const SubmitDescriptor none = rings.Take();
  CHECK(none.block_ids_offset != 0);  // the first load's ids still hold the arena's start
  CHECK(none.launch_deadline_ns == 0);
  // A Match still carries its keys' offset there.
  const std::vector<BlockKey> keys = {BlockKey{1, 2}};
  auto match = rings.client->Submit(RingOp::kMatch, 0, 1, keys, {}, 0, flexkv::kRootParent, 0, 0, deadline);
  REQUIRE(match.ok());
  const SubmitDescriptor m = rings.Take();
  CHECK(m.keys_offset < (1u << 20));  // inside the arena, not the deadline
  CHECK(m.keys_offset % 8 == 0);
}

TEST_CASE("session rings: a launch deadline to a flexkvd of ring layout 4 or 5 is refused FAILED_PRECONDITION",
          "[unit]") {
  for (const uint32_t layout : {4u, 5u}) {
    const flexkv::Status refused = flexkv::CheckLaunchDeadlineLayout(layout, 1'000'000);
    CHECK(refused.code() == flexkv::StatusCode::kFailedPrecondition);
    CHECK_THAT(refused.message(), Catch::Contains("a launch deadline needs ring layout 6, and the daemon speaks layout " +
                                                  std::to_string(layout)));
    CHECK(flexkv::CheckLaunchDeadlineLayout(layout, 0).ok());  // no deadline: every layout takes the load
  }
  CHECK(flexkv::CheckLaunchDeadlineLayout(6, 1'000'000).ok());
}
