// See kv_event_sources.h.
#include "daemon/events/kv_event_sources.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "daemon/cache/cache.h"
#include "common/log.h"
#include "daemon/cache/cache_set.h"
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
  uint64_t generation = 0;  // the cache's: a dropped domain's namespace may come back with another geometry
  uint16_t id = 0;
  bool set = false;
};

// How vLLM's KV events name each component's KV cache group (kv_cache_spec_kind, kv_cache_spec_sliding_window).
std::vector<KvEventStream::ComponentInfo> ComponentsOf(const Geometry& g) {
  std::vector<KvEventStream::ComponentInfo> out;
  out.push_back({g.is_mla() ? "mla_attention" : "full_attention", 0});
  for (const ComponentSpec& c : g.components) {
    if (c.kind == ComponentKind::kSlidingWindow) {
      out.push_back({"sliding_window", c.window_tokens});
    } else {
      out.push_back({"mamba", 0});  // a state snapshot per prefix end (Mamba, linear attention)
    }
  }
  return out;
}

}  // namespace

void ConnectKvEventSources(KvEventStream* stream, CacheSet* caches, const TierSet* tiers) {
  for (size_t i = 0; i < caches->max_domains(); ++i) {
    Cache* cache = &caches->cache(i);
    const uint16_t source = stream->AddSource([stream, cache](KvEventStream::SnapshotSink& sink) {
      struct Held {
        BlockKey key, parent;
        uint8_t component;
      };
      std::vector<Held> blocks;
      std::optional<Geometry> geometry;
      std::string ns;
      cache->SnapshotBlocks(
          [&sink] { sink.Mark(); },
          [&blocks](const BlockKey& key, const BlockKey& parent, uint8_t component) {
            blocks.push_back(Held{key, parent, component});
          },
          &geometry, &ns);
      if (ns.empty() || !geometry) return;  // no domain yet (interning it now also names its SSD blocks)
      const uint16_t domain = stream->InternDomain(ns, geometry->tokens_per_block, ComponentsOf(*geometry));
      for (const Held& b : blocks) sink.Add(KvTier::kDram, domain, b.key, b.parent, b.component);
    });
    auto memo = std::make_shared<DomainMemo>();
    cache->AddObserver(std::make_shared<FunctionCacheObserver>(nullptr, nullptr, [stream, source, memo, cache](const Cache::BlockEvent& e) {
      if (!stream->active()) return;
      const uint64_t generation = cache->generation();
      if (!memo->set || memo->model_namespace != e.model_namespace || memo->generation != generation) {
        memo->model_namespace = std::string(e.model_namespace);
        memo->generation = generation;
        memo->id = stream->InternDomain(e.model_namespace, e.tokens_per_block,
                                        e.geometry != nullptr ? ComponentsOf(*e.geometry)
                                                              : std::vector<KvEventStream::ComponentInfo>{});
        memo->set = true;
      }
      KvEvent ev;
      ev.key = e.key;
      ev.parent = e.parent;
      ev.domain = memo->id;
      ev.source = source;
      ev.tier = KvTier::kDram;
      ev.cause = CauseOf(e.cause);
      ev.component = e.component;
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
      tier->SnapshotBlocks([&sink] { sink.Mark(); }, [&blocks](const TierBlockEvent& e) { blocks.push_back(e); });
      for (const TierBlockEvent& e : blocks) {
        sink.Add(kv_tier, stream->DomainByHash(e.namespace_hash), e.key, e.parent, e.component);
      }
    });
    tier->SetBlockObserver([stream, source, kv_tier](const TierBlockEvent& e) {
      if (!stream->active()) return;
      KvEvent ev;
      ev.key = e.key;
      ev.component = e.component;
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
