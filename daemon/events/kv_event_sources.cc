// See kv_event_sources.h.
#include "daemon/events/kv_event_sources.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "daemon/cache/cache.h"
#include "daemon/cache/cache_set.h"
#include "daemon/tiers/ssd/ssd_tier.h"

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

void ConnectKvEventSources(KvEventStream* stream, CacheSet* caches, SsdTier* ssd) {
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
    cache->SetEventListener([stream, source, memo](const Cache::BlockEvent& e) {
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
    });
  }
  if (ssd == nullptr) return;
  const uint16_t source = stream->AddSource([stream, ssd](KvEventStream::SnapshotSink& sink) {
    std::vector<SsdEntry> entries;
    ssd->SnapshotBlocks([&sink] { sink.Mark(); }, [&entries](const SsdEntry& e) {
      if (e.id.component == 0) entries.push_back(e);
    });
    for (const SsdEntry& e : entries) {
      sink.Add(KvTier::kSsd, stream->DomainByHash(e.id.domain.namespace_hash), e.id.key, e.parent);
    }
  });
  ssd->SetEventListener([stream, source](SsdStore::BlockEventKind kind, bool restored, const SsdEntry& e) {
    if (!stream->active() || e.id.component != 0) return;
    KvEvent ev;
    ev.key = e.id.key;
    ev.domain = stream->DomainByHash(e.id.domain.namespace_hash);
    ev.source = source;
    ev.tier = KvTier::kSsd;
    switch (kind) {
      case SsdStore::BlockEventKind::kWritten:
        ev.kind = KvEventKind::kStored;
        ev.parent = e.parent;
        ev.cause = restored ? KvEventCause::kRestored : KvEventCause::kWrittenBack;
        break;
      case SsdStore::BlockEventKind::kEvicted:
        ev.kind = KvEventKind::kRemoved;
        ev.cause = KvEventCause::kEvicted;
        break;
      case SsdStore::BlockEventKind::kDropped:
        ev.kind = KvEventKind::kRemoved;
        ev.cause = KvEventCause::kDropped;
        break;
    }
    stream->Append(ev);
  });
}

}  // namespace flexkv
