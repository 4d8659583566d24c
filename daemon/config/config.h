// flexkvd's configuration: command-line flags and an optional TOML file (--config), read by CLI11.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/log.h"
#include "daemon/metrics/listen_address.h"
#include "daemon/sessions/namespace_access.h"
#include "flexkv/status.h"

namespace flexkv {

struct DaemonConfig {
  std::string socket_path;             // --socket; default DefaultSocketPath()
  bool private_socket_dir = false;     // the default socket's directory is created 0700
  uint64_t pool_bytes = 1ULL << 30;    // --pool-size
  std::string pool_path;               // --pool-path; default /dev/shm/flexkvd-<uid>/pool (dir 0700)
  std::optional<gid_t> socket_gid;     // --socket-group; default: the daemon's own group
  std::optional<gid_t> admin_gid;      // --admin-group; none: only root and the daemon's uid are admins
  log::Level log_level = log::Level::kInfo;
  double drain_timeout_s = 30;         // --drain-timeout: how long SIGTERM waits for in-flight work
  double attach_timeout_s = 10;        // --attach-timeout: a session must open its channel within this
  uint32_t max_pending_sessions_per_uid = 64;  // --max-pending-sessions-per-uid: attached, channel not open yet
  uint32_t max_pending_sessions = 1024;        // --max-pending-sessions: the same, all uids together
  uint32_t fd_reserve = 256;                   // --fd-reserve: Attach is refused with fewer fds free than this
  double max_session_pin_share = 0.5;  // --max-session-pin-share: of the pool's slots one session may pin
  double pin_lease_s = 10;             // --pin-lease: a stopped process's pins lapse after this (0: never)
  // --swa-share / --state-share: a hybrid geometry's pool split (daemon/cache/pool.h PoolSplit; 0: automatic).
  double swa_share = 0;
  double state_share = 0;
  bool discard_pool = false;           // --discard-pool: replace a pool file that cannot be re-attached
  double spin_us = 50;                 // --spin-us: poller spin window after activity
  unsigned copy_threads = 0;           // --copy-threads: 0 = one per core
  int poller_cpu = -1;                 // --poller-cpu: pin the ring poller (-1: not pinned)
  bool load_copy_engine = false;       // --load-path copy-engine (default: kernel)
  bool store_copy_engine = false;      // --store-path copy-engine (default: kernel)
  uint32_t copy_staging_mib = 64;      // --copy-staging-mib: GPU staging per GPU and direction (0: kernels alone)
  // --metrics-listen HOST:PORT: the Prometheus endpoint; none by default. A non-loopback address needs
  // --metrics-allow-remote (the endpoint has no authentication).
  std::optional<ListenAddress> metrics_listen;
  // KV events (docs/kv_events.md): the event ring subscribers read from (--kv-events-buffer, events), and the ZMQ
  // publisher in vLLM's KV-event format (--kv-events-zmq ENDPOINT, off by default; --kv-events-zmq-topic).
  uint32_t kv_events_buffer = 65536;
  std::string kv_events_zmq;
  std::string kv_events_zmq_topic = "kv-events";
  // gRPC event subscriptions open at once, per uid and in all (--kv-events-max-subscribers-per-uid,
  // --kv-events-max-subscribers); past either a subscription is refused with RESOURCE_EXHAUSTED naming it.
  uint32_t kv_events_max_subscribers_per_uid = 64;
  uint32_t kv_events_max_subscribers = 1024;
  // [namespace."<name>"] tables of the --config file: who may write and read each namespace (namespace_access.h).
  std::map<std::string, NamespaceAcl, std::less<>> namespace_acls;
  size_t max_domains = 1;              // --max-domains: cache domains (namespace + geometry) served at once
  uint32_t verify_threads = 0;         // --verify-threads: threads of each domain's restart check (0: half the
                                       // cores, 1 to 8)
  // [namespace."<name>"] pool_size: a namespace's fixed share of --pool-size (bytes); others share the rest.
  std::map<std::string, uint64_t, std::less<>> namespace_pool_bytes;
  // The cluster tier (docs/cluster.md); off without --etcd-endpoints.
  std::vector<std::string> etcd_endpoints;  // --etcd-endpoints host:port[,host:port...]: the cluster's store
  std::string etcd_credentials_file;        // --etcd-credentials-file: "user = ..." / "password = ..." (0600)
  std::string node_id;                      // --node-id (default: the host name)
  std::string cluster_secret_file;          // --cluster-secret-file (0600, >= 16 bytes): peers prove it
  std::optional<ListenAddress> cluster_listen;  // --cluster-listen HOST:PORT: the transfer endpoint peers read from
  std::string transfer_devices;             // --transfer-dev: NICs for UCX, e.g. mlx5_0:1,mlx5_1:1 (default: all)
  std::string cluster_transports = "rc,tcp";  // --cluster-transports: UCX transports allowed
  uint32_t cluster_chunk_blocks = 8;        // --cluster-chunk-blocks: one directory entry per this many blocks
  double cluster_lease_ttl_s = 10;          // --cluster-lease-ttl: a dead node leaves the directory after this
  double cluster_pull_deadline_s = 2;       // --cluster-pull-deadline: per network step of a pull
  uint32_t cluster_max_pulls = 8;           // --cluster-max-pulls: prefetches pulling at once
  uint32_t cluster_max_session_pulls = 2;   // --cluster-max-session-pulls: per session
  uint32_t cluster_lanes = 4;               // --cluster-lanes: UCX workers (threads, connections per peer), 1..16
  // The SSD tier (docs/ssd.md); off without --ssd-path.
  std::vector<std::string> ssd_paths;  // --ssd-path DIR, repeatable: one directory per drive
  uint64_t ssd_bytes = 0;              // --ssd-size: bytes on disk over all paths
  uint32_t ssd_queue_depth = 32;       // --ssd-queue-depth: requests in flight per drive
  bool ssd_allow_buffered = false;     // --ssd-allow-buffered: buffered I/O where O_DIRECT is impossible
  bool ssd_sync_writes = false;        // --ssd-sync-writes: O_DSYNC (survive power loss)
  bool ssd_discard_mismatch = false;   // --ssd-on-mismatch discard (default refuse)
  bool ssd_write_all = false;          // --ssd-write-policy cold (the cold end, ahead of eviction) or all
  double ssd_writeback_window = 0.25;  // --ssd-writeback-window: share of each pool kept written, coldest first
  double ssd_store_wait_s = 1.0;       // --ssd-store-wait: seconds a store may wait for the write-back (0: never)
};

// Outcome of parsing: a config to run with, or an exit (help printed, or a usage error already reported
// on stderr naming the flag and the accepted form).
struct ParsedArgs {
  std::optional<DaemonConfig> config;
  int exit_code = 0;
};

ParsedArgs ParseDaemonArgs(int argc, char** argv);

// Resolves a group name or a numeric gid. INVALID_ARGUMENT naming `flag` if unknown.
Result<gid_t> ResolveGroup(const std::string& flag, const std::string& name);

// Reads the [namespace."<name>"] tables of the TOML file at `config_path`. A table has `writers` and optionally
// `readers` (arrays of user names, uids (numbers, or digits in a string) and "group:<name or gid>"): the namespace's
// ACL, returned; and/or `pool_size` (a size string like "8GiB", or bytes; at least 1MiB): the namespace's share of
// the pool budget, stored in `*pool_bytes` (optional). A table without writers leaves the namespace the default
// access rule (readers need writers). Names are resolved now (getpwnam_r, getgrnam_r). INVALID_ARGUMENT naming
// the file, the line, the entry and what was expected, for a TOML syntax error, an unknown key, a value of the
// wrong type, a bad namespace name or size, an empty table, or an unknown user or group.
Result<std::map<std::string, NamespaceAcl, std::less<>>> ReadNamespaceAcls(
    const std::string& config_path, std::map<std::string, uint64_t, std::less<>>* pool_bytes = nullptr);

}  // namespace flexkv
