// Connects the daemon's tiers to the KV event stream: each cache domain's DRAM blocks (Cache::SetEventListener,
// one snapshot source per CacheSet slot) and the SSD tier's blocks (SsdTier::SetEventListener, one source).
// Call once at start, after the tiers exist and before anyone can subscribe.
#pragma once

#include "daemon/events/kv_event_stream.h"

namespace flexkv {

class CacheSet;
class SsdTier;

void ConnectKvEventSources(KvEventStream* stream, CacheSet* caches, SsdTier* ssd);

}  // namespace flexkv
