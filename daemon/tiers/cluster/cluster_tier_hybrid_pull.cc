// The cluster tier's hybrid pulls (cluster_tier_impl.h, PullHybrid): a hybrid domain's prefix comes from a peer only
// as a whole hit (docs/hybrid.md "Match: the hit rule"): the FULL blocks up to the peer's hit end e, each window's
// blocks before e and the state at e. The reply is checked against what the hit rule at e needs here, every entry is
// read into a pending slot and checked against its content checksum, and the set is committed only when all of it
// verified; anything less is given back and costs a miss. Committing the verified part alone would keep the hit rule
// true (Match asks for every component), but it would hold slots that serve no hit (FULL blocks without the window
// and state that make them usable, or entries whose FULL blocks are missing) and evict blocks that do; the next
// prefetch pulls the set again.
#include <fmt/format.h>

#include "common/block_checksum.h"
#include "common/log.h"
#include "daemon/tiers/cluster/cluster_tier_impl.h"

namespace flexkv {

Result<PrefetchResult> ClusterTier::Impl::PullHybrid(const PullJob& job, const Geometry& geometry,
                                                     const std::string& node_id, const cluster::PeerHandle& peer,
                                                     const PeerLookupReply& reply,
                                                     const std::vector<cluster::RemoteRegion>& peer_regions) {
  Cache& cache = *job.cache;
  const uint32_t from = job.local;
  const uint32_t e = reply.matched;  // <= the keys asked (DecodeLookupReply)
  if (Status checked = CheckHybridReply(reply, geometry, from); !checked.ok()) {
    return Status(checked.code(), fmt::format("peer {}: {}", node_id, checked.message()));
  }
  // The keys of the entries (checked: each component's in order, at positions below e).
  std::vector<std::vector<BlockKey>> entry_keys(geometry.component_count());
  std::vector<size_t> first_entry(geometry.component_count(), reply.entries.size());
  for (size_t i = reply.entries.size(); i-- > 0;) first_entry[reply.entries[i].component] = i;
  for (const PeerLookupReply::Entry& entry : reply.entries) {
    entry_keys[entry.component].push_back(job.keys[entry.position]);
  }

  const BlockKey parent = from == 0 ? BlockKey{} : job.keys[from - 1];
  const std::span<const BlockKey> full_keys(job.keys.data() + from, e - from);
  const Cache::HybridReservation reserved = cache.ReservePulledHybrid(parent, full_keys, entry_keys);
  if (reserved.shortfall != StatusCode::kOk) {
    if (reserved.full.parent_refused) {
      return Status(StatusCode::kAborted, "the local prefix was evicted during the pull");
    }
    return Status(reserved.shortfall,
                  fmt::format("component {} of the hybrid prefix could not be reserved here ({}): nothing pulled",
                              reserved.component, StatusCodeName(reserved.shortfall)));
  }
  // What to read: the FULL blocks not cached here, then each component's entries not cached here.
  std::vector<PeerLookupReply::Block> remote;
  std::vector<SlotId> slots;
  std::vector<size_t> component_of;
  for (size_t i = 0; i < reserved.full.slots.size(); ++i) {
    remote.push_back(reply.blocks[reserved.full.cached + i]);
    slots.push_back(reserved.full.slots[i]);
    component_of.push_back(0);
  }
  for (size_t c = 1; c < reserved.slots.size(); ++c) {
    for (size_t i = 0; i < reserved.slots[c].size(); ++i) {
      if (reserved.slots[c][i] == ComponentIndex::kNoSlot) continue;
      remote.push_back(reply.entries[first_entry[c] + i].where);
      slots.push_back(reserved.slots[c][i]);
      component_of.push_back(c);
    }
  }
  const std::vector<Status> got = ReadBlocks(cache, peer, peer_regions, remote, slots);
  std::vector<std::vector<uint64_t>> checksums(geometry.component_count());
  for (size_t i = 0; i < slots.size(); ++i) {
    Status bad;
    if (!got[i].ok()) {
      bad = got[i];
    } else if (BlockChecksum(cache.SlotData(slots[i]), cache.SlotBytes(slots[i])) != remote[i].checksum) {
      verify_failures.fetch_add(1, std::memory_order_relaxed);
      bad = Status::DataLoss("did not match its checksum (overwritten or evicted during the read)");
    }
    if (!bad.ok()) {
      cache.AbortHybrid(reserved);
      if (bad.code() == StatusCode::kDeadlineExceeded || bad.code() == StatusCode::kUnavailable) {
        DropPeer(node_id, peer);
      }
      return Status(bad.code(), fmt::format("peer {}: {} (component {}): {}; nothing of the hybrid prefix was kept",
                                            node_id, component_of[i] == 0 ? "a FULL block" : "an entry",
                                            component_of[i], bad.message()));
    }
    checksums[component_of[i]].push_back(remote[i].checksum);
  }
  cache.CommitPulledHybrid(parent, full_keys, reserved, checksums);

  PrefetchResult r;
  r.local_blocks = static_cast<uint32_t>(from + reserved.full.cached);
  r.pulled_blocks = static_cast<uint32_t>(reserved.full.slots.size());
  uint64_t entry_bytes = 0;
  for (size_t i = 0; i < slots.size(); ++i) {
    const uint64_t bytes = cache.SlotBytes(slots[i]);
    r.pulled_bytes += bytes;
    if (component_of[i] != 0) entry_bytes += bytes;
  }
  r.source = node_id;
  pulled_entries.fetch_add(slots.size() - reserved.full.slots.size(), std::memory_order_relaxed);
  pulled_entry_bytes.fetch_add(entry_bytes, std::memory_order_relaxed);
  return r;
}

}  // namespace flexkv
