// CacheSet: the cache domains one daemon serves - a model namespace with its geometry each, in a Cache of its own
// (own pool file, PoolLock, prefix index, component indexes and BlockVerifier) - and how the pool budget is shared
// between them: each domain's pool is laid out for its limit (its namespace's pool_size, else the whole budget)
// and holds memory for its active part only (Cache::Resize), and the active parts together never exceed the
// budget. They follow demand (budget_plan.h): a new domain gets a share as the others' demand says it should
// (an equal one while nobody has traffic), taken from the others, and Rebalance moves memory towards the domains
// that store and load the most. Thread-safe.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"
#include "daemon/cache/block_verifier.h"
#include "daemon/cache/budget_plan.h"
#include "daemon/cache/cache.h"
#include "daemon/cache/pool.h"
#include "daemon/cache/pool_region.h"
#include "flexkv/geometry.h"
#include "flexkv/status.h"

namespace flexkv {

// The most domains one daemon serves (--max-domains).
inline constexpr size_t kMaxDomains = 64;

struct CacheSetOptions {
  uint64_t budget_bytes = 1ULL << 30;  // --pool-size: every domain's share together
  std::string pool_path;               // --pool-path: domain slot 0's file; slot i >= 1 has "<pool_path>.<i>"
  PoolSplit split;                     // a hybrid geometry's split of its share (--swa-share, --state-share)
  size_t max_domains = 1;              // --max-domains: 1 is a daemon of one domain at a time
  // [namespace."<name>"] pool_size: the most a namespace's domain may hold (bytes); without one, the budget.
  std::map<std::string, uint64_t, std::less<>> namespace_pool_bytes;
  // Each new domain's pool is prepared in the background (Cache::SetPrepareInBackground): Admit returns at once.
  bool prepare_in_background = false;
  unsigned verify_threads = 0;  // each domain's restart check (BlockVerifier); 0: half the cores, 1 to 8
};

// The values of a domain's request counters (CacheCounters), since the domain was created.
struct CounterValues {
  uint64_t match_requests = 0, match_blocks = 0, hit_blocks = 0, load_blocks = 0, store_blocks = 0, bytes_loaded = 0,
           bytes_stored = 0, data_loss_blocks = 0;
  static CounterValues Read(const CacheCounters& counters);
  CounterValues operator-(const CounterValues& base) const;
  CounterValues operator+(const CounterValues& other) const;
};

class CacheSet {
 public:
  // Creates max_domains Caches (slot i's pool file: PoolPathOf(pool_path, i)); nothing is locked or opened until
  // RecoverPools. The Caches live as long as the set: a Cache* handed out is never dangling (a dropped domain's
  // Cache is reset and reused for a later domain; its generation() tells sessions of the old one apart).
  // max_domains is clamped to 1..kMaxDomains.
  explicit CacheSet(CacheSetOptions options);
  ~CacheSet();
  CacheSet(const CacheSet&) = delete;
  CacheSet& operator=(const CacheSet&) = delete;

  // Slot i's pool file: `pool_path` for i = 0 (a single-domain daemon's file is the one it always had), else
  // "<pool_path>.<i>".
  static std::string PoolPathOf(const std::string& pool_path, size_t slot);

  size_t max_domains() const { return caches_.size(); }
  uint64_t budget_bytes() const { return options_.budget_bytes; }
  // Slot i's Cache and verifier, i < max_domains(); whether or not it holds a domain now.
  Cache& cache(size_t slot) const { return *caches_[slot]; }
  BlockVerifier& verifier(size_t slot) const { return *verifiers_[slot]; }

  // Adds `observer` to every slot's cache (Cache::AddObserver): told each domain's pool regions and blocks. Call
  // before RecoverPools.
  void AddObserver(const std::shared_ptr<CacheObserver>& observer);

  // At start: locks every slot's pool file (PoolLock; a second daemon on the same files is refused) and
  // re-attaches each existing one (Cache::RecoverPool) with the layout the current config gives its namespace
  // (MaxFor) and the active size it had. A file laid out for another size (--pool-size or its pool_size changed),
  // two files of one namespace, or files whose active parts add up to more than the budget are refused naming the
  // file and what to do, unless `discard` (--discard-pool), which drops that domain's file instead (its blocks are
  // lost). A file of a slot beyond max_domains is logged (and removed
  // with `discard`). Then starts each re-attached domain's restart verification.
  Status RecoverPools(bool discard);

  // The most the domain of `model_namespace` may hold: its pool_size, else the whole budget (its pool's layout).
  uint64_t MaxFor(std::string_view model_namespace) const;

  // Finds or creates the domain of `model_namespace`. A known namespace checks `geometry` against the domain's
  // (FAILED_PRECONDITION naming the differing field, as Cache::Admit). A new one is validated first (namespace and
  // geometry: INVALID_ARGUMENT), then takes a free slot (when none is free, domains that `in_use` says have no
  // session and that hold no block - nothing pinned or reserved either - are dropped first, each named in
  // `*replaced`, optional) and its share: PlanShares over the domains there are and the new one, whose demand is
  // taken as the mean of theirs (all equal while none has traffic); the others are shrunk towards their shares
  // first (evicting blocks beyond them), and the new domain's pool is active for what the budget then has free,
  // at most its share. RESOURCE_EXHAUSTED naming the budget, what each domain holds, and what the operator can do
  // when no slot is free or not even one grant of each of its components is (the others' pinned blocks hold
  // their memory). The caller serializes Admit with DropDomain and with the sessions `in_use` counts; `in_use` is
  // called without the set's lock (it may take the session registry's, under which a session's channel calls
  // Find).
  Result<Cache*> Admit(const std::string& model_namespace, const Geometry& geometry, uid_t creator_uid,
                       const std::function<bool(const std::string& model_namespace)>& in_use,
                       std::vector<std::string>* replaced = nullptr);
  // The domain of `model_namespace`, or nullptr.
  Cache* Find(std::string_view model_namespace) const;

  struct Domain {
    size_t slot = 0;
    Cache* cache = nullptr;
    std::string model_namespace;
    Geometry geometry;
    uint64_t budget_bytes = 0;  // its share: the bytes its pool's active part holds
    uint64_t limit_bytes = 0;   // the configured pool_size, 0: none
    int64_t created_ms = 0;     // monotonic: when it was created or re-attached
    // Its requests since it was created (a reused Cache's counters also hold the earlier domains' of its slot).
    CounterValues counters;
  };
  // The domains there are, in the order they were created.
  std::vector<Domain> Domains() const;
  // Every request counted since start, dropped domains' included (monotonic: the daemon's totals).
  CounterValues TotalCounters() const;

  // Moves memory between the domains as their demand says (PlanShares over each domain's DemandMeter of bytes
  // stored + loaded), one step a call (StepShares): domains above their share shrink first (evicting their least
  // recently used blocks beyond it; pinned ones hold a shrink back until a later call), then those below grow into
  // what is free; a domain grows by at most budget / 8 a call and one above its share gives up only what the
  // growing ones take at once (beyond free budget), so the budget stays assigned while shares move. Memory is taken
  // from a domain only while another is under pressure (it has traffic and its pool is nine tenths full);
  // otherwise nothing shrinks and only free budget (a dropped domain's) moves. Acts at most every
  // kRebalanceIntervalMs (`now_ms`: a monotonic clock; the daemon calls it from a thread of its own every second)
  // and only on changes of at least one grant of each component and 1/32 of the budget.
  // Then, in each hybrid domain whose sub-pools are sized by demand (layout 4; Cache::SubPoolNeeds), the same rules
  // move its share between its sub-pools (PlanSubPools over a DemandMeter per component of the bytes stored into
  // it): only while a component with demand is nine tenths full, by at least one grant and 1/32 of the share, at
  // most an eighth of it a call, each component keeping one grant. Logged: "cache domain 'X': sub-pools ...".
  void Rebalance(int64_t now_ms);
  static constexpr int64_t kRebalanceIntervalMs = 5000;
  static constexpr double kDemandHalfLifeS = 60;

  // Drops the domain of `model_namespace` and its pool file (Cache::DropDomain: FAILED_PRECONDITION while blocks
  // are pinned, being stored or verified; with `only_if_empty` while it holds blocks); its slot and budget share
  // are free again. NOT_FOUND naming the domains there are. The caller guarantees no session of it is attached.
  Status DropDomain(std::string_view model_namespace, bool only_if_empty, uint64_t* dropped_blocks);

 private:
  struct Slot {
    std::string model_namespace;  // empty: no domain
    uint64_t limit_bytes = 0;
    int64_t created_ms = 0;
    uint64_t order = 0;  // creation order
    CounterValues base;  // the Cache's counters when the domain was created
    DemandMeter demand{kDemandHalfLifeS};  // of the Cache's bytes stored + loaded
    std::vector<DemandMeter> component_demand{};  // per component of a hybrid pool: bytes stored into it
  };
  // One step of the sub-pools of the domain in `slot` towards their demand (see Rebalance).
  void RebalanceSubPoolsLocked(size_t slot, int64_t now_ms) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The active bytes of every domain's pool together.
  uint64_t HeldLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t MaxForLocked(std::string_view model_namespace) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The slots holding a domain with a pool.
  std::vector<size_t> LiveLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Shrinks each live domain above its target to it (`targets` parallel to `live`; a held shrink is continued);
  // then, with `grow`, grows those below it into what the budget has free (at most budget / 8 a call), lifting a
  // held shrink whose target came back; growing by less than one grant of each component is skipped. Rebalance
  // passes one step (StepShares), Admit the plan itself.
  void ApplySharesLocked(const std::vector<size_t>& live, const std::vector<uint64_t>& targets, bool grow)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::optional<size_t> SlotOfLocked(std::string_view model_namespace) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::optional<size_t> FreeSlotLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One line per domain: its namespace, share and blocks, for RESOURCE_EXHAUSTED and NOT_FOUND messages.
  std::string DescribeLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ForgetLocked(size_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const CacheSetOptions options_;
  std::vector<std::unique_ptr<Cache>> caches_;                // fixed at construction
  std::vector<std::unique_ptr<BlockVerifier>> verifiers_;     // one per cache; stopped before the caches go
  mutable Mutex mu_;
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);
  uint64_t next_order_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t last_rebalance_ms_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace flexkv
