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
    caches_.push_back(std::make_unique<Cache>(options_.budget_bytes, PoolPathOf(options_.pool_path, i),
                                              options_.split));
    caches_.back()->SetPrepareInBackground(options_.prepare_in_background);
    verifiers_.push_back(std::make_unique<BlockVerifier>(caches_.back().get(), options_.verify_threads));
  }
  MutexLock lock(&mu_);
  slots_.resize(n);
}

CacheSet::~CacheSet() { verifiers_.clear(); }  // their threads read the caches

std::string CacheSet::PoolPathOf(const std::string& pool_path, size_t slot) {
  return slot == 0 ? pool_path : fmt::format("{}.{}", pool_path, slot);
}

void CacheSet::AddObserver(const std::shared_ptr<CacheObserver>& observer) {
  for (const auto& cache : caches_) cache->AddObserver(observer);
}

uint64_t CacheSet::HeldLocked() const {
  uint64_t held = 0;
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (!slots_[i].model_namespace.empty()) held += caches_[i]->held_bytes();  // a preparing pool: its target
  }
  return held;
}

uint64_t CacheSet::MaxFor(std::string_view model_namespace) const {
  MutexLock lock(&mu_);
  return MaxForLocked(model_namespace);
}

uint64_t CacheSet::MaxForLocked(std::string_view model_namespace) const {
  const auto it = options_.namespace_pool_bytes.find(model_namespace);
  return it != options_.namespace_pool_bytes.end() ? it->second : options_.budget_bytes;
}

std::vector<size_t> CacheSet::LiveLocked() const {
  std::vector<size_t> live;
  for (size_t i = 0; i < slots_.size(); ++i) {
    // A pool still being prepared is not resized (it holds its target of the budget until it is done).
    if (!slots_[i].model_namespace.empty() && caches_[i]->has_pool() && !caches_[i]->preparation().preparing) {
      live.push_back(i);
    }
  }
  return live;
}

namespace {

// The least a new pool of `geometry` laid out for `max_bytes` can be active for: one grant of each component
// (Cache::min_bytes of the pool it would create). 0 when the budget cannot hold its components (Admit refuses).
uint64_t FloorOf(const Geometry& geometry, uint64_t max_bytes, const PoolSplit& split) {
  auto plan = PlanPoolLayout(geometry, max_bytes, split);
  if (!plan.ok()) return 0;
  uint64_t bytes = 0;
  for (size_t c = 0; c < plan->capacity.size(); ++c) {
    bytes += uint64_t{plan->grant[c]} * geometry.Component(c).host_block_bytes();
  }
  return bytes;
}

}  // namespace

void CacheSet::ApplySharesLocked(const std::vector<size_t>& live, const std::vector<uint64_t>& targets, bool grow) {
  // Shrinks first: the memory they give back is what the grows take.
  for (size_t k = 0; k < live.size(); ++k) {
    Cache& cache = *caches_[live[k]];
    const uint64_t active = cache.active_bytes();
    if (targets[k] >= active) continue;  // an earlier shrink that waits for pins (held) is continued here too
    auto reached = cache.Resize(targets[k]);
    if (!reached.ok()) {
      log::Warning("cache", "cache domain '{}': shrinking its pool to {} failed: {}", slots_[live[k]].model_namespace,
                   FormatByteSize(targets[k]), reached.status().ToString());
      continue;
    }
    if (*reached != active) {
      log::Info("cache", "cache domain '{}': share {} -> {} (asked {}{})", slots_[live[k]].model_namespace,
                FormatByteSize(active), FormatByteSize(*reached), FormatByteSize(targets[k]),
                cache.shrink_held() ? "; pinned blocks hold the rest until they are released" : "");
    }
  }
  if (!grow) return;
  for (size_t k = 0; k < live.size(); ++k) {
    Cache& cache = *caches_[live[k]];
    const uint64_t active = cache.active_bytes();
    if (targets[k] < active) continue;  // shrinking (or held above its share): not lifted here
    const std::vector<uint32_t> was = cache.ActiveSlots();
    if (cache.shrink_held()) {
      // Its share came back up to what it holds: the held shrink is lifted at the sizes it has.
      (void)cache.ResizeSlots(was);
    }
    const uint64_t held = HeldLocked();
    const uint64_t free = options_.budget_bytes > held ? options_.budget_bytes - held : 0;
    // At most an eighth of the budget per call: every grant grown into is pinned for DMA under the domain's lock.
    const uint64_t to = std::min({targets[k], active + free, active + std::max(options_.budget_bytes / 8,
                                                                                cache.min_bytes())});
    if (to < active + cache.min_bytes()) continue;
    auto reached = cache.Resize(to);
    if (!reached.ok()) {
      log::Warning("cache", "cache domain '{}': growing its pool to {} failed: {}", slots_[live[k]].model_namespace,
                   FormatByteSize(to), reached.status().ToString());
      continue;
    }
    if (HeldLocked() > options_.budget_bytes) {
      // A component held above its share (pinned blocks) and the others grown to theirs: more than is free. The
      // grown grants hold nothing yet; give them back, exactly.
      auto back = cache.ResizeSlots(was);
      log::Warning("cache", "cache domain '{}': growing to {} would exceed the {} budget (a held shrink); back to {}",
                   slots_[live[k]].model_namespace, FormatByteSize(*reached), FormatByteSize(options_.budget_bytes),
                   back.ok() ? FormatByteSize(*back) : back.status().ToString());
      continue;
    }
    if (*reached != active) {
      log::Info("cache", "cache domain '{}': share {} -> {}", slots_[live[k]].model_namespace, FormatByteSize(active),
                FormatByteSize(*reached));
    }
  }
}

void CacheSet::Rebalance(int64_t now_ms) {
  MutexLock lock(&mu_);
  if (last_rebalance_ms_ != 0 && now_ms - last_rebalance_ms_ < kRebalanceIntervalMs) return;
  last_rebalance_ms_ = now_ms;
  const std::vector<size_t> live = LiveLocked();
  if (live.empty()) return;
  // Memory is taken from a domain only for one under pressure: with traffic, and a pool nine tenths full (its next
  // stores evict). Otherwise nothing shrinks (every floor at what the domain has) and only free budget moves.
  bool pressure = false;
  for (size_t i : live) {
    const CounterValues c = CounterValues::Read(caches_[i]->counters());
    slots_[i].demand.Observe(c.bytes_stored + c.bytes_loaded, now_ms);
    const Cache::Stats stats = caches_[i]->GetStats();
    pressure = pressure || (slots_[i].demand.rate() > 0 && stats.used * 10 >= stats.capacity * 9);
  }
  std::vector<DomainNeed> needs;
  for (size_t i : live) {
    const Cache& cache = *caches_[i];
    DomainNeed n;
    n.current_bytes = cache.active_bytes();
    n.limit_bytes = cache.max_bytes();
    n.demand = pressure ? slots_[i].demand.rate() : 1;
    n.floor_bytes = pressure ? cache.min_bytes() : std::min(n.current_bytes, n.limit_bytes);
    needs.push_back(n);
  }
  const std::vector<uint64_t> shares = PlanShares(options_.budget_bytes, needs);
  // One step towards the shares, as much given up as grown into (StepShares): a domain above its share loses only
  // what the others take at once, so the budget stays assigned (cutting an idle domain to its share at once while
  // the busy one grows an eighth of the budget a call left most of the budget to nobody, its blocks lost for
  // nothing). Hysteresis: no move below one grant of each component and 1/32 of the budget, so that demand noise
  // does not evict, punch out and re-register memory back and forth.
  const uint64_t hysteresis = std::max<uint64_t>(options_.budget_bytes / 32, 1);
  std::vector<DomainStep> steps;
  for (size_t k = 0; k < live.size(); ++k) {
    const Cache& cache = *caches_[live[k]];
    DomainStep step;
    step.current_bytes = needs[k].current_bytes;
    step.target_bytes = shares[k];
    // A held shrink (pinned blocks kept it above its share) is continued whatever is left of it.
    step.min_move = cache.shrink_held() ? 0 : std::max(cache.min_bytes(), hysteresis);
    // At most an eighth of the budget per call: every grant grown into is pinned for DMA under the domain's lock.
    step.max_move = std::max(options_.budget_bytes / 8, cache.min_bytes());
    steps.push_back(step);
  }
  ApplySharesLocked(live, StepShares(options_.budget_bytes, steps), /*grow=*/true);
  for (size_t i : live) RebalanceSubPoolsLocked(i, now_ms);
}

void CacheSet::RebalanceSubPoolsLocked(size_t slot, int64_t now_ms) {
  Cache& cache = *caches_[slot];
  std::vector<SubPoolNeed> parts = cache.SubPoolNeeds();
  if (parts.empty()) return;
  // Stores only, not loads: a hit loads every FULL block of its prefix but one window and one state, so loads would
  // take memory from the window and state sub-pools exactly while they serve hits. What each sub-pool must hold to
  // keep its entries as long as the others keep theirs is what is stored into it.
  const std::vector<uint64_t> stored = cache.ComponentBytesStored();
  std::vector<DemandMeter>& meters = slots_[slot].component_demand;
  if (stored.size() != parts.size()) return;
  if (meters.size() != parts.size()) meters.assign(parts.size(), DemandMeter(kDemandHalfLifeS));
  for (size_t c = 0; c < parts.size(); ++c) {
    meters[c].Observe(stored[c], now_ms);
    parts[c].demand = meters[c].rate();
  }
  uint64_t held = 0;
  for (const SubPoolNeed& p : parts) held += uint64_t{p.active} * p.slot_bytes;
  const std::vector<uint32_t> target = PlanSubPools(parts, held / 32, held / 8);
  bool moves = false;
  for (size_t c = 0; c < parts.size(); ++c) moves = moves || target[c] != parts[c].active;
  if (!moves) return;
  // Shrinks first; the grows take only what they freed (pinned or pending entries may hold a shrink back: it stops
  // where it got, and the domain's share is never exceeded).
  std::vector<uint32_t> shrunk;
  for (size_t c = 0; c < parts.size(); ++c) shrunk.push_back(std::min(target[c], parts[c].active));
  auto reached = cache.ResizeSlots(shrunk);
  if (reached.ok() && cache.shrink_held()) reached = cache.ResizeSlots(cache.ActiveSlots());  // keeps what it got
  if (reached.ok()) {
    std::vector<uint32_t> grown = cache.ActiveSlots();
    uint64_t free = held > *reached ? held - *reached : 0;
    for (size_t c = 0; c < parts.size() && grown.size() == parts.size(); ++c) {
      if (target[c] <= grown[c]) continue;
      const SubPoolNeed& p = parts[c];
      const uint64_t fits = free / p.slot_bytes / p.grant * p.grant;
      const uint32_t add = static_cast<uint32_t>(std::min<uint64_t>(target[c] - grown[c], fits));
      if (add == 0 || (grown[c] + add != p.capacity && (grown[c] + add) % p.grant != 0)) continue;
      grown[c] += add;
      free -= uint64_t{add} * p.slot_bytes;
    }
    reached = cache.ResizeSlots(grown);
  }
  const std::vector<uint32_t> now = cache.ActiveSlots();
  const CacheDomain::View view = cache.Domain();
  std::string sizes;
  for (size_t c = 0; c < parts.size() && c < now.size(); ++c) {
    sizes += fmt::format("{}{} {} -> {} ({:.0f} KiB/s stored)", sizes.empty() ? "" : ", ",
                         view.geometry ? ComponentKindName(view.geometry->component_kind(c)) : "component",
                         FormatByteSize(uint64_t{parts[c].active} * parts[c].slot_bytes),
                         FormatByteSize(uint64_t{now[c]} * parts[c].slot_bytes), parts[c].demand / 1024);
  }
  if (!reached.ok()) {
    log::Warning("cache", "cache domain '{}': moving memory between its sub-pools failed ({}): {}",
                 slots_[slot].model_namespace, reached.status().ToString(), sizes);
    return;
  }
  log::Info("cache", "cache domain '{}': sub-pools by demand: {}", slots_[slot].model_namespace, sizes);
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
    out += fmt::format("{}'{}' holds {} ({} blocks, {} pinned{})", out.empty() ? "" : ", ",
                       slots_[i].model_namespace, FormatByteSize(caches_[i]->active_bytes()), stats.blocks,
                       stats.pinned, slots_[i].limit_bytes != 0 ? ", at most its pool_size" : "");
  }
  return out.empty() ? std::string("no domain exists") : out;
}

void CacheSet::ForgetLocked(size_t slot) { slots_[slot] = Slot{}; }

Status CacheSet::RecoverPools(bool discard) {
  {
    MutexLock lock(&mu_);
    for (size_t i = 0; i < caches_.size(); ++i) {
      Cache& cache = *caches_[i];
      // The layouts a file of this slot may have been made for: the whole budget, or a namespace's pool_size.
      const uint64_t held = HeldLocked();
      const uint64_t free = options_.budget_bytes > held ? options_.budget_bytes - held : 0;
      std::vector<uint64_t> others;
      for (const auto& [name, bytes] : options_.namespace_pool_bytes) others.push_back(bytes);
      FLEXKV_RETURN_IF_ERROR(cache.SetBudget(options_.budget_bytes));
      FLEXKV_RETURN_IF_ERROR(cache.RecoverPool(discard, others));
      const CacheDomain::View view = cache.Domain();
      if (!view.geometry) continue;
      const uint64_t max = MaxForLocked(view.model_namespace);
      const uint64_t has = cache.budget_bytes(), active = cache.active_bytes();
      std::string refusal;
      if (SlotOfLocked(view.model_namespace)) {
        refusal = fmt::format("pool file {} is a second domain of namespace '{}' (one domain per namespace)",
                              cache.pool_path(), view.model_namespace);
      } else if (has != max) {
        refusal = fmt::format(
            "pool file {} of namespace '{}' is laid out for {}, but the config gives it at most {} ({}; --pool-size "
            "{})",
            cache.pool_path(), view.model_namespace, FormatByteSize(has), FormatByteSize(max),
            options_.namespace_pool_bytes.contains(view.model_namespace) ? "its pool_size" : "the whole budget",
            FormatByteSize(options_.budget_bytes));
      } else if (active > free) {
        refusal = fmt::format(
            "pool file {} of namespace '{}' holds {} but the domains re-attached before it leave {} of the {} budget "
            "({})",
            cache.pool_path(), view.model_namespace, FormatByteSize(active), FormatByteSize(free),
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
      const auto limit = options_.namespace_pool_bytes.find(view.model_namespace);
      slots_[i] = Slot{view.model_namespace, limit != options_.namespace_pool_bytes.end() ? limit->second : 0,
                       MonotonicMs(), next_order_++, CounterValues{}};
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
  // Every domain kept: pools of an older release's layer-major slot order are flagged now, before their blocks are
  // checked and rewritten and before anything is stored in today's order.
  for (const auto& cache : caches_) FLEXKV_RETURN_IF_ERROR(cache->AdoptRankMajorSlots());
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
  while (!FreeSlotLocked()) {
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
  const uint64_t max = MaxForLocked(model_namespace);
  const uint64_t floor = FloorOf(geometry, max, options_.split);
  const auto refuse = [&](const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return Status::ResourceExhausted(fmt::format(
        "cannot create cache domain '{}': {}; the pool budget is {} and {}; raise --max-domains or --pool-size, set "
        "a pool_size for namespaces in the config's [namespace.\"<name>\"] tables, or drop an idle domain (flexkvctl "
        "drop-domain <namespace>)",
        model_namespace, why, FormatByteSize(options_.budget_bytes), DescribeLocked()));
  };
  if (!slot) {
    return refuse(fmt::format("all {} domains (--max-domains) exist, each in use or holding blocks", caches_.size()));
  }
  // A geometry whose components its limit cannot hold is refused before anything moves.
  if (auto split = SplitBudget(geometry, max, options_.split); !split.ok()) {
    return split.status().WithContext(
        fmt::format("cache domain '{}' may hold at most {}", model_namespace, FormatByteSize(max)));
  }
  // Its share: as the domains' demand says, the new one's taken as the mean of theirs (equal while none has traffic).
  const std::vector<size_t> live = LiveLocked();
  double demand_sum = 0;
  size_t with_demand = 0;
  for (size_t i : live) {
    demand_sum += slots_[i].demand.rate();
    with_demand += slots_[i].demand.rate() > 0 ? 1 : 0;
  }
  const double seed = with_demand > 0 ? demand_sum / static_cast<double>(with_demand) : 0;
  std::vector<DomainNeed> needs;
  for (size_t i : live) {
    const Cache& cache = *caches_[i];
    needs.push_back(DomainNeed{seed > 0 ? slots_[i].demand.rate() : 1, cache.min_bytes(), cache.max_bytes(),
                               cache.active_bytes()});
  }
  needs.push_back(DomainNeed{seed > 0 ? seed : 1, floor, max, 0});
  std::vector<uint64_t> targets = PlanShares(options_.budget_bytes, needs);
  const uint64_t share = targets.back();
  targets.pop_back();
  std::vector<std::vector<uint32_t>> before;  // to give the others their memory back if the new domain is not made
  for (size_t i : live) before.push_back(caches_[i]->ActiveSlots());
  const auto restore = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (size_t k = 0; k < live.size(); ++k) (void)caches_[live[k]]->ResizeSlots(before[k]);
  };
  // Exactly to the plan (no hysteresis): the new domain needs what the others give.
  ApplySharesLocked(live, targets, /*grow=*/false);
  const uint64_t held = HeldLocked();
  const uint64_t free = options_.budget_bytes > held ? options_.budget_bytes - held : 0;
  const uint64_t active = std::min(share, free);
  if (active < floor) {
    restore();
    return refuse(fmt::format("its pool needs at least {} (one grant of each component) and {} of the budget is free",
                              FormatByteSize(std::max<uint64_t>(floor, geometry.host_block_bytes())),
                              FormatByteSize(free)));
  }
  Cache* cache = caches_[*slot].get();
  Status admitted = cache->SetBudget(max, active);
  if (admitted.ok()) admitted = cache->Admit(model_namespace, geometry, creator_uid);
  if (!admitted.ok()) {
    if (cache->Domain().geometry) (void)cache->DropDomain(/*only_if_empty=*/true, nullptr);  // no pool after all
    restore();
    return admitted;
  }
  const auto limit = options_.namespace_pool_bytes.find(model_namespace);
  slots_[*slot] = Slot{model_namespace, limit != options_.namespace_pool_bytes.end() ? limit->second : 0,
                       MonotonicMs(), next_order_++, CounterValues::Read(cache->counters())};
  slots_[*slot].demand.Seed(seed);
  log::Info("cache", "cache domain '{}' {} created in {}: active {} of the {} budget (at most {}){}", model_namespace,
            geometry.ToString(), cache->pool_path(), FormatByteSize(cache->held_bytes()),
            FormatByteSize(options_.budget_bytes), FormatByteSize(max),
            cache->preparation().preparing ? "; its pool is prepared in the background" : "");
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
                                         caches_[i]->active_bytes(), s.limit_bytes, s.created_ms,
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
