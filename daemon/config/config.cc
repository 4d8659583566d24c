// Flag and config-file parsing for flexkvd.
#include "daemon/config/config.h"

#include <grp.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <cerrno>
#include <cstdio>
#include <iostream>

#include "common/paths.h"
#include "common/units.h"
#include "common/version.h"

namespace flexkv {

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

ParsedArgs ParseDaemonArgs(int argc, char** argv) {
  CLI::App app{"flexkvd: node-local KV-cache daemon for LLM inference engines"};
  app.set_version_flag("--version", kVersion);
  app.set_config("--config", "", "TOML file with the same keys as the long flags (socket = \"...\")");
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
  app.add_option("--load-path", load_path, "GPU loads: kernel (gather/scatter kernels) or copy-engine (SM-free)")
      ->check(CLI::IsMember({"kernel", "copy-engine"}));
  app.add_option("--store-path", store_path, "GPU stores: kernel or copy-engine")
      ->check(CLI::IsMember({"kernel", "copy-engine"}));
  std::string metrics_listen;
  bool metrics_allow_remote = false;
  app.add_option("--metrics-listen", metrics_listen,
                 "Serve Prometheus metrics on HOST:PORT (GET /metrics), e.g. 127.0.0.1:9400 (default: off)");
  app.add_flag("--metrics-allow-remote", metrics_allow_remote,
               "Allow a --metrics-listen address other than loopback (the endpoint has no authentication)");
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
  if (cfg.pool_path.empty()) cfg.pool_path = "/dev/shm/flexkvd-" + std::to_string(geteuid()) + "/pool";
  return ParsedArgs{cfg, 0};
}

}  // namespace flexkv
