// RequestHandlers over a fake engine-memory backend and a fake session (no rings, no client): the handlers work
// with any backend that declared what the registration needs - a Store publishes only after its copy and
// returns its slots when the copy fails, a layer-wise Load on a backend without layer-wise copies still reports
// every layer, a Release during a Load unpins when the Load ends, a Load is refused while draining, a session
// pins no more than its cap, and handles whose pins lapsed are answered as such.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/clock.h"
#include "daemon/dataplane/request_handlers.h"
#include "daemon/lifecycle/lifecycle.h"
#include "daemon/tiers/dram/dram_tier.h"
#include "tests/unit/daemon/cache/temp_cache.h"
#include "tests/unit/daemon/transfer/fake_engine_memory.h"

using flexkv::BlockKey;
using flexkv::CompletionDescriptor;
using flexkv::CopyDirection;
using flexkv::MemoryKind;
using flexkv::RingOp;
using flexkv::Status;
using flexkv::StatusCode;
using flexkv::SubmitDescriptor;
using flexkv::testing::Caps;
using flexkv::testing::FakeEngineMemory;
using flexkv::testing::SmallGeometry;
using flexkv::testing::TempCache;

namespace {

constexpr uint64_t kKeysOffset = 0;
constexpr uint64_t kIdsOffset = 4096;

// A session whose completions land in a vector; one test thread drives it (the fake backend runs copies only
// when the test finishes them).
class FakeSession final : public flexkv::RequestSession {
 public:
  FakeSession(flexkv::Cache* cache, const flexkv::DramTier* tier, uint64_t pool_generation,
              Status store_access = Status::Ok())
      : RequestSession(1, SmallGeometry(), cache, tier, pool_generation, std::move(store_access)) {}
  void Post(const CompletionDescriptor& c) override { posted.push_back(c); }
  bool ended() const override { return ended_; }
  std::vector<CompletionDescriptor> posted;
  bool ended_ = false;
};

struct Harness {
  explicit Harness(Status store_access = Status::Ok()) {
    REQUIRE(cache.cache().RecoverPool(false).ok());
    REQUIRE(cache.cache().Admit("ns", SmallGeometry()).ok());
    session = std::make_shared<FakeSession>(&cache.cache(), &tier, cache.cache().generation(), std::move(store_access));
    auto fake = std::make_unique<FakeEngineMemory>("fake", Caps({MemoryKind::kHostMemfd}));
    backend = fake.get();
    backends.Add(std::move(fake));
    REQUIRE(session->kv().Register(backends, {flexkv::HostKvMemory{{}, flexkv::KvLayout::kBlockFirst, 16}}).ok());
  }

  // Writes keys and block ids into the arena and submits a descriptor for them.
  void Submit(RingOp op, uint16_t flags, const std::vector<BlockKey>& keys, const std::vector<uint32_t>& ids,
              uint64_t handle = 0, uint32_t event_set = 0) {
    SubmitDescriptor d{};
    d.event_set = event_set;
    d.user_data = ++next_user_data;
    d.opcode = static_cast<uint16_t>(op);
    d.flags = flags;
    d.count = static_cast<uint32_t>(keys.empty() ? ids.size() : keys.size());
    if (op != RingOp::kLoad) d.keys_offset = kKeysOffset;  // a Load's word there is its launch deadline
    d.block_ids_offset = kIdsOffset;
    d.match_handle = handle;
    if (!keys.empty()) std::memcpy(arena.data() + kKeysOffset, keys.data(), keys.size() * sizeof(BlockKey));
    if (!ids.empty()) std::memcpy(arena.data() + kIdsOffset, ids.data(), ids.size() * sizeof(uint32_t));
    active->Handle(session, arena, d, flexkv::NowNs());
  }
  CompletionDescriptor Last() {
    REQUIRE_FALSE(session->posted.empty());
    return session->posted.back();
  }

  TempCache cache;
  flexkv::Lifecycle lifecycle;
  flexkv::DramTier tier{&cache.cache()};
  flexkv::CopyScheduler copies;
  flexkv::RequestMetrics metrics;
  flexkv::EngineMemoryBackends backends;
  FakeEngineMemory* backend = nullptr;
  flexkv::RequestHandlers handlers{&lifecycle, &copies, &metrics, 1024};
  flexkv::RequestHandlers* active = &handlers;  // the handlers Submit goes to
  std::shared_ptr<FakeSession> session;
  std::vector<uint8_t> arena = std::vector<uint8_t>(8192);
  uint64_t next_user_data = 0;
};

std::vector<BlockKey> Keys(size_t n) {
  std::vector<BlockKey> keys(n);
  for (size_t i = 0; i < n; ++i) keys[i] = BlockKey{i + 11, 3};
  return keys;
}

}  // namespace

TEST_CASE("request handlers: a Store publishes after its copy, through any backend that declared the memory",
          "[unit][dataplane]") {
  Harness h;
  h.Submit(RingOp::kStore, 0, Keys(3), {5, 6, 7});
  REQUIRE(h.backend->jobs.size() == 1);
  CHECK(h.backend->jobs[0].direction == CopyDirection::kToPool);
  CHECK(*h.backend->jobs[0].engine_blocks == std::vector<uint32_t>{5, 6, 7});
  CHECK(h.session->posted.empty());  // answered when the copy ends
  h.Submit(RingOp::kMatch, 0, Keys(3), {});
  CHECK(h.Last().matched_blocks == 0);  // not visible before its bytes are in
  h.backend->Finish(0, Status::Ok(), flexkv::NowNs());
  CHECK(h.Last().status_code == 0);
  CHECK(h.Last().done_blocks == 3);
  h.Submit(RingOp::kMatch, 0, Keys(3), {});
  CHECK(h.Last().matched_blocks == 3);
  CHECK(h.lifecycle.inflight() == 0);
}

TEST_CASE("request handlers: a failed Store copy returns its slots and answers the backend's error", "[unit][dataplane]") {
  Harness h;
  h.Submit(RingOp::kStore, 0, Keys(2), {1, 2});
  REQUIRE(h.backend->jobs.size() == 1);
  h.backend->Finish(0, Status::Internal("DMA went wrong"), flexkv::NowNs());
  const CompletionDescriptor c = h.Last();
  CHECK(c.status_code == static_cast<int32_t>(StatusCode::kInternal));
  CHECK(std::string(c.message) == "DMA went wrong");
  CHECK(c.done_blocks == 0);
  CHECK(h.cache.cache().GetStats().used == 0);
  CHECK(h.metrics.TotalErrors() == 1);
}

TEST_CASE("request handlers: a layer-wise Load on a backend without layer-wise copies reports every layer, then ends",
          "[unit][dataplane]") {
  Harness h;
  h.Submit(RingOp::kStore, 0, Keys(2), {1, 2});
  h.backend->Finish(0, Status::Ok(), flexkv::NowNs());
  h.Submit(RingOp::kMatch, flexkv::kMatchFlagPin, Keys(2), {});
  const uint64_t handle = h.Last().match_handle;
  REQUIRE(handle != 0);
  h.session->posted.clear();
  h.Submit(RingOp::kLoad, flexkv::kLoadFlagLayerwise, {}, {8, 9}, handle);
  REQUIRE(h.backend->jobs.size() == 2);
  CHECK(h.backend->jobs[1].direction == CopyDirection::kFromPool);
  h.backend->Finish(1, Status::Ok(), flexkv::NowNs());
  REQUIRE(h.session->posted.size() == 3);  // layer 0, layer 1, the end
  CHECK(h.session->posted[0].flags == flexkv::kCompletionFlagLayerDone);
  CHECK(h.session->posted[1].matched_blocks == 1);
  CHECK(h.session->posted[2].flags == 0);
  CHECK(h.session->posted[2].done_blocks == 2);
}

TEST_CASE("request handlers: a Release during a Load unpins when the Load ends", "[unit][dataplane]") {
  Harness h;
  h.Submit(RingOp::kStore, 0, Keys(2), {1, 2});
  h.backend->Finish(0, Status::Ok(), flexkv::NowNs());
  h.Submit(RingOp::kMatch, flexkv::kMatchFlagPin, Keys(2), {});
  const uint64_t handle = h.Last().match_handle;
  h.Submit(RingOp::kLoad, 0, {}, {3, 4}, handle);
  h.Submit(RingOp::kRelease, 0, {}, {}, handle);
  CHECK(h.Last().status_code == 0);
  CHECK(h.cache.cache().GetStats().pinned == 2);  // the load still copies from them
  CHECK(h.session->pinned_blocks() == 2);
  h.Submit(RingOp::kRelease, 0, {}, {}, handle);
  CHECK(h.Last().status_code == static_cast<int32_t>(StatusCode::kNotFound));
  h.backend->Finish(1, Status::Ok(), flexkv::NowNs());
  CHECK(h.cache.cache().GetStats().pinned == 0);
  CHECK(h.session->pinned_blocks() == 0);
}

TEST_CASE("request handlers: a Load while draining is refused and leaves the handle held", "[unit][dataplane]") {
  Harness h;
  h.Submit(RingOp::kStore, 0, Keys(1), {1});
  h.backend->Finish(0, Status::Ok(), flexkv::NowNs());
  h.Submit(RingOp::kMatch, flexkv::kMatchFlagPin, Keys(1), {});
  const uint64_t handle = h.Last().match_handle;
  h.lifecycle.Drain();
  h.Submit(RingOp::kLoad, 0, {}, {2}, handle);
  CHECK(h.Last().status_code == static_cast<int32_t>(StatusCode::kUnavailable));
  CHECK(h.backend->jobs.size() == 1);  // no copy started
  h.Submit(RingOp::kRelease, 0, {}, {}, handle);
  CHECK(h.Last().status_code == 0);
  CHECK(h.cache.cache().GetStats().pinned == 0);
}

TEST_CASE("request handlers: the session's end unpins its handles, and a Store finishing after it is not published",
          "[unit][dataplane]") {
  Harness h;
  h.Submit(RingOp::kStore, 0, Keys(1), {1});
  h.backend->Finish(0, Status::Ok(), flexkv::NowNs());
  h.Submit(RingOp::kMatch, flexkv::kMatchFlagPin, Keys(1), {});
  h.Submit(RingOp::kStore, 0, Keys(3), {1, 2, 3});
  REQUIRE(h.backend->jobs.size() == 2);
  h.session->ended_ = true;
  h.handlers.EndSession(*h.session);
  CHECK(h.cache.cache().GetStats().pinned == 0);
  h.backend->Finish(1, Status::Ok(), flexkv::NowNs());
  CHECK(h.cache.cache().GetStats().blocks == 1);  // the late store's two new blocks were returned
  CHECK(h.cache.cache().GetStats().used == 1);
}

TEST_CASE("request handlers: a read-only session's Store is refused with its reason, before any slot is reserved",
          "[unit][dataplane][security]") {
  Harness h(Status::PermissionDenied("Store refused: uid 1001 may not write namespace 'ns'"));
  h.Submit(RingOp::kStore, 0, Keys(3), {5, 6, 7});
  CHECK(h.backend->jobs.empty());  // no copy
  const CompletionDescriptor c = h.Last();
  CHECK(c.status_code == static_cast<int32_t>(StatusCode::kPermissionDenied));
  CHECK(std::string(c.message) == "Store refused: uid 1001 may not write namespace 'ns'");
  CHECK(c.done_blocks == 0);
  CHECK(h.cache.cache().GetStats().used == 0);
  CHECK(h.lifecycle.inflight() == 0);
  // Matching is reading: allowed.
  h.Submit(RingOp::kMatch, 0, Keys(3), {});
  CHECK(h.Last().status_code == 0);
}

TEST_CASE("request handlers: a Match with pin beyond the session's pin cap pins nothing and names the cap",
          "[unit][dataplane]") {
  Harness h;
  const uint32_t capacity = h.cache.cache().capacity_slots();
  REQUIRE(capacity >= 8);
  flexkv::RequestHandlers capped{&h.lifecycle, &h.copies, &h.metrics, 1024,
                                 flexkv::PinPolicy{3.5 / capacity, 10000}};
  REQUIRE(capped.SessionPinCap(*h.session) == 3);
  h.active = &capped;
  h.Submit(RingOp::kStore, 0, Keys(4), {1, 2, 3, 4});
  h.backend->Finish(0, Status::Ok(), flexkv::NowNs());
  h.Submit(RingOp::kMatch, flexkv::kMatchFlagPin, Keys(4), {});
  CompletionDescriptor c = h.Last();
  CHECK(c.status_code == static_cast<int32_t>(StatusCode::kResourceExhausted));
  CHECK(std::string(c.message) == "session pin cap: 0 pinned + 4 > 3 (--max-session-pin-share); Release handles");
  CHECK(c.matched_blocks == 4);  // what is cached
  CHECK(c.match_handle == 0);    // nothing pinned
  CHECK(h.cache.cache().GetStats().pinned == 0);
  CHECK(h.session->pinned_blocks() == 0);

  h.Submit(RingOp::kMatch, flexkv::kMatchFlagPin, Keys(2), {});
  const uint64_t two = h.Last().match_handle;
  CHECK(h.Last().status_code == 0);
  CHECK(two != 0);
  h.Submit(RingOp::kMatch, flexkv::kMatchFlagPin, Keys(2), {});
  CHECK(h.Last().status_code == static_cast<int32_t>(StatusCode::kResourceExhausted));
  CHECK(std::string(h.Last().message) == "session pin cap: 2 pinned + 2 > 3 (--max-session-pin-share); Release handles");
  h.Submit(RingOp::kMatch, 0, Keys(4), {});  // a Match without pin is never capped
  CHECK(h.Last().status_code == 0);
  CHECK(h.Last().matched_blocks == 4);
  h.Submit(RingOp::kMatch, flexkv::kMatchFlagPin, Keys(1), {});
  CHECK(h.Last().status_code == 0);  // 3 pinned: at the cap, not over it
  CHECK(h.session->pinned_blocks() == 3);
  h.Submit(RingOp::kRelease, 0, {}, {}, two);
  h.Submit(RingOp::kMatch, flexkv::kMatchFlagPin, Keys(2), {});
  CHECK(h.Last().status_code == 0);  // room again after a Release
  CHECK(h.session->pinned_blocks() == 3);
  CHECK(h.cache.cache().GetStats().pinned == 2);  // a slot pinned twice counts once in the pool
}

TEST_CASE("request handlers: lapsed pins are unpinned, their handles answer FAILED_PRECONDITION, a new Match pins again",
          "[unit][dataplane]") {
  Harness h;
  h.Submit(RingOp::kStore, 0, Keys(3), {1, 2, 3});
  h.backend->Finish(0, Status::Ok(), flexkv::NowNs());
  h.Submit(RingOp::kMatch, flexkv::kMatchFlagPin, Keys(2), {});
  const uint64_t idle = h.Last().match_handle;
  h.Submit(RingOp::kMatch, flexkv::kMatchFlagPin, Keys(3), {});
  const uint64_t loading = h.Last().match_handle;
  h.Submit(RingOp::kLoad, 0, {}, {4, 5, 6}, loading);
  REQUIRE(h.backend->jobs.size() == 2);
  CHECK(h.cache.cache().GetStats().pinned == 3);

  const flexkv::RequestHandlers::Lapsed lapsed = h.handlers.LapsePins(*h.session);
  CHECK(lapsed.handles == 2);
  CHECK(lapsed.blocks == 2);  // the idle handle's; the loading one's go when its copy ends
  CHECK(h.session->pinned_blocks() == 3);
  const std::string expected = "pins lapsed after 10000 ms without renewal (process stopped?); Match again";
  h.Submit(RingOp::kLoad, 0, {}, {7}, idle);
  CHECK(h.Last().status_code == static_cast<int32_t>(StatusCode::kFailedPrecondition));
  CHECK(std::string(h.Last().message) == expected);
  CHECK(h.backend->jobs.size() == 2);  // no copy
  h.backend->Finish(1, Status::Ok(), flexkv::NowNs());  // the load that was copying ends whole
  CHECK(h.Last().status_code == 0);
  CHECK(h.Last().done_blocks == 3);
  CHECK(h.cache.cache().GetStats().pinned == 0);
  CHECK(h.session->pinned_blocks() == 0);
  h.Submit(RingOp::kRelease, 0, {}, {}, loading);
  CHECK(h.Last().status_code == static_cast<int32_t>(StatusCode::kFailedPrecondition));
  CHECK(std::string(h.Last().message) == expected);
  h.Submit(RingOp::kRelease, 0, {}, {}, loading);  // answered as lapsed once, then an unknown handle
  CHECK(h.Last().status_code == static_cast<int32_t>(StatusCode::kNotFound));
  CHECK(h.handlers.LapsePins(*h.session).handles == 0);  // nothing left to lapse

  h.Submit(RingOp::kMatch, flexkv::kMatchFlagPin, Keys(3), {});  // the process runs again: it pins again
  CHECK(h.Last().status_code == 0);
  CHECK(h.Last().match_handle != 0);
  CHECK(h.cache.cache().GetStats().pinned == 3);
}

namespace {

// Two blocks stored and pinned under a handle; returns it.
uint64_t StoredAndPinned(Harness& h) {
  h.Submit(RingOp::kStore, 0, Keys(2), {1, 2});
  h.backend->Finish(h.backend->jobs.size() - 1, Status::Ok(), flexkv::NowNs());
  h.Submit(RingOp::kMatch, flexkv::kMatchFlagPin, Keys(2), {});
  const uint64_t handle = h.Last().match_handle;
  REQUIRE(handle != 0);
  h.session->posted.clear();
  return handle;
}

}  // namespace

TEST_CASE("request handlers: a Load naming an event set records it, says launched before the end, one load per set",
          "[unit][dataplane]") {
  Harness h;
  h.backend->mutable_capabilities().layer_events = true;
  const uint32_t layers = h.session->geometry().num_layers;
  auto set = h.session->AddEventSet({std::make_shared<flexkv::testing::FakeLayerEvents>(0, layers)});
  REQUIRE(set.ok());
  REQUIRE(*set != 0);
  const uint64_t handle = StoredAndPinned(h);
  h.Submit(RingOp::kLoad, 0, {}, {8, 9}, handle, *set);
  REQUIRE(h.backend->jobs.size() == 2);
  REQUIRE(h.backend->jobs[1].layer_events != nullptr);
  CHECK(h.backend->jobs[1].layer_events->num_layers() == layers);
  CHECK_FALSE(h.backend->jobs[1].on_layer);  // no progress completions with events
  CHECK(h.session->posted.empty());

  // The set is busy until that load ends: a second load naming it is refused, and takes nothing.
  h.Submit(RingOp::kLoad, 0, {}, {10, 11}, handle, *set);
  CHECK(h.backend->jobs.size() == 2);
  CHECK(h.Last().status_code == static_cast<int32_t>(StatusCode::kFailedPrecondition));
  CHECK_THAT(std::string(h.Last().message), Catch::Contains("is busy") && Catch::Contains("ticket 3"));
  h.session->posted.clear();

  h.backend->jobs[1].on_launched();
  REQUIRE(h.session->posted.size() == 1);
  CHECK(h.session->posted[0].flags == (flexkv::kCompletionFlagLayerDone | flexkv::kCompletionFlagLaunched));
  CHECK(h.session->posted[0].matched_blocks == layers);
  h.backend->Finish(1, Status::Ok(), flexkv::NowNs());
  REQUIRE(h.session->posted.size() == 2);
  CHECK(h.session->posted[1].flags == 0);
  CHECK(h.session->posted[1].done_blocks == 2);

  // Free again once the load ended: the next load takes it.
  h.Submit(RingOp::kLoad, 0, {}, {8, 9}, handle, *set);
  CHECK(h.backend->jobs.size() == 3);
  h.backend->Finish(2, Status::Ok(), flexkv::NowNs());
  CHECK(h.Last().status_code == 0);
  CHECK(h.lifecycle.inflight() == 0);
}

TEST_CASE("request handlers: unknown event sets and backends that record no events are refused, the set freed",
          "[unit][dataplane]") {
  Harness h;  // the fake backend does not declare layer_events
  const uint64_t handle = StoredAndPinned(h);
  h.Submit(RingOp::kLoad, 0, {}, {8, 9}, handle, 41);
  CHECK(h.Last().status_code == static_cast<int32_t>(StatusCode::kNotFound));
  CHECK_THAT(std::string(h.Last().message), Catch::Contains("event_set 41 is not registered in this session (registered: none)"));
  auto set = h.session->AddEventSet({std::make_shared<flexkv::testing::FakeLayerEvents>(0, 2)});
  REQUIRE(set.ok());
  for (int i = 0; i < 2; ++i) {  // refused by the copy scheduler each time, never "busy"
    h.Submit(RingOp::kLoad, 0, {}, {8, 9}, handle, *set);
    CHECK(h.Last().status_code == static_cast<int32_t>(StatusCode::kFailedPrecondition));
    CHECK_THAT(std::string(h.Last().message), Catch::Contains("does not record CUDA layer events"));
  }
  CHECK(h.backend->jobs.size() == 1);  // only the store's
  CHECK(h.session->pinned_blocks() == 2);  // the handle is still held
  CHECK(h.session->ReleaseEventSet(*set).ok());
  CHECK(h.session->ReleaseEventSet(*set).code() == StatusCode::kNotFound);
  CHECK(h.lifecycle.inflight() == 0);
}

TEST_CASE("request handlers: a session holds at most 16 event sets, ids are never reused, none after its end",
          "[unit][dataplane]") {
  Harness h;
  auto one = [] {
    return std::vector<std::shared_ptr<flexkv::LayerEvents>>{std::make_shared<flexkv::testing::FakeLayerEvents>(0, 2)};
  };
  std::vector<uint32_t> ids;
  for (size_t i = 0; i < flexkv::RequestSession::kMaxEventSets; ++i) {
    auto id = h.session->AddEventSet(one());
    REQUIRE(id.ok());
    ids.push_back(*id);
  }
  auto refused = h.session->AddEventSet(one());
  CHECK(refused.status().code() == StatusCode::kResourceExhausted);
  CHECK_THAT(refused.status().message(), Catch::Contains("expected at most 16: release one"));
  REQUIRE(h.session->ReleaseEventSet(ids[3]).ok());
  auto again = h.session->AddEventSet(one());
  REQUIRE(again.ok());
  CHECK(std::find(ids.begin(), ids.end(), *again) == ids.end());
  h.session->ended_ = true;
  h.handlers.EndSession(*h.session);
  CHECK(h.session->event_sets() == 0);
  CHECK(h.session->AddEventSet(one()).status().code() == StatusCode::kFailedPrecondition);
}
