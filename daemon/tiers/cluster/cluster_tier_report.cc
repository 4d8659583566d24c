// ClusterTier's own status message and metric families (CacheTier::ReportStatus, CollectMetrics); docs/operations.md
// lists them.
#include "daemon/tiers/cluster/cluster_tier.h"

#include "flexkv/v1/control.pb.h"

namespace flexkv {
namespace {

void FillCluster(const ClusterTierStatus& c, v1::ClusterStatus* out) {
  out->set_state(c.state);
  out->set_node_id(c.node_id);
  out->set_epoch(c.epoch);
  out->set_endpoint(c.endpoint);
  for (const ClusterMember& m : c.members) {
    v1::ClusterMember* member = out->add_members();
    member->set_node_id(m.node_id);
    member->set_epoch(m.epoch);
    member->set_endpoint(m.endpoint);
    member->set_self(m.self);
  }
  out->set_published_keys(c.published_keys);
  out->set_publish_queue(c.publish_queue);
  out->set_publish_failures(c.publish_failures);
  out->set_rejoins(c.rejoins);
  out->set_prefetches(c.prefetches);
  out->set_pulls_ok(c.pulls_ok);
  out->set_pulls_failed(c.pulls_failed);
  out->set_pulled_blocks(c.pulled_blocks);
  out->set_pulled_bytes(c.pulled_bytes);
  out->set_pulled_entries(c.pulled_entries);
  out->set_pulled_entry_bytes(c.pulled_entry_bytes);
  out->set_verify_failures(c.verify_failures);
  out->set_pulls_in_flight(c.pulls_in_flight);
  out->set_lookups_served(c.lookups_served);
  out->set_blocks_offered(c.blocks_offered);
  out->set_peer_reads_ok(c.transport.gets_ok);
  out->set_peer_reads_failed(c.transport.gets_failed);
  out->set_peer_read_deadlines(c.transport.deadlines);
  out->set_connections_accepted(c.transport.connections_accepted);
  out->set_connections_rejected(c.transport.connections_rejected);
  out->set_auth_failures(c.transport.auth_failures);
  out->set_replies_dropped(c.transport.replies_dropped);
  out->set_directory_unauthenticated(c.directory_unauthenticated);
  out->set_requests_refused(c.transport.requests_refused);
  for (const std::string& t : c.transports_in_use) out->add_transports(t);
  for (const std::string& d : c.rdma_devices) out->add_rdma_devices(d);
  out->set_last_error(c.last_error);
}

}  // namespace

void ClusterTier::ReportStatus(v1::GetStatusResponse* status) const {
  FillCluster(GetStatus(), status->mutable_cluster());
}

void ClusterTier::CollectMetrics(MetricFamilies* out) const {
  const ClusterTierStatus c = GetStatus();
  AddGauge(out, "flexkv_cluster_joined", "1 while this node is a member of the cluster (its lease is alive), else 0",
        c.state == "joined" ? 1 : 0);
  AddGauge(out, "flexkv_cluster_members", "Live members of the cluster, this node included",
        static_cast<double>(c.members.size()));
  AddGauge(out, "flexkv_cluster_published_keys", "Directory entries this node holds", static_cast<double>(c.published_keys));
  AddGauge(out, "flexkv_cluster_publish_queue", "Directory updates waiting", static_cast<double>(c.publish_queue));
  AddGauge(out, "flexkv_cluster_pulls_in_flight", "Prefetches pulling from peers now", static_cast<double>(c.pulls_in_flight));
  AddCounter(out, "flexkv_cluster_publish_failures_total", "Directory store calls that failed (retried)", c.publish_failures);
  AddCounter(out, "flexkv_cluster_rejoins_total", "Leases lost (store unreachable for a ttl) and joined again", c.rejoins);
  AddCounter(out, "flexkv_cluster_prefetches_total", "Prefetch requests that went to the network", c.prefetches);
  AddCounter(out, "flexkv_cluster_pulls_ok_total", "Prefetches that pulled at least one block from a peer", c.pulls_ok);
  AddCounter(out, "flexkv_cluster_pulls_failed_total", "Prefetches that found a peer but pulled nothing", c.pulls_failed);
  AddCounter(out, "flexkv_cluster_pulled_blocks_total", "Blocks pulled from peers, verified and cached here", c.pulled_blocks);
  AddCounter(out, "flexkv_cluster_pulled_bytes_total", "Bytes of the blocks pulled from peers (hybrid entries included)",
             c.pulled_bytes);
  AddCounter(out, "flexkv_cluster_pulled_entries_total",
             "Window and state entries of hybrid prefixes pulled from peers, verified and cached here", c.pulled_entries);
  AddCounter(out, "flexkv_cluster_pulled_entry_bytes_total", "Bytes of the hybrid entries pulled from peers",
             c.pulled_entry_bytes);
  AddCounter(out, "flexkv_cluster_verify_failures_total", "Pulled blocks that did not match their checksum (never served)",
          c.verify_failures);
  AddCounter(out, "flexkv_cluster_lookups_served_total", "Peers' lookups answered by this node", c.lookups_served);
  AddCounter(out, "flexkv_cluster_blocks_offered_total", "Blocks this node's lookups offered to peers", c.blocks_offered);
  AddCounter(out, "flexkv_cluster_peer_read_deadlines_total", "Reads from peers that hit the pull deadline",
          c.transport.deadlines);
  AddCounter(out, "flexkv_cluster_auth_failures_total", "Peers refused: the cluster secret not proven, or not a member",
          c.transport.auth_failures);
  AddCounter(out, "flexkv_cluster_replies_dropped_total",
          "Peer replies that answered no request of this node (forged, or late): dropped, never written",
          c.transport.replies_dropped);
  AddCounter(out, "flexkv_cluster_requests_refused_total",
          "Peers' gets and calls refused: unauthenticated endpoint, a range not registered here, malformed",
          c.transport.requests_refused);
  AddCounter(out, "flexkv_cluster_directory_unauthenticated_total",
          "Member records and directory entries in etcd without the cluster secret's signature: ignored",
          c.directory_unauthenticated);
}

}  // namespace flexkv
