// See cache.h: the pool prepared in the background (SetPrepareInBackground), so that no Attach waits for a pool of
// tens of GiB to be allocated and registered for DMA.
#include <fmt/format.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>

#include "common/clock.h"
#include "common/log.h"
#include "common/units.h"
#include "daemon/cache/cache.h"

namespace flexkv {

Cache::~Cache() { StopPreparation(); }

void Cache::SetPrepareInBackground(bool on) {
  MutexLock lock(&mu_);
  prepare_in_background_ = on;
}

Cache::Preparation Cache::preparation() const {
  MutexLock lock(&mu_);
  Preparation p = preparation_;
  p.ready_bytes = pool_ ? pool_->active_bytes() : 0;
  return p;
}

Status Cache::PoolNotReady() const {
  const Preparation p = preparation();
  const CacheDomain::View domain = domain_.Snapshot();
  if (p.preparing) {
    // What matters first: a ring completion keeps only the message's first 87 bytes.
    return Status::Unavailable(fmt::format(
        "pool being prepared ({} ms so far); retry in a moment (domain '{}': {} being allocated and registered)",
        MonotonicMs() - p.started_ms, domain.model_namespace, FormatByteSize(p.target_bytes)));
  }
  if (!p.error.ok()) {
    return Status(p.error.code(), fmt::format("pool not created: {} (domain '{}'; the next Attach tries again)",
                                              p.error.message(), domain.model_namespace));
  }
  return Status::FailedPrecondition("the pool does not exist yet");
}

bool Cache::WaitForPreparation(std::chrono::milliseconds timeout) const {
  const auto end = std::chrono::steady_clock::now() + timeout;
  MutexLock lock(&mu_);
  while (preparation_.preparing) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= end) break;
    mu_.WaitFor(&pool_cv_, end - now);
  }
  return pool_ != nullptr;
}

uint64_t Cache::held_bytes() const {
  MutexLock lock(&mu_);
  const uint64_t active = pool_ ? pool_->active_bytes() : 0;
  return preparation_.preparing ? std::max(active, preparation_.target_bytes) : active;
}

Status Cache::CheckSpaceFor(uint64_t bytes) const {
  const std::filesystem::path dir = std::filesystem::path(pool_path_).parent_path();
  struct statvfs vfs {};
  if (statvfs(dir.empty() ? "." : dir.c_str(), &vfs) != 0) return Status::Ok();  // Create reports the real error
  const uint64_t free_bytes = uint64_t{vfs.f_bavail} * vfs.f_frsize;
  if (free_bytes >= bytes) return Status::Ok();
  return Status::ResourceExhausted(fmt::format(
      "cannot allocate {} of the pool file {}: only {} free in {}; free space there (df -h) or lower --pool-size",
      FormatByteSize(bytes), pool_path_, FormatByteSize(free_bytes), dir.empty() ? "." : dir.string()));
}

void Cache::StopPreparation() {
  prepare_stop_.store(true, std::memory_order_release);
  MutexLock t(&thread_mu_);
  if (prepare_thread_.joinable()) prepare_thread_.join();
}

namespace {

// The grants of component c in slots [from, to) (grant boundaries), as the pool listener is told them.
std::vector<PoolRegion> GrantsOf(const SubPool& p, uint32_t from, uint32_t to) {
  std::vector<PoolRegion> grants;
  for (uint32_t first = from; first < to; first += p.grant) {
    const uint32_t slots = std::min(p.grant, to - first);
    grants.push_back(PoolRegion{p.data + uint64_t{first} * p.slot_bytes, uint64_t{slots} * p.slot_bytes,
                                p.slot_bytes, slots});
  }
  return grants;
}

}  // namespace

void Cache::Prepare(std::string model_namespace, Geometry geometry, uid_t creator_uid, uint64_t target_bytes) {
  std::function<Status(const PoolRegion&)> added;
  std::function<void(const PoolRegion&)> gone;
  {
    MutexLock lock(&mu_);
    added = pool_listener_;
    gone = pool_gone_listener_;
  }
  const int64_t started_ms = MonotonicMs();
  const auto end = [&](const Status& error) {
    MutexLock lock(&mu_);
    preparation_.preparing = false;
    preparation_.error = error;
    preparation_.done_ms = MonotonicMs();
    pool_cv_.notify_all();
  };
  // One grant of each component: the least a pool is, allocated here, registered below, all without the lock.
  auto created = Pool::Create(pool_path_, model_namespace, geometry, budget_bytes(), creator_uid, split_,
                              /*active_bytes=*/0);
  if (!created.ok()) {
    log::Error("cache", "cannot prepare the pool of cache domain '{}': {}; the next Attach tries again",
               model_namespace, created.status().ToString());
    return end(created.status());
  }
  std::unique_ptr<Pool> pool = std::move(*created);
  std::vector<PoolRegion> told;
  for (size_t c = 0; c < pool->component_count(); ++c) {
    for (const PoolRegion& r : GrantsOf(pool->sub_pool(c), 0, pool->sub_pool(c).active)) {
      // A grant the listener refuses is kept: it keeps the error for the sessions it concerns (as at a restart).
      if (added) (void)added(r);
      told.push_back(r);
    }
  }
  {
    MutexLock lock(&mu_);
    Status locked = prepare_stop_.load(std::memory_order_acquire)
                        ? Status::Cancelled("the domain was dropped while its pool was being prepared")
                        : pool_lock_.LockPoolFile();
    if (!locked.ok()) {
      for (const PoolRegion& r : told) {
        if (gone) gone(r);
      }
      pool.reset();
      ::unlink(pool_path_.c_str());
      preparation_.preparing = false;
      preparation_.error = locked;
      preparation_.done_ms = MonotonicMs();
      pool_cv_.notify_all();
      if (locked.code() != StatusCode::kCancelled) {
        log::Error("cache", "cannot prepare the pool of cache domain '{}': {}", model_namespace, locked.ToString());
      }
      return;
    }
    auto index = std::make_unique<PrefixIndex>(pool->sub_pool(0).capacity, pool->sub_pool(0).active);
    std::vector<std::unique_ptr<ComponentIndex>> parts;
    for (size_t c = 1; c < pool->component_count(); ++c) {
      parts.push_back(std::make_unique<ComponentIndex>(pool->sub_pool(c).capacity, pool->sub_pool(c).active));
    }
    AdoptPoolLocked(std::move(pool), std::move(index), std::move(parts), /*announce=*/false,
                    /*new_generation=*/false);
    preparation_.served_ms = MonotonicMs();
    pool_cv_.notify_all();
    log::Info("cache", "cache domain '{}': pool {} serves {} after {} ms; growing to {} in the background",
              model_namespace, pool_path_, FormatByteSize(pool_->active_bytes()), preparation_.served_ms - started_ms,
              FormatByteSize(target_bytes));
  }
  std::vector<uint32_t> target;
  {
    MutexLock lock(&mu_);
    target = pool_->DefaultSlotsFor(target_bytes);  // a new pool: the split it starts from
  }
  GrowInBackground(target);
  MutexLock lock(&mu_);
  preparation_.preparing = false;
  preparation_.done_ms = MonotonicMs();
  pool_cv_.notify_all();
  if (prepare_stop_.load(std::memory_order_acquire)) {
    log::Info("cache", "cache domain '{}': pool {} preparation stopped at {} active (the domain is being dropped)",
              model_namespace, pool_path_, FormatByteSize(pool_->active_bytes()));
  } else {
    log::Info("cache", "cache domain '{}': pool {} prepared: {} active in {} ms", model_namespace, pool_path_,
              FormatByteSize(pool_->active_bytes()), preparation_.done_ms - started_ms);
  }
}

void Cache::GrowInBackground(const std::vector<uint32_t>& target) {
  // pool_ is not replaced while a preparation runs (DropDomain stops it first): read without the lock below.
  Pool* const pool = [&] {
    MutexLock lock(&mu_);
    return pool_.get();
  }();
  std::function<Status(const PoolRegion&)> added;
  std::function<void(const PoolRegion&)> gone;
  {
    MutexLock lock(&mu_);
    added = pool_listener_;
    gone = pool_gone_listener_;
  }
  // Round robin over the components, one grant each, so that every component grows alike.
  for (bool grew = true; grew;) {
    grew = false;
    for (size_t c = 0; c < target.size(); ++c) {
      if (prepare_stop_.load(std::memory_order_acquire)) return;
      uint32_t from = 0, to = 0;
      {
        MutexLock lock(&mu_);
        const SubPool& p = pool->sub_pool(c);
        from = p.active;
        if (from >= target[c]) continue;
        to = std::min(target[c], p.RoundToGrants(uint64_t{from} + p.grant));
      }
      const SubPool& p = pool->sub_pool(c);  // its fields other than `active` never change
      if (Status allocated = pool->AllocateData(c, from, to); !allocated.ok()) {
        log::Warning("cache", "pool {}: the background growth stops at {}: {}", pool_path_,
                     FormatByteSize(pool->active_bytes()), allocated.ToString());
        return;
      }
      const std::vector<PoolRegion> grants = GrantsOf(p, from, to);
      Status registered;
      size_t told = 0;
      for (const PoolRegion& r : grants) {
        ++told;
        if (added) registered = added(r);
        if (!registered.ok()) break;
      }
      Status published = registered;
      if (published.ok()) {
        MutexLock lock(&mu_);
        published = pool->SetActive(c, to, /*allocated=*/true);
        if (published.ok()) {
          if (c == 0) {
            index_->Grow(to);
          } else {
            Part(c).Grow(to);
          }
          PublishActiveLocked();
        }
      }
      pool_cv_.notify_all();
      if (!published.ok()) {
        // Not reachable for copies (DMA registration failed) or not recorded: its slots are never handed out.
        for (size_t i = 0; i < told; ++i) {
          if (gone) gone(grants[i]);
        }
        pool->FreeData(c, from, to);
        log::Warning("cache", "pool {}: the background growth stops at {}: {}", pool_path_,
                     FormatByteSize(pool->active_bytes()), published.ToString());
        return;
      }
      grew = true;
    }
  }
}

}  // namespace flexkv

namespace flexkv {

void Cache::StartRegisteringLocked() {
  index_->LimitTo(0);
  for (size_t c = 1; c < pool_->component_count(); ++c) Part(c).LimitTo(0);
  preparation_ = Preparation{};
  preparation_.preparing = true;
  preparation_.target_bytes = pool_->active_bytes();
  preparation_.started_ms = MonotonicMs();
  prepare_stop_.store(false, std::memory_order_release);
  MutexLock t(&thread_mu_);
  prepare_thread_ = std::thread([this] { RegisterRestored(); });
}

void Cache::RegisterRestored() {
  std::function<Status(const PoolRegion&)> added;
  Pool* pool = nullptr;
  {
    MutexLock lock(&mu_);
    added = pool_listener_;
    pool = pool_.get();  // not replaced while this runs (DropDomain stops it first)
  }
  // Round robin over the components, one grant each, so that a hybrid domain's stores find room in every one soon.
  // A component's active part does not change while this runs (Resize is refused).
  std::vector<uint32_t> next(pool->component_count(), 0);
  for (bool any = true; any;) {
    any = false;
    for (size_t c = 0; c < pool->component_count(); ++c) {
      if (prepare_stop_.load(std::memory_order_acquire)) break;
      const SubPool& p = pool->sub_pool(c);
      if (next[c] >= p.active) continue;
      const uint32_t slots = std::min(p.grant, p.active - next[c]);
      // A grant the listener refuses is kept: it keeps the error for the sessions it concerns.
      if (added) {
        (void)added(PoolRegion{p.data + uint64_t{next[c]} * p.slot_bytes, uint64_t{slots} * p.slot_bytes,
                               p.slot_bytes, slots});
      }
      next[c] += slots;
      any = true;
      MutexLock lock(&mu_);
      if (c == 0) {
        index_->LimitTo(next[c]);
      } else {
        Part(c).LimitTo(next[c]);
      }
      if (preparation_.served_ms == 0) preparation_.served_ms = MonotonicMs();
    }
  }
  MutexLock lock(&mu_);
  // Stopped early (the domain is being dropped): the limits stay where they are; DropDomain gives everything back.
  preparation_.preparing = false;
  preparation_.done_ms = MonotonicMs();
  pool_cv_.notify_all();
  log::Info("cache", "pool {}: {} re-attached and registered in {} ms; its restored blocks are verified next",
            pool_path_, FormatByteSize(pool_->active_bytes()), preparation_.done_ms - preparation_.started_ms);
}

}  // namespace flexkv
