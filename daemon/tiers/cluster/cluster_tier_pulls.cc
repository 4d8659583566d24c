// The cluster tier's pulls (cluster_tier_impl.h): the pullers, each running one Prefetch at a time (the directory
// names the peer, the peer's lookup names its slots, the blocks are read, verified and committed), and the
// connections to peers they share.
#include <fmt/format.h>

#include <algorithm>
#include <random>

#include "common/block_checksum.h"
#include "common/log.h"
#include "daemon/tiers/cluster/cluster_tier_impl.h"
#include "daemon/tiers/cluster/publish_policy.h"

namespace flexkv {

void ClusterTier::Impl::PullLoop() {
  for (;;) {
    PullJob job;
    {
      MutexLock lock(&pull_mu);
      while (jobs.empty() && !stopping.load(std::memory_order_acquire)) pull_mu.Wait(&pull_cv);
      if (stopping.load(std::memory_order_acquire)) return;  // Stop answers what is queued
      job = std::move(jobs.front());
      jobs.pop_front();
    }
    pulls_running.fetch_add(1, std::memory_order_relaxed);
    PrefetchResult result = Pull(job);
    pulls_running.fetch_sub(1, std::memory_order_relaxed);
    {
      MutexLock lock(&pull_mu);
      --pulls_admitted;
      if (--session_pulls[job.session] == 0) session_pulls.erase(job.session);
    }
    job.done(std::move(result));
  }
}

Result<cluster::PeerHandle> ClusterTier::Impl::PeerFor(const std::string& node_id, uint64_t epoch) {
  std::optional<cluster::NodeInfo> member = Member(node_id);
  if (!member || member->epoch != epoch) {
    AskRefresh();
    return Status::Unavailable(fmt::format("node '{}' epoch {} is not a current member", node_id, epoch));
  }
  {
    MutexLock lock(&peers_mu);
    auto it = peers.find(node_id);
    if (it != peers.end() && it->second.epoch == epoch && it->second.endpoint == member->transfer_endpoint) {
      return it->second.handle;
    }
    if (it != peers.end()) {
      transport->Disconnect(it->second.handle);
      peers.erase(it);
    }
  }
  auto connected = transport->Connect(member->transfer_endpoint);
  if (!connected.ok() && connected.status().code() != StatusCode::kDeadlineExceeded) {
    // A peer refuses a node that joined after its last member refresh (once a second); the refusal makes it
    // refresh at once, so one retry a moment later gets in.
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    connected = transport->Connect(member->transfer_endpoint);
  }
  if (!connected.ok()) return connected.status();
  if (!connected->node_id.empty() && connected->node_id != node_id) {
    transport->Disconnect(*connected);
    return Status::PermissionDenied(fmt::format("the endpoint {} of node '{}' proved to be node '{}'",
                                                member->transfer_endpoint, node_id, connected->node_id));
  }
  MutexLock lock(&peers_mu);
  auto [it, added] = peers.try_emplace(node_id, Peer{*connected, epoch, member->transfer_endpoint});
  if (!added) {
    if (it->second.epoch == epoch && it->second.endpoint == member->transfer_endpoint) {
      // Another puller connected meanwhile: one connection per peer.
      transport->Disconnect(*connected);
      return it->second.handle;
    }
    transport->Disconnect(it->second.handle);  // of an earlier epoch or endpoint
    it->second = Peer{*connected, epoch, member->transfer_endpoint};
  }
  return *connected;
}

void ClusterTier::Impl::DropPeer(const std::string& node_id, const cluster::PeerHandle& handle) {
  MutexLock lock(&peers_mu);
  auto it = peers.find(node_id);
  if (it == peers.end() || it->second.handle.id != handle.id) return;
  transport->Disconnect(it->second.handle);
  peers.erase(it);
}

// At most `window` reads at once. Stops posting after the first failure (only the verified prefix is committed).
// Every read posted has ended when it returns (a read the transport refused as over its limit is retried once one
// of ours ends).
std::vector<Status> ClusterTier::Impl::ReadBlocks(Cache& cache, const cluster::PeerHandle& peer,
                                                  const std::vector<cluster::RemoteRegion>& peer_regions,
                                                  std::span<const PeerLookupReply::Block> blocks,
                                                  std::span<const SlotId> slots) {
  // What the reads' completions (on the transport's progress threads) and this thread share.
  struct Reads {
    explicit Reads(size_t n) : got(n, Status::Cancelled("not read: an earlier block failed")) {}
    Mutex mu;
    std::condition_variable cv;
    size_t in_flight ABSL_GUARDED_BY(mu) = 0;
    bool failed ABSL_GUARDED_BY(mu) = false;
    std::vector<Status> got ABSL_GUARDED_BY(mu);  // each read's end, by block
  } reads(slots.size());
  const size_t window = std::max<size_t>(4, kTransportInflight / (options.max_pulls + 1));
  for (size_t i = 0; i < slots.size(); ++i) {
    {
      MutexLock lock(&reads.mu);
      while (reads.in_flight >= window && !reads.failed) reads.mu.Wait(&reads.cv);
      if (reads.failed || stopping.load(std::memory_order_acquire)) break;
      ++reads.in_flight;
    }
    const PeerLookupReply::Block& b = blocks[i];
    Status posted;
    for (int attempt = 0;; ++attempt) {
      posted = transport->Get(peer, peer_regions[b.region], b.offset, cache.SlotData(slots[i]), cache.SlotBytes(slots[i]),
                              [&reads, i](Status s) {
                                MutexLock lock(&reads.mu);
                                if (!s.ok()) reads.failed = true;
                                reads.got[i] = std::move(s);
                                --reads.in_flight;
                                reads.cv.notify_all();
                              });
      if (posted.code() != StatusCode::kResourceExhausted || attempt >= 200) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));  // other pulls hold the transport's reads
    }
    if (!posted.ok()) {
      MutexLock lock(&reads.mu);
      reads.got[i] = posted;
      reads.failed = true;
      --reads.in_flight;
      break;
    }
  }
  MutexLock lock(&reads.mu);
  while (reads.in_flight > 0) reads.mu.Wait(&reads.cv);
  return std::move(reads.got);
}

PrefetchResult ClusterTier::Impl::Pull(const PullJob& job) {
  PrefetchResult r;
  r.local_blocks = job.local;
  const auto cancelled = [&] { return stopping.load(std::memory_order_acquire) || job.cancelled(); };
  prefetches.fetch_add(1, std::memory_order_relaxed);
  Cache& cache = *job.cache;
  const auto fail = [&](std::string why) {
    pulls_failed.fetch_add(1, std::memory_order_relaxed);
    NoteError(why);
    log::Debug("cluster", "pull: {}", why);
    r.source = std::move(why);
    return r;
  };
  if (!cache.has_pool() || !transport_up.load(std::memory_order_acquire)) return r;
  const CacheDomain::View domain = cache.Domain();
  if (!domain.geometry) return r;
  const bool hybrid = domain.geometry->is_hybrid();
  const std::string ns = domain.model_namespace;
  const std::string layout = domain.geometry->ToString();
  const uint64_t block_bytes = cache.block_bytes();
  const size_t n = job.keys.size();
  // A lookup names at most kMaxLookupKeys keys (the chain from the root): deeper blocks are not pulled.
  const size_t reach = std::min<size_t>(n, kMaxLookupKeys);
  // Candidates, deepest first: the keys after the local prefix that a peer may have published and that are
  // reached only by asking for them (publish_policy.h).
  const std::vector<size_t> candidates = LookupCandidates(job.keys, job.local, reach, options.chunk_blocks);
  size_t deepest = n;
  std::vector<cluster::Owner> owners;
  for (size_t at = 0; at < candidates.size() && deepest == n; at += cluster::kLookupBatch) {
    if (cancelled()) return r;
    std::vector<BlockKey> asked;
    for (size_t i = at; i < std::min(candidates.size(), at + cluster::kLookupBatch); ++i) {
      asked.push_back(job.keys[candidates[i]]);
    }
    auto found = directory->Lookup(ns, asked);
    if (!found.ok()) return fail(fmt::format("directory lookup: {}", found.status().message()));
    for (size_t i = 0; i < found->size(); ++i) {
      if (!(*found)[i].empty()) {
        deepest = candidates[at + i];
        owners = (*found)[i];
        break;
      }
    }
  }
  if (deepest == n) return r;  // no peer has any of it: a plain miss
  // Found at a sampled key: a commit end just above it (not asked yet) names a deeper owner, if there is one.
  const std::vector<size_t> gap = LookupGapAbove(job.keys, deepest, reach, options.chunk_blocks);
  for (size_t at = 0; at < gap.size(); at += cluster::kLookupBatch) {
    if (cancelled()) return r;
    std::vector<BlockKey> asked;
    for (size_t i = at; i < std::min(gap.size(), at + cluster::kLookupBatch); ++i) asked.push_back(job.keys[gap[i]]);
    auto found = directory->Lookup(ns, asked);
    if (!found.ok()) break;  // the sampled key's owners answer still
    const auto hit = std::find_if(found->begin(), found->end(), [](const auto& o) { return !o.empty(); });
    if (hit != found->end()) {
      deepest = gap[at + static_cast<size_t>(hit - found->begin())];
      owners = *hit;
      break;
    }
  }
  static thread_local std::minstd_rand pick(static_cast<unsigned>(std::random_device{}()));
  const cluster::Owner owner = owners[pick() % owners.size()];
  if (cancelled()) return r;

  auto peer = PeerFor(owner.node_id, owner.epoch);
  if (!peer.ok()) return fail(fmt::format("peer {}: {}", owner.node_id, peer.status().message()));
  PeerLookupRequest request;
  request.model_namespace = ns;
  request.layout = layout;
  request.block_bytes = block_bytes;
  request.epoch = owner.epoch;
  request.from = job.local;
  request.hybrid = hybrid;
  // The whole chain, not only up to the key found: the owner answers with all of it it holds (a commit end past
  // the sampled key found, which the directory was not asked about, or blocks it holds unpublished).
  request.keys.assign(job.keys.begin(), job.keys.begin() + static_cast<ptrdiff_t>(reach));
  auto answer = transport->CallSync(*peer, kPeerLookupMethod, EncodeLookupRequest(request));
  for (int attempt = 0; !answer.ok() && answer.status().code() == StatusCode::kResourceExhausted && attempt < 200;
       ++attempt) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));  // other pulls hold the transport's requests
    answer = transport->CallSync(*peer, kPeerLookupMethod, EncodeLookupRequest(request));
  }
  if (!answer.ok()) {
    if (answer.status().code() == StatusCode::kDeadlineExceeded || answer.status().code() == StatusCode::kUnavailable) {
      DropPeer(owner.node_id, *peer);
    }
    return fail(fmt::format("peer {}: {}", owner.node_id, answer.status().message()));
  }
  auto reply = DecodeLookupReply(*answer, request.from, request.keys.size(), hybrid);
  if (!reply.ok()) return fail(fmt::format("peer {}: {}", owner.node_id, reply.status().message()));
  if (reply->blocks.empty() && !hybrid) return fail(fmt::format("peer {}: no longer holds the blocks", owner.node_id));
  std::vector<cluster::RemoteRegion> peer_regions;
  for (const std::string& d : reply->regions) {
    auto parsed = cluster::RemoteRegion::Parse(d);
    if (!parsed.ok()) return fail(fmt::format("peer {}: {}", owner.node_id, parsed.status().message()));
    peer_regions.push_back(*parsed);
  }
  if (cancelled()) return r;
  if (hybrid) {
    auto pulled = PullHybrid(job, *domain.geometry, owner.node_id, *peer, *reply, peer_regions);
    if (!pulled.ok()) return fail(std::string(pulled.status().message()));
    pulls_ok.fetch_add(1, std::memory_order_relaxed);
    pulled_blocks.fetch_add(pulled->pulled_blocks, std::memory_order_relaxed);
    pulled_bytes.fetch_add(pulled->pulled_bytes, std::memory_order_relaxed);
    return std::move(*pulled);
  }

  // Pending local slots for the blocks offered, under the local prefix.
  const BlockKey parent = job.local == 0 ? BlockKey{} : job.keys[job.local - 1];
  const std::span<const BlockKey> wanted(job.keys.data() + job.local, reply->blocks.size());
  // While an SSD tier's write-back serves, a pull evicts only blocks SSD holds (it pulls what fits then): a read never
  // costs a block the node accepted.
  PrefixIndex::Reservation reserved = cache.Reserve(parent, wanted, /*may_wait=*/true);
  if (reserved.parent_refused) return fail("the local prefix was evicted during the pull");
  const size_t first = reserved.cached;  // stored here meanwhile: not pulled again
  const size_t count = reserved.slots.size();
  if (count == 0) {
    r.local_blocks = static_cast<uint32_t>(job.local + first);
    return r;
  }
  const std::vector<Status> got =
      ReadBlocks(cache, *peer, peer_regions, std::span(reply->blocks).subspan(first, count), reserved.slots);
  size_t verified = 0;
  std::vector<uint64_t> checksums;
  std::string why;
  for (; verified < count; ++verified) {
    if (!got[verified].ok()) {
      why = fmt::format("peer {}: block {}: {}", owner.node_id, job.local + first + verified, got[verified].message());
      break;
    }
    const uint64_t expected = reply->blocks[first + verified].checksum;
    const SlotId slot = reserved.slots[verified];
    if (BlockChecksum(cache.SlotData(slot), cache.SlotBytes(slot)) != expected) {
      verify_failures.fetch_add(1, std::memory_order_relaxed);
      why = fmt::format("peer {}: block {} did not match its checksum (overwritten or evicted during the read)",
                        owner.node_id, job.local + first + verified);
      break;
    }
    checksums.push_back(expected);
  }
  const std::span<const SlotId> good(reserved.slots.data(), verified);
  if (verified > 0) cache.Commit(parent, wanted, first, good, checksums, Cache::BlockEvent::kPulled);
  if (verified < count) cache.Abort(std::span<const SlotId>(reserved.slots.data() + verified, count - verified));
  if (verified == 0) {
    if (got[0].code() == StatusCode::kDeadlineExceeded || got[0].code() == StatusCode::kUnavailable) {
      DropPeer(owner.node_id, *peer);
    }
    return fail(why);
  }
  if (!why.empty()) {
    NoteError(why);
    log::Debug("cluster", "pull stopped early: {}", why);
  }
  r.local_blocks = static_cast<uint32_t>(job.local + first);
  r.pulled_blocks = static_cast<uint32_t>(verified);
  for (size_t i = 0; i < verified; ++i) r.pulled_bytes += cache.SlotBytes(reserved.slots[i]);
  r.source = owner.node_id;
  pulls_ok.fetch_add(1, std::memory_order_relaxed);
  pulled_blocks.fetch_add(verified, std::memory_order_relaxed);
  pulled_bytes.fetch_add(r.pulled_bytes, std::memory_order_relaxed);
  return r;
}

}  // namespace flexkv
