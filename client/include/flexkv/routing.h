// Prefix-aware routing: which node of a cluster holds which block keys in which tier, kept from the daemons' KV
// event streams (docs/kv_events.md), and, for a prompt's block keys, how long a cached prefix each node holds.
// A router computes the prompt's keys with flexkvd's key function (ComputeBlockKeys, docs/protocol.md "Block keys")
// and sends the request where most of it is cached (docs/routing.md).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "flexkv/block_key.h"
#include "flexkv/status.h"

namespace flexkv {

// The tiers a node's daemon reports blocks in. DRAM is the host pool; SSD the tier below it (docs/ssd.md).
enum class CacheTier : uint8_t { kDram = 0, kSsd = 1 };
inline constexpr size_t kCacheTierCount = 2;

// One entry per distinct key, holding a bit per node and tier (16 bytes beside the 16-byte key), so a cluster of
// 64 nodes with 10 M cached blocks between them costs a few hundred MB at most, and less when nodes share prefixes.
//
// Thread safety: every method may be called from any thread; updates (one writer per node's stream, typically)
// and lookups share one reader-writer lock, lookups taking it shared. Updates are idempotent: a key stored twice
// is held once, a key removed that was not held changes nothing, so replaying a stream's snapshot over a view that
// already saw part of it is harmless.
class RoutingIndex {
 public:
  static constexpr uint32_t kMaxNodes = 64;

  RoutingIndex();
  ~RoutingIndex();
  RoutingIndex(const RoutingIndex&) = delete;
  RoutingIndex& operator=(const RoutingIndex&) = delete;

  // Adds a node and returns its number (0, 1, ... in the order added). ALREADY_EXISTS for a name given before,
  // RESOURCE_EXHAUSTED past kMaxNodes, INVALID_ARGUMENT for an empty name.
  Result<uint32_t> AddNode(std::string_view name);
  // The node's number, NOT_FOUND for a name never added.
  Result<uint32_t> FindNode(std::string_view name) const;
  std::string NodeName(uint32_t node) const;  // "" for a number never handed out
  uint32_t node_count() const;

  // The node now holds `keys` in `tier` (its daemon stored them, or moved them there). INVALID_ARGUMENT for a
  // node number never handed out.
  Status Stored(uint32_t node, CacheTier tier, std::span<const BlockKey> keys);
  // The node no longer holds `keys` in `tier` (evicted, dropped, or moved to another tier, which reports Stored
  // there). Keys held by no node and tier any more leave the index.
  Status Removed(uint32_t node, CacheTier tier, std::span<const BlockKey> keys);
  // The node holds nothing (its daemon restarted with an empty pool, cleared its cache, or the stream is to be
  // rebuilt from a snapshot). O(keys in the index).
  Status ClearNode(uint32_t node);
  // The node now holds exactly `dram` in DRAM and `ssd` on SSD, nothing else (a stream's snapshot): one update
  // under the lock, so a concurrent PrefixLengths sees the node's old view or its new one, never a part of each.
  // INVALID_ARGUMENT for a node number never handed out (nothing changes). O(keys in the index + keys given).
  Status ReplaceNode(uint32_t node, std::span<const BlockKey> dram, std::span<const BlockKey> ssd);
  // Whether the node is live: a request sent to a dead node fails (it does not cost a miss), so ChoosePrefixAware
  // never chooses one. Nodes start live; the router sets a node dead when its event stream ends or goes quiet, or it
  // left the cluster's membership, and live again when its daemon is heard from. Its keys stay meanwhile.
  // INVALID_ARGUMENT for a node number never handed out.
  Status SetLive(uint32_t node, bool live);

  struct NodePrefix {
    uint32_t node = 0;
    uint32_t blocks = 0;       // leading blocks of the prompt the node holds, in any tier
    uint32_t dram_blocks = 0;  // leading blocks it holds in DRAM (a load without a promotion from SSD)
    bool live = true;          // SetLive: never chosen when false
  };
  // For every node, in node order: how many leading blocks of `keys` it holds. O(the longest prefix held).
  std::vector<NodePrefix> PrefixLengths(std::span<const BlockKey> keys) const;

  // Keys the node holds in `tier`; 0 for an unknown node.
  uint64_t KeyCount(uint32_t node, CacheTier tier) const;
  // Distinct keys in the index (held by at least one node in one tier).
  uint64_t size() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// A router's choice for one request: the node with the longest cached prefix among the nodes that are not
// overloaded, where overloaded means a load above `max_load_ratio` times the least loaded node's (plus one, so
// that idle nodes compare sensibly); ties go to the least loaded node, then the lowest number. `loads` holds one
// value per node in node order (queued requests or tokens: any measure of outstanding work; the router keeps it).
// `prefixes` comes from PrefixLengths. Nodes that are not live are never chosen (the least load is taken over the
// live ones). Returns the node number; INVALID_ARGUMENT when the sizes differ or are 0, UNAVAILABLE when no node is
// live.
Result<uint32_t> ChoosePrefixAware(std::span<const RoutingIndex::NodePrefix> prefixes, std::span<const double> loads,
                                   double max_load_ratio = 2.0);

}  // namespace flexkv
