#include "daemon/cache/observer_registry.h"

#include <algorithm>

namespace flexkv {

Status ObserverRegistry::Added(const PoolRegion& region) {
  MutexLock lock(&mu_);
  Told& told = told_[region.base];
  told = Told{region, {}, false, next_order_++};
  for (const std::shared_ptr<CacheObserver>& o : observers_) {
    told.observers.push_back(o.get());
    Status s = o->PoolRegionAdded(region);
    if (!s.ok()) {
      told.refused = true;
      return s;
    }
  }
  return Status::Ok();
}

void ObserverRegistry::Removed(const PoolRegion& region) {
  MutexLock lock(&mu_);
  auto it = told_.find(region.base);
  if (it == told_.end()) return;
  const std::vector<CacheObserver*> observers = std::move(it->second.observers);
  told_.erase(it);
  for (size_t i = observers.size(); i-- > 0;) observers[i]->PoolRegionRemoved(region);
}

void ObserverRegistry::Add(std::shared_ptr<CacheObserver> observer) {
  MutexLock lock(&mu_);
  CacheObserver* added = observer.get();
  observers_.push_back(std::move(observer));
  std::vector<Told*> grants;
  for (auto& [base, told] : told_) {
    if (!told.refused) grants.push_back(&told);
  }
  std::sort(grants.begin(), grants.end(), [](const Told* a, const Told* b) { return a->order < b->order; });
  for (Told* told : grants) {
    told->observers.push_back(added);
    (void)added->PoolRegionAdded(told->region);  // a refusal is the new observer's to keep
  }
}

void ObserverRegistry::Remove(const CacheObserver* observer) {
  MutexLock lock(&mu_);
  std::erase_if(observers_, [observer](const std::shared_ptr<CacheObserver>& o) { return o.get() == observer; });
  for (auto& [base, told] : told_) std::erase(told.observers, observer);
}

}  // namespace flexkv
