// ClusterTier: the cluster tier (issue 16, docs/cluster.md). Nodes reuse each other's cached
// prefixes: a block another daemon of the cluster holds is pulled into this node's DRAM pool instead of being
// prefilled again. It joins three parts:
//   membership + directory  the shared store (etcd, daemon/cluster/directory.h): this node's member record under a
//                           lease (node id, epoch, transfer endpoint), and one directory entry per published block
//                           key. Published (publish_policy.h): every key whose low 64 bits are 0 mod chunk_blocks
//                           (one in chunk_blocks on average, wherever it sits in a prompt: no depth needed) and the
//                           last key of every commit (a stored request's end, a pull's end), once committed here.
//                           Withdrawn when the block
//                           leaves (evicted, dropped). Publishing runs on a thread of its own, batched and retried,
//                           as the difference between what the node holds and what the store has (bounded by the
//                           blocks held, however long the store is away): a failed or slow publish never touches
//                           the local blocks, which stay served. A lease
//                           lost while the store was unreachable is joined again (a new epoch) and everything
//                           still held is published again.
//   bytes                   UCX (daemon/cluster/ucx/ucx_transport.h): each pool grant is registered for remote
//                           reads; peers authenticate with the cluster secret and must be current members.
//   pulls                   Prefetch: after the local prefix, the directory names the peer holding the deepest
//                           published key it is asked about (LookupCandidates: the sampled keys and the keys before
//                           the first and after the last of them); that peer's lookup (a Call) answers which of its
//                           slots hold the prompt's keys (the whole chain: all of it the peer holds),
//                           with each block's content checksum and its region descriptor; the blocks are read
//                           into pending local slots, each checked against its checksum, and committed (the
//                           verified prefix only). A peer that evicts, overwrites or dies mid-read costs a miss,
//                           never a wrong block. Match never waits on the network; only Prefetch pulls.
//   hybrid domains          their FULL blocks are published as above; a peer's lookup answers its hit end by the
//                           hit rule (docs/hybrid.md) with the window and state entries it needs, and the pull
//                           commits the whole set (FULL blocks, windows, state) only once all of it verified.
// Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "daemon/cache/cache.h"
#include "daemon/cluster/directory.h"
#include "daemon/cluster/ucx/ucx_transport.h"
#include "daemon/tiers/cache_tier.h"
#include "flexkv/block_key.h"
#include "flexkv/status.h"

namespace flexkv {

class CacheSet;

struct ClusterTierOptions {
  std::string node_id;                       // --node-id: [A-Za-z0-9._-]{1,64}, unique in the cluster
  std::vector<std::string> etcd_endpoints;   // --etcd-endpoints: host:port, the store
  std::string etcd_credentials_file;         // --etcd-credentials-file: "user = ..." / "password = ..." lines (0600)
  std::string secret_file;                   // --cluster-secret-file: the cluster secret (mode 0600/0400, >= 16 bytes)
  std::string listen_address;                // --cluster-listen host:port: the transfer endpoint (numeric host)
  uint16_t listen_port = 0;
  std::string transfer_devices;              // --transfer-dev: UCX_NET_DEVICES, e.g. "mlx5_0:1,mlx5_1:1"
  std::string transports = "rc,tcp";         // --cluster-transports
  uint32_t chunk_blocks = 8;                 // --cluster-chunk-blocks: one published key in this many, on average
  std::chrono::milliseconds lease_ttl{10000};       // --cluster-lease-ttl
  std::chrono::milliseconds pull_deadline{2000};    // --cluster-pull-deadline: per network step of a pull
  uint32_t max_pulls = 8;                    // --cluster-max-pulls: prefetches pulling at once, node-wide
  uint32_t max_session_pulls = 2;            // --cluster-max-session-pulls: per session
  uint32_t lanes = 4;                        // --cluster-lanes: UCX workers, each peer connected once per lane
};

// One member as status shows it.
struct ClusterMember {
  std::string node_id;
  uint64_t epoch = 0;
  std::string endpoint;
  bool self = false;
};

struct ClusterTierStatus {
  // "joining" (the first attempt), "joined", "retrying: <the last attempt's error> (attempt N)" (the listener's port
  // or the store not there yet, the lease lost), "failed: <why>" (a transport configuration UCX refuses), "stopped"
  std::string state;
  std::string node_id, endpoint;
  uint64_t epoch = 0;
  std::vector<ClusterMember> members;
  uint64_t published_keys = 0;          // directory entries this node holds now
  uint64_t publish_queue = 0;           // publishes and withdrawals not yet in the store
  uint64_t publish_failures = 0;        // store calls that failed (retried)
  uint64_t rejoins = 0;                 // leases lost and joined again
  uint64_t prefetches = 0;              // Prefetch requests that went to the network
  uint64_t pulls_ok = 0;                // ... that pulled at least one block
  uint64_t pulls_failed = 0;            // ... that found a peer but pulled nothing (deadline, peer gone, verification)
  uint64_t pulled_blocks = 0, pulled_bytes = 0;  // FULL blocks; bytes of everything pulled (entries included)
  uint64_t pulled_entries = 0, pulled_entry_bytes = 0;  // hybrid domains' window and state entries pulled
  uint64_t verify_failures = 0;         // pulled blocks whose bytes did not match their checksum (not served)
  uint64_t pulls_in_flight = 0;
  uint64_t lookups_served = 0;          // peers' lookups answered here
  uint64_t blocks_offered = 0;          // blocks those lookups offered (hybrid entries included)
  cluster::UcxTransport::Stats transport;
  uint64_t directory_unauthenticated = 0;  // member records / entries in the store without the secret's signature
  std::vector<std::string> transports_in_use;
  std::vector<std::string> rdma_devices;  // "mlx5_0:1 PORT_ACTIVE InfiniBand"
  std::string last_error;               // the last pull or publish failure, for the operator
};

class ClusterTier final : public CacheTier {
 public:
  // Checks the options and reads the secret and credential files (PERMISSION_DENIED naming the file when it is
  // readable by others, INVALID_ARGUMENT when the secret is shorter than 16 bytes): only these stop the start. It
  // contacts nothing and never waits on the network (the local cache does not wait on the cluster tier): the
  // membership thread creates the transport (its listener bound to the configured address only) and joins, in the
  // background, retrying with backoff (200 ms doubling to 2 s) while the node serves its own cache; status says
  // "joining", "joined" or "retrying: <why>". A listen port still taken, a store that cannot be reached or refuses
  // us, and a node id that a live lease holds are retried; before its first join, a member record of this node id
  // held by this node's previous run (killed: its lease lives until its ttl) is released at once
  // (Directory::ReleaseNodeId), since its transfer endpoint is the address this process now listens on. A transport configuration UCX refuses
  // (INVALID_ARGUMENT) is not retried (status: "failed: ..."). Sets every cache's block listener (call before
  // RecoverPools, so that restored blocks are published once verified); daemon.cc chains AddPoolRegion/
  // RemovePoolRegion into the pool listener. Threads start here.
  static Result<std::unique_ptr<ClusterTier>> Create(ClusterTierOptions options, CacheSet* caches);
  ~ClusterTier();  // Stop()
  ClusterTier(const ClusterTier&) = delete;
  ClusterTier& operator=(const ClusterTier&) = delete;

  std::string_view name() const override { return "peer"; }
  TierCapabilities capabilities() const override {
    TierCapabilities c;
    c.pulls_on_prefetch = true;
    c.hybrid = true;
    return c;
  }

  // The cache observer's part: registers / unregisters a grant for remote reads (a grant announced before the
  // transport is up is registered when it comes up); a grant peers cannot read still serves here (logged). Runs
  // under the cache's lock.
  Status AddPoolRegion(const PoolRegion& region);
  void RemovePoolRegion(const PoolRegion& region);

  // Pulls keys[local_blocks, ...) from a peer into `cache` (the prefix keys[0, local_blocks) is cached here) and
  // calls `done` exactly once with what it did: on a puller thread, or inside this call when it is refused at once
  // (the limits below, or stopped) or answered at once: while this node is not a member (joining, the store out of
  // reach) nothing is asked of the store, the answer is the local prefix (OK, `source` says why nothing was pulled). `session` counts
  // the per-session bound; `cancelled` is asked between the network steps (the session ended: the pull stops, what
  // it already read and verified is still committed). RESOURCE_EXHAUSTED (through done) when max_pulls or the
  // session's max_session_pulls are pulling already (4 x max_pulls may wait node-wide). After Stop, done answers at
  // once with UNAVAILABLE.
  void Prefetch(Cache* cache, std::vector<BlockKey> keys, uint32_t local_blocks, uint64_t session,
                std::function<bool()> cancelled, std::function<void(PrefetchResult)> done) override;

  // Leaves the cluster (the lease is revoked: every entry of this node goes at once), ends every pull (each
  // answered), stops the threads. Idempotent.
  void Stop() override;

  ClusterTierStatus GetStatus() const;
  // GetStatusResponse.cluster and the flexkv_cluster_* families
  // (cluster_tier_report.cc).
  void ReportStatus(v1::GetStatusResponse* status) const override;
  void CollectMetrics(MetricFamilies* out) const override;

 private:
  struct Impl;
  explicit ClusterTier(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Call methods between daemons (UcxTransport::Call), and the lookup's wire format (docs/cluster.md "Peer calls").
inline constexpr uint16_t kPeerLookupMethod = 1;

}  // namespace flexkv
