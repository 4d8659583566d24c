// The three-router trace simulation (trace_router_sim.h).
#include "trace_router_sim.h"

#include <algorithm>
#include <deque>
#include <memory>
#include <numeric>
#include <random>
#include <unordered_map>

#include "daemon/cache/prefix_index.h"
#include "daemon/cluster/directory.h"
#include "daemon/tiers/cluster/peer_lookup.h"
#include "daemon/tiers/cluster/publish_policy.h"
#include "flexkv/routing.h"

namespace flexkv::bench {

double RouterRun::imbalance() const {
  if (per_node_requests.empty() || requests == 0) return 1.0;
  const double mean = static_cast<double>(requests) / static_cast<double>(per_node_requests.size());
  return static_cast<double>(*std::max_element(per_node_requests.begin(), per_node_requests.end())) / mean;
}

namespace {

enum class Router { kRoundRobin, kRoundRobinPulls, kRoundRobinPullsEveryKey, kPrefixAware };

// N nodes, each a PrefixIndex, mirrored into one RoutingIndex through the nodes' commits and evictions, and into a
// directory of what each node publishes (publish_policy.h) as the cluster tier keeps it in etcd.
class Cluster {
 public:
  Cluster(uint32_t nodes, uint32_t capacity, uint32_t chunk_blocks) : chunk_blocks_(chunk_blocks) {
    for (uint32_t n = 0; n < nodes; ++n) {
      node_ids_.push_back(routing_.AddNode("node-" + std::to_string(n)).value());
      auto index = std::make_unique<PrefixIndex>(capacity);
      index->SetEvictionListener([this, n](SlotId, const BlockKey& key) {
        (void)routing_.Removed(node_ids_[n], CacheTier::kDram, std::span(&key, 1));
        auto it = directory_.find(key);  // withdrawn with the block
        if (it != directory_.end() && (it->second &= ~(uint64_t{1} << n)) == 0) directory_.erase(it);
      });
      nodes_.push_back(std::move(index));
    }
  }
  PrefixIndex& node(uint32_t n) { return *nodes_[n]; }
  const RoutingIndex& routing() const { return routing_; }

  // The node's cached prefix of `keys` (marks it used, as a Match does).
  size_t Match(uint32_t n, std::span<const BlockKey> keys) { return nodes_[n]->Match(keys, /*pin=*/false, nullptr); }
  // Stores the whole prompt on node n (the cached prefix is skipped by Reserve), publishing what it committed.
  void Store(uint32_t n, std::span<const BlockKey> keys) {
    auto r = nodes_[n]->Reserve(kRootParent, keys);
    nodes_[n]->Commit(r.slots);
    const std::span<const BlockKey> committed = keys.subspan(r.cached, r.slots.size());
    (void)routing_.Stored(node_ids_[n], CacheTier::kDram, committed);
    for (size_t j = 0; j < committed.size(); ++j) {
      if (IsPublishedKey(committed[j], j + 1 == committed.size(), chunk_blocks_)) {
        directory_[committed[j]] |= uint64_t{1} << n;
      }
    }
  }

  // The cluster tier's Prefetch on node n as the daemon does it (ClusterTier's Pull): the directory asked for
  // LookupCandidates in batches, deepest first; one owner of the deepest key found, picked at random, asked for the
  // whole chain (its Match, which marks the blocks used, as its lookup's pinned match does); what it holds after
  // the local prefix is pulled and committed here (publishing the pull's end). Returns the blocks pulled.
  size_t PullAsDaemon(uint32_t n, std::span<const BlockKey> keys, size_t local, RouterRun* run) {
    const size_t reach = std::min<size_t>(keys.size(), kMaxLookupKeys);
    const std::vector<size_t> candidates = LookupCandidates(keys, local, reach, chunk_blocks_);
    uint64_t owners = 0;
    size_t found = 0;
    for (size_t at = 0; at < candidates.size() && owners == 0; at += cluster::kLookupBatch) {
      ++run->lookups;
      for (size_t i = at; i < std::min(candidates.size(), at + cluster::kLookupBatch); ++i) {
        ++run->lookup_keys;
        auto it = directory_.find(keys[candidates[i]]);
        if (owners == 0 && it != directory_.end() && (it->second & ~(uint64_t{1} << n)) != 0) {
          owners = it->second & ~(uint64_t{1} << n);
          found = candidates[i];
        }
      }
    }
    if (owners == 0) return 0;
    // Found at a sampled key: the keys just above it, as the daemon asks them next.
    uint64_t deeper = 0;
    const std::vector<size_t> gap = LookupGapAbove(keys, found, reach, chunk_blocks_);
    for (size_t at = 0; at < gap.size() && deeper == 0; at += cluster::kLookupBatch) {
      ++run->lookups;
      for (size_t i = at; i < std::min(gap.size(), at + cluster::kLookupBatch); ++i) {
        ++run->lookup_keys;
        auto it = directory_.find(keys[gap[i]]);
        if (deeper == 0 && it != directory_.end()) deeper = it->second & ~(uint64_t{1} << n);
      }
    }
    if (deeper != 0) owners = deeper;
    std::vector<uint32_t> listed;
    for (uint32_t o = 0; o < nodes_.size(); ++o) {
      if ((owners >> o) & 1) listed.push_back(o);
    }
    const uint32_t owner = listed[pick_() % listed.size()];
    const size_t held = nodes_[owner]->Match(keys.first(reach), /*pin=*/false, nullptr);
    if (held <= local) return 0;
    // Committed here under the local prefix, as the pull's Reserve + Commit of the verified blocks.
    Store(n, keys.first(held));
    return held - local;
  }

  // The reference: the longest prefix any other node holds, as if every key were published.
  size_t PullEveryKey(uint32_t n, std::span<const BlockKey> keys, size_t local) const {
    size_t pulled = 0;
    for (const auto& p : routing_.PrefixLengths(keys)) {
      if (p.node != n && p.blocks > local) pulled = std::max<size_t>(pulled, p.blocks - local);
    }
    return pulled;
  }
  // Whether the routing index holds exactly every node's committed keys.
  bool Consistent() const {
    for (uint32_t n = 0; n < nodes_.size(); ++n) {
      if (routing_.KeyCount(node_ids_[n], CacheTier::kDram) != nodes_[n]->committed_blocks()) return false;
      bool all = true;
      nodes_[n]->ForEachCommitted([&](SlotId, const BlockKey& key, const BlockKey&) {
        if (!all) return;
        // A one-key prompt: the node holds it iff its prefix length is 1. (Keys are chained, so a lookup of the
        // key alone asks exactly "does node n hold this key".)
        all = routing_.PrefixLengths(std::span(&key, 1))[node_ids_[n]].blocks == 1;
      });
      if (!all) return false;
    }
    return true;
  }

 private:
  const uint32_t chunk_blocks_;
  RoutingIndex routing_;
  std::vector<uint32_t> node_ids_;
  std::vector<std::unique_ptr<PrefixIndex>> nodes_;
  std::unordered_map<BlockKey, uint64_t, BlockKeyHash> directory_;  // published key -> the nodes holding it
  std::minstd_rand pick_{29};                                        // the owner picked, reproducibly
};

RouterRun Run(Router router, std::span<const TraceRequest> trace, std::span<const std::vector<BlockKey>> keys,
              uint32_t nodes, uint32_t capacity, double max_load_ratio, uint32_t chunk_blocks) {
  Cluster cluster(nodes, capacity, chunk_blocks);
  RouterRun run;
  run.router = router == Router::kRoundRobin                ? "round-robin"
               : router == Router::kRoundRobinPulls         ? "round-robin + peer pulls"
               : router == Router::kRoundRobinPullsEveryKey ? "round-robin + pulls, every key"
                                                            : "prefix-aware";
  run.per_node_requests.assign(nodes, 0);
  const size_t window = size_t{8} * nodes;
  std::deque<uint32_t> recent;  // the nodes of the last `window` requests
  std::vector<double> loads(nodes, 0.0);
  for (size_t i = 0; i < trace.size(); ++i) {
    std::span<const BlockKey> k = keys[i];
    uint32_t n = static_cast<uint32_t>(i % nodes);
    if (router == Router::kPrefixAware) {
      const auto prefixes = cluster.routing().PrefixLengths(k);
      n = ChoosePrefixAware(prefixes, loads, max_load_ratio).value();
    }
    const size_t local = cluster.Match(n, k);
    size_t pulled = 0;
    if (router == Router::kRoundRobinPulls && local < k.size()) pulled = cluster.PullAsDaemon(n, k, local, &run);
    if (router == Router::kRoundRobinPullsEveryKey && local < k.size()) pulled = cluster.PullEveryKey(n, k, local);
    cluster.Store(n, k);
    ++run.requests;
    ++run.per_node_requests[n];
    run.blocks += k.size();
    run.local_hits += local;
    run.pulled_blocks += pulled;
    run.hits += local + pulled;
    recent.push_back(n);
    loads[n] += 1;
    if (recent.size() > window) {
      loads[recent.front()] -= 1;
      recent.pop_front();
    }
  }
  run.index_consistent = cluster.Consistent();
  return run;
}

}  // namespace

std::vector<RouterRun> SimulateRouters(std::span<const TraceRequest> trace, std::span<const std::vector<BlockKey>> keys,
                                       uint32_t nodes, uint32_t node_capacity, double max_load_ratio,
                                       uint32_t chunk_blocks) {
  std::vector<RouterRun> runs;
  for (Router r : {Router::kRoundRobin, Router::kRoundRobinPulls, Router::kRoundRobinPullsEveryKey,
                   Router::kPrefixAware}) {
    runs.push_back(Run(r, trace, keys, nodes, node_capacity, max_load_ratio, chunk_blocks));
  }
  return runs;
}

}  // namespace flexkv::bench
