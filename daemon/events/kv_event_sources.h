// Connects the daemon's tiers to the KV event stream: each cache domain's DRAM blocks (a CacheObserver, one snapshot
// source per CacheSet slot) and the blocks of each tier that reports them (CacheTier::SetBlockObserver, one source
// each).
// Call once at start, after the tiers exist and before anyone can subscribe.
#pragma once

#include "daemon/events/kv_event_stream.h"

namespace flexkv {

class CacheSet;
class TierSet;

void ConnectKvEventSources(KvEventStream* stream, CacheSet* caches, const TierSet* tiers);

}  // namespace flexkv
