// See cache.h. Over 700 lines: the Cache's one lock guards the pool, the prefix index, the component indexes and
// the next-tier marks together, and the code that keeps them consistent under it stays in one file; its elastic
// capacity (cache_elastic.cc), next-tier write-back (cache_next_tier.cc) and background pool preparation
// (cache_prepare.cc) are split out already.
#include "daemon/cache/cache.h"

#include <fmt/format.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <unordered_set>

#include "common/clock.h"
#include "common/hybrid_ids.h"
#include "common/log.h"
#include "common/uds.h"
#include "common/units.h"

namespace flexkv {

Cache::Cache(uint64_t budget_bytes, std::string pool_path, PoolSplit split)
    : budget_bytes_(budget_bytes), pool_path_(std::move(pool_path)), split_(split), domain_(budget_bytes) {
  MutexLock lock(&mu_);
  pool_listener_ = [registry = registry_](const PoolRegion& region) { return registry->Added(region); };
  pool_gone_listener_ = [registry = registry_](const PoolRegion& region) { registry->Removed(region); };
}

Status Cache::SetBudget(uint64_t budget_bytes, uint64_t initial_active_bytes) {
  MutexLock lock(&mu_);
  const CacheDomain::View domain = domain_.Snapshot();
  if (domain.geometry) {
    return Status::FailedPrecondition(fmt::format(
        "the cache domain '{}' is set; its budget changes only once it is dropped", domain.model_namespace));
  }
  budget_bytes_.store(budget_bytes, std::memory_order_release);
  initial_active_bytes_.store(initial_active_bytes, std::memory_order_release);
  domain_.SetBudget(budget_bytes);
  return Status::Ok();
}

namespace {

// The index of each component >= 1 of `pool`.
std::vector<std::unique_ptr<ComponentIndex>> MakeParts(const Pool& pool) {
  std::vector<std::unique_ptr<ComponentIndex>> parts;
  for (size_t c = 1; c < pool.component_count(); ++c) {
    parts.push_back(std::make_unique<ComponentIndex>(pool.sub_pool(c).capacity, pool.sub_pool(c).active));
  }
  return parts;
}

}  // namespace

// The pool file is created at the first Attach (its geometry fixes the slot size); refuse to start when its
// filesystem (normally /dev/shm) cannot hold the budget, rather than failing that Attach.
Status Cache::CheckPoolSpace() const {
  const std::filesystem::path dir = std::filesystem::path(pool_path_).parent_path();
  struct statvfs vfs {};
  if (statvfs(dir.empty() ? "." : dir.c_str(), &vfs) != 0) return Status::Ok();  // Create reports the real error
  const uint64_t free_bytes = uint64_t{vfs.f_bavail} * vfs.f_frsize;
  const uint64_t budget_bytes = budget_bytes_.load(std::memory_order_acquire);
  if (free_bytes >= budget_bytes) return Status::Ok();
  return Status::ResourceExhausted(fmt::format(
      "cannot allocate the {} pool file {}: only {} free in {}; free space there (df -h) or lower --pool-size",
      FormatByteSize(budget_bytes), pool_path_, FormatByteSize(free_bytes), dir.empty() ? "." : dir.string()));
}

Status Cache::RecoverPool(bool discard, std::span<const uint64_t> other_budgets) {
  const std::filesystem::path dir = std::filesystem::path(pool_path_).parent_path();
  if (!dir.empty() && !std::filesystem::exists(dir)) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec || chmod(dir.c_str(), 0700) != 0) {
      return Status::FailedPrecondition(fmt::format("cannot create pool directory {}: {}", dir.string(), ec.message()));
    }
  }
  auto pool_lock = PoolLock::Acquire(pool_path_);
  if (!pool_lock.ok()) return pool_lock.status();
  pool_lock_ = std::move(*pool_lock);
  const std::optional<uint32_t> version = Pool::FileLayoutVersion(pool_path_);
  if (version && *version < kPoolLayoutVersion) {
    // Its blocks carry no content checksum, so nothing could show they are intact: a cache may drop them.
    log::Warning("cache",
                 "pool file {} has layout version {} (written by an older flexkvd, without block checksums): its "
                 "blocks cannot be verified and are dropped; the first Attach creates a version {} pool",
                 pool_path_, *version, kPoolLayoutVersion);
    ::unlink(pool_path_.c_str());
    return CheckPoolSpace();
  }
  auto pool = Pool::Open(pool_path_, budget_bytes(), split_);
  for (const uint64_t budget : other_budgets) {
    if (pool.ok() || pool.status().code() != StatusCode::kFailedPrecondition) break;
    auto other = Pool::Open(pool_path_, budget, split_);
    if (!other.ok()) continue;
    pool = std::move(other);
    budget_bytes_.store(budget, std::memory_order_release);
    domain_.SetBudget(budget);
  }
  if (!pool.ok()) {
    if (pool.status().code() == StatusCode::kNotFound) return CheckPoolSpace();
    if (!discard) return pool.status();
    log::Warning("cache", "discarding pool file {} as asked (--discard-pool): {}", pool_path_, pool.status().message());
    ::unlink(pool_path_.c_str());
    return CheckPoolSpace();
  }
  MutexLock lock(&mu_);
  uint64_t dropped = 0, corrupt = 0;
  auto committed = (*pool)->Recover(&dropped, &corrupt);
  // A slot entry that fails its checksum (changed, or moved from another slot) loses its block.
  counters_.data_loss_blocks.fetch_add(corrupt, std::memory_order_relaxed);
  auto index = std::make_unique<PrefixIndex>((*pool)->sub_pool(0).capacity, (*pool)->sub_pool(0).active);
  auto parts = MakeParts(**pool);
  std::vector<Pool::Committed> restored;
  restored.reserve(committed.size());
  std::unordered_set<BlockKey, BlockKeyHash> full_keys;  // FULL blocks restored (a component entry needs its own)
  for (const Pool::Committed& c : committed) {
    Status placed;
    if (c.component == 0) {
      placed = index->RestoreUnverified(c.slot, c.key, c.parent);
      if (placed.ok()) full_keys.insert(c.key);
    } else if (!full_keys.contains(c.key)) {
      placed = Status::FailedPrecondition("its FULL block is gone");  // it serves no prefix end
    } else {
      placed = parts[c.component - 1]->RestoreUnverified(c.slot - (*pool)->sub_pool(c.component).base, c.key);
    }
    if (placed.ok()) {
      restored.push_back(c);
    } else {
      (*pool)->MarkFree(c.slot);
      ++dropped;
    }
  }
  // A domain is kept across a restart only for its blocks: an empty one (say, fixed by one odd Attach whose
  // session then left) would otherwise lock every other geometry out until --discard-pool.
  if (index->unverified_blocks() == 0) {
    log::Info("cache", "pool {} holds no blocks: its domain '{}' is not kept, the first Attach fixes the domain",
              pool_path_, (*pool)->model_namespace());
    (*pool).reset();
    ::unlink(pool_path_.c_str());
    return CheckPoolSpace();
  }
  Status admitted = domain_.Admit((*pool)->model_namespace(), (*pool)->geometry(), (*pool)->creator_uid());
  if (!admitted.ok()) {
    return admitted.WithContext(
        fmt::format("pool file {} (start with --discard-pool to replace it; its blocks are lost)", pool_path_));
  }
  log::Info("cache",
            "re-attached pool {}: {} committed blocks restored (served once their bytes are verified), {} incomplete, "
            "orphaned or corrupt dropped ({} slot entries failed their checksum); domain '{}' {}, created by uid {}",
            pool_path_, index->unverified_blocks(), dropped, corrupt, (*pool)->model_namespace(),
            (*pool)->geometry().ToString(), (*pool)->creator_uid());
  unverified_ = std::move(restored);
  // Registering a pool of tens of GiB for DMA takes seconds (about 10 s for 96 GiB on an H100 node): in the
  // background, so that the daemon serves at once; the restored blocks are served (verified) after it.
  AdoptPoolLocked(std::move(*pool), std::move(index), std::move(parts), /*announce=*/!prepare_in_background_);
  if (prepare_in_background_) StartRegisteringLocked();
  return Status::Ok();
}

Status Cache::Admit(const std::string& model_namespace, const Geometry& geometry, uid_t creator_uid) {
  // A hybrid geometry whose sub-pools the budget cannot hold is refused before it fixes the domain (it would
  // otherwise hold the daemon to a geometry that has no pool).
  if (geometry.is_hybrid() && geometry.Validate().ok() && !domain_.Snapshot().geometry) {
    auto split = SplitBudget(geometry, budget_bytes(), split_);
    if (!split.ok()) return split.status();
  }
  FLEXKV_RETURN_IF_ERROR(domain_.Admit(model_namespace, geometry, creator_uid));
  MutexLock lock(&mu_);
  if (pool_ || preparation_.preparing) return Status::Ok();
  // The domain's creator, not this caller's uid: two first Attaches may race, and the one that fixed the domain wins.
  const uid_t creator = domain_.Snapshot().creator_uid.value_or(creator_uid);
  if (!prepare_in_background_) return CreatePoolLocked(model_namespace, geometry, creator);
  const uint64_t target = std::min(initial_active_bytes_.load(std::memory_order_acquire), budget_bytes());
  FLEXKV_RETURN_IF_ERROR(CheckSpaceFor(target));
  MutexLock t(&thread_mu_);
  if (prepare_thread_.joinable()) prepare_thread_.join();  // an earlier preparation that failed: it has ended
  prepare_stop_.store(false, std::memory_order_release);
  preparation_ = Preparation{};
  preparation_.preparing = true;
  preparation_.target_bytes = target;
  preparation_.started_ms = MonotonicMs();
  prepare_thread_ = std::thread([this, model_namespace, geometry, creator, target] {
    Prepare(model_namespace, geometry, creator, target);
  });
  return Status::Ok();
}

Status Cache::CreatePoolLocked(const std::string& model_namespace, const Geometry& geometry, uid_t creator_uid) {
  auto pool = Pool::Create(pool_path_, model_namespace, geometry, budget_bytes(), creator_uid, split_,
                           initial_active_bytes_.load(std::memory_order_acquire));
  if (!pool.ok()) return pool.status();
  FLEXKV_RETURN_IF_ERROR(pool_lock_.LockPoolFile());
  auto index = std::make_unique<PrefixIndex>((*pool)->sub_pool(0).capacity, (*pool)->sub_pool(0).active);
  auto parts = MakeParts(**pool);
  AdoptPoolLocked(std::move(*pool), std::move(index), std::move(parts));
  return Status::Ok();
}

void Cache::AdoptPoolLocked(std::unique_ptr<Pool> pool, std::unique_ptr<PrefixIndex> index,
                            std::vector<std::unique_ptr<ComponentIndex>> parts, bool announce, bool new_generation) {
  pool_ = std::move(pool);
  index_ = std::move(index);
  parts_ = std::move(parts);
  Pool* p = pool_.get();
  // Listeners run inside index calls, which run under mu_.
  index_->SetEvictionListener([this, p](SlotId slot, const BlockKey& key) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    p->MarkFree(slot);
    UnanchorLocked(key);
    ForgetNextTierLocked(slot, /*evicted=*/true);
    ReportBlockLocked(BlockEvent::kRemoved, key, false, BlockEvent::kEvicted);
  });
  {
    const CacheDomain::View domain = domain_.Snapshot();
    event_namespace_ = domain.model_namespace;
    event_tokens_per_block_ = domain.geometry ? domain.geometry->tokens_per_block : 0;
    event_geometry_ = domain.geometry;
  }
  on_next_.assign(pool_->capacity(), 0);  // every component's slots
  touched_.assign(pool_->capacity(), 0);
  touch_queue_.clear();
  component_bytes_stored_.assign(pool_->component_count(), 0);
  commit_queue_.clear();
  writing_ = 0;
  for (size_t c = 1; c < pool_->component_count(); ++c) {
    const SlotId base = pool_->sub_pool(c).base;
    Part(c).SetEvictionListener([this, p, base, c](SlotId local, const BlockKey& key) ABSL_NO_THREAD_SAFETY_ANALYSIS {
      // An unverified entry was never reported stored: its drop is not reported either.
      if (!Part(c).IsUnverified(local)) {
        ReportBlockLocked(BlockEvent::kRemoved, key, false, dropping_ ? BlockEvent::kDropped : BlockEvent::kEvicted,
                          BlockKey{}, static_cast<uint8_t>(c));
      }
      p->MarkFree(base + local);
      ForgetNextTierLocked(base + local, /*evicted=*/true);
    });
  }
  if (new_generation) generation_.fetch_add(1, std::memory_order_acq_rel);
  PublishActiveLocked();
  has_pool_.store(true, std::memory_order_release);
  for (size_t c = 0; announce && c < pool_->component_count(); ++c) {
    AnnounceAllAddedLocked(c, 0, pool_->sub_pool(c).active);  // the listener keeps an error for its sessions
  }
}

Status Cache::DropDomain(bool only_if_empty, uint64_t* dropped_blocks) {
  StopPreparation();  // a pool being prepared is dropped (or kept, if refused below) at the size it reached
  MutexLock lock(&mu_);
  const CacheDomain::View domain = domain_.Snapshot();
  if (!domain.geometry) return Status::NotFound("no cache domain is set; the first Attach fixes one");
  if (verifying_) {
    return Status::FailedPrecondition(
        "the blocks restored at start are still being verified; retry once flexkvctl status shows none");
  }
  if (index_) {
    if (index_->unverified_blocks() > 0) {
      return Status::FailedPrecondition(fmt::format(
          "{} blocks restored at start are still being verified; retry once flexkvctl status shows none",
          index_->unverified_blocks()));
    }
    if (index_->pinned_slots() > 0) {
      return Status::FailedPrecondition(fmt::format(
          "{} blocks are still pinned (a session's end releasing them, a scrub reading them, or {} being written to "
          "the SSD tier); retry in a moment", index_->pinned_slots(), writing_));
    }
    if (index_->used_slots() != index_->committed_blocks()) {
      return Status::FailedPrecondition(
          fmt::format("{} blocks are being stored; retry in a moment", index_->used_slots() - index_->committed_blocks()));
    }
    for (const auto& part : parts_) {
      if (part->unverified_entries() > 0 || part->pinned_slots() > 0 ||
          part->used_slots() != part->committed_entries()) {
        return Status::FailedPrecondition(
            "window or state entries are still being stored, verified or read; retry in a moment");
      }
    }
    if (only_if_empty && index_->committed_blocks() > 0) {
      return Status::FailedPrecondition(fmt::format("the domain '{}' holds {} blocks", domain.model_namespace,
                                                    index_->committed_blocks()));
    }
  }
  const uint64_t blocks = index_ ? index_->committed_blocks() : 0;
  if (index_ && blocks > 0) ReportBlockLocked(BlockEvent::kDomainDropped, BlockKey{}, false, BlockEvent::kAdminDropped);
  for (size_t c = 0; pool_ && c < pool_->component_count(); ++c) {
    AnnounceGrantsLocked(pool_gone_listener_, c, 0, pool_->sub_pool(c).active);
  }
  has_pool_.store(false, std::memory_order_release);
  capacity_.store(0, std::memory_order_release);
  for (auto& active : active_slots_) active.store(0, std::memory_order_release);
  index_.reset();
  parts_.clear();
  on_next_.clear();
  touched_.clear();
  touch_queue_.clear();
  commit_queue_.clear();
  writing_ = 0;
  if (pool_) {
    pool_.reset();
    ::unlink(pool_path_.c_str());
  }
  domain_.Reset();
  preparation_ = Preparation{};
  generation_.fetch_add(1, std::memory_order_acq_rel);
  if (dropped_blocks != nullptr) *dropped_blocks = blocks;
  log::Warning("cache", "dropped cache domain '{}' {} and its pool {} ({} blocks lost); the next Attach fixes the domain",
               domain.model_namespace, domain.geometry->ToString(), pool_path_, blocks);
  return Status::Ok();
}

std::vector<SlotId> Cache::component_bases() const {
  MutexLock lock(&mu_);
  std::vector<SlotId> bases;
  for (size_t c = 0; pool_ && c < pool_->component_count(); ++c) bases.push_back(pool_->sub_pool(c).base);
  return bases;
}

void Cache::AddObserver(std::shared_ptr<CacheObserver> observer) {
  // The grants first (announced so far; waits for one in flight, without holding up the cache), then the blocks.
  registry_->Add(observer);
  MutexLock lock(&mu_);
  observers_.push_back(std::move(observer));
  RebuildListenersLocked();
}

void Cache::RemoveObserver(const CacheObserver* observer) {
  {
    MutexLock lock(&mu_);
    std::erase_if(observers_, [observer](const std::shared_ptr<CacheObserver>& o) { return o.get() == observer; });
    RebuildListenersLocked();
  }
  registry_->Remove(observer);  // waits for an announcement in flight (a background preparation's)
}

void Cache::RebuildListenersLocked() {
  block_observers_ = std::any_of(observers_.begin(), observers_.end(),
                                 [](const std::shared_ptr<CacheObserver>& o) { return o->wants_blocks(); });
}

bool Cache::has_pool() const { return has_pool_.load(std::memory_order_acquire); }

uint32_t Cache::capacity_slots() const { return capacity_.load(std::memory_order_acquire); }

uint64_t Cache::block_bytes() const {
  MutexLock lock(&mu_);
  return pool_ ? pool_->block_bytes() : 0;
}

uint8_t* Cache::SlotData(SlotId slot) const { return pool_->SlotData(slot); }

uint64_t Cache::SlotBytes(SlotId slot) const { return pool_->SlotBytes(slot); }

size_t Cache::Match(std::span<const BlockKey> keys, bool pin, std::vector<SlotId>* pinned) {
  MutexLock lock(&mu_);
  if (!index_) return 0;
  if (!parts_.empty()) return HybridMatchLocked(keys, pin, pinned);
  ++next_tier_epoch_;  // the eviction order may change
  if (!next_tier_) return index_->Match(keys, pin, pinned);
  // The hits the next tier holds too are touched there (TakeTouched), so that a block DRAM always serves keeps a
  // recent copy on SSD.
  std::vector<SlotId> local;
  std::vector<SlotId>* hits = pinned != nullptr ? pinned : &local;
  const size_t before = hits->size();
  const size_t n = index_->Match(keys, pin, hits);
  NoteHitsLocked(std::span<const SlotId>(*hits).subspan(before));
  return n;
}

size_t Cache::HybridMatchLocked(std::span<const BlockKey> keys, bool pin, std::vector<SlotId>* pinned) {
  const Geometry& g = pool_->geometry();
  const size_t full_prefix = index_->Match(keys, false, nullptr);
  std::vector<ComponentRule> rules;
  for (size_t c = 1; c < g.component_count(); ++c) {
    rules.push_back(ComponentRule{g.component_kind(c) == ComponentKind::kState, g.window_blocks(c)});
  }
  const size_t e = LongestUsableEnd(full_prefix, rules, [&](size_t c, size_t j) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return Part(c).Find(keys[j]).has_value();
  });
  if (!pin || e == 0) return e;
  // Pin all of it, in the order of a Load's ids.
  const HybridIdLayout layout = LayoutIds(g, false, static_cast<uint32_t>(e));
  const size_t first = pinned->size();
  pinned->resize(first + layout.total);
  std::vector<SlotId> full;
  index_->Match(keys.first(e), true, &full);
  std::copy(full.begin(), full.end(), pinned->begin() + static_cast<ptrdiff_t>(first + layout.offset[0]));
  for (size_t c = 1; c < g.component_count(); ++c) {
    const uint64_t n = ComponentIdCount(g, c, false, static_cast<uint32_t>(e));
    const SlotId base = pool_->sub_pool(c).base;
    for (uint64_t i = 0; i < n; ++i) {
      const SlotId local = *Part(c).Find(keys[e - n + i]);  // present: the hit rule just saw it, under this lock
      Part(c).Pin(local);
      (*pinned)[first + layout.offset[c] + i] = base + local;
    }
  }
  // The pieces the next tier holds too are touched there (TakeTouched), as for FULL-only domains.
  if (NextTierLocked()) NoteHitsLocked(std::span<const SlotId>(*pinned).subspan(first));
  return e;
}

void Cache::Unpin(std::span<const SlotId> slots) {
  MutexLock lock(&mu_);
  ++next_tier_epoch_;  // blocks may be evictable again
  UnpinLocked(slots);
}

void Cache::UnpinLocked(std::span<const SlotId> slots) {
  if (!index_) return;
  if (parts_.empty()) return index_->Unpin(slots);
  for (SlotId s : slots) {
    const size_t c = ComponentOfLocked(s);
    if (c == 0) {
      index_->Unpin(std::span<const SlotId>(&s, 1));
    } else {
      const SlotId local = LocalLocked(c, s);
      Part(c).Unpin(std::span<const SlotId>(&local, 1));
    }
  }
}

void Cache::UnanchorLocked(const BlockKey& key) {
  for (const auto& part : parts_) part->Unanchor(key);
}

Cache::HybridReservation Cache::ReserveHybrid(const BlockKey& parent, std::span<const BlockKey> keys,
                                              std::span<const uint32_t> boundaries, uint32_t window_keys,
                                              bool may_wait) {
  MutexLock lock(&mu_);
  HybridReservation r;
  if (!index_) {
    r.full.shortfall = r.shortfall = StatusCode::kFailedPrecondition;
    return r;
  }
  const Geometry& g = pool_->geometry();
  r.keys.resize(g.component_count());
  r.slots.resize(g.component_count());
  for (size_t c = 1; c < g.component_count(); ++c) {
    std::vector<BlockKey>& ck = r.keys[c];
    if (g.component_kind(c) == ComponentKind::kSlidingWindow) {
      const size_t n = window_keys != 0 ? std::min<size_t>(window_keys, keys.size())
                                        : std::min<size_t>(g.window_blocks(c), keys.size());
      ck.assign(keys.end() - static_cast<ptrdiff_t>(n), keys.end());
    } else {
      for (uint32_t b : boundaries) ck.push_back(keys[b - 1]);
    }
  }
  auto refuse = [&](StatusCode code, size_t component) {
    r.keys.clear();
    r.slots.clear();
    r.shortfall = code;
    r.component = component;
    return r;
  };
  // All or none, and a refused store evicts nothing: the other components are checked first (without changing
  // them), then the FULL part is reserved (which evicts), then the other components (which cannot fail now: nothing
  // in between pinned or reserved their entries, and FULL evictions only unanchor them).
  // With a write-back that keeps up, a store waits for it rather than lose unwritten entries or be refused by the
  // pins of writes in flight (nothing reserved, nothing evicted).
  const bool wait_allowed = may_wait && StoreWaitMsLocked() > 0;
  const auto wait = [&] {
    r.keys.clear();
    r.slots.clear();
    r.full = PrefixIndex::Reservation{};
    r.wait_for_write_back = true;
    return r;
  };
  for (size_t c = 1; c < g.component_count(); ++c) {
    const StatusCode feasible = Part(c).Feasible(r.keys[c]);
    if (wait_allowed && feasible == StatusCode::kResourceExhausted && writing_ > 0) return wait();
    if (feasible != StatusCode::kOk) return refuse(feasible, c);
    if (wait_allowed && !Part(c).FitsWithoutDirty(r.keys[c])) return wait();
  }
  r.full = index_->Reserve(parent, keys, /*allow_dirty=*/!wait_allowed);
  if (wait_allowed && (r.full.dirty_only || (r.full.shortfall == StatusCode::kResourceExhausted && writing_ > 0))) {
    index_->Abort(r.full.slots);  // the clean blocks it evicted were on the next tier: nothing lost
    return wait();
  }
  if (r.full.shortfall != StatusCode::kOk) {
    index_->Abort(r.full.slots);
    r.full.slots.clear();
    return refuse(r.full.shortfall, 0);
  }
  for (SlotId s : r.full.slots) ForgetNextTierLocked(s, /*evicted=*/false);
  // The FULL evictions unanchored entries of the other components (they go first at eviction): checked again. The
  // FULL blocks evicted were on the next tier, and their entries stay: aborting here loses nothing.
  for (size_t c = 1; wait_allowed && c < g.component_count(); ++c) {
    if (!Part(c).FitsWithoutDirty(r.keys[c])) {
      index_->Abort(r.full.slots);
      return wait();
    }
  }
  for (size_t c = 1; c < g.component_count(); ++c) {
    ComponentIndex::Reservation part = Part(c).Reserve(r.keys[c]);
    if (part.shortfall != StatusCode::kOk) {  // a repeated key (the client's): give back what was taken
      for (size_t d = 1; d < c; ++d) {
        std::vector<SlotId> local;
        for (SlotId s : r.slots[d]) {
          if (s != ComponentIndex::kNoSlot) local.push_back(LocalLocked(d, s));
        }
        Part(d).Abort(local);
      }
      index_->Abort(r.full.slots);
      r.full.slots.clear();
      return refuse(part.shortfall, c);
    }
    const SlotId base = pool_->sub_pool(c).base;
    for (SlotId& s : part.slots) {
      if (s == ComponentIndex::kNoSlot) continue;
      s += base;
      ForgetNextTierLocked(s, /*evicted=*/false);
    }
    r.slots[c] = std::move(part.slots);
  }
  return r;
}

void Cache::CommitHybrid(const BlockKey& parent, std::span<const BlockKey> keys, const HybridReservation& r,
                         const std::vector<std::vector<uint64_t>>& checksums) {
  MutexLock lock(&mu_);
  if (!index_) return;  // DropDomain waits for copies in flight
  const size_t first = r.full.cached;
  index_->Commit(r.full.slots);
  // Each sub-pool's demand: what this store added to it (the same bytes the copies moved).
  component_bytes_stored_[0] += r.full.slots.size() * pool_->sub_pool(0).slot_bytes;
  for (size_t c = 1; c < r.slots.size(); ++c) {
    const auto added = std::count_if(r.slots[c].begin(), r.slots[c].end(),
                                     [](SlotId s) { return s != ComponentIndex::kNoSlot; });
    component_bytes_stored_[c] += static_cast<uint64_t>(added) * pool_->sub_pool(c).slot_bytes;
  }
  std::vector<BlockKey> gone;  // FULL blocks of this store dropped while they copied: their windows and states serve nothing
  for (size_t i = 0; i < r.full.slots.size(); ++i) {
    const SlotId slot = r.full.slots[i];
    if (!index_->IsCommitted(slot)) {  // dropped with a failed ancestor while it copied
      gone.push_back(keys[first + i]);
      continue;
    }
    const size_t k = first + i;
    pool_->MarkCommitted(slot, keys[k], k == 0 ? parent : keys[k - 1], checksums[0][i]);
    for (const auto& part : parts_) part->Anchor(keys[k]);
    ReportBlockLocked(BlockEvent::kCommitted, keys[k], k + 1 == keys.size(), BlockEvent::kStored,
                      k == 0 ? parent : keys[k - 1]);
    QueueCommitLocked(slot);
  }
  const Geometry& g = pool_->geometry();
  for (size_t c = 1; c < r.slots.size(); ++c) {
    // A window's entries before its trailing window (a store's window_keys beyond it) go in at the cold end.
    const size_t trailing = g.component_kind(c) == ComponentKind::kSlidingWindow
                                ? std::min<size_t>(g.window_blocks(c), keys.size())
                                : r.slots[c].size();
    const size_t extra = r.slots[c].size() - std::min(trailing, r.slots[c].size());
    std::vector<SlotId> local;
    size_t cold = 0;
    for (size_t i = 0; i < r.slots[c].size(); ++i) {
      const SlotId s = r.slots[c][i];
      if (s == ComponentIndex::kNoSlot) continue;
      local.push_back(LocalLocked(c, s));
      if (i < extra) ++cold;
    }
    Part(c).Commit(local, cold);
    size_t n = 0;
    for (size_t i = 0; i < r.slots[c].size(); ++i) {
      const SlotId s = r.slots[c][i];
      if (s == ComponentIndex::kNoSlot) continue;
      const uint64_t sum = checksums[c][n++];
      if (!Part(c).IsCommitted(LocalLocked(c, s))) continue;
      pool_->MarkCommitted(s, r.keys[c][i], BlockKey{}, sum);
      ReportBlockLocked(BlockEvent::kCommitted, r.keys[c][i], false, BlockEvent::kStored, BlockKey{},
                        static_cast<uint8_t>(c));
      QueueCommitLocked(s);
    }
  }
  for (const BlockKey& key : gone) UnanchorLocked(key);
  ++next_tier_epoch_;
}

void Cache::AbortHybrid(const HybridReservation& r) {
  MutexLock lock(&mu_);
  if (!index_) return;
  index_->Abort(r.full.slots);
  for (size_t c = 1; c < r.slots.size(); ++c) {
    std::vector<SlotId> local;
    for (SlotId s : r.slots[c]) {
      if (s != ComponentIndex::kNoSlot) local.push_back(LocalLocked(c, s));
    }
    Part(c).Abort(local);
  }
}

PrefixIndex::Reservation Cache::Reserve(const BlockKey& parent, std::span<const BlockKey> keys, bool may_wait) {
  MutexLock lock(&mu_);
  if (!index_) {
    PrefixIndex::Reservation none;
    none.shortfall = StatusCode::kFailedPrecondition;
    return none;
  }
  const bool allow_dirty = !may_wait || StoreWaitMsLocked() == 0;
  PrefixIndex::Reservation r = index_->Reserve(parent, keys, allow_dirty);
  for (SlotId s : r.slots) ForgetNextTierLocked(s, /*evicted=*/false);
  return r;
}

void Cache::Commit(const BlockKey& parent, std::span<const BlockKey> keys, size_t first, std::span<const SlotId> slots,
                   std::span<const uint64_t> content_checksums, BlockEvent::Cause cause) {
  MutexLock lock(&mu_);
  if (!index_) return;  // DropDomain waits for copies in flight; a dropped pool has nothing to commit into
  index_->Commit(slots);
  for (size_t i = 0; i < slots.size(); ++i) {
    if (!index_->IsCommitted(slots[i])) continue;  // dropped with a failed ancestor while it copied
    const size_t k = first + i;
    pool_->MarkCommitted(slots[i], keys[k], k == 0 ? parent : keys[k - 1], content_checksums[i]);
    QueueCommitLocked(slots[i]);
    ReportBlockLocked(BlockEvent::kCommitted, keys[k], k + 1 == keys.size(), cause, k == 0 ? parent : keys[k - 1]);
  }
  ++next_tier_epoch_;
}

std::optional<uint64_t> Cache::EntryChecksum(SlotId slot) const {
  MutexLock lock(&mu_);
  if (!pool_ || slot >= pool_->capacity()) return std::nullopt;
  const std::optional<Pool::Committed> entry = pool_->Entry(slot);
  if (!entry) return std::nullopt;
  return entry->content_checksum;
}

void Cache::ReportBlockLocked(BlockEvent::Kind kind, const BlockKey& key, bool request_end, BlockEvent::Cause cause,
                              const BlockKey& parent, uint8_t component) {
  if (!block_observers_) return;
  BlockEvent e;
  e.kind = kind;
  e.key = key;
  e.request_end = request_end;
  e.cause = cause;
  e.parent = parent;
  e.model_namespace = event_namespace_;
  e.tokens_per_block = event_tokens_per_block_;
  e.component = component;
  e.hybrid = !parts_.empty();
  e.geometry = event_geometry_ ? &*event_geometry_ : nullptr;
  for (const std::shared_ptr<CacheObserver>& o : observers_) {
    if (o->wants_blocks()) o->BlockChanged(e);
  }
}

void Cache::SnapshotBlocks(const std::function<void()>& mark,
                           const std::function<void(const BlockKey& key, const BlockKey& parent, uint8_t component)>& each,
                           std::optional<Geometry>* geometry, std::string* model_namespace) const {
  MutexLock lock(&mu_);
  mark();
  if (geometry != nullptr) *geometry = event_geometry_;
  if (model_namespace != nullptr) *model_namespace = event_namespace_;
  if (!index_ || !pool_) return;
  const SlotId end = pool_->sub_pool(0).capacity;
  for (SlotId s = 0; s < end; ++s) {
    if (!index_->IsCommitted(s)) continue;
    if (const std::optional<Pool::Committed> entry = pool_->Entry(s)) each(entry->key, entry->parent, 0);
  }
  for (size_t c = 1; c < pool_->component_count(); ++c) {
    Part(c).ForEachCommitted([&each, c](SlotId, const BlockKey& key) { each(key, BlockKey{}, static_cast<uint8_t>(c)); });
  }
}

std::vector<Pool::Committed> Cache::TakeUnverified() {
  MutexLock lock(&mu_);
  std::vector<Pool::Committed> taken = std::move(unverified_);
  unverified_.clear();
  verifying_ = !taken.empty();
  return taken;
}

void Cache::EndVerification() {
  MutexLock lock(&mu_);
  verifying_ = false;
}

void Cache::KeepUnverified(std::vector<Pool::Committed>* batch) const {
  MutexLock lock(&mu_);
  size_t kept = 0;
  if (!index_) batch->clear();  // dropped meanwhile (DropDomain refuses while blocks are being verified)
  for (const Pool::Committed& c : *batch) {
    const bool unverified = c.component == 0 ? index_->IsUnverified(c.slot)
                                             : Part(c.component).IsUnverified(LocalLocked(c.component, c.slot));
    if (unverified) (*batch)[kept++] = c;
  }
  batch->resize(kept);
}

bool Cache::ContentMatches(SlotId slot, uint64_t content_checksum) const {
  return pool_->ContentMatches(slot, content_checksum);
}

bool Cache::RewriteInSlotOrder(const Pool::Committed& block) { return pool_->RewriteInSlotOrder(block).has_value(); }

Status Cache::AdoptRankMajorSlots() {
  MutexLock lock(&mu_);
  return pool_ ? pool_->AdoptRankMajorSlots() : Status::Ok();
}

std::optional<uint64_t> Cache::RewriteReservedInSlotOrder(SlotId slot, uint64_t layer_major_checksum) {
  return pool_->RewriteBytesInSlotOrder(slot, layer_major_checksum);
}

std::vector<Cache::CheckTarget> Cache::PinForCheck(SlotId begin, SlotId end) {
  MutexLock lock(&mu_);
  std::vector<CheckTarget> out;
  if (!index_) return out;
  end = std::min(end, pool_->capacity());
  for (SlotId s = begin; s < end; ++s) {
    const size_t c = ComponentOfLocked(s);
    if (!(c == 0 ? index_->PinSlot(s) : Part(c).PinSlot(LocalLocked(c, s)))) continue;
    const std::optional<Pool::Committed> entry = pool_->Entry(s);
    out.push_back(CheckTarget{s, entry ? std::optional<uint64_t>(entry->content_checksum) : std::nullopt});
  }
  return out;
}

size_t Cache::FinishChecks(std::span<const SlotId> passed, std::span<const SlotId> unpin,
                           std::span<const SlotId> failed) {
  MutexLock lock(&mu_);
  if (!index_) return 0;  // dropped (DropDomain refuses while any slot is pinned, so nothing was checked)
  ++next_tier_epoch_;  // verified blocks become evictable
  // FULL blocks first and parents first (the verifier's order): a component entry does not depend on them.
  std::vector<SlotId> full_failed;
  for (SlotId s : passed) {
    const size_t c = ComponentOfLocked(s);
    if (c == 0) {
      const bool verified = index_->MarkVerified(s);
      // Write policy all: a restored block is written like a stored one (SSD answers "already there" for most).
      if (verified) QueueCommitLocked(s);
      if (verified && block_observers_) {
        if (const std::optional<Pool::Committed> entry = pool_->Entry(s)) {
          ReportBlockLocked(BlockEvent::kCommitted, entry->key, index_->ChildCount(s) == 0, BlockEvent::kRestored,
                            entry->parent);
        }
      }
    } else if (Part(c).MarkVerified(LocalLocked(c, s))) {
      QueueCommitLocked(s);
      if (block_observers_) {
        if (const std::optional<Pool::Committed> entry = pool_->Entry(s)) {
          ReportBlockLocked(BlockEvent::kCommitted, entry->key, false, BlockEvent::kRestored, BlockKey{},
                            static_cast<uint8_t>(c));
        }
      }
    }
  }
  size_t dropped = 0;
  for (SlotId s : failed) {
    const size_t c = ComponentOfLocked(s);
    if (c == 0) {
      full_failed.push_back(s);
    } else {
      const SlotId local = LocalLocked(c, s);
      dropping_ = true;  // its removal is reported as a drop
      dropped += Part(c).Drop(std::span<const SlotId>(&local, 1));  // its listener clears the slot entry
      dropping_ = false;
    }
  }
  UnpinLocked(unpin);
  if (failed.empty()) return 0;
  counters_.data_loss_blocks.fetch_add(failed.size(), std::memory_order_relaxed);
  // The slot entries go first: a restart must never restore a dropped block, even one a load still reads.
  return dropped + index_->DropSubtrees(full_failed, [this](SlotId s) ABSL_NO_THREAD_SAFETY_ANALYSIS {
           const std::optional<Pool::Committed> entry = pool_->Entry(s);
           pool_->MarkFree(s);
           if (entry) {
             UnanchorLocked(entry->key);
             ReportBlockLocked(BlockEvent::kRemoved, entry->key, false, BlockEvent::kDropped);
           }
         });
}

void Cache::Abort(std::span<const SlotId> slots) {
  MutexLock lock(&mu_);
  if (index_) index_->Abort(slots);
}

Cache::Stats Cache::GetStats() const {
  MutexLock lock(&mu_);
  Stats s;
  if (!index_) return s;
  s.capacity = pool_->sub_pool(0).active;
  s.used = index_->used_slots();
  s.pinned = index_->pinned_slots();
  s.blocks = index_->committed_blocks();
  s.evicted = index_->evicted_blocks();
  s.unverified = index_->unverified_blocks();
  s.backing = pool_->path();
  if (parts_.empty()) return s;
  const SubPool& full = pool_->sub_pool(0);
  s.components.push_back(ComponentStats{ComponentKind::kFull, full.slot_bytes, full.active, s.used, s.pinned,
                                        s.evicted, 0});
  for (size_t c = 1; c < pool_->component_count(); ++c) {
    const ComponentIndex& part = Part(c);
    const SubPool& sub = pool_->sub_pool(c);
    s.components.push_back(ComponentStats{sub.kind, sub.slot_bytes, sub.active, part.used_slots(),
                                          part.pinned_slots(), part.evicted_entries(), part.unanchored_entries()});
    s.capacity += sub.active;
    s.used += part.used_slots();
    s.pinned += part.pinned_slots();
    s.evicted += part.evicted_entries();
    s.unverified += part.unverified_entries();
  }
  return s;
}

}  // namespace flexkv
