// CacheSet: the cache domains one daemon serves - a model namespace with its geometry each, in a Cache of its own
// (own pool file, PoolLock, prefix index, component indexes and BlockVerifier) - and how the pool budget is shared
// between them. Thread-safe.
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
  // [namespace."<name>"] pool_size: a namespace's fixed share of the budget (bytes). Others share what is left.
  std::map<std::string, uint64_t, std::less<>> namespace_pool_bytes;
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

  // Sets every slot's pool listener (Cache::SetPoolListener): `listener` is told each domain's pool region when
  // it exists, `gone` the same region before it is unmapped. Call before RecoverPools.
  void SetPoolListener(const std::function<void(const PoolRegion&)>& listener,
                       const std::function<void(const PoolRegion&)>& gone);

  // At start: locks every slot's pool file (PoolLock; a second daemon on the same files is refused) and
  // re-attaches each existing one (Cache::RecoverPool) with the share the current config gives its namespace: its
  // pool_size, or for a namespace without one at most budget / max_domains of what the domains re-attached before
  // it leave. A file made for another share, two files of one namespace, or files whose shares add up to more
  // than the budget are refused naming the file and what to do, unless `discard` (--discard-pool), which drops
  // that domain's file instead (its blocks are lost). A file of a slot beyond max_domains is logged (and removed
  // with `discard`). Then starts each re-attached domain's restart verification.
  Status RecoverPools(bool discard);

  // The share of the budget a new domain of `model_namespace` gets - the one place this is decided (a later
  // planner sizes shares by demand). `wanted`: what it takes when the budget allows (its pool_size, else
  // budget / max_domains); `bytes`: what it gets now (its pool_size, else min(wanted, the budget no domain
  // holds)). `limit`: the configured pool_size, 0 without one.
  struct Share {
    uint64_t bytes = 0;
    uint64_t wanted = 0;
    uint64_t limit = 0;
  };
  Share ShareFor(std::string_view model_namespace) const;

  // Finds or creates the domain of `model_namespace`. A known namespace checks `geometry` against the domain's
  // (FAILED_PRECONDITION naming the differing field, as Cache::Admit). A new one is validated first (namespace and
  // geometry: INVALID_ARGUMENT), then takes a free slot and its ShareFor budget; when no slot is free or the
  // share does not fit in the free budget, domains that `in_use` says have no session and that hold no block
  // (and nothing pinned or reserved) are dropped first, each named in `*replaced` (optional). Otherwise
  // RESOURCE_EXHAUSTED naming the budget, what each domain holds, and what the operator can do. The caller
  // serializes Admit with DropDomain and with the sessions `in_use` counts; `in_use` is called without the set's
  // lock (it may take the session registry's, under which a session's channel calls Find).
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
    uint64_t budget_bytes = 0;  // its share
    uint64_t limit_bytes = 0;   // the configured pool_size, 0: none
    int64_t created_ms = 0;     // monotonic: when it was created or re-attached
    // Its requests since it was created (a reused Cache's counters also hold the earlier domains' of its slot).
    CounterValues counters;
  };
  // The domains there are, in the order they were created.
  std::vector<Domain> Domains() const;
  // Every request counted since start, dropped domains' included (monotonic: the daemon's totals).
  CounterValues TotalCounters() const;

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
  };
  uint64_t HeldLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Share ShareForLocked(std::string_view model_namespace) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
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
};

}  // namespace flexkv
