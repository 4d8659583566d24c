// ObserverRegistry: a Cache's observers and the pool grants they were told of (internal to daemon/cache). Every
// grant announcement - under the cache's lock (a Resize, a dropped pool) or without it (a background preparation) -
// goes through one registry, so that an observer added at any moment is told exactly the grants that are active (and
// not those a background thread is about to announce: those it hears from that thread), and an observer removed is
// never called again once RemoveObserver returns, background threads included.
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "common/mutex.h"
#include "daemon/cache/cache_observer.h"

namespace flexkv {

class ObserverRegistry {
 public:
  // Tells `region` added to the observers in order until one refuses (its error is returned; the ones after it are
  // not told). Recorded either way: who was told, for Removed and for observers added later.
  Status Added(const PoolRegion& region);
  // Tells the observers that were told `region` added (the refusing one included) that it is gone, in reverse order,
  // each once; a region never told added is ignored.
  void Removed(const PoolRegion& region);
  // Adds `observer` after the others and tells it every recorded grant no observer refused, in the order they were
  // added. Its own refusal is kept by it (for the sessions it concerns): the grant stays, and it hears it removed.
  void Add(std::shared_ptr<CacheObserver> observer);
  // Removes `observer`; returns once no call into it runs (an announcement in flight on another thread ends first)
  // and it is never called again, for any grant.
  void Remove(const CacheObserver* observer);

 private:
  struct Told {
    PoolRegion region;
    std::vector<CacheObserver*> observers;  // told it added, in order (the last one refused it when `refused`)
    bool refused = false;
    uint64_t order = 0;  // announcement order, for observers added later
  };
  // Held while observers are called: announcements from several threads (a background preparation, a Resize) and
  // Add/Remove are serialized, so an observer's view of the grants is always consistent.
  mutable Mutex mu_;
  std::vector<std::shared_ptr<CacheObserver>> observers_ ABSL_GUARDED_BY(mu_);
  std::map<const uint8_t*, Told> told_ ABSL_GUARDED_BY(mu_);  // by the region's base
  uint64_t next_order_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace flexkv
