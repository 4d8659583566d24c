// See kv_event_sources.h.
#include "daemon/events/kv_event_sources.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "daemon/cache/cache.h"
#include "daemon/cache/cache_set.h"
#include "common/log.h"
#include "daemon/tiers/tier_set.h"

namespace flexkv {
namespace {

KvEventCause CauseOf(Cache::BlockEvent::Cause cause) {
  switch (cause) {
    case Cache::BlockEvent::kStored: return KvEventCause::kStored;
    case Cache::BlockEvent::kPromoted: return KvEventCause::kPromoted;
    case Cache::BlockEvent::kPulled: return KvEventCause::kPulled;
    case Cache::BlockEvent::kRestored: return KvEventCause::kRestored;
    case Cache::BlockEvent::kEvicted: return KvEventCause::kEvicted;
    case Cache::BlockEvent::kDropped: return KvEventCause::kDropped;
    case Cache::BlockEvent::kAdminDropped: return KvEventCause::kDomainDropped;
  }
  return KvEventCause::kUnknown;
}

// The domain id of the cache's current namespace, remembered between events (used under the cache's lock only).
struct DomainMemo {
  std::string model_namespace;
  uint16_t id = 0;
  bool set = false;
};

}  // namespace

void ConnectKvEventSources(KvEventStream* stream, CacheSet* caches, const TierSet* tiers) {
  for (size_t i = 0; i < caches->max_domains(); ++i) {
    Cache* cache = &caches->cache(i);
    const uint16_t source = stream->AddSource([stream, cache](KvEventStream::SnapshotSink& sink) {
      std::vector<std::pair<BlockKey, BlockKey>> blocks;
      std::string ns;
      uint32_t tokens_per_block = 0;
      cache->SnapshotBlocks([&sink] { sink.Mark(); },
                            [&blocks](const BlockKey& key, const BlockKey& parent) { blocks.emplace_back(key, parent); },
                            &ns, &tokens_per_block);
      if (ns.empty()) return;  // no domain yet (interning it now also names its SSD blocks)
      const uint16_t domain = stream->InternDomain(ns, tokens_per_block);
      for (const auto& [key, parent] : blocks) sink.Add(KvTier::kDram, domain, key, parent);
    });
    auto memo = std::make_shared<DomainMemo>();
    cache->AddObserver(std::make_shared<FunctionCacheObserver>(nullptr, nullptr, [stream, source, memo](const Cache::BlockEvent& e) {
      if (!stream->active()) return;
      if (!memo->set || memo->model_namespace != e.model_namespace) {
        memo->model_namespace = std::string(e.model_namespace);
        memo->id = stream->InternDomain(e.model_namespace, e.tokens_per_block);
        memo->set = true;
      }
      KvEvent ev;
      ev.key = e.key;
      ev.parent = e.parent;
      ev.domain = memo->id;
      ev.source = source;
      ev.tier = KvTier::kDram;
      ev.cause = CauseOf(e.cause);
      switch (e.kind) {
        case Cache::BlockEvent::kCommitted: ev.kind = KvEventKind::kStored; break;
        case Cache::BlockEvent::kRemoved: ev.kind = KvEventKind::kRemoved; ev.parent = BlockKey{}; break;
        case Cache::BlockEvent::kDomainDropped: ev.kind = KvEventKind::kCleared; break;
      }
      stream->Append(ev);
    }));
  }
  if (tiers == nullptr) return;
  for (CacheTier* tier : tiers->With(&TierCapabilities::reports_blocks)) {
    // The stream names DRAM and SSD (KvTier, the proto's KvEvent.Tier, the ZMQ medium).
    if (tier->name() != "ssd") {
      log::Warning("kv-events", "the {} tier reports its blocks, but the KV event stream names only the DRAM and SSD "
                   "tiers: its blocks are not in the stream", tier->name());
      continue;
    }
    const KvTier kv_tier = KvTier::kSsd;
    const uint16_t source = stream->AddSource([stream, tier, kv_tier](KvEventStream::SnapshotSink& sink) {
      std::vector<TierBlockEvent> blocks;
      tier->SnapshotBlocks([&sink] { sink.Mark(); }, [&blocks](const TierBlockEvent& e) {
        if (e.component == 0) blocks.push_back(e);
      });
      for (const TierBlockEvent& e : blocks) sink.Add(kv_tier, stream->DomainByHash(e.namespace_hash), e.key, e.parent);
    });
    tier->SetBlockObserver([stream, source, kv_tier](const TierBlockEvent& e) {
      if (!stream->active() || e.component != 0) return;
      KvEvent ev;
      ev.key = e.key;
      ev.domain = stream->DomainByHash(e.namespace_hash);
      ev.source = source;
      ev.tier = kv_tier;
      ev.kind = e.kind == TierBlockEvent::kStored ? KvEventKind::kStored : KvEventKind::kRemoved;
      if (e.kind == TierBlockEvent::kStored) ev.parent = e.parent;
      switch (e.cause) {
        case TierBlockEvent::kWrittenBack: ev.cause = KvEventCause::kWrittenBack; break;
        case TierBlockEvent::kRestored: ev.cause = KvEventCause::kRestored; break;
        case TierBlockEvent::kEvicted: ev.cause = KvEventCause::kEvicted; break;
        case TierBlockEvent::kDropped: ev.cause = KvEventCause::kDropped; break;
      }
      stream->Append(ev);
    });
  }
}

}  // namespace flexkv
