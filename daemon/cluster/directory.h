// Directory: cluster membership and the block directory of the cluster tier (issue 16, docs/cluster.md), on a
// shared store. The interface is store-neutral so that another backend (Redis) stays possible; the one backend
// is etcd v3 (daemon/cluster/etcd/etcd_directory.h, ConnectEtcd).
//
// A node joins with a lease: its member record and every directory entry it publishes are attached to that
// lease, so they all vanish at once when the node leaves, dies or stays unreachable for longer than the ttl.
// Each join of a node id gets a new epoch (the previous one + 1, kept in the store); an entry carries the epoch
// it was published under, and Lookup returns only entries whose epoch is the owner's current one, so a
// restarted node's old entries are never trusted. Everything read back from the store is validated: a value
// that does not parse is skipped (and counted), never trusted. A stale entry (evicted but not yet withdrawn)
// costs at most a failed pull, which the puller verifies anyway.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "flexkv/block_key.h"
#include "flexkv/status.h"

namespace flexkv::cluster {

// Limits the store accepts and the reader enforces.
inline constexpr size_t kMaxNodeIdBytes = 128;         // node ids: [A-Za-z0-9._-]+
inline constexpr size_t kMaxEndpointBytes = 256;       // transfer_endpoint: host:port
inline constexpr size_t kMaxPoolInfoBytes = 64 * 1024;  // pool_info
inline constexpr size_t kMaxNamespaceBytes = 256;       // model_namespace (any bytes; escaped in keys)
inline constexpr size_t kLookupBatch = 64;              // keys per Lookup round trip

struct NodeInfo {
  std::string node_id;
  uint64_t epoch = 0;               // ignored by Join (the store picks it); set in what Members returns
  std::string transfer_endpoint;    // host:port
  std::string pool_info;            // opaque: what a peer needs to read our pool (rkey etc.), <= 64 KiB
};

struct DirectoryEntry {
  BlockKey chunk_key;  // the last block key of a chunk of blocks
  std::string model_namespace;
  uint32_t blocks = 0;  // blocks in the chunk (> 0)
};

struct Owner {
  std::string node_id;
  uint64_t epoch = 0;
  friend bool operator==(const Owner&, const Owner&) = default;
};

// Thread-safe.
class Directory {
 public:
  virtual ~Directory() = default;

  // Joins: grants a lease of `ttl` (the node's entries die with it), claims self.node_id (FAILED_PRECONDITION if
  // a live node holds it), picks epoch = the previous epoch of this node id + 1 (kept in the store under a key
  // without lease), writes the member record under the lease, and keeps the lease alive from a thread of its own
  // until Leave or destruction. FAILED_PRECONDITION too when this client is already joined (Leave first).
  // INVALID_ARGUMENT for a node id, endpoint or pool_info outside the limits above. UNAVAILABLE naming the
  // endpoint when the store cannot be reached within the deadline.
  virtual Status Join(const NodeInfo& self, std::chrono::milliseconds ttl) = 0;
  // Revokes the lease: every entry of this node goes at once. OK when not joined. Destruction without Leave
  // only stops the keepalives: the store drops the node after its ttl, as when the process dies.
  virtual Status Leave() = 0;
  // Revokes the lease that holds node_id's member record, and with it every entry published under it: for a node
  // that proved the record is its own previous run's (the daemon: the record's transfer endpoint is the one this
  // process listens on now, which no other live process can). OK when no record exists or its lease ended.
  // FAILED_PRECONDITION when this client holds it (Leave instead), the record has no lease (not flexkvd's), is not
  // signed with the cluster secret, or names another transfer endpoint than `expected_endpoint` (when not empty): the
  // lease of a record this node cannot prove its own is never revoked.
  virtual Status ReleaseNodeId(const std::string& node_id, std::string_view expected_endpoint = {}) = 0;
  // Every live member (this node included), with its current epoch.
  virtual Result<std::vector<NodeInfo>> Members() = 0;

  // Batched: one round trip per call of up to 128 entries (a Txn of puts/deletes attached to the lease); more
  // take one round trip per 128. Entries of the current epoch only. FAILED_PRECONDITION when not joined (or the
  // lease was found gone: joined() turns false).
  virtual Status Publish(std::span<const DirectoryEntry> entries) = 0;
  virtual Status Withdraw(std::span<const DirectoryEntry> entries) = 0;

  // For each key, the owners that published it: other nodes only, live members only (an entry whose epoch is
  // not its owner's current epoch is never returned). One round trip for up to 64 keys (kLookupBatch).
  virtual Result<std::vector<std::vector<Owner>>> Lookup(const std::string& model_namespace,
                                                          std::span<const BlockKey> chunk_keys) = 0;

  // Whether the lease is alive: false before Join, after Leave, and once the store was unreachable for longer
  // than the ttl (the node must then consider itself out and Join again).
  virtual bool joined() const = 0;
  // The epoch of the current (or last) Join; 0 before the first one. (Added to the brief's interface: the
  // daemon must put its own epoch next to its pool registration, and reading it back through Members would
  // cost a round trip and could fail.)
  virtual uint64_t epoch() const = 0;
  // Values read back from the store that were not written with the cluster secret (a bad or missing signature):
  // ignored, since construction (status and metrics show it).
  virtual uint64_t unauthenticated_values() const = 0;
};

}  // namespace flexkv::cluster
