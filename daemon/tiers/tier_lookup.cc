// See tier_lookup.h.
#include "daemon/tiers/tier_lookup.h"

#include <memory>
#include <utility>

namespace flexkv {
namespace {

struct Lookup {
  std::vector<CacheTier*> promoters;
  Lifecycle* lifecycle = nullptr;
  TierLookupRequest request;
  std::function<void(size_t, std::vector<SlotId>)> done;
};

// Matches in DRAM, then asks promoters[next...] in turn; answers when none starts a promotion.
void Continue(std::shared_ptr<Lookup> lookup, size_t next) {
  Cache& cache = *lookup->request.cache;
  const std::vector<BlockKey>& keys = lookup->request.keys;
  std::vector<SlotId> pinned;
  const size_t hit = cache.Match(keys, lookup->request.pin, lookup->request.pin ? &pinned : nullptr);
  const bool hybrid = hit < keys.size() && !lookup->promoters.empty() && [&cache] {
    const CacheDomain::View domain = cache.Domain();
    return domain.geometry && domain.geometry->is_hybrid();
  }();
  for (size_t i = next; hit < keys.size() && i < lookup->promoters.size(); ++i) {
    if (hybrid && !lookup->promoters[i]->capabilities().hybrid) continue;  // it keeps FULL-only domains
    if (lookup->request.may_promote && !lookup->request.may_promote()) break;
    InFlight admitted = lookup->lifecycle->Admit();
    if (!admitted) break;  // draining: the DRAM answer
    auto in_flight = std::make_shared<InFlight>(std::move(admitted));
    CacheTier* tier = lookup->promoters[i];
    // The DRAM prefix stays pinned until the promotion ends (a promotion may wait for the write-back with nothing
    // reserved under it); the next match pins it again before these pins go.
    auto held = std::make_shared<std::vector<SlotId>>(std::move(pinned));
    if (tier->Promote(cache, keys, hit, [lookup, i, in_flight, held](size_t) {
          Continue(lookup, i + 1);  // the promoted run is in DRAM now: match again, ask the tiers after this one
          if (!held->empty()) lookup->request.cache->Unpin(*held);
          in_flight->End();
        })) {
      return;
    }
    pinned = std::move(*held);
  }
  lookup->done(hit, std::move(pinned));
}

}  // namespace

void MatchThroughTiers(const TierSet& tiers, Lifecycle& lifecycle, TierLookupRequest request,
                       std::function<void(size_t hit, std::vector<SlotId> pinned)> done) {
  auto lookup = std::make_shared<Lookup>();
  lookup->promoters = tiers.With(&TierCapabilities::promotes_on_match);
  lookup->lifecycle = &lifecycle;
  lookup->request = std::move(request);
  lookup->done = std::move(done);
  Continue(std::move(lookup), 0);
}

}  // namespace flexkv
