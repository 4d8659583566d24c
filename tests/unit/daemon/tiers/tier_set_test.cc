// TierSet and the one lookup path (daemon/tiers/tier_set.h, tier_lookup.h) with a tier plugged in the way
// docs/architecture.md "Adding a tier" says: the test tier (tests/support/memory_tier.h) takes write-backs, promotes on
// match, reports its status and metrics, on a real CacheSet and pool file - no part of the daemon knows it.
#include <catch2/catch.hpp>

#include <chrono>
#include <future>
#include <thread>
#include <memory>
#include <string>
#include <vector>

#include "daemon/cache/cache_set.h"
#include "daemon/dataplane/data_plane.h"
#include "daemon/lifecycle/lifecycle.h"
#include "daemon/server/daemon_metrics.h"
#include "daemon/sessions/session_registry.h"
#include "daemon/transfer/engine_memory_backends.h"
#include "daemon/tiers/tier_lookup.h"
#include "daemon/tiers/tier_set.h"
#include "flexkv/v1/control.pb.h"
#include "tests/support/memory_tier.h"
#include "tests/support/temp_dir.h"
#include "tests/unit/daemon/cache/temp_cache.h"

using flexkv::BlockKey;
using flexkv::Cache;
using flexkv::CacheSet;
using flexkv::CacheSetOptions;
using flexkv::CacheTier;
using flexkv::Lifecycle;
using flexkv::SlotId;
using flexkv::TierCapabilities;
using flexkv::TierSet;
using flexkv::testing::MemoryTier;

namespace {

constexpr uint64_t kBlock = 4096;  // SmallGeometry's block

std::vector<BlockKey> Chain(uint64_t chain, size_t n) {
  std::vector<BlockKey> keys;
  for (size_t i = 0; i < n; ++i) keys.push_back(BlockKey{i + 1, chain * 7919 + 3});
  return keys;
}
uint8_t ByteOf(uint64_t chain, size_t i, uint64_t offset) { return static_cast<uint8_t>(chain * 29 + i * 5 + offset * 3); }

void StoreChain(Cache& cache, uint64_t chain, size_t n) {
  const std::vector<BlockKey> keys = Chain(chain, n);
  flexkv::PrefixIndex::Reservation r = cache.Reserve(flexkv::kRootParent, keys);
  REQUIRE(r.slots.size() == n - r.cached);
  std::vector<uint64_t> sums;
  for (size_t k = 0; k < r.slots.size(); ++k) {
    uint8_t* bytes = cache.SlotData(r.slots[k]);
    for (uint64_t o = 0; o < kBlock; ++o) bytes[o] = ByteOf(chain, r.cached + k, o);
    sums.push_back(flexkv::BlockChecksum(bytes, kBlock));
  }
  cache.Commit(flexkv::kRootParent, keys, r.cached, r.slots, sums);
}

struct Looked {
  size_t hit = 0;
  std::vector<SlotId> pinned;
};

// The lookup path, waited for.
Looked Lookup(const TierSet& tiers, Lifecycle& lifecycle, Cache& cache, const std::vector<BlockKey>& keys, bool pin,
              std::function<bool()> may_promote = {}) {
  auto answered = std::make_shared<std::promise<Looked>>();
  std::future<Looked> answer = answered->get_future();
  flexkv::TierLookupRequest request;
  request.cache = &cache;
  request.keys = keys;
  request.pin = pin;
  request.may_promote = std::move(may_promote);
  flexkv::MatchThroughTiers(tiers, lifecycle, std::move(request), [answered](size_t hit, std::vector<SlotId> pinned) {
    answered->set_value(Looked{hit, std::move(pinned)});
  });
  return answer.get();
}

struct Fixture {
  Fixture() : dir("flexkv-tierset", flexkv::testing::ShmOrTmp()) {
    CacheSetOptions o;
    o.budget_bytes = 16 * kBlock;  // one domain of 16 blocks
    o.pool_path = dir.path + "/pool";
    caches = std::make_unique<CacheSet>(o);
    REQUIRE(caches->RecoverPools(false).ok());
    auto admitted = caches->Admit("m", flexkv::testing::SmallGeometry(), 0, [](const std::string&) { return false; });
    REQUIRE(admitted.ok());
    cache = *admitted;
  }
  flexkv::testing::TempDir dir;
  std::unique_ptr<CacheSet> caches;
  Cache* cache = nullptr;
};

// A tier that declares nothing but its name, for the set's own rules.
class NamedTier final : public CacheTier {
 public:
  NamedTier(std::string name, TierCapabilities caps, std::vector<std::string>* stops)
      : name_(std::move(name)), caps_(caps), stops_(stops) {}
  std::string_view name() const override { return name_; }
  TierCapabilities capabilities() const override { return caps_; }
  void Stop() override {
    if (stops_ != nullptr) stops_->push_back(name_);
    stops_ = nullptr;  // idempotent
  }
  void ReportStatus(flexkv::v1::GetStatusResponse*) const override {}
  void CollectMetrics(flexkv::MetricFamilies*) const override {}

 private:
  std::string name_;
  TierCapabilities caps_;
  std::vector<std::string>* stops_;
};

// A promoter that answers later, promoting nothing (as a promotion that waited for the write-back in vain).
class DeferringTier final : public CacheTier {
 public:
  std::string_view name() const override { return "deferring"; }
  TierCapabilities capabilities() const override {
    TierCapabilities c;
    c.promotes_on_match = true;
    return c;
  }
  void Stop() override {}
  void ReportStatus(flexkv::v1::GetStatusResponse*) const override {}
  void CollectMetrics(flexkv::MetricFamilies*) const override {}
  bool Promote(Cache&, std::span<const BlockKey>, size_t, PromotionDone done) override {
    pending_.push_back(std::move(done));
    return true;
  }
  // Runs every deferred `done` with nothing promoted.
  void AnswerAll() {
    std::vector<PromotionDone> pending;
    pending.swap(pending_);
    for (PromotionDone& d : pending) d(0);
  }
  size_t pending() const { return pending_.size(); }

 private:
  std::vector<PromotionDone> pending_;
};

}  // namespace

TEST_CASE("tiers: a match's DRAM prefix stays pinned while a tier's promotion is under way, and its answer holds "
          "exactly the pins of its hit",
          "[unit][tiers]") {
  Fixture f;
  TierSet tiers;
  auto owned = std::make_unique<DeferringTier>();
  DeferringTier* tier = owned.get();
  REQUIRE(tiers.Add(std::move(owned)).ok());
  Lifecycle lifecycle;
  StoreChain(*f.cache, 1, 6);
  auto answered = std::make_shared<std::promise<Looked>>();
  std::future<Looked> answer = answered->get_future();
  flexkv::TierLookupRequest request;
  request.cache = f.cache;
  request.keys = Chain(1, 10);  // 6 in DRAM, 4 asked of the tier
  request.pin = true;
  flexkv::MatchThroughTiers(tiers, lifecycle, std::move(request), [answered](size_t hit, std::vector<SlotId> pinned) {
    answered->set_value(Looked{hit, std::move(pinned)});
  });
  REQUIRE(tier->pending() == 1);
  CHECK(answer.wait_for(std::chrono::seconds(0)) == std::future_status::timeout);
  // Under way: the 6 DRAM blocks are pinned - a store of a whole pool's worth meanwhile gets the other 10 slots only.
  CHECK(f.cache->GetStats().pinned == 6);
  CHECK(lifecycle.inflight() == 1);
  flexkv::PrefixIndex::Reservation r = f.cache->Reserve(flexkv::kRootParent, Chain(2, 16));
  CHECK(r.slots.size() == 10);
  f.cache->Abort(r.slots);
  CHECK(f.cache->Match(Chain(1, 6), false, nullptr) == 6);
  tier->AnswerAll();
  REQUIRE(answer.wait_for(std::chrono::seconds(5)) == std::future_status::ready);
  Looked looked = answer.get();
  CHECK(looked.hit == 6);
  CHECK(looked.pinned.size() == 6);
  CHECK(f.cache->GetStats().pinned == 6);  // the answer's pins only: the lookup's own went
  f.cache->Unpin(looked.pinned);
  CHECK(f.cache->GetStats().pinned == 0);
  CHECK(lifecycle.inflight() == 0);
}

TEST_CASE("tiers: a tier plugged into a TierSet takes write-backs, brings evicted blocks back byte-exact through the "
          "lookup path, and reports its own status and metrics",
          "[unit][tiers]") {
  Fixture f;
  TierSet tiers;
  auto owned = std::make_unique<MemoryTier>(f.caches.get());
  MemoryTier* memory = owned.get();
  REQUIRE(tiers.Add(std::move(owned)).ok());
  tiers.StartAll();
  Lifecycle lifecycle;

  StoreChain(*f.cache, 1, 8);
  REQUIRE(memory->WriteBack() == 8);
  // Another prompt fills the pool: chain 1's blocks are on the tier (clean), so they are evicted first.
  StoreChain(*f.cache, 2, 14);
  const std::vector<BlockKey> keys = Chain(1, 8);
  const size_t in_dram = f.cache->Match(keys, false, nullptr);
  REQUIRE(in_dram < 8);

  const Looked looked = Lookup(tiers, lifecycle, *f.cache, keys, /*pin=*/true);
  REQUIRE(looked.hit == 8);
  REQUIRE(looked.pinned.size() == 8);
  for (size_t i = 0; i < 8; ++i) {
    const uint8_t* bytes = f.cache->SlotData(looked.pinned[i]);
    bool same = true;
    for (uint64_t o = 0; o < kBlock && same; ++o) same = bytes[o] == ByteOf(1, i, o);
    INFO("block " << i);
    CHECK(same);
  }
  f.cache->Unpin(looked.pinned);
  // The promotion is counted in flight until just after its answer: it ends on the tier's thread.
  for (int i = 0; i < 5000 && lifecycle.inflight() != 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  CHECK(lifecycle.inflight() == 0);

  // Its status entry and its families, through the same calls GetStatus and the metrics endpoint make.
  flexkv::v1::GetStatusResponse status;
  tiers.ReportStatus(&status);
  REQUIRE(status.tiers_size() == 1);
  CHECK(status.tiers(0).name() == "memory");
  CHECK(status.tiers(0).state() == "serving");
  CHECK(status.tiers(0).promoted_blocks() == 8 - in_dram);
  CHECK(status.tiers(0).written_back_blocks() >= 8);

  flexkv::EngineMemoryBackends backends;
  flexkv::DataPlane data_plane(&lifecycle, &backends, {});
  flexkv::SessionRegistry sessions(1000);
  flexkv::ErrorCounts errors;
  flexkv::DaemonMetrics metrics({f.caches.get(), &data_plane, &sessions, &lifecycle, &errors, &tiers});
  const std::string text = metrics.Text();
  INFO(text);
  CHECK(text.find("flexkv_memory_promoted_blocks_total " + std::to_string(8 - in_dram)) != std::string::npos);
  CHECK(text.find("# TYPE flexkv_memory_blocks gauge") != std::string::npos);
  tiers.StopAll();
  data_plane.Stop();
}

TEST_CASE("tiers: the lookup path answers from DRAM when no tier promotes, when the request may not promote, and "
          "while the daemon drains",
          "[unit][tiers]") {
  Fixture f;
  TierSet tiers;
  auto owned = std::make_unique<MemoryTier>(f.caches.get());
  MemoryTier* memory = owned.get();
  REQUIRE(tiers.Add(std::move(owned)).ok());
  Lifecycle lifecycle;
  StoreChain(*f.cache, 1, 8);
  REQUIRE(memory->WriteBack() == 8);
  StoreChain(*f.cache, 2, 14);
  const std::vector<BlockKey> keys = Chain(1, 8);
  const size_t in_dram = f.cache->Match(keys, false, nullptr);
  REQUIRE(in_dram < 8);

  // A key the tier does not hold: nothing to promote, answered inside the call from DRAM.
  CHECK(Lookup(tiers, lifecycle, *f.cache, Chain(3, 4), false).hit == 0);
  // The session's domain was dropped meanwhile: its keys must not be promoted into another pool.
  CHECK(Lookup(tiers, lifecycle, *f.cache, keys, false, [] { return false; }).hit == in_dram);
  // Draining: no new work is admitted, so nothing is promoted.
  lifecycle.Drain();
  CHECK(Lookup(tiers, lifecycle, *f.cache, keys, false).hit == in_dram);
  CHECK(memory->held_blocks() == 8);
  // Without tiers at all: DRAM.
  TierSet none;
  CHECK(Lookup(none, lifecycle, *f.cache, keys, false).hit == in_dram);
}

TEST_CASE("tiers: a TierSet refuses a second tier of one name and a second tier that pulls, and stops its tiers in "
          "reverse order, once",
          "[unit][tiers]") {
  std::vector<std::string> stops;
  TierCapabilities pulls;
  pulls.pulls_on_prefetch = true;
  {
    TierSet tiers;
    REQUIRE(tiers.Add(std::make_unique<NamedTier>("a", TierCapabilities{}, &stops)).ok());
    REQUIRE(tiers.Add(std::make_unique<NamedTier>("b", pulls, &stops)).ok());
    const flexkv::Status twice = tiers.Add(std::make_unique<NamedTier>("a", TierCapabilities{}, nullptr));
    CHECK(twice.code() == flexkv::StatusCode::kInvalidArgument);
    CHECK(twice.message().find("'a'") != std::string::npos);
    const flexkv::Status second_puller = tiers.Add(std::make_unique<NamedTier>("c", pulls, nullptr));
    CHECK(second_puller.code() == flexkv::StatusCode::kInvalidArgument);
    CHECK(second_puller.message().find("pull") != std::string::npos);
    const flexkv::Status failed = tiers.Add(flexkv::Result<std::unique_ptr<NamedTier>>(
        flexkv::Status::PermissionDenied("the secret file is readable by others")));
    CHECK(failed.code() == flexkv::StatusCode::kPermissionDenied);
    CHECK(tiers.tiers().size() == 2);
    REQUIRE(tiers.puller() != nullptr);
    CHECK(tiers.puller()->name() == "b");
    CHECK(tiers.Find("a") != nullptr);
    CHECK(tiers.Find("c") == nullptr);
    CHECK(tiers.With(&TierCapabilities::pulls_on_prefetch).size() == 1);
    tiers.StopAll();
    CHECK(stops == std::vector<std::string>{"b", "a"});
  }
  CHECK(stops.size() == 2);  // the destructor does not stop them again
}
