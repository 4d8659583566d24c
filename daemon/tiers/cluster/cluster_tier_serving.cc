// What the cluster tier offers peers (cluster_tier_impl.h): the directory publisher (the difference between what
// the node holds and what the store has, batched and retried) and the lookup server (peers' lookups answered from
// the local cache and the registered pool grants).
#include <fmt/format.h>

#include <algorithm>

#include "common/hybrid_ids.h"
#include "common/log.h"
#include "daemon/cache/cache_set.h"
#include "daemon/tiers/cluster/cluster_tier_impl.h"
#include "daemon/tiers/cluster/publish_policy.h"

namespace flexkv {

// --- directory updates ---------------------------------------------------------------------------------------

void ClusterTier::Impl::OnBlockEvent(Cache* cache, const Cache::BlockEvent& e) {
  MutexLock lock(&pub_mu);
  DirectoryState& d = directory_state[cache];
  switch (e.kind) {
    case Cache::BlockEvent::kCommitted:
      if (!IsPublishedKey(e.key, e.request_end, options.chunk_blocks)) return;
      d.desired.insert(e.key);
      d.to_withdraw.erase(e.key);
      if (d.published.count(e.key) == 0) d.to_publish.insert(e.key);
      break;
    case Cache::BlockEvent::kRemoved:
      if (d.desired.erase(e.key) == 0) return;
      d.to_publish.erase(e.key);
      if (d.published.count(e.key) > 0) d.to_withdraw.insert(e.key);
      break;
    case Cache::BlockEvent::kDomainDropped:
      d.desired.clear();
      d.to_publish.clear();
      d.to_withdraw = d.published;
      break;
  }
  pub_cv.notify_one();
}

void ClusterTier::Impl::RepublishAll() {
  MutexLock lock(&pub_mu);
  ++lease_generation;
  for (auto& [cache, d] : directory_state) {
    d.published.clear();
    d.to_withdraw.clear();
    d.to_publish = d.desired;
  }
  pub_cv.notify_one();
}

size_t ClusterTier::Impl::PendingLocked() const {
  size_t n = 0;
  for (const auto& [cache, d] : directory_state) n += d.to_publish.size() + d.to_withdraw.size();
  return n;
}

void ClusterTier::Impl::PublishLoop() {
  int64_t backoff_ms = 100;
  while (!stopping.load(std::memory_order_acquire)) {
    {
      MutexLock lock(&pub_mu);
      const Clock::time_point until = Clock::now() + std::chrono::milliseconds(500);
      while (PendingLocked() == 0 && !stopping.load(std::memory_order_acquire) && Clock::now() < until) {
        pub_mu.WaitFor(&pub_cv, until - Clock::now());
      }
    }
    if (stopping.load(std::memory_order_acquire)) return;
    if (!directory->joined()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the membership thread joins again
      continue;
    }
    const Status s = PublishRound();
    if (s.ok()) {
      backoff_ms = 100;
      continue;
    }
    publish_failures.fetch_add(1, std::memory_order_relaxed);
    NoteError(fmt::format("directory update: {}", s.ToString()));
    log::Warning("cluster", "directory update failed, retrying in {} ms: {}", backoff_ms, s.ToString());
    MutexLock lock(&pub_mu);
    const Clock::time_point until = Clock::now() + std::chrono::milliseconds(backoff_ms);
    while (!stopping.load(std::memory_order_acquire) && Clock::now() < until) {
      pub_mu.WaitFor(&pub_cv, until - Clock::now());
    }
    backoff_ms = std::min<int64_t>(backoff_ms * 2, 2000);
  }
}

// Per cache, up to 1024 withdrawals first, then (once nothing of another namespace is left) up to 1024 publishes.
Status ClusterTier::Impl::PublishRound() {
  std::vector<Cache*> caches_now;
  {
    MutexLock lock(&pub_mu);
    for (const auto& [cache, d] : directory_state) {
      if (!d.to_publish.empty() || !d.to_withdraw.empty()) caches_now.push_back(cache);
    }
  }
  for (Cache* cache : caches_now) {
    const std::string ns = cache->Domain().model_namespace;  // not under the cache's lock
    std::vector<cluster::DirectoryEntry> withdraw, publish;
    uint64_t generation = 0;
    {
      MutexLock lock(&pub_mu);
      generation = lease_generation;
      DirectoryState& d = directory_state[cache];
      for (auto it = d.to_withdraw.begin(); it != d.to_withdraw.end() && withdraw.size() < 1024; ++it) {
        withdraw.push_back({*it, d.published_ns, 1});
      }
      if (d.published.empty()) d.published_ns = ns;
      if (d.published_ns == ns && !ns.empty()) {
        for (auto it = d.to_publish.begin(); it != d.to_publish.end() && publish.size() < 1024; ++it) {
          publish.push_back({*it, ns, 1});
        }
      } else if (d.published_ns != ns && d.to_withdraw.empty()) {
        // A new domain in a reused slot, and the old one's entries are not all queued: withdraw them all.
        d.to_withdraw = d.published;
      }
    }
    if (!withdraw.empty()) {
      FLEXKV_RETURN_IF_ERROR(directory->Withdraw(withdraw));
      MutexLock lock(&pub_mu);
      if (generation != lease_generation) continue;  // joined again meanwhile: everything is published anew
      DirectoryState& d = directory_state[cache];
      for (const auto& e : withdraw) {
        d.published.erase(e.chunk_key);
        d.to_withdraw.erase(e.chunk_key);
        if (d.desired.count(e.chunk_key) > 0) d.to_publish.insert(e.chunk_key);  // stored again meanwhile
      }
    }
    if (!publish.empty()) {
      FLEXKV_RETURN_IF_ERROR(directory->Publish(publish));
      MutexLock lock(&pub_mu);
      if (generation != lease_generation) continue;
      DirectoryState& d = directory_state[cache];
      for (const auto& e : publish) {
        d.to_publish.erase(e.chunk_key);
        d.published.insert(e.chunk_key);
        if (d.desired.count(e.chunk_key) == 0) d.to_withdraw.insert(e.chunk_key);  // evicted meanwhile
      }
    }
  }
  return Status::Ok();
}

// --- the lookup server ---------------------------------------------------------------------------------------

std::optional<std::pair<std::string, uint64_t>> ClusterTier::Impl::Locate(const uint8_t* addr, uint64_t bytes) const {
  MutexLock lock(&regions_mu);
  const auto a = reinterpret_cast<uintptr_t>(addr);
  auto it = regions.upper_bound(a);
  if (it == regions.begin()) return std::nullopt;
  --it;
  const cluster::RegisteredRegion& r = it->second.registered;
  if (!r.valid()) return std::nullopt;
  const uint64_t off = a - it->first;
  if (off > r.bytes() || bytes > r.bytes() - off) return std::nullopt;
  return std::make_pair(r.descriptor(), off);
}

void ClusterTier::Impl::ServeLoop() {
  for (;;) {
    ServeJob job;
    {
      MutexLock lock(&serve_mu);
      while (serve_jobs.empty() && !stopping.load(std::memory_order_acquire)) serve_mu.Wait(&serve_cv);
      if (serve_jobs.empty()) return;
      job = std::move(serve_jobs.front());
      serve_jobs.pop_front();
    }
    job.reply(ServeLookup(job.peer, job.request));
  }
}

Result<std::string> ClusterTier::Impl::ServeLookup(const std::string& peer, const std::string& bytes) {
  auto request = DecodeLookupRequest(bytes);
  if (!request.ok()) {
    log::Warning("cluster", "peer '{}' sent a lookup that does not parse: {}", peer, request.status().message());
    return request.status();
  }
  const uint64_t my_epoch = directory->epoch();
  if (request->epoch != my_epoch) {
    return Status::FailedPrecondition(fmt::format(
        "node '{}' is at epoch {}, not {}: its blocks of that epoch are gone", options.node_id, my_epoch,
        request->epoch));
  }
  Cache* cache = caches->Find(request->model_namespace);
  if (cache == nullptr || !cache->has_pool()) {
    return Status::NotFound(fmt::format("node '{}' has no cache domain '{}'", options.node_id,
                                        request->model_namespace));
  }
  const CacheDomain::View domain = cache->Domain();
  const bool hybrid = domain.geometry && domain.geometry->is_hybrid();
  if (hybrid != request->hybrid) {
    return Status::FailedPrecondition(fmt::format(
        "node '{}' serves '{}' with a {} geometry; the lookup asks for a {} one (version {})", options.node_id,
        request->model_namespace, hybrid ? "hybrid" : "full-attention", request->hybrid ? "hybrid" : "full-attention",
        request->hybrid ? kPeerLookupHybridVersion : kPeerLookupVersion));
  }
  const std::string layout = domain.geometry ? domain.geometry->ToString() : std::string();
  if (layout != request->layout) {
    return Status::FailedPrecondition(fmt::format(
        "blocks laid out differently: node '{}' serves '{}' as {}, not {}", options.node_id,
        request->model_namespace, layout, request->layout));
  }
  if (cache->block_bytes() != request->block_bytes) {
    return Status::FailedPrecondition(fmt::format(
        "node '{}' stores blocks of {} bytes in '{}', not {}: the geometries differ", options.node_id,
        cache->block_bytes(), request->model_namespace, request->block_bytes));
  }
  if (hybrid) return ServeHybridLookup(*cache, *domain.geometry, *request);
  std::vector<SlotId> slots;
  const size_t matched = cache->Match(request->keys, /*pin=*/true, &slots);
  PeerLookupReply reply;
  reply.matched = static_cast<uint32_t>(matched);
  std::map<std::string, uint32_t> region_index;
  for (size_t i = request->from; i < matched; ++i) {
    const SlotId slot = slots[i];
    const std::optional<uint64_t> checksum = cache->EntryChecksum(slot);
    const auto where = Locate(cache->SlotData(slot), cache->SlotBytes(slot));
    if (!checksum || !where) break;  // not registered (a grant being added) or no entry: the answer ends here
    auto [it, added] = region_index.emplace(where->first, static_cast<uint32_t>(reply.regions.size()));
    if (added) reply.regions.push_back(where->first);
    reply.blocks.push_back({it->second, where->second, *checksum});
  }
  cache->Unpin(slots);
  lookups_served.fetch_add(1, std::memory_order_relaxed);
  blocks_offered.fetch_add(reply.blocks.size(), std::memory_order_relaxed);
  return EncodeLookupReply(reply);
}

// The hit rule on what this node holds (Cache::Match): its longest hit end e, with FULL [0, e), each window's blocks
// before e and the state at e pinned while the answer is made. Offered: the FULL blocks from `from` and every entry
// (the requester may hold none of them: its own hit ends at `from`). All or nothing: an entry that cannot be offered
// (its grant not registered for peers yet, its slot entry unreadable) leaves the answer without blocks.
std::string ClusterTier::Impl::ServeHybridLookup(Cache& cache, const Geometry& geometry,
                                                 const PeerLookupRequest& request) {
  std::vector<SlotId> slots;
  const auto e = static_cast<uint32_t>(cache.Match(request.keys, /*pin=*/true, &slots));
  PeerLookupReply reply;
  reply.hybrid = true;
  reply.matched = e;
  if (e > request.from) {
    std::map<std::string, uint32_t> region_index;
    const auto offer = [&](SlotId slot) -> std::optional<PeerLookupReply::Block> {
      const std::optional<uint64_t> checksum = cache.EntryChecksum(slot);
      const auto where = Locate(cache.SlotData(slot), cache.SlotBytes(slot));
      if (!checksum || !where) return std::nullopt;
      auto [it, added] = region_index.emplace(where->first, static_cast<uint32_t>(reply.regions.size()));
      if (added) reply.regions.push_back(where->first);
      return PeerLookupReply::Block{it->second, where->second, *checksum};
    };
    const HybridIdLayout layout = LayoutIds(geometry, /*store=*/false, e);
    bool whole = true;
    for (uint32_t i = request.from; i < e && whole; ++i) {
      const auto b = offer(slots[layout.offset[0] + i]);
      if (b) reply.blocks.push_back(*b); else whole = false;
    }
    for (size_t c = 1; c < geometry.component_count() && whole; ++c) {
      const uint64_t n = ComponentIdCount(geometry, c, /*store=*/false, e);
      for (uint64_t i = 0; i < n && whole; ++i) {
        const auto b = offer(slots[layout.offset[c] + i]);
        if (b) {
          reply.entries.push_back({static_cast<uint32_t>(c), static_cast<uint32_t>(e - n + i), *b});
        } else {
          whole = false;
        }
      }
    }
    if (!whole) {
      reply.regions.clear();
      reply.blocks.clear();
      reply.entries.clear();
    }
  }
  cache.Unpin(slots);
  lookups_served.fetch_add(1, std::memory_order_relaxed);
  blocks_offered.fetch_add(reply.blocks.size() + reply.entries.size(), std::memory_order_relaxed);
  return EncodeLookupReply(reply);
}

}  // namespace flexkv
