// A new domain's pool prepared in the background (issue 29 item 7): Admit returns while the pool listener (DMA
// registration: seconds per 16 GiB on a GPU node) has not finished even one grant; the pool serves from its first
// grants; matches and stores never wait for a later grant's registration; a drop stops the preparation and every
// grant told to the listener is taken back; a pool that cannot be created is reported and tried again.
#include <catch2/catch.hpp>

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/block_checksum.h"
#include "daemon/cache/cache_set.h"
#include "tests/support/temp_dir.h"
#include "tests/unit/daemon/cache/temp_cache.h"

using flexkv::BlockKey;
using flexkv::Cache;
using flexkv::CacheSet;
using flexkv::CacheSetOptions;
using flexkv::PoolRegion;
using flexkv::SlotId;
using flexkv::Status;
using flexkv::StatusCode;
using flexkv::testing::ShmOrTmp;
using flexkv::testing::SmallGeometry;
using flexkv::testing::StoreBlocks;
using flexkv::testing::TempDir;
using namespace std::chrono_literals;

namespace {

constexpr uint64_t kBlock = 4096;      // SmallGeometry's host block
constexpr uint64_t kSlots = 1024;      // the pool's slots at its budget: 16 grants of 64
constexpr uint32_t kGrant = kSlots / 16;

// A pool listener that holds each grant until the test lets it through (as a slow cudaHostRegister would), and
// records what it was told.
class GatedListener {
 public:
  // Lets `n` more grants through (each `added` call waits for one).
  void Allow(size_t n) {
    std::lock_guard<std::mutex> l(mu_);
    allowed_ += n;
    cv_.notify_all();
  }
  void AllowAll() { Allow(1u << 30); }
  Status Added(const PoolRegion& r) {
    std::unique_lock<std::mutex> l(mu_);
    ++waiting_;
    cv_.notify_all();
    cv_.wait(l, [&] { return allowed_ > 0; });
    --allowed_;
    --waiting_;
    added_.insert(r.base);
    return Status::Ok();
  }
  void Removed(const PoolRegion& r) {
    std::lock_guard<std::mutex> l(mu_);
    removed_.insert(r.base);
  }
  // Waits until a grant waits in Added.
  bool WaitForBlocked(std::chrono::seconds limit = 10s) {
    std::unique_lock<std::mutex> l(mu_);
    return cv_.wait_for(l, limit, [&] { return waiting_ > 0; });
  }
  std::set<const uint8_t*> added() {
    std::lock_guard<std::mutex> l(mu_);
    return added_;
  }
  std::set<const uint8_t*> removed() {
    std::lock_guard<std::mutex> l(mu_);
    return removed_;
  }
  void Attach(CacheSet& caches) {
    caches.AddObserver(std::make_shared<flexkv::FunctionCacheObserver>([this](const PoolRegion& r) { return Added(r); },
                           [this](const PoolRegion& r) { Removed(r); }));
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  size_t allowed_ = 0, waiting_ = 0;
  std::set<const uint8_t*> added_, removed_;
};

CacheSetOptions Options(const std::string& pool_path) {
  CacheSetOptions o;
  o.budget_bytes = kSlots * kBlock;
  o.pool_path = pool_path;
  o.max_domains = 2;
  o.prepare_in_background = true;
  return o;
}

bool NeverInUse(const std::string&) { return false; }

std::vector<BlockKey> Keys(size_t n, uint64_t chain) {
  std::vector<BlockKey> keys(n);
  for (size_t i = 0; i < n; ++i) keys[i] = BlockKey{i + 1, chain};
  return keys;
}

template <typename F>
bool Eventually(F f, std::chrono::seconds limit = 20s) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (f()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return f();
}

}  // namespace

TEST_CASE("cache prepare: Admit returns before one grant is registered and the pool serves from its first grant "
          "while it grows without holding up lookups",
          "[unit][cache]") {
  TempDir dir("flexkv-prepare", ShmOrTmp());
  CacheSet caches(Options(dir.path + "/pool"));
  GatedListener listener;
  listener.Attach(caches);
  REQUIRE(caches.RecoverPools(false).ok());

  // Nothing registered yet, and the registration of the first grant is held: Admit does not wait for it.
  auto admitted = caches.Admit("m", SmallGeometry(), 1000, NeverInUse);
  REQUIRE(admitted.ok());
  Cache& cache = **admitted;
  REQUIRE(listener.WaitForBlocked());
  CHECK_FALSE(cache.has_pool());
  const Cache::Preparation during = cache.preparation();
  CHECK(during.preparing);
  CHECK(during.target_bytes == kSlots * kBlock);
  CHECK(during.ready_bytes == 0);
  // A request that needs the pool is told to retry, with the progress; a lookup is a miss.
  const Status not_ready = cache.PoolNotReady();
  CHECK(not_ready.code() == StatusCode::kUnavailable);
  CHECK_THAT(not_ready.message(), Catch::Contains("pool being prepared") && Catch::Contains("retry"));
  CHECK(cache.Match(Keys(2, 1), false, nullptr) == 0);
  CHECK_FALSE(cache.WaitForPreparation(50ms));
  // The budget counts what the preparation grows to: a second domain gets only what is left of it (none here).
  CHECK(cache.held_bytes() == kSlots * kBlock);
  auto second = caches.Admit("other", SmallGeometry(), 1000, NeverInUse);
  CHECK(second.status().code() == StatusCode::kResourceExhausted);

  // The first grant through: the pool exists and serves, with that grant active.
  listener.Allow(1);
  REQUIRE(Eventually([&] { return cache.has_pool(); }));
  CHECK(cache.capacity_slots() == kGrant);
  CHECK(cache.preparation().served_ms != 0);
  // The second grant's registration is held now: stores and matches go on meanwhile.
  REQUIRE(listener.WaitForBlocked());
  auto stored = std::async(std::launch::async, [&] {
    StoreBlocks(cache, Keys(8, 2));
    return cache.Match(Keys(8, 2), false, nullptr);
  });
  REQUIRE(stored.wait_for(10s) == std::future_status::ready);
  CHECK(stored.get() == 8);
  CHECK(cache.capacity_slots() == kGrant);  // still one grant: the second is not handed out before it is registered
  CHECK(cache.Resize(kGrant * kBlock).status().code() == StatusCode::kFailedPrecondition);  // not while preparing

  listener.AllowAll();
  REQUIRE(Eventually([&] { return !cache.preparation().preparing; }));
  const Cache::Preparation done = cache.preparation();
  CHECK(done.error.ok());
  CHECK(done.ready_bytes == kSlots * kBlock);
  CHECK(done.done_ms >= done.served_ms);
  CHECK(cache.capacity_slots() == kSlots);
  CHECK(listener.added().size() == 16);  // every grant, once
  CHECK(listener.removed().empty());
  // What was stored while it grew is still there, and the grown slots take stores.
  CHECK(cache.Match(Keys(8, 2), false, nullptr) == 8);
  StoreBlocks(cache, Keys(512, 3));
  CHECK(cache.Match(Keys(512, 3), false, nullptr) == 512);
  // Once prepared it is resized like any pool.
  CHECK(cache.Resize(kSlots * kBlock / 2).ok());
}

TEST_CASE("cache prepare: dropping a domain while its pool is prepared stops the preparation and takes back every "
          "grant told",
          "[unit][cache]") {
  TempDir dir("flexkv-prepare", ShmOrTmp());
  const std::string pool_path = dir.path + "/pool";
  CacheSet caches(Options(pool_path));
  GatedListener listener;
  listener.Attach(caches);
  REQUIRE(caches.RecoverPools(false).ok());
  REQUIRE(caches.Admit("m", SmallGeometry(), 1000, NeverInUse).ok());
  listener.Allow(3);  // the first grant and two of the growth
  REQUIRE(Eventually([&] { return listener.added().size() == 3; }));
  REQUIRE(listener.WaitForBlocked());
  auto dropped = std::async(std::launch::async, [&] { return caches.DropDomain("m", true, nullptr); });
  // The drop waits for the grant being registered (it cannot be interrupted), then nothing more is prepared.
  CHECK(dropped.wait_for(200ms) == std::future_status::timeout);
  listener.AllowAll();
  REQUIRE(dropped.wait_for(20s) == std::future_status::ready);
  CHECK(dropped.get().ok());
  CHECK(listener.added().size() <= 4);
  CHECK(listener.removed() == listener.added());
  CHECK_FALSE(std::filesystem::exists(pool_path));
  CHECK(caches.Find("m") == nullptr);
  // The slot and the budget are free again: the next domain is prepared in full.
  auto next = caches.Admit("n", SmallGeometry(), 1000, NeverInUse);
  REQUIRE(next.ok());
  REQUIRE(Eventually([&] { return !(*next)->preparation().preparing; }));
  CHECK((*next)->capacity_slots() == kSlots);
}

TEST_CASE("cache prepare: a pool that cannot be created is reported to the requests and tried again by the next "
          "Attach",
          "[unit][cache]") {
  TempDir dir("flexkv-prepare", ShmOrTmp());
  // The pool's directory is a regular file: creating the pool fails (after Admit has answered).
  const std::string blocker = dir.path + "/not-a-dir";
  std::ofstream(blocker) << "x";
  CacheSet caches(Options(blocker + "/pool"));
  GatedListener listener;
  listener.AllowAll();
  listener.Attach(caches);
  auto admitted = caches.Admit("m", SmallGeometry(), 1000, NeverInUse);
  REQUIRE(admitted.ok());
  Cache& cache = **admitted;
  REQUIRE(Eventually([&] { return !cache.preparation().preparing; }));
  CHECK_FALSE(cache.has_pool());
  const Cache::Preparation failed = cache.preparation();
  CHECK_FALSE(failed.error.ok());
  const Status answer = cache.PoolNotReady();
  CHECK(answer.code() == failed.error.code());
  CHECK_THAT(answer.message(), Catch::Contains("pool not created") && Catch::Contains("next Attach tries again"));
  // The operator fixes the directory; the next Attach of the domain prepares the pool.
  std::filesystem::remove(blocker);
  std::filesystem::create_directory(blocker);
  REQUIRE(caches.Admit("m", SmallGeometry(), 1000, NeverInUse).ok());
  REQUIRE(cache.WaitForPreparation(10s));
  CHECK_FALSE(cache.preparation().preparing);
  CHECK(cache.preparation().error.ok());
  CHECK(cache.capacity_slots() == kSlots);
}

TEST_CASE("cache prepare: a re-attached pool serves at once and its grants are registered in the background before "
          "its restored blocks are served",
          "[unit][cache]") {
  TempDir dir("flexkv-prepare", ShmOrTmp());
  const std::string pool_path = dir.path + "/pool";
  {  // An earlier run stores 40 blocks and stops.
    CacheSetOptions options = Options(pool_path);
    options.prepare_in_background = false;
    CacheSet caches(options);
    REQUIRE(caches.RecoverPools(false).ok());
    auto admitted = caches.Admit("m", SmallGeometry(), 1000, NeverInUse);
    REQUIRE(admitted.ok());
    StoreBlocks(**admitted, Keys(40, 5));
  }
  CacheSet caches(Options(pool_path));
  GatedListener listener;
  listener.Attach(caches);
  // Not one grant registered, and RecoverPools has answered: the daemon serves.
  REQUIRE(caches.RecoverPools(false).ok());
  Cache* cache = caches.Find("m");
  REQUIRE(cache != nullptr);
  REQUIRE(listener.WaitForBlocked());
  CHECK(cache->has_pool());
  CHECK(cache->preparation().preparing);
  CHECK(cache->capacity_slots() == kSlots);
  // No slot is handed out before its grant is registered, and the restored blocks are not served yet.
  const auto refused = cache->Reserve(flexkv::kRootParent, Keys(1, 6));
  CHECK(refused.slots.empty());
  CHECK(refused.shortfall == StatusCode::kResourceExhausted);
  CHECK(cache->PoolNotReady().code() == StatusCode::kUnavailable);
  CHECK(cache->Match(Keys(40, 5), false, nullptr) == 0);
  // One grant registered: stores find room in it, and only in it.
  listener.Allow(1);
  REQUIRE(Eventually([&] { return cache->preparation().served_ms != 0; }));
  REQUIRE(listener.WaitForBlocked());
  const auto reserved = cache->Reserve(flexkv::kRootParent, Keys(8, 7));
  REQUIRE(reserved.slots.size() == 8);
  for (SlotId s : reserved.slots) CHECK(s < kGrant);
  cache->Abort(reserved.slots);
  CHECK(cache->Match(Keys(40, 5), false, nullptr) == 0);  // still not verified: not every grant is registered
  // Every grant registered: the restored blocks are verified and served.
  listener.AllowAll();
  REQUIRE(Eventually([&] { return cache->Match(Keys(40, 5), false, nullptr) == 40; }));
  CHECK_FALSE(cache->preparation().preparing);
  CHECK(listener.added().size() == 16);
  StoreBlocks(*cache, Keys(600, 8));  // every grant takes stores now
  CHECK(cache->Match(Keys(600, 8), false, nullptr) == 600);
}

TEST_CASE("cache prepare: an observer added while the pool is prepared hears every grant once, and one removed then "
          "is never called again",
          "[unit][cache]") {
  TempDir dir("flexkv-prepare", ShmOrTmp());
  CacheSet caches(Options(dir.path + "/pool"));
  GatedListener listener;
  listener.Attach(caches);
  REQUIRE(caches.RecoverPools(false).ok());
  struct Counts {
    std::mutex mu;
    std::multiset<const uint8_t*> added, removed;
  };
  const auto counting = [](Counts* c) {
    return std::make_shared<flexkv::FunctionCacheObserver>(
        [c](const PoolRegion& r) {
          std::lock_guard<std::mutex> l(c->mu);
          c->added.insert(r.base);
          return Status::Ok();
        },
        [c](const PoolRegion& r) {
          std::lock_guard<std::mutex> l(c->mu);
          c->removed.insert(r.base);
        });
  };
  Counts early, late;
  auto leaving = counting(&early);
  caches.AddObserver(leaving);

  auto admitted = caches.Admit("m", SmallGeometry(), 1000, NeverInUse);
  REQUIRE(admitted.ok());
  Cache& cache = **admitted;
  listener.Allow(3);
  REQUIRE(Eventually([&] { return listener.added().size() == 3; }));
  REQUIRE(listener.WaitForBlocked());  // the fourth grant is being registered on the preparation's thread
  // Added and removed now: each waits for that grant's announcement, not for the whole preparation.
  auto joining = counting(&late);
  auto add = std::async(std::launch::async, [&] { cache.AddObserver(joining); });
  auto remove = std::async(std::launch::async, [&] { cache.RemoveObserver(leaving.get()); });
  CHECK(add.wait_for(200ms) == std::future_status::timeout);
  CHECK(remove.wait_for(0ms) == std::future_status::timeout);
  // The rest through (the preparation may announce more grants before the two get their turn).
  listener.AllowAll();
  REQUIRE(add.wait_for(10s) == std::future_status::ready);
  REQUIRE(remove.wait_for(10s) == std::future_status::ready);
  size_t early_added = 0;
  {
    std::lock_guard<std::mutex> l(early.mu);
    early_added = early.added.size();
  }
  CHECK(early_added >= 4);  // the grants up to its removal, the one in flight included
  REQUIRE(Eventually([&] { return !cache.preparation().preparing; }));
  REQUIRE(cache.capacity_slots() == kSlots);
  {
    std::lock_guard<std::mutex> l(late.mu);
    CHECK(late.added.size() == 16);  // every grant, none twice
    CHECK(std::set<const uint8_t*>(late.added.begin(), late.added.end()).size() == 16);
    CHECK(std::set<const uint8_t*>(late.added.begin(), late.added.end()) == listener.added());
  }
  {
    std::lock_guard<std::mutex> l(early.mu);
    CHECK(early.added.size() == early_added);  // never called after RemoveObserver returned
    CHECK(early.removed.empty());
  }
  // The one added late hears every grant removed when the pool goes, each once.
  REQUIRE(caches.DropDomain("m", false, nullptr).ok());
  std::lock_guard<std::mutex> l(late.mu);
  CHECK(late.removed == late.added);
}
