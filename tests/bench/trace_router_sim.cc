// The three-router trace simulation (trace_router_sim.h).
#include "trace_router_sim.h"

#include <algorithm>
#include <deque>
#include <memory>
#include <numeric>

#include "daemon/cache/prefix_index.h"
#include "flexkv/routing.h"

namespace flexkv::bench {

double RouterRun::imbalance() const {
  if (per_node_requests.empty() || requests == 0) return 1.0;
  const double mean = static_cast<double>(requests) / static_cast<double>(per_node_requests.size());
  return static_cast<double>(*std::max_element(per_node_requests.begin(), per_node_requests.end())) / mean;
}

namespace {

enum class Router { kRoundRobin, kRoundRobinPulls, kPrefixAware };

// N nodes, each a PrefixIndex, mirrored into one RoutingIndex through the nodes' commits and evictions.
class Cluster {
 public:
  Cluster(uint32_t nodes, uint32_t capacity) {
    for (uint32_t n = 0; n < nodes; ++n) {
      node_ids_.push_back(routing_.AddNode("node-" + std::to_string(n)).value());
      auto index = std::make_unique<PrefixIndex>(capacity);
      index->SetEvictionListener([this, n](SlotId, const BlockKey& key) {
        (void)routing_.Removed(node_ids_[n], CacheTier::kDram, std::span(&key, 1));
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
    (void)routing_.Stored(node_ids_[n], CacheTier::kDram, keys.subspan(r.cached, r.slots.size()));
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
  RoutingIndex routing_;
  std::vector<uint32_t> node_ids_;
  std::vector<std::unique_ptr<PrefixIndex>> nodes_;
};

RouterRun Run(Router router, std::span<const TraceRequest> trace, std::span<const std::vector<BlockKey>> keys,
              uint32_t nodes, uint32_t capacity, double max_load_ratio) {
  Cluster cluster(nodes, capacity);
  RouterRun run;
  run.router = router == Router::kRoundRobin        ? "round-robin"
               : router == Router::kRoundRobinPulls ? "round-robin + peer pulls"
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
    if (router == Router::kRoundRobinPulls && local < k.size()) {
      // Prefetch: the directory (here the routing index) names the peers holding what follows the local prefix.
      for (const auto& p : cluster.routing().PrefixLengths(k)) {
        if (p.node != n && p.blocks > local) pulled = std::max<size_t>(pulled, p.blocks - local);
      }
    }
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
                                       uint32_t nodes, uint32_t node_capacity, double max_load_ratio) {
  std::vector<RouterRun> runs;
  for (Router r : {Router::kRoundRobin, Router::kRoundRobinPulls, Router::kPrefixAware}) {
    runs.push_back(Run(r, trace, keys, nodes, node_capacity, max_load_ratio));
  }
  return runs;
}

}  // namespace flexkv::bench
