// See cache_set.h.
#include "daemon/cache/cache_set.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>

#include "common/clock.h"
#include "common/log.h"
#include "common/units.h"
#include "daemon/cache/cache_domain.h"

namespace flexkv {

CounterValues CounterValues::Read(const CacheCounters& c) {
  CounterValues v;
  v.match_requests = c.match_requests.load(std::memory_order_relaxed);
  v.match_blocks = c.match_blocks.load(std::memory_order_relaxed);
  v.hit_blocks = c.hit_blocks.load(std::memory_order_relaxed);
  v.load_blocks = c.load_blocks.load(std::memory_order_relaxed);
  v.store_blocks = c.store_blocks.load(std::memory_order_relaxed);
  v.bytes_loaded = c.bytes_loaded.load(std::memory_order_relaxed);
  v.bytes_stored = c.bytes_stored.load(std::memory_order_relaxed);
  v.data_loss_blocks = c.data_loss_blocks.load(std::memory_order_relaxed);
  return v;
}

CounterValues CounterValues::operator-(const CounterValues& b) const {
  return CounterValues{match_requests - b.match_requests, match_blocks - b.match_blocks, hit_blocks - b.hit_blocks,
                       load_blocks - b.load_blocks,       store_blocks - b.store_blocks, bytes_loaded - b.bytes_loaded,
                       bytes_stored - b.bytes_stored,     data_loss_blocks - b.data_loss_blocks};
}

CounterValues CounterValues::operator+(const CounterValues& b) const {
  return CounterValues{match_requests + b.match_requests, match_blocks + b.match_blocks, hit_blocks + b.hit_blocks,
                       load_blocks + b.load_blocks,       store_blocks + b.store_blocks, bytes_loaded + b.bytes_loaded,
                       bytes_stored + b.bytes_stored,     data_loss_blocks + b.data_loss_blocks};
}

CacheSet::CacheSet(CacheSetOptions options) : options_(std::move(options)) {
  const size_t n = std::clamp<size_t>(options_.max_domains, 1, kMaxDomains);
  for (size_t i = 0; i < n; ++i) {
    caches_.push_back(std::make_unique<Cache>(options_.budget_bytes / n, PoolPathOf(options_.pool_path, i),
                                              options_.split));
    verifiers_.push_back(std::make_unique<BlockVerifier>(caches_.back().get()));
  }
  MutexLock lock(&mu_);
  slots_.resize(n);
}

CacheSet::~CacheSet() { verifiers_.clear(); }  // their threads read the caches

std::string CacheSet::PoolPathOf(const std::string& pool_path, size_t slot) {
  return slot == 0 ? pool_path : fmt::format("{}.{}", pool_path, slot);
}

void CacheSet::SetPoolListener(const std::function<void(const PoolRegion&)>& listener,
                               const std::function<void(const PoolRegion&)>& gone) {
  for (const auto& cache : caches_) cache->SetPoolListener(listener, gone);
}

uint64_t CacheSet::HeldLocked() const {
  uint64_t held = 0;
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (!slots_[i].model_namespace.empty()) held += caches_[i]->budget_bytes();
  }
  return held;
}

CacheSet::Share CacheSet::ShareFor(std::string_view model_namespace) const {
  MutexLock lock(&mu_);
  return ShareForLocked(model_namespace);
}

CacheSet::Share CacheSet::ShareForLocked(std::string_view model_namespace) const {
  Share share;
  if (auto it = options_.namespace_pool_bytes.find(model_namespace); it != options_.namespace_pool_bytes.end()) {
    share.limit = it->second;
    share.wanted = share.bytes = it->second;
    return share;
  }
  const uint64_t held = HeldLocked();
  const uint64_t free = options_.budget_bytes > held ? options_.budget_bytes - held : 0;
  share.wanted = options_.budget_bytes / caches_.size();
  share.bytes = std::min(share.wanted, free);
  return share;
}

std::optional<size_t> CacheSet::SlotOfLocked(std::string_view model_namespace) const {
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (!slots_[i].model_namespace.empty() && slots_[i].model_namespace == model_namespace) return i;
  }
  return std::nullopt;
}

std::optional<size_t> CacheSet::FreeSlotLocked() const {
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].model_namespace.empty()) return i;
  }
  return std::nullopt;
}

std::string CacheSet::DescribeLocked() const {
  std::vector<std::pair<uint64_t, size_t>> order;  // (creation order, slot)
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (!slots_[i].model_namespace.empty()) order.emplace_back(slots_[i].order, i);
  }
  std::sort(order.begin(), order.end());
  std::string out;
  for (const auto& [created, i] : order) {
    const Cache::Stats stats = caches_[i]->GetStats();
    out += fmt::format("{}'{}' holds {} ({} blocks{})", out.empty() ? "" : ", ", slots_[i].model_namespace,
                       FormatByteSize(caches_[i]->budget_bytes()), stats.blocks,
                       slots_[i].limit_bytes != 0 ? ", its pool_size" : "");
  }
  return out.empty() ? std::string("no domain exists") : out;
}

void CacheSet::ForgetLocked(size_t slot) { slots_[slot] = Slot{}; }

Status CacheSet::RecoverPools(bool discard) {
  {
    MutexLock lock(&mu_);
    for (size_t i = 0; i < caches_.size(); ++i) {
      Cache& cache = *caches_[i];
      // The budgets a file of this slot may have been made for: a namespace's pool_size, the default share, or
      // the default share cut to what the domains before it left.
      const uint64_t held = HeldLocked();
      const uint64_t free = options_.budget_bytes > held ? options_.budget_bytes - held : 0;
      const uint64_t default_share = options_.budget_bytes / caches_.size();
      std::vector<uint64_t> others;
      for (const auto& [name, bytes] : options_.namespace_pool_bytes) others.push_back(bytes);
      if (free != 0 && free < default_share) others.push_back(free);
      FLEXKV_RETURN_IF_ERROR(cache.SetBudget(default_share));
      FLEXKV_RETURN_IF_ERROR(cache.RecoverPool(discard, others));
      const CacheDomain::View view = cache.Domain();
      if (!view.geometry) continue;
      const Share share = ShareForLocked(view.model_namespace);
      const uint64_t has = cache.budget_bytes();
      std::string refusal;
      if (SlotOfLocked(view.model_namespace)) {
        refusal = fmt::format("pool file {} is a second domain of namespace '{}' (one domain per namespace)",
                              cache.pool_path(), view.model_namespace);
      } else if (share.limit != 0 ? has != share.limit : has > share.wanted) {
        refusal = fmt::format(
            "pool file {} of namespace '{}' was made for a share of {}, but the config gives it {}{} (--pool-size {}, "
            "--max-domains {})",
            cache.pool_path(), view.model_namespace, FormatByteSize(has), share.limit != 0 ? "" : "at most ",
            FormatByteSize(share.limit != 0 ? share.limit : share.wanted), FormatByteSize(options_.budget_bytes),
            caches_.size());
      } else if (has > free) {
        refusal = fmt::format(
            "pool file {} of namespace '{}' holds a share of {} but the domains re-attached before it leave {} of the "
            "{} budget ({})",
            cache.pool_path(), view.model_namespace, FormatByteSize(has), FormatByteSize(free),
            FormatByteSize(options_.budget_bytes), DescribeLocked());
      }
      if (!refusal.empty()) {
        if (!discard) {
          return Status::FailedPrecondition(refusal +
                                            "; start with the config it was made with, or with --discard-pool to drop "
                                            "it (its blocks are lost)");
        }
        log::Warning("cache", "{}: dropped as asked (--discard-pool), its blocks are lost", refusal);
        uint64_t dropped = 0;
        FLEXKV_RETURN_IF_ERROR(cache.DropDomain(/*only_if_empty=*/false, &dropped));
        continue;
      }
      // Counted from zero: what the restart check drops counts against this domain.
      slots_[i] = Slot{view.model_namespace, share.limit, MonotonicMs(), next_order_++, CounterValues{}};
    }
  }
  // Files of slots this daemon does not have (an earlier run with a larger --max-domains) are not re-attached.
  for (size_t i = caches_.size(); i < kMaxDomains; ++i) {
    const std::string path = PoolPathOf(options_.pool_path, i);
    std::error_code ec;
    if (!std::filesystem::exists(path, ec)) continue;
    if (discard) {
      log::Warning("cache", "pool file {} is beyond --max-domains {}: removed as asked (--discard-pool)", path,
                   caches_.size());
      std::filesystem::remove(path, ec);
      std::filesystem::remove(path + ".lock", ec);
    } else {
      log::Warning("cache",
                   "pool file {} is beyond --max-domains {}: its domain is not served (its memory stays used); raise "
                   "--max-domains to serve it, or remove it (--discard-pool)",
                   path, caches_.size());
    }
  }
  for (const auto& verifier : verifiers_) verifier->StartRestartVerification();
  return Status::Ok();
}

Result<Cache*> CacheSet::Admit(const std::string& model_namespace, const Geometry& geometry, uid_t creator_uid,
                               const std::function<bool(const std::string&)>& in_use,
                               std::vector<std::string>* replaced) {
  // Asked before the lock, never under it: `in_use` takes the session registry's lock, which is held while a
  // session's channel opens and looks its domain up here (Find). The caller's serialization keeps the answers
  // valid: no session appears meanwhile, and one that ends only makes a domain look busy a moment longer.
  std::vector<std::string> busy;
  for (const Domain& d : Domains()) {
    if (in_use(d.model_namespace)) busy.push_back(d.model_namespace);
  }
  const auto is_busy = [&busy](const std::string& name) {
    return std::find(busy.begin(), busy.end(), name) != busy.end();
  };
  MutexLock lock(&mu_);
  if (const std::optional<size_t> slot = SlotOfLocked(model_namespace)) {
    Cache* cache = caches_[*slot].get();
    FLEXKV_RETURN_IF_ERROR(cache->Admit(model_namespace, geometry, creator_uid));
    return cache;
  }
  // Nothing is dropped for an Attach that would be refused anyway.
  FLEXKV_RETURN_IF_ERROR(CheckName("model_namespace", model_namespace, 256));
  FLEXKV_RETURN_IF_ERROR(geometry.Validate());
  auto needs_room = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const Share share = ShareForLocked(model_namespace);
    return !FreeSlotLocked() || share.bytes < share.wanted;
  };
  while (needs_room()) {
    // Oldest first: a domain nobody uses and that holds no block is not kept for later sessions.
    std::optional<size_t> victim;
    for (size_t i = 0; i < slots_.size(); ++i) {
      const Slot& s = slots_[i];
      if (s.model_namespace.empty() || is_busy(s.model_namespace)) continue;
      if (victim && slots_[*victim].order < s.order) continue;
      const Cache::Stats stats = caches_[i]->GetStats();
      if (stats.used != 0 || stats.pinned != 0 || stats.unverified != 0) continue;
      victim = i;
    }
    if (!victim) break;
    const std::string name = slots_[*victim].model_namespace;
    if (!caches_[*victim]->DropDomain(/*only_if_empty=*/true, nullptr).ok()) break;
    ForgetLocked(*victim);
    if (replaced != nullptr) replaced->push_back(name);
  }
  const std::optional<size_t> slot = FreeSlotLocked();
  if (!slot && caches_.size() == 1) {
    // One domain per daemon (--max-domains 1): refused as it always was, naming the domain that is there.
    FLEXKV_RETURN_IF_ERROR(caches_[0]->Admit(model_namespace, geometry, creator_uid));
    return caches_[0].get();
  }
  const Share share = ShareForLocked(model_namespace);
  const uint64_t held = HeldLocked();
  const uint64_t free = options_.budget_bytes > held ? options_.budget_bytes - held : 0;
  const uint64_t block = geometry.host_block_bytes();
  if (!slot || share.bytes > free || share.bytes < block) {
    std::string why;
    if (!slot) {
      why = fmt::format("all {} domains (--max-domains) exist", caches_.size());
    } else if (share.bytes < block) {
      why = fmt::format("its share would be {}, less than one {} block", FormatByteSize(share.bytes),
                        FormatByteSize(block));
    } else {
      why = fmt::format("its pool_size {} is more than the {} free", FormatByteSize(share.bytes), FormatByteSize(free));
    }
    return Status::ResourceExhausted(fmt::format(
        "cannot create cache domain '{}': {}; the pool budget is {} and {} (each in use or holding blocks); raise "
        "--max-domains or --pool-size, set a pool_size for namespaces in the config's [namespace.\"<name>\"] tables, "
        "or drop an idle domain (flexkvctl drop-domain <namespace>)",
        model_namespace, why, FormatByteSize(options_.budget_bytes), DescribeLocked()));
  }
  Cache* cache = caches_[*slot].get();
  FLEXKV_RETURN_IF_ERROR(cache->SetBudget(share.bytes));
  Status admitted = cache->Admit(model_namespace, geometry, creator_uid);
  if (!admitted.ok()) {
    if (cache->Domain().geometry) (void)cache->DropDomain(/*only_if_empty=*/true, nullptr);  // no pool after all
    return admitted;
  }
  slots_[*slot] = Slot{model_namespace, share.limit, MonotonicMs(), next_order_++,
                       CounterValues::Read(cache->counters())};
  log::Info("cache", "cache domain '{}' {} created in {} with a share of {} of the {} budget", model_namespace,
            geometry.ToString(), cache->pool_path(), FormatByteSize(share.bytes),
            FormatByteSize(options_.budget_bytes));
  return cache;
}

Cache* CacheSet::Find(std::string_view model_namespace) const {
  MutexLock lock(&mu_);
  const std::optional<size_t> slot = SlotOfLocked(model_namespace);
  return slot ? caches_[*slot].get() : nullptr;
}

std::vector<CacheSet::Domain> CacheSet::Domains() const {
  MutexLock lock(&mu_);
  std::vector<std::pair<uint64_t, Domain>> ordered;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    if (s.model_namespace.empty()) continue;
    const CacheDomain::View view = caches_[i]->Domain();
    if (!view.geometry) continue;
    ordered.emplace_back(s.order, Domain{i, caches_[i].get(), s.model_namespace, *view.geometry,
                                         caches_[i]->budget_bytes(), s.limit_bytes, s.created_ms,
                                         CounterValues::Read(caches_[i]->counters()) - s.base});
  }
  std::sort(ordered.begin(), ordered.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<Domain> out;
  for (auto& [order, d] : ordered) out.push_back(std::move(d));
  return out;
}

CounterValues CacheSet::TotalCounters() const {
  CounterValues total;
  for (const auto& cache : caches_) total = total + CounterValues::Read(cache->counters());
  return total;
}

Status CacheSet::DropDomain(std::string_view model_namespace, bool only_if_empty, uint64_t* dropped_blocks) {
  MutexLock lock(&mu_);
  const std::optional<size_t> slot = SlotOfLocked(model_namespace);
  if (!slot) {
    return Status::NotFound(fmt::format("no cache domain has namespace '{}'; {}", model_namespace, DescribeLocked()));
  }
  FLEXKV_RETURN_IF_ERROR(caches_[*slot]->DropDomain(only_if_empty, dropped_blocks));
  ForgetLocked(*slot);
  return Status::Ok();
}

}  // namespace flexkv
