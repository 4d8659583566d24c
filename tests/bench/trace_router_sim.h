// `flexkv-bench trace --nodes N`: the trace's requests over N nodes, each the daemon's own policy (a PrefixIndex of
// --capacity-blocks, replayed in-process as SimulatePrefixIndex does for one node), behind these routers:
//   round-robin           request i goes to node i mod N; hits are that node's cached prefix;
//   round-robin + pulls   the same, then the cluster tier's Prefetch as the daemon does it (publish_policy.h): each
//                         node publishes its sampled keys (one in chunk_blocks) and each commit's last key to a
//                         directory and withdraws them on eviction; after the local prefix the directory is asked
//                         for LookupCandidates, one owner of the deepest key found (a seeded random pick) is asked
//                         for the whole chain, and what it holds after the local prefix is pulled (hits, pulled
//                         bytes), committed (publishing its end) and the prompt stored;
//   round-robin + pulls, every key published
//                         the reference for the above: the peer with the longest prefix, as if every key were
//                         published;
//   prefix-aware          the node with the longest cached prefix among those not overloaded (ChoosePrefixAware
//                         over a RoutingIndex fed by every node's stores and evictions, the way a router fed by the
//                         daemons' KV events sees them), load = requests sent to the node among the last 8N.
// Every router stores the whole prompt on the node it chose (the daemon skips the cached prefix), as the replay
// through flexkvd does.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "flexkv/block_key.h"
#include "trace_bench.h"

namespace flexkv::bench {

struct RouterRun {
  std::string router;
  uint64_t requests = 0, blocks = 0, hits = 0;
  uint64_t local_hits = 0;       // of hits: the chosen node's own cached prefix
  uint64_t pulled_blocks = 0;    // of hits: pulled from a peer (round-robin + pulls only)
  uint64_t lookup_keys = 0;      // keys asked of the directory (round-robin + pulls as the daemon does it)
  uint64_t lookups = 0;          // directory round trips (kLookupBatch keys each at most)
  std::vector<uint64_t> per_node_requests;
  bool index_consistent = true;  // the RoutingIndex held exactly each node's committed keys at the end
  double hit_ratio() const { return blocks == 0 ? 0.0 : static_cast<double>(hits) / static_cast<double>(blocks); }
  // Busiest node's requests over the mean (1.0: perfectly even).
  double imbalance() const;
};

// The four routers, in the order above. `keys[i]` are request i's block keys (TraceKeys). nodes >= 1,
// node_capacity >= 1 block; chunk_blocks: the daemons' --cluster-chunk-blocks (default 8, the daemon's).
std::vector<RouterRun> SimulateRouters(std::span<const TraceRequest> trace,
                                       std::span<const std::vector<BlockKey>> keys, uint32_t nodes,
                                       uint32_t node_capacity, double max_load_ratio = 2.0,
                                       uint32_t chunk_blocks = 8);

}  // namespace flexkv::bench
