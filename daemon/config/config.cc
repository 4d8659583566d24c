// Flag and config-file parsing for flexkvd.
#include "daemon/config/config.h"

#include <grp.h>
#include <pwd.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <cerrno>
#include <cstdio>
#include <fmt/format.h>
#include <iostream>
#include <toml++/toml.h>

#include "common/paths.h"
#include "common/units.h"
#include "common/version.h"
#include "daemon/cache/cache_domain.h"
#include "daemon/cache/cache_set.h"

namespace flexkv {
namespace {

// The TOML reader CLI11 uses for the flags' keys, minus the [namespace.*] tables, which ReadNamespaceAcls reads
// (CLI11 would refuse them as unknown keys). Not thread-safe: one per parse.
class FlagsConfig final : public CLI::ConfigTOML {
 public:
  std::vector<CLI::ConfigItem> from_config(std::istream& input) const override {
    std::vector<CLI::ConfigItem> flags = CLI::ConfigTOML::from_config(input);
    const size_t before = flags.size();
    std::erase_if(flags, [](const CLI::ConfigItem& item) {
      return item.parents.empty() ? item.name == "namespace" : item.parents.front() == "namespace";
    });
    has_namespaces_ = has_namespaces_ || flags.size() != before;
    return flags;
  }
  // Whether the file had a namespace key or table. Only such a file is read again with the strict reader, so that
  // files CLI11 accepted before namespaces existed still do.
  bool has_namespaces() const { return has_namespaces_; }

 private:
  mutable bool has_namespaces_ = false;
};

bool AllDigits(const std::string& s) {
  return !s.empty() && s.size() < 10 && s.find_first_not_of("0123456789") == std::string::npos;
}

std::string_view TypeName(toml::node_type type) {
  switch (type) {
    case toml::node_type::table: return "a table";
    case toml::node_type::array: return "an array";
    case toml::node_type::string: return "a string";
    case toml::node_type::integer: return "an integer";
    case toml::node_type::floating_point: return "a float";
    case toml::node_type::boolean: return "a boolean";
    case toml::node_type::date: return "a date";
    case toml::node_type::time: return "a time";
    case toml::node_type::date_time: return "a date-time";
    case toml::node_type::none: break;
  }
  return "nothing";
}

// A namespace's pool_size: a size string ("8GiB", as --pool-size) or a number of bytes, at least 1MiB.
Result<uint64_t> ParsePoolSize(const toml::node& node, const std::string& where) {
  uint64_t bytes = 0;
  if (const auto* number = node.as_integer()) {
    if (number->get() < 0) {
      return Status::InvalidArgument(
          fmt::format("{} is {}; expected a size like \"8GiB\" or bytes", where, number->get()));
    }
    bytes = static_cast<uint64_t>(number->get());
  } else if (const auto* str = node.as_string()) {
    auto parsed = ParseByteSize(str->get());
    if (!parsed.ok()) return parsed.status().WithContext(where);
    bytes = *parsed;
  } else {
    return Status::InvalidArgument(
        fmt::format("{} is {}; expected a size like \"8GiB\" or a number of bytes", where, TypeName(node.type())));
  }
  if (bytes < (1u << 20)) {
    return Status::InvalidArgument(
        fmt::format("{} is {} bytes, below 1MiB; expected e.g. \"512MiB\" or \"8GiB\"", where, bytes));
  }
  return bytes;
}

constexpr char kPrincipalForms[] = "a user name, a uid, or \"group:\" with a group name or gid";

// One entry of a writers/readers array. `where` names the file, line and entry for messages.
Result<AccessPrincipal> ParsePrincipal(const toml::node& node, const std::string& where) {
  AccessPrincipal p;
  if (const auto* number = node.as_integer()) {
    const int64_t v = number->get();
    if (v < 0 || v >= int64_t{UINT32_MAX}) {
      return Status::InvalidArgument(fmt::format("{} is {}; expected a uid in 0..{}", where, v, UINT32_MAX - 1));
    }
    p.id = static_cast<uint32_t>(v);
    p.text = std::to_string(v);
    return p;
  }
  const auto* str = node.as_string();
  if (str == nullptr) {
    return Status::InvalidArgument(fmt::format("{} is {}; expected {}", where, TypeName(node.type()), kPrincipalForms));
  }
  p.text = str->get();
  std::string name = p.text;
  if (name.starts_with("group:")) {
    p.kind = AccessPrincipal::Kind::kGroup;
    name = name.substr(6);
  }
  if (name.empty()) {
    return Status::InvalidArgument(fmt::format("{} '{}' names nobody; expected {}", where, p.text, kPrincipalForms));
  }
  if (AllDigits(name)) {
    p.id = static_cast<uint32_t>(std::stoul(name));
    return p;
  }
  std::string buf(16384, '\0');
  int rc;
  if (p.kind == AccessPrincipal::Kind::kGroup) {
    group grp{};
    group* found = nullptr;
    rc = getgrnam_r(name.c_str(), &grp, buf.data(), buf.size(), &found);
    if (rc == 0 && found != nullptr) p.id = found->gr_gid;
    if (rc == 0 && found == nullptr) {
      return Status::InvalidArgument(fmt::format("{} '{}' is not a known group; expected {}", where, p.text,
                                                 kPrincipalForms));
    }
  } else {
    passwd pw{};
    passwd* found = nullptr;
    rc = getpwnam_r(name.c_str(), &pw, buf.data(), buf.size(), &found);
    if (rc == 0 && found != nullptr) p.id = found->pw_uid;
    if (rc == 0 && found == nullptr) {
      return Status::InvalidArgument(fmt::format("{} '{}' is not a known user; expected {}", where, p.text,
                                                 kPrincipalForms));
    }
  }
  if (rc != 0) {
    return Status::InvalidArgument(fmt::format("{} '{}': cannot look the name up: {}", where, p.text, ErrnoText(rc)));
  }
  return p;
}

Result<std::vector<AccessPrincipal>> ParsePrincipals(const toml::node& node, const std::string& where) {
  const auto* array = node.as_array();
  if (array == nullptr) {
    return Status::InvalidArgument(fmt::format("{} is {}; expected an array of entries, each {}", where,
                                               TypeName(node.type()), kPrincipalForms));
  }
  std::vector<AccessPrincipal> out;
  for (size_t i = 0; i < array->size(); ++i) {
    const toml::node& entry = *array->get(i);
    const std::string at = fmt::format("{}[{}]", where, i);
    auto principal = ParsePrincipal(entry, at);
    if (!principal.ok()) return principal.status();
    out.push_back(std::move(*principal));
  }
  return out;
}

}  // namespace

Result<gid_t> ResolveGroup(const std::string& flag, const std::string& name) {
  if (name.empty()) return Status::InvalidArgument(flag + " is empty; expected a group name or a numeric gid");
  if (name.find_first_not_of("0123456789") == std::string::npos && name.size() < 10) {
    return static_cast<gid_t>(std::stoul(name));
  }
  group grp{};
  group* found = nullptr;
  std::string buf(16384, '\0');
  const int rc = getgrnam_r(name.c_str(), &grp, buf.data(), buf.size(), &found);
  if (rc != 0 || found == nullptr) {
    return Status::InvalidArgument(flag + " '" + name + "' is not a known group; expected a group name or a numeric gid");
  }
  return found->gr_gid;
}

Result<std::map<std::string, NamespaceAcl, std::less<>>> ReadNamespaceAcls(
    const std::string& config_path, std::map<std::string, uint64_t, std::less<>>* pool_bytes) {
  toml::table root;
  try {
    root = toml::parse_file(config_path);
  } catch (const toml::parse_error& e) {
    return Status::InvalidArgument(fmt::format("--config {} line {}: {}; expected TOML", config_path,
                                               e.source().begin.line, e.description()));
  }
  std::map<std::string, NamespaceAcl, std::less<>> acls;
  const toml::node* namespaces = root.get("namespace");
  if (namespaces == nullptr) return acls;
  const auto line = [](const toml::node& n) { return n.source().begin.line; };
  const auto* table = namespaces->as_table();
  if (table == nullptr) {
    return Status::InvalidArgument(fmt::format(
        "--config {} line {}: namespace is {}; expected tables [namespace.\"<name>\"] with writers and readers",
        config_path, line(*namespaces), TypeName(namespaces->type())));
  }
  for (const auto& [key, node] : *table) {
    const std::string name(key.str());
    // Checked before the name goes into any message (no control characters reach the log).
    Status valid_name = CheckName("namespace", name, 256);
    if (!valid_name.ok()) {
      return valid_name.WithContext(fmt::format("--config {} line {}: a [namespace.\"<name>\"] table's name",
                                                config_path, line(node)));
    }
    const std::string header = fmt::format("--config {} line {}: [namespace.\"{}\"]", config_path, line(node), name);
    const auto* entries = node.as_table();
    if (entries == nullptr) {
      return Status::InvalidArgument(
          fmt::format("{} is {}; expected a table with writers and readers", header, TypeName(node.type())));
    }
    NamespaceAcl acl;
    acl.source = fmt::format("--config {} line {}", config_path, line(node));
    bool has_writers = false, has_readers = false;
    std::optional<uint64_t> pool_size;
    for (const auto& [field, value] : *entries) {
      const std::string where =
          fmt::format("--config {} line {}: [namespace.\"{}\"] {}", config_path, line(value), name, field.str());
      if (field.str() == "writers") {
        auto writers = ParsePrincipals(value, where);
        if (!writers.ok()) return writers.status();
        acl.writers = std::move(*writers);
        has_writers = true;
      } else if (field.str() == "readers") {
        auto readers = ParsePrincipals(value, where);
        if (!readers.ok()) return readers.status();
        acl.readers = std::move(*readers);
        has_readers = true;
      } else if (field.str() == "pool_size") {
        auto size = ParsePoolSize(value, where);
        if (!size.ok()) return size.status();
        pool_size = *size;
      } else {
        return Status::InvalidArgument(
            fmt::format("{} is not a known key; expected writers, readers or pool_size", where));
      }
    }
    if (!has_writers && (has_readers || !pool_size)) {
      return Status::InvalidArgument(fmt::format(
          "{} has no writers; expected writers = [...] (users, uids, \"group:<name>\"; [] for admins only){}", header,
          has_readers ? " with readers" : ", or a pool_size"));
    }
    if (pool_size && pool_bytes != nullptr) pool_bytes->emplace(name, *pool_size);
    if (has_writers) acls.emplace(name, std::move(acl));
  }
  return acls;
}

ParsedArgs ParseDaemonArgs(int argc, char** argv) {
  CLI::App app{"flexkvd: node-local KV-cache daemon for LLM inference engines"};
  app.set_version_flag("--version", kVersion);
  app.set_config("--config", "",
                 "TOML file with the same keys as the long flags (socket = \"...\"), and [namespace.\"<name>\"] "
                 "tables with writers and readers");
  auto flags_config = std::make_shared<FlagsConfig>();
  app.config_formatter(flags_config);
  app.get_config_ptr()->check(CLI::ExistingFile);
  app.allow_config_extras(CLI::config_extras_mode::error);  // a misspelt key must not be silently ignored

  DaemonConfig cfg;
  std::string pool_size = "1GiB";
  std::string socket_group;
  std::string admin_group;
  std::string log_level = "info";
  app.add_option("--socket", cfg.socket_path, "Control socket path (default: " + DefaultSocketPath() + ")");
  app.add_option("--pool-size", pool_size, "Host KV pool budget, with units: 512MiB, 64GiB (default 1GiB)");
  app.add_option("--pool-path", cfg.pool_path,
                 "Pool file under /dev/shm or hugetlbfs (default /dev/shm/flexkvd-<uid>/pool)");
  app.add_option("--socket-group", socket_group, "Group that may connect to the socket (mode 0660)");
  app.add_option("--admin-group", admin_group, "Group whose members may Drain/Resume besides root and the daemon's uid");
  app.add_option("--log-level", log_level, "debug, info, warning or error");
  app.add_option("--drain-timeout", cfg.drain_timeout_s, "Seconds SIGTERM waits for in-flight work (default 30)")
      ->check(CLI::Range(0.0, 3600.0));
  app.add_option("--attach-timeout", cfg.attach_timeout_s,
                 "Seconds a new session has to open its session channel (default 10)")
      ->check(CLI::Range(0.1, 600.0));
  app.add_option("--max-pending-sessions-per-uid", cfg.max_pending_sessions_per_uid,
                 "Sessions of one uid that may be attached without their session channel open (default 64; 0: no bound)")
      ->check(CLI::Range(0u, 1000000u));
  app.add_option("--max-pending-sessions", cfg.max_pending_sessions,
                 "The same for all uids together (default 1024; 0: no bound)")
      ->check(CLI::Range(0u, 1000000u));
  app.add_option("--fd-reserve", cfg.fd_reserve,
                 "Free fds kept for the control plane and admin calls: Attach is refused below it (default 256; 0: none)")
      ->check(CLI::Range(0u, 1000000u));
  app.add_option("--max-session-pin-share", cfg.max_session_pin_share,
                 "Share of the pool's slots one session may hold pinned, above 0 and at most 1 (default 0.5)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--pin-lease", cfg.pin_lease_s,
                 "Seconds after which a session's pins lapse when its process stops renewing them (default 10; 0: never)")
      ->check(CLI::Range(0.0, 3600.0));

  app.add_option("--verify-threads", cfg.verify_threads,
                 "Threads that check (and, for an older release's TP > 1 pool, rewrite) a restarted pool's blocks "
                 "before they are served; 0: half the cores, at most 8 (default 0)")
      ->check(CLI::Range(0u, 64u));
  app.add_option("--max-domains", cfg.max_domains,
                 "Cache domains (model namespace + geometry) served at once, each with its own pool file and a share "
                 "of --pool-size (default 1)")
      ->check(CLI::Range(size_t{1}, kMaxDomains));
  app.add_option("--swa-share", cfg.swa_share,
                 "Hybrid models: share of the pool for sliding-window blocks, in [0, 1), fixed (default 0: the sub-pools "
                 "start at a split from the geometry and follow demand)")
      ->check(CLI::Range(0.0, 0.99));
  app.add_option("--state-share", cfg.state_share,
                 "Hybrid models: share of the pool for state snapshots, in [0, 1), fixed (default 0: the sub-pools start at "
                 "a split from the geometry and follow demand)")
      ->check(CLI::Range(0.0, 0.99));
  app.add_flag("--discard-pool", cfg.discard_pool,
               "Replace a pool file of another geometry, version or size, or a corrupt one (its blocks are lost)");
  app.add_option("--spin-us", cfg.spin_us, "Microseconds the ring poller spins after activity before parking (default 50)")
      ->check(CLI::Range(0.0, 100000.0));
  app.add_option("--copy-threads", cfg.copy_threads, "Threads copying blocks (default: one per core)")
      ->check(CLI::Range(0u, 256u));
  app.add_option("--poller-cpu", cfg.poller_cpu,
                 "Pin the ring poller thread to this CPU (keep engines off it: best p99 when cores are scarce)")
      ->check(CLI::Range(-1, 4095));
  std::string load_path = "kernel", store_path = "kernel";
  app.add_option("--load-path", load_path,
                 "GPU loads: kernel (gather/scatter kernels) or copy-engine (SM-free; refused for chunks under 32 KiB)")
      ->check(CLI::IsMember({"kernel", "copy-engine"}));
  app.add_option("--store-path", store_path, "GPU stores: kernel or copy-engine")
      ->check(CLI::IsMember({"kernel", "copy-engine"}));
  app.add_option("--copy-staging-mib", cfg.copy_staging_mib,
                 "GPU memory per GPU and direction through which the kernel paths stage whole-slot copies for the copy "
                 "engine (loads and stores at once near the PCIe two-way limit); 0: kernels alone (default 64)")
      ->check(CLI::Range(0u, 16384u));
  std::string metrics_listen;
  bool metrics_allow_remote = false;
  app.add_option("--metrics-listen", metrics_listen,
                 "Serve Prometheus metrics on HOST:PORT (GET /metrics), e.g. 127.0.0.1:9400 (default: off)");
  app.add_flag("--metrics-allow-remote", metrics_allow_remote,
               "Allow a --metrics-listen address other than loopback (the endpoint has no authentication)");
  app.add_option("--kv-events-buffer", cfg.kv_events_buffer,
                 "KV events: events kept for subscribers (a subscriber further behind is cut off; default 65536)")
      ->check(CLI::Range(64u, 1u << 24));
  app.add_option("--kv-events-zmq", cfg.kv_events_zmq,
                 "KV events: publish them on this ZMQ endpoint in vLLM's KV-event format, e.g. tcp://127.0.0.1:5557 or "
                 "ipc:///run/flexkvd/kv-events (default: off)");
  app.add_option("--kv-events-zmq-topic", cfg.kv_events_zmq_topic,
                 "KV events: the topic frame of each ZMQ message (default kv-events)");
  app.add_option("--kv-events-max-subscribers-per-uid", cfg.kv_events_max_subscribers_per_uid,
                 "KV events: gRPC subscriptions one uid may have open at once; more are refused with "
                 "RESOURCE_EXHAUSTED (default 64)")
      ->check(CLI::Range(1u, 1u << 20));
  app.add_option("--kv-events-max-subscribers", cfg.kv_events_max_subscribers,
                 "KV events: gRPC subscriptions open at once in all; more are refused with RESOURCE_EXHAUSTED "
                 "(default 1024)")
      ->check(CLI::Range(1u, 1u << 20));
  std::string ssd_size;
  std::string ssd_on_mismatch = "refuse";
  app.add_option("--ssd-path", cfg.ssd_paths,
                 "SSD tier: a directory on a local NVMe drive (repeat once per drive); each gets one block file");
  app.add_option("--ssd-size", ssd_size, "SSD tier: bytes on disk over all --ssd-path, with units: 500GiB, 4TiB");
  app.add_option("--ssd-queue-depth", cfg.ssd_queue_depth, "SSD tier: I/O requests in flight per drive (default 32)")
      ->check(CLI::Range(1, 4096));
  app.add_flag("--ssd-allow-buffered", cfg.ssd_allow_buffered,
               "SSD tier: where a path refuses O_DIRECT (or is tmpfs), use buffered I/O with a warning instead of "
               "refusing to start");
  app.add_flag("--ssd-sync-writes", cfg.ssd_sync_writes,
               "SSD tier: O_DSYNC writes, which survive a power cut (slower on drives with a volatile cache)");
  app.add_option("--ssd-on-mismatch", ssd_on_mismatch,
                 "SSD tier: block files of another format or block size: refuse (default: do not start) or discard "
                 "(reformat, losing them)");
  std::string ssd_write_policy = "cold";
  app.add_option("--ssd-write-policy", ssd_write_policy,
                 "SSD tier: cold (default: the cold end of DRAM, --ssd-writeback-window, is written ahead of "
                 "eviction) or all (every stored block, oldest first, as fast as the drives take them: a reboot keeps "
                 "every block, at more SSD writes and a smaller combined capacity)");
  app.add_option("--ssd-writeback-window", cfg.ssd_writeback_window,
                 "SSD tier: the share of each DRAM pool, coldest first, kept written to SSD ahead of eviction "
                 "(default 0.25; with --ssd-write-policy all, what a restart's blocks and failed writes are "
                 "written from)");
  app.add_option("--ssd-store-wait", cfg.ssd_store_wait_s,
                 "SSD tier: seconds an engine's store may wait for the write-back when it could go on only by "
                 "evicting DRAM blocks SSD does not hold yet (lost from the node; counted in "
                 "evicted_unwritten_blocks); after that it evicts them (default 1; 0: never waits)")
      ->check(CLI::Range(0.0, 60.0));
  std::string etcd_endpoints, cluster_listen;
  app.add_option("--etcd-endpoints", etcd_endpoints,
                 "Cluster tier: the cluster's etcd, host:port[,host:port...] (turns the tier on; docs/cluster.md)");
  app.add_option("--etcd-credentials-file", cfg.etcd_credentials_file,
                 "Cluster tier: etcd user and password, lines 'user = NAME' and 'password = SECRET' (mode 0600)");
  app.add_option("--node-id", cfg.node_id, "Cluster tier: this node's id, unique in the cluster (default: host name)");
  app.add_option("--cluster-secret-file", cfg.cluster_secret_file,
                 "Cluster tier: the shared cluster secret (mode 0600, >= 16 bytes); peers must prove it");
  app.add_option("--cluster-listen", cluster_listen,
                 "Cluster tier: HOST:PORT of this node's transfer endpoint on the cluster network (numeric address)");
  app.add_option("--transfer-dev", cfg.transfer_devices,
                 "Cluster tier: NICs UCX may use, e.g. mlx5_0:1,mlx5_1:1 or eth0 (default: all)");
  app.add_option("--cluster-transports", cfg.cluster_transports,
                 "Cluster tier: UCX transports allowed (default rc,tcp; shared-memory ones are refused)");
  app.add_option("--cluster-chunk-blocks", cfg.cluster_chunk_blocks,
                 "Cluster tier: publish one directory entry per this many blocks on average, besides every stored "
                 "prompt's end (default 8)");
  app.add_option("--cluster-lease-ttl", cfg.cluster_lease_ttl_s,
                 "Cluster tier: seconds after which a dead node's entries leave the directory (default 10)");
  app.add_option("--cluster-pull-deadline", cfg.cluster_pull_deadline_s,
                 "Cluster tier: seconds each network step of a pull may take (default 2)");
  app.add_option("--cluster-max-pulls", cfg.cluster_max_pulls,
                 "Cluster tier: prefetches pulling at once on this node (default 8)");
  app.add_option("--cluster-max-session-pulls", cfg.cluster_max_session_pulls,
                 "Cluster tier: prefetches one session may have in flight (default 2)");
  app.add_option("--cluster-lanes", cfg.cluster_lanes,
                 "Cluster tier: UCX lanes, each a worker with a thread of its own and a connection to every peer "
                 "(1..16, default 4)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // prints help/version, or the error naming the flag or config key
    return ParsedArgs{std::nullopt, rc == 0 ? 0 : 2};
  }

  cfg.load_copy_engine = load_path == "copy-engine";
  cfg.store_copy_engine = store_path == "copy-engine";
  auto usage_error = [](const Status& s) {
    std::fprintf(stderr, "flexkvd: %s\n", s.message().c_str());
    return ParsedArgs{std::nullopt, 2};
  };
  if (cfg.max_session_pin_share <= 0) {
    return usage_error(Status::InvalidArgument(fmt::format(
        "--max-session-pin-share {} leaves a session no pins; expected a share above 0 and at most 1, e.g. 0.5",
        cfg.max_session_pin_share)));
  }
  if (cfg.swa_share + cfg.state_share >= 1) {
    return usage_error(Status::InvalidArgument(fmt::format(
        "--swa-share {} and --state-share {} leave nothing for the full-attention layers; expected a sum below 1",
        cfg.swa_share, cfg.state_share)));
  }
  if (cfg.pin_lease_s > 0 && cfg.pin_lease_s < 0.05) {
    return usage_error(Status::InvalidArgument(fmt::format(
        "--pin-lease {} is below 0.05 s, shorter than a busy client can renew; expected 0 (never) or 0.05..3600",
        cfg.pin_lease_s)));
  }
  auto size = ParseByteSize(pool_size);
  if (!size.ok()) return usage_error(size.status().WithContext("--pool-size"));
  if (*size < (1u << 20)) {
    return usage_error(Status::InvalidArgument("--pool-size " + pool_size + " is below 1MiB; expected e.g. 512MiB or 64GiB"));
  }
  cfg.pool_bytes = *size;
  auto level = log::ParseLevel(log_level);
  if (!level.ok()) return usage_error(level.status().WithContext("--log-level"));
  cfg.log_level = *level;
  if (!socket_group.empty()) {
    auto g = ResolveGroup("--socket-group", socket_group);
    if (!g.ok()) return usage_error(g.status());
    cfg.socket_gid = *g;
  }
  if (!admin_group.empty()) {
    auto g = ResolveGroup("--admin-group", admin_group);
    if (!g.ok()) return usage_error(g.status());
    cfg.admin_gid = *g;
  }
  if (cfg.socket_path.empty()) {
    cfg.socket_path = DefaultSocketPath();
    cfg.private_socket_dir = true;
  }
  if (cfg.socket_path.size() >= 108) {
    return usage_error(Status::InvalidArgument("--socket path has " + std::to_string(cfg.socket_path.size()) +
                                               " bytes; expected at most 107 (sun_path)"));
  }
  if (!cfg.kv_events_zmq.empty() && cfg.kv_events_zmq.rfind("tcp://", 0) != 0 &&
      cfg.kv_events_zmq.rfind("ipc://", 0) != 0) {
    return usage_error(Status::InvalidArgument("--kv-events-zmq " + cfg.kv_events_zmq +
                                               ": expected a ZMQ endpoint tcp://HOST:PORT or ipc://PATH"));
  }
  if (!metrics_listen.empty()) {
    auto address = ParseListenAddress("--metrics-listen", metrics_listen);
    if (!address.ok()) return usage_error(address.status());
    if (!address->loopback && !metrics_allow_remote) {
      return usage_error(Status::InvalidArgument(
          "--metrics-listen " + metrics_listen +
          " is not a loopback address; the endpoint has no authentication: use 127.0.0.1, or add "
          "--metrics-allow-remote to serve it to the network"));
    }
    cfg.metrics_listen = *address;
  }
  if (app.get_config_ptr()->count() > 0 && flags_config->has_namespaces()) {
    auto acls = ReadNamespaceAcls(app.get_config_ptr()->as<std::string>(), &cfg.namespace_pool_bytes);
    if (!acls.ok()) return usage_error(acls.status());
    cfg.namespace_acls = std::move(*acls);
  }
  // A pool_size is the most that namespace's domain may hold of the budget (the domains share the budget by
  // demand): one above the budget could never be reached.
  for (const auto& [name, bytes] : cfg.namespace_pool_bytes) {
    if (bytes > cfg.pool_bytes) {
      return usage_error(Status::InvalidArgument(fmt::format(
          "namespace '{}' has pool_size {}, more than --pool-size {}; expected at most the budget (a pool_size "
          "bounds what that namespace's domain may hold of it)",
          name, FormatByteSize(bytes), FormatByteSize(cfg.pool_bytes))));
    }
  }
  if (ssd_on_mismatch != "refuse" && ssd_on_mismatch != "discard") {
    return usage_error(Status::InvalidArgument("--ssd-on-mismatch " + ssd_on_mismatch + ": expected refuse or discard"));
  }
  cfg.ssd_discard_mismatch = ssd_on_mismatch == "discard";
  if (ssd_write_policy != "all" && ssd_write_policy != "cold") {
    return usage_error(Status::InvalidArgument("--ssd-write-policy " + ssd_write_policy + ": expected all or cold"));
  }
  cfg.ssd_write_all = ssd_write_policy == "all";
  if (!cfg.ssd_paths.empty() || !ssd_size.empty()) {
    if (cfg.ssd_paths.empty()) return usage_error(Status::InvalidArgument("--ssd-size needs --ssd-path (a directory per drive)"));
    if (ssd_size.empty()) {
      return usage_error(Status::InvalidArgument("--ssd-path needs --ssd-size: the bytes the tier may use on disk, e.g. 2TiB"));
    }
    auto bytes = ParseByteSize(ssd_size);
    if (!bytes.ok()) return usage_error(bytes.status().WithContext("--ssd-size"));
    cfg.ssd_bytes = *bytes;
    for (size_t i = 0; i < cfg.ssd_paths.size(); ++i) {
      for (size_t j = 0; j < i; ++j) {
        if (cfg.ssd_paths[i] == cfg.ssd_paths[j]) {
          return usage_error(Status::InvalidArgument("--ssd-path " + cfg.ssd_paths[i] + " is given twice; expected one per drive"));
        }
      }
    }
    if (!(cfg.ssd_writeback_window > 0 && cfg.ssd_writeback_window <= 1)) {
      return usage_error(Status::InvalidArgument(fmt::format(
          "--ssd-writeback-window {} is out of range; expected a share of the pool above 0 and at most 1, e.g. 0.25",
          cfg.ssd_writeback_window)));
    }
  }
  if (!etcd_endpoints.empty()) {
    for (size_t at = 0; at <= etcd_endpoints.size();) {
      const size_t comma = std::min(etcd_endpoints.find(',', at), etcd_endpoints.size());
      if (comma > at) cfg.etcd_endpoints.push_back(etcd_endpoints.substr(at, comma - at));
      at = comma + 1;
    }
    if (cfg.cluster_secret_file.empty()) {
      return usage_error(Status::InvalidArgument(
          "--etcd-endpoints needs --cluster-secret-file: peers authenticate with the cluster secret (mode 0600)"));
    }
    if (cluster_listen.empty()) {
      return usage_error(Status::InvalidArgument(
          "--etcd-endpoints needs --cluster-listen HOST:PORT: the address peers read this node's blocks from"));
    }
    auto address = ParseListenAddress("--cluster-listen", cluster_listen);
    if (!address.ok()) return usage_error(address.status());
    cfg.cluster_listen = *address;
    if (cfg.node_id.empty()) {
      char host[256] = {};
      if (gethostname(host, sizeof host - 1) == 0) cfg.node_id = host;
    }
    if (cfg.cluster_chunk_blocks == 0 || cfg.cluster_max_pulls == 0 || cfg.cluster_max_session_pulls == 0 ||
        !(cfg.cluster_lease_ttl_s >= 1) || !(cfg.cluster_pull_deadline_s > 0)) {
      return usage_error(Status::InvalidArgument(
          "--cluster-chunk-blocks, --cluster-max-pulls and --cluster-max-session-pulls must be >= 1, "
          "--cluster-lease-ttl >= 1 s and --cluster-pull-deadline > 0 s"));
    }
    if (cfg.cluster_lanes == 0 || cfg.cluster_lanes > 16) {
      return usage_error(Status::InvalidArgument("--cluster-lanes " + std::to_string(cfg.cluster_lanes) +
                                                 ": expected 1..16"));
    }
  } else if (!cfg.cluster_secret_file.empty() || !cluster_listen.empty() || !cfg.transfer_devices.empty()) {
    return usage_error(Status::InvalidArgument(
        "--cluster-secret-file, --cluster-listen and --transfer-dev need --etcd-endpoints (the cluster's store)"));
  }
  if (cfg.pool_path.empty()) cfg.pool_path = "/dev/shm/flexkvd-" + std::to_string(geteuid()) + "/pool";
  return ParsedArgs{cfg, 0};
}

}  // namespace flexkv
