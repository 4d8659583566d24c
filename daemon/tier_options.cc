// See tier_options.h.
#include "daemon/tier_options.h"

#include <chrono>
#include <cstdint>

namespace flexkv {

ClusterTierOptions ClusterTierOptionsFrom(const DaemonConfig& config) {
  ClusterTierOptions o;
  o.node_id = config.node_id;
  o.etcd_endpoints = config.etcd_endpoints;
  o.etcd_credentials_file = config.etcd_credentials_file;
  o.secret_file = config.cluster_secret_file;
  if (config.cluster_listen) {
    o.listen_address = config.cluster_listen->host;
    o.listen_port = config.cluster_listen->port;
  }
  o.transfer_devices = config.transfer_devices;
  o.transports = config.cluster_transports;
  o.chunk_blocks = config.cluster_chunk_blocks;
  o.lease_ttl = std::chrono::milliseconds(static_cast<int64_t>(config.cluster_lease_ttl_s * 1000));
  o.pull_deadline = std::chrono::milliseconds(static_cast<int64_t>(config.cluster_pull_deadline_s * 1000));
  o.max_pulls = config.cluster_max_pulls;
  o.max_session_pulls = config.cluster_max_session_pulls;
  o.lanes = config.cluster_lanes;
  return o;
}

SsdTierOptions SsdTierOptionsFrom(const DaemonConfig& config) {
  SsdTierOptions o;
  o.store.paths = config.ssd_paths;
  o.store.size_bytes = config.ssd_bytes;
  o.store.queue_depth = config.ssd_queue_depth;
  o.store.allow_buffered = config.ssd_allow_buffered;
  o.store.sync_writes = config.ssd_sync_writes;
  o.store.on_mismatch = config.ssd_discard_mismatch ? SsdMismatchPolicy::kDiscard : SsdMismatchPolicy::kRefuse;
  o.write_all = config.ssd_write_all;
  o.writeback_window = config.ssd_writeback_window;
  o.store_wait_ms = static_cast<int64_t>(config.ssd_store_wait_s * 1000.0 + 0.5);
  return o;
}

}  // namespace flexkv
