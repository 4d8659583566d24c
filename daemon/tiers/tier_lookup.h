// The one lookup path, used by the ring's Match and the gRPC Match alike: DRAM first; where DRAM's prefix ends before
// the keys do, each tier that promotes on match (in the TierSet's order) is asked to bring the run it holds into DRAM,
// and DRAM is matched again - so the answer says what a Load can have now. A tier that starts a promotion is waited
// for (asynchronously: the caller's thread is not held); the next tier is asked where that one's run ended.
#pragma once

#include <functional>
#include <span>
#include <vector>

#include "daemon/cache/cache.h"
#include "daemon/lifecycle/lifecycle.h"
#include "daemon/tiers/tier_set.h"
#include "flexkv/block_key.h"

namespace flexkv {

struct TierLookupRequest {
  Cache* cache = nullptr;
  std::vector<BlockKey> keys;
  bool pin = false;  // the final DRAM match pins its blocks (Cache::Match)
  // Asked before each promotion starts: false stops the lookup at the DRAM answer so far (the session's domain was
  // dropped: its keys must not promote into another domain's pool).
  std::function<bool()> may_promote;
};

// Answers `done(hit, pinned)` exactly once: inside this call when no tier promoted (the DRAM answer), else on the
// promoting tier's thread after its promotion ended. While a promotion runs the request is counted in flight
// (lifecycle.Admit(): a drain waits for it); when the daemon is draining no promotion starts.
void MatchThroughTiers(const TierSet& tiers, Lifecycle& lifecycle, TierLookupRequest request,
                       std::function<void(size_t hit, std::vector<SlotId> pinned)> done);

}  // namespace flexkv
