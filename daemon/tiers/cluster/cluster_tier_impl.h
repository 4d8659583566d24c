// ClusterTier::Impl: the state the cluster tier's threads share, and their loops. Private to daemon/tiers/cluster/.
// Threads: the membership thread (the transport and the join, retried with backoff while the node serves its own
// cache; the member list every second; joins again after a lost lease), the publisher (directory updates, batched
// and retried), the pullers (one Prefetch each, max_pulls of them) and the lookup server (peers' lookups, handed
// over from the transport's progress thread, which must never wait on the cache's lock: the pool hooks hold that
// lock while they wait on the progress thread to (un)register). Their code, by concern:
//   cluster_tier_membership.cc  the transport, the join, the member list, the accept filter, peers' calls
//   cluster_tier_serving.cc     what this node offers: the directory publisher and the lookup server
//   cluster_tier_pulls.cc       the pullers and the connections to peers
//   cluster_tier_hybrid_pull.cc a hybrid domain's pull: the whole hit (FULL, windows, state) or nothing
//   cluster_tier.cc             the public ClusterTier (Create, the pool hooks, Prefetch, Stop, GetStatus)
// Each mutex below guards the members annotated with it (ABSL_GUARDED_BY); no function holds two of them at once.
#pragma once

#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"
#include "daemon/cache/cache.h"
#include "daemon/cluster/directory.h"
#include "daemon/cluster/ucx/ucx_transport.h"
#include "daemon/tiers/cluster/cluster_tier.h"
#include "daemon/tiers/cluster/peer_lookup.h"
#include "flexkv/block_key.h"
#include "flexkv/status.h"

namespace flexkv {

class CacheSet;

struct ClusterTier::Impl {
  using Clock = std::chrono::steady_clock;
  // Requests (reads and lookups) the transport takes at once, over all pulls; each pull reads with a window of its
  // share, so that a long pull neither starves the others nor hits the limit.
  static constexpr uint32_t kTransportInflight = 1024;

  // Set by Create before any thread starts, then only read.
  ClusterTierOptions options;
  CacheSet* caches = nullptr;
  // This tier's observer of each cache (caches->cache(i)), removed at Stop.
  std::vector<std::shared_ptr<CacheObserver>> observers;
  std::unique_ptr<cluster::Directory> directory;
  cluster::UcxOptions ucx_options;

  // The transport, created by the membership thread (MembershipLoop: its listener may find the port taken for a
  // while, and the node serves its own cache meanwhile) and kept until ~Impl. `transport` is written once (under
  // regions_mu), before `transport_up` is set (release); every other thread reads it only after seeing
  // `transport_up`, without a lock.
  std::unique_ptr<cluster::UcxTransport> transport;
  std::atomic<bool> transport_up{false};

  // Set (under each waiter's mutex in turn, BeginStop) by the one Stop that runs; every loop ends on it.
  std::atomic<bool> stopping{false};
  Mutex stop_mu;
  bool stopped ABSL_GUARDED_BY(stop_mu) = false;  // Stop runs once

  // The pool grants, by base address: registered for peers' reads once the transport is up (until then, and when
  // a registration failed, `registered` is empty: the grant serves locally, peers' lookups do not offer its blocks).
  struct Grant {
    void* base = nullptr;
    uint64_t bytes = 0;
    cluster::RegisteredRegion registered;
  };
  mutable Mutex regions_mu;
  std::map<uintptr_t, Grant> regions ABSL_GUARDED_BY(regions_mu);

  // Members (from the store, refreshed every second), their hosts (the transport's accept filter), and what the
  // membership thread shows of itself.
  mutable Mutex members_mu;
  std::map<std::string, cluster::NodeInfo> members ABSL_GUARDED_BY(members_mu);
  std::unordered_set<std::string> member_hosts ABSL_GUARDED_BY(members_mu);
  std::string endpoint ABSL_GUARDED_BY(members_mu);  // set with the transport
  std::vector<std::string> rdma_devices ABSL_GUARDED_BY(members_mu);  // listed by the membership thread
  // "joining" until the first attempt ends, then "joined" or "retrying: ..."
  std::string join_state ABSL_GUARDED_BY(members_mu) = "joining";
  std::condition_variable members_cv;  // wakes the membership thread (a refresh asked for, or Stop)
  bool refresh_asked ABSL_GUARDED_BY(members_mu) = false;
  // The accept filter's rate limits.
  int64_t last_refresh_ask_ms ABSL_GUARDED_BY(members_mu) = 0;
  int64_t last_refusal_log_ms ABSL_GUARDED_BY(members_mu) = 0;

  // Directory state, per cache (domain slot): what should be published (`desired`: the local truth, changed at
  // once by the cache's events), what the store has (`published`, changed only once a store call succeeded), and
  // the differences still to send. Bounded by the blocks the cache holds, whatever the store does.
  struct DirectoryState {
    std::string published_ns;  // the namespace `published` was published under
    std::unordered_set<BlockKey, BlockKeyHash> desired, published, to_publish, to_withdraw;
  };
  mutable Mutex pub_mu;
  std::condition_variable pub_cv;
  std::map<Cache*, DirectoryState> directory_state ABSL_GUARDED_BY(pub_mu);
  // Bumped by RepublishAll: a store call begun under an older lease changes nothing.
  uint64_t lease_generation ABSL_GUARDED_BY(pub_mu) = 0;

  // Connections to peers, by node id (the epoch they were made for: a new epoch reconnects).
  struct Peer {
    cluster::PeerHandle handle;
    uint64_t epoch = 0;
    std::string endpoint;
  };
  Mutex peers_mu;
  std::map<std::string, Peer> peers ABSL_GUARDED_BY(peers_mu);

  // Pulls: admitted by Prefetch, run by the pullers, answered by Stop when still queued then.
  struct PullJob {
    Cache* cache = nullptr;
    std::vector<BlockKey> keys;
    uint32_t local = 0;
    uint64_t session = 0;
    std::function<bool()> cancelled;
    std::function<void(PrefetchResult)> done;
  };
  Mutex pull_mu;
  std::condition_variable pull_cv;
  std::deque<PullJob> jobs ABSL_GUARDED_BY(pull_mu);
  std::map<uint64_t, uint32_t> session_pulls ABSL_GUARDED_BY(pull_mu);
  uint32_t pulls_admitted ABSL_GUARDED_BY(pull_mu) = 0;  // queued + running

  // Peers' lookups, handed over by the transport's progress thread.
  struct ServeJob {
    std::string peer;
    std::string request;
    std::function<void(Result<std::string>)> reply;
  };
  Mutex serve_mu;
  std::condition_variable serve_cv;
  std::deque<ServeJob> serve_jobs ABSL_GUARDED_BY(serve_mu);

  // Filled by Create before any of them runs; joined by the one Stop that runs.
  std::vector<std::thread> threads;

  std::atomic<uint64_t> publish_failures{0}, rejoins{0}, prefetches{0}, pulls_ok{0},
      pulls_failed{0}, pulled_blocks{0}, pulled_bytes{0}, verify_failures{0}, pulls_running{0}, lookups_served{0},
      blocks_offered{0};
  // Window and state entries pulled with hybrid prefixes (pulled_bytes counts their bytes too).
  std::atomic<uint64_t> pulled_entries{0}, pulled_entry_bytes{0};
  mutable Mutex error_mu;
  std::string last_error ABSL_GUARDED_BY(error_mu);

  // The transport's progress thread runs callbacks that use the members above: it ends first (every region left
  // becomes inert).
  ~Impl() { transport.reset(); }

  // The last pull or publish failure, for status (cluster_tier.cc).
  void NoteError(const std::string& what) ABSL_LOCKS_EXCLUDED(error_mu);
  // Sets `stopping` under each waiter's mutex (so that no thread checks the flag and then sleeps past the notify)
  // and wakes them all (cluster_tier.cc).
  void BeginStop() ABSL_LOCKS_EXCLUDED(pull_mu, serve_mu, pub_mu, members_mu);

  // --- membership (cluster_tier_membership.cc) ------------------------------------------------------------------

  // The transport and its listener, once (the membership thread). A failure is retried by the caller, except a
  // refusal of the configuration (INVALID_ARGUMENT: a transport list UCX cannot take), which stays.
  Status StartTransport() ABSL_LOCKS_EXCLUDED(members_mu, regions_mu);
  // Registers `grant` for peers' reads; on failure it stays unregistered (serves locally). The transport is up.
  void RegisterGrant(Grant& grant) ABSL_EXCLUSIVE_LOCKS_REQUIRED(regions_mu);
  // One attempt to join; releases this node's previous run's member record while `may_release` (see the .cc).
  Status JoinOnce(bool may_release) ABSL_LOCKS_EXCLUDED(members_mu);
  // Reads the member list from the store; keeps the last one when the store does not answer.
  void RefreshMembers() ABSL_LOCKS_EXCLUDED(members_mu);
  // The membership thread: the transport, the join (both retried with backoff while the node serves its own
  // cache), the member list every second, and a join again after a lost lease. Returns once `stopping`.
  void MembershipLoop() ABSL_LOCKS_EXCLUDED(members_mu, regions_mu, pub_mu, error_mu);
  // The transport's accept filter (lane 0's progress thread): only current members' hosts get in.
  bool AcceptFrom(const sockaddr& from) ABSL_LOCKS_EXCLUDED(members_mu);
  // The transport's call handler (a lane's progress thread): peers' lookups go to the lookup server; `reply` is
  // called at once when refused (stopping, an unknown method, too many waiting).
  void OnCall(const std::string& peer, uint16_t method, std::string request,
              std::function<void(Result<std::string>)> reply) ABSL_LOCKS_EXCLUDED(serve_mu);
  // What status shows: "joined", "joining" (the first attempt), "retrying: <why> (attempt N)", "failed: <why>",
  // "stopped".
  std::string State() const ABSL_LOCKS_EXCLUDED(members_mu);
  // Wakes the membership thread to read the member list now.
  void AskRefresh() ABSL_LOCKS_EXCLUDED(members_mu);
  // The member `node_id` as last read from the store, if it is one.
  std::optional<cluster::NodeInfo> Member(const std::string& node_id) const ABSL_LOCKS_EXCLUDED(members_mu);

  // --- what this node offers (cluster_tier_serving.cc) -------------------------------------------------------

  // The cache's block listener, under the cache's lock: only the directory sets change here.
  void OnBlockEvent(Cache* cache, const Cache::BlockEvent& e) ABSL_LOCKS_EXCLUDED(pub_mu);
  // After a new Join every entry of the old lease is gone: publish everything still held again.
  void RepublishAll() ABSL_LOCKS_EXCLUDED(pub_mu);
  // Publishes and withdrawals not yet in the store.
  size_t PendingLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(pub_mu);
  // The publisher thread: PublishRound whenever something is pending, with backoff after a failure. Returns once
  // `stopping`.
  void PublishLoop() ABSL_LOCKS_EXCLUDED(pub_mu, error_mu);
  // One round of store calls; the sets change only for what the store took.
  Status PublishRound() ABSL_LOCKS_EXCLUDED(pub_mu);
  // The registered region holding [addr, addr + bytes): (descriptor, offset in it); nullopt when none does.
  std::optional<std::pair<std::string, uint64_t>> Locate(const uint8_t* addr, uint64_t bytes) const
      ABSL_LOCKS_EXCLUDED(regions_mu);
  // The lookup server thread: answers the queued lookups in turn. Returns once `stopping` and nothing is queued
  // (Stop answers what comes later).
  void ServeLoop() ABSL_LOCKS_EXCLUDED(serve_mu, regions_mu);
  // Answers one peer's lookup (the encoded request) with the encoded reply, or why not.
  Result<std::string> ServeLookup(const std::string& peer, const std::string& bytes) ABSL_LOCKS_EXCLUDED(regions_mu);
  // A hybrid domain's lookup (version 2; ServeLookup checked everything but the keys): the encoded reply.
  std::string ServeHybridLookup(Cache& cache, const Geometry& geometry, const PeerLookupRequest& request)
      ABSL_LOCKS_EXCLUDED(regions_mu);

  // --- pulls (cluster_tier_pulls.cc) ----------------------------------------------------------------------------

  // A puller thread: runs the queued pulls, each answered once. Returns once `stopping` (Stop answers what is
  // queued).
  void PullLoop() ABSL_LOCKS_EXCLUDED(pull_mu, peers_mu, members_mu, error_mu);
  // The connection to `node_id` at `epoch`, made when there is none (one per peer); UNAVAILABLE when it is not a
  // current member at that epoch (a member refresh is asked for), PERMISSION_DENIED when its endpoint proves to be
  // another node.
  Result<cluster::PeerHandle> PeerFor(const std::string& node_id, uint64_t epoch)
      ABSL_LOCKS_EXCLUDED(peers_mu, members_mu);
  // Closes the connection `handle` to a peer that failed (the next pull reconnects), unless another puller has
  // replaced it already.
  void DropPeer(const std::string& node_id, const cluster::PeerHandle& handle) ABSL_LOCKS_EXCLUDED(peers_mu);
  // Reads blocks[i] of `peer` into slots[i] (i < slots.size()) and returns each read's end (see the .cc).
  std::vector<Status> ReadBlocks(Cache& cache, const cluster::PeerHandle& peer,
                                 const std::vector<cluster::RemoteRegion>& peer_regions,
                                 std::span<const PeerLookupReply::Block> blocks, std::span<const SlotId> slots);
  // The pull itself (a puller thread). Every exit answers; a failure after a peer was found counts as failed.
  PrefetchResult Pull(const PullJob& job) ABSL_LOCKS_EXCLUDED(peers_mu, members_mu, error_mu);
  // A hybrid domain's pull once the peer answered (cluster_tier_hybrid_pull.cc): checks the reply against the hit
  // rule at its end, reserves the whole set (Cache::ReservePulledHybrid), reads and verifies every block and entry,
  // and commits all of it or nothing. What it pulled (done_blocks: the FULL blocks), or why nothing (the caller
  // counts it as failed).
  Result<PrefetchResult> PullHybrid(const PullJob& job, const Geometry& geometry, const std::string& node_id,
                                    const cluster::PeerHandle& peer, const PeerLookupReply& reply,
                                    const std::vector<cluster::RemoteRegion>& peer_regions)
      ABSL_LOCKS_EXCLUDED(peers_mu);
};

}  // namespace flexkv
