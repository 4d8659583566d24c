// flexkvd's assembly and main loop; see daemon.h.
#include "daemon/daemon.h"

#include <algorithm>
#include <fmt/format.h>
#include <grpcpp/ext/health_check_service_server_builder_option.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/server_posix.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <thread>

#include "common/log.h"
#include "common/units.h"
#include "common/version.h"
#include "daemon/cache/cache.h"
#include "daemon/cache/cache_set.h"
#include "daemon/cache/pool_guard.h"
#include "daemon/dataplane/data_plane.h"
#include "daemon/lifecycle/lifecycle.h"
#include "daemon/server/daemon_metrics.h"
#include "daemon/metrics/metrics_server.h"
#include "daemon/server/acceptor.h"
#include "daemon/server/control_service.h"
#include "daemon/server/control_socket.h"
#include "daemon/server/parse_error_interceptor.h"
#include "daemon/server/peer_table.h"
#include "daemon/sessions/session_registry.h"
#include "daemon/tier_options.h"
#include "daemon/tiers/tier_set.h"
#include "daemon/events/kv_event_sources.h"
#include "daemon/events/kv_event_stream.h"
#include "daemon/events/zmq_publisher.h"
#include "daemon/transfer/cuda/cuda_engine_memory.h"
#include "daemon/transfer/engine_memory_backends.h"
#include "daemon/transfer/host/host_backend.h"

namespace flexkv {
namespace {

// A worker loop that has not turned for this long is stuck; the watchdog stops being fed.
constexpr int64_t kStuckLoopMs = 5000;

void Notify(const std::string& message) { sd_notify(0, message.c_str()); }

// Sessions offer fds (a GPU cache in cuMem/VMM memory: one per physical allocation); the default soft
// limit of 1024 is too low for that, the hard limit is what the operator allows.
void RaiseFdLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur >= limit.rlim_max) return;
  const rlim_t was = limit.rlim_cur;
  limit.rlim_cur = limit.rlim_max;
  if (setrlimit(RLIMIT_NOFILE, &limit) == 0) {
    log::Debug("daemon", "RLIMIT_NOFILE raised from {} to {}", was, limit.rlim_cur);
  }
}

}  // namespace

int RunDaemon(const DaemonConfig& config) {
  log::SetLevel(config.log_level);
  const int64_t started_ms = MonotonicMs();
  RaiseFdLimit();

  // Signals are taken synchronously by the main loop; block them before any thread starts.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);
  // Before the pool is mapped: a pool file truncated under us exits with a message, not a bare SIGBUS.
  InstallPoolFaultHandler();
  UniqueFd signal_fd(signalfd(-1, &signals, SFD_CLOEXEC));
  if (!signal_fd) {
    log::Error("daemon", "signalfd: {}", ErrnoText(errno));
    return 1;
  }

  // Parts in construction order; they are torn down in reverse (sessions before the cache they pin).
  // The engine-memory backends, one line each; the data plane picks among them by what they declare.
  EngineMemoryBackends backends;
  backends.Add(std::make_unique<HostBackend>(config.copy_threads));
  CudaCopyPaths paths;
  paths.load_copy_engine = config.load_copy_engine;
  paths.store_copy_engine = config.store_copy_engine;
  paths.staging_bytes = static_cast<uint64_t>(config.copy_staging_mib) << 20;
  if (auto cuda = CudaEngineMemory::Create(paths)) backends.Add(std::move(cuda));
  // The tiers below DRAM (daemon/tiers/cache_tier.h), one line each below; declared before the caches so that they
  // outlive them (the caches' observers call them), stopped explicitly before the sessions go.
  TierSet tiers;
  const auto add_tier = [](std::string_view what, Status added) {  // what: "cannot <what>: <why>"
    if (!added.ok()) log::Error("daemon", "cannot {}: {}", what, added.ToString());
    return added.ok();
  };
  // The KV event stream (docs/kv_events.md), declared before the caches so that it outlives them (their listeners
  // append to it); its sources are connected once the tiers exist.
  const uint64_t instance_id = [] {
    std::random_device rd;
    return (uint64_t{rd()} << 32) ^ rd() ^ static_cast<uint64_t>(getpid());
  }();
  auto kv_events = std::make_unique<KvEventStream>(config.kv_events_buffer, instance_id);
  CacheSetOptions cache_options;
  cache_options.budget_bytes = config.pool_bytes;
  cache_options.pool_path = config.pool_path;
  cache_options.split = PoolSplit{config.swa_share, config.state_share};
  cache_options.max_domains = config.max_domains;
  cache_options.verify_threads = config.verify_threads;
  cache_options.namespace_pool_bytes = config.namespace_pool_bytes;
  // No Attach waits for a pool of tens of GiB to be allocated and pinned: a new domain's pool is prepared by a
  // thread of its own, serving from its first grants while the rest is registered (issue 29 item 7).
  cache_options.prepare_in_background = true;
  CacheSet caches(std::move(cache_options));
  // Each domain's pool announces itself to the caches' observers (now when re-attached, or when its first Attach
  // creates it): the backends register it for DMA before any session can copy, so that registering GPU buffers later
  // is quick; a dropped domain's region is unregistered, exactly that one. Tiers that read the grants themselves
  // (peers' remote reads) add their observers after this one: told after the DMA registration, and before it goes.
  caches.AddObserver(std::make_shared<FunctionCacheObserver>(
      [&backends](const PoolRegion& pool) { return backends.RegisterPool(pool); },
      [&backends](const PoolRegion& pool) { backends.UnregisterPool(pool); }));
  // The cluster tier is created before the pools are re-attached, so that restored blocks are published once verified.
  if (!config.etcd_endpoints.empty() &&
      !add_tier("start the cluster tier", tiers.Add(ClusterTier::Create(ClusterTierOptionsFrom(config), &caches)))) {
    return 1;
  }
  // Whatever way this function returns, the tiers' threads (which read the caches) end before the caches go.
  struct TiersStop {
    ~TiersStop() { tiers->StopAll(); }
    TierSet* tiers;
  } tiers_stop{&tiers};
  // Budget shares follow the domains' demand: a thread of its own (growing a share pins memory for DMA, which must
  // not hold up the signals and the watchdog here), acting every few seconds and only when shares change. Declared
  // after `caches`, so it stops before they go.
  struct Rebalancer {
    explicit Rebalancer(CacheSet* caches)
        : thread([this, caches] {
            while (!stop.load(std::memory_order_acquire)) {
              caches->Rebalance(MonotonicMs());
              for (int i = 0; i < 10 && !stop.load(std::memory_order_acquire); ++i) {
                std::this_thread::sleep_for(std::chrono::milliseconds(100));
              }
            }
          }) {}
    ~Rebalancer() {
      stop.store(true, std::memory_order_release);
      thread.join();
    }
    std::atomic<bool> stop{false};
    std::thread thread;
  };
  // Restored blocks are served only once their bytes pass their checksums, checked in the background (one
  // verifier per domain, started by RecoverPools).
  Status recovered = caches.RecoverPools(config.discard_pool);
  if (!recovered.ok()) {
    log::Error("daemon", "cannot use the pool: {}", recovered.ToString());  // names the code
    return 1;
  }
  Rebalancer rebalancer(&caches);
  // The SSD tier, created once the pools are re-attached: its store opens now when block files exist or a pool was
  // re-attached (a refusal stops the start, with the store's message), else once the first pool exists.
  if (!config.ssd_paths.empty() &&
      !add_tier("use the SSD tier", tiers.Add(SsdTier::Create(SsdTierOptionsFrom(config), &caches)))) {
    return 1;
  }
  tiers.StartAll();

  ConnectKvEventSources(kv_events.get(), &caches, &tiers);
  std::unique_ptr<ZmqKvEventPublisher> kv_events_zmq;
  if (!config.kv_events_zmq.empty()) {
    auto publisher = ZmqKvEventPublisher::Start(kv_events.get(), config.kv_events_zmq, config.kv_events_zmq_topic);
    if (!publisher.ok()) {
      log::Error("daemon", "cannot publish KV events: {}", publisher.status().ToString());
      return 1;
    }
    kv_events_zmq = std::move(*publisher);
  }
  // Whatever way this function returns, subscribers end (UNAVAILABLE) and the publisher stops before the tiers go.
  struct KvEventsStop {
    ~KvEventsStop() {
      stream->Close();
      if (zmq) zmq->Stop();
    }
    KvEventStream* stream;
    ZmqKvEventPublisher* zmq;
  } kv_events_stop{kv_events.get(), kv_events_zmq.get()};

  auto activated = ControlSocket::FromSystemd(config.socket_path);
  auto socket = (!activated.ok() && activated.status().code() == StatusCode::kNotFound)
                    ? ControlSocket::Bind(config.socket_path, config.socket_gid, config.private_socket_dir ? 0700 : 0755)
                    : std::move(activated);
  if (!socket.ok()) {
    log::Error("daemon", "cannot serve the control socket: {}", socket.status().message());
    return 1;
  }

  Lifecycle lifecycle;
  DataPlaneOptions dp_options;
  dp_options.spin_ns = static_cast<int64_t>(config.spin_us * 1000);
  dp_options.poller_cpu = config.poller_cpu;
  dp_options.pins.max_session_share = config.max_session_pin_share;
  dp_options.pins.lease_ms = static_cast<int64_t>(config.pin_lease_s * 1000);
  dp_options.tiers = &tiers;
  DataPlane data_plane(&lifecycle, &backends, dp_options);
  SessionRegistry sessions(SessionLimits{static_cast<int64_t>(config.attach_timeout_s * 1000),
                                         config.max_pending_sessions_per_uid, config.max_pending_sessions,
                                         config.fd_reserve});
  sessions.SetChannelOpenCallback(
      [&](uint64_t id, const SessionIdentity& identity, const SessionAccess& access) -> Result<std::vector<UniqueFd>> {
        // Attach admitted the namespace's domain, and it is not dropped while this session exists.
        Cache* cache = caches.Find(identity.model_namespace);
        if (cache == nullptr) {
          return Status::FailedPrecondition(fmt::format(
              "the cache domain '{}' this session attached to was dropped by an admin; Attach again",
              identity.model_namespace));
        }
        return data_plane.OpenSession(id, cache, identity.geometry, access);
      });
  sessions.SetEndCallback([&](uint64_t id, const std::string&) { data_plane.EndSession(id); });
  PeerTable peers;
  std::atomic<bool> shutting_down{false};
  grpc::HealthCheckServiceInterface* health = nullptr;  // set once the server is up
  lifecycle.SetListener([&](ServingState state) {
    log::Info("daemon", "state: {}", ServingStateName(state));
    // grpc.health.v1 answers SERVING only while new work is admitted.
    if (health != nullptr) health->SetServingStatus(state == ServingState::kServing);
    if (state == ServingState::kServing) Notify("READY=1\nSTATUS=serving");
    if (state == ServingState::kDraining) Notify(shutting_down ? "STOPPING=1\nSTATUS=draining" : "STATUS=draining");
    if (state == ServingState::kDrained) Notify("STATUS=drained");
  });

  ErrorCounts control_errors;
  auto metrics = std::make_shared<DaemonMetrics>(
      MetricsSources{&caches, &data_plane, &sessions, &lifecycle, &control_errors, &tiers});
  const NamespaceAccess access(config.namespace_acls);
  for (const auto& [name, acl] : config.namespace_acls) {
    log::Info("daemon", "namespace '{}': ACL from {} ({} writers, {})", name, acl.source, acl.writers.size(),
              acl.readers ? fmt::format("{} readers", acl.readers->size()) : std::string("everyone may read"));
  }
  ControlService control(ControlContext{&caches, &data_plane, &backends, &sessions, &lifecycle, &peers,
                                        config.admin_gid, started_ms, &control_errors, metrics.get(), &access,
                                        &tiers, kv_events.get(), kv_events_zmq.get(),
                                        std::chrono::duration_cast<std::chrono::milliseconds>(
                                            std::chrono::system_clock::now().time_since_epoch()).count() -
                                            (MonotonicMs() - started_ms),
                                        KvSubscriptionLimits{config.kv_events_max_subscribers_per_uid,
                                                             config.kv_events_max_subscribers}});
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.RegisterService(&control);
  builder.SetMaxReceiveMessageSize(16 << 20);
  // SubscribeKvEvents runs on gRPC's callback API: its write completions are delivered by whichever thread polls the
  // connection, which on this server are the synchronous calls' pollers; they look every 10 ms rather than every
  // second, so that an event stream's next batch never waits for a poll timeout (measured: up to 1 s otherwise).
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::CQ_TIMEOUT_MSEC, 10);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(MakeParseErrorInterceptorFactory());
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server) {
    log::Error("daemon", "gRPC server failed to start");
    return 1;
  }
  health = server->GetHealthCheckService();
  if (health != nullptr) health->SetServingStatus(true);

  Status started = data_plane.Start();
  if (started.ok()) started = sessions.Start();
  // Declared after the parts it reads, so it stops (joining its threads) before they go.
  std::unique_ptr<MetricsServer> metrics_server;
  if (started.ok() && config.metrics_listen) {
    auto served = MetricsServer::Start(*config.metrics_listen, metrics);
    if (served.ok()) {
      metrics_server = std::move(*served);
    } else {
      started = served.status();
    }
  }
  Acceptor acceptor(socket->fd(), Acceptor::Handlers{
                                      [&](int fd, const PeerCredentials& peer) {
                                        peers.Add(fd, peer);
                                        grpc::AddInsecureChannelFromFd(server.get(), fd);
                                      },
                                      [&](UniqueFd fd, const PeerCredentials& peer) {
                                        sessions.AdoptChannel(std::move(fd), peer);
                                      }});
  if (started.ok()) started = acceptor.Start();
  if (!started.ok()) {
    log::Error("daemon", "startup failed: {}", started.ToString());
    server->Shutdown();
    return 1;
  }

  log::Info("daemon", "flexkvd {} (pid {}) listening on {}{}; pool budget {}{}", kVersion, getpid(), socket->path(),
            socket->activated_by_systemd() ? " (socket activation)" : "", FormatByteSize(config.pool_bytes),
            config.max_domains > 1 ? fmt::format(" for up to {} cache domains", config.max_domains) : std::string());
  if (metrics_server) {
    ListenAddress bound = *config.metrics_listen;
    bound.port = metrics_server->port();
    log::Info("daemon", "metrics on http://{}/metrics", bound.ToString());
  }
  log::Info("daemon", "ready: serving");
  Notify("READY=1\nSTATUS=serving");

  uint64_t watchdog_usec = 0;
  const bool watchdog = sd_watchdog_enabled(0, &watchdog_usec) > 0;
  const int tick_ms = watchdog ? static_cast<int>(std::min<uint64_t>(watchdog_usec / 4000, 1000)) : 1000;
  int64_t drain_deadline_ms = 0;
  int exit_code = 0;

  for (;;) {
    pollfd pfd{signal_fd.get(), POLLIN, 0};
    const int n = poll(&pfd, 1, shutting_down ? 20 : tick_ms);
    const int64_t now = MonotonicMs();
    if (n > 0) {
      signalfd_siginfo info{};
      if (read(signal_fd.get(), &info, sizeof(info)) == static_cast<ssize_t>(sizeof(info))) {
        if (info.ssi_signo == SIGHUP) {
          log::Info("daemon", "SIGHUP ignored: configuration is read at start; restart to change it");
        } else if (!shutting_down) {
          log::Info("daemon", "{} received: draining, then exiting (at most {} s)", strsignal(static_cast<int>(info.ssi_signo)),
                    config.drain_timeout_s);
          shutting_down = true;
          lifecycle.Drain();
          drain_deadline_ms = now + static_cast<int64_t>(config.drain_timeout_s * 1000);
        } else {
          log::Warning("daemon", "second signal: exiting without waiting for in-flight work");
          break;
        }
      }
    }
    // One fstat a tick: a pool file that shrank is reported here before a copy faults on it (pool_guard.h).
    if (Status pool_file = CheckWatchedPoolFile(); pool_file.code() == StatusCode::kDataLoss) {
      log::Error("daemon", "FATAL {}", pool_file.message());
      Notify("STATUS=pool file truncated");
      lifecycle.Drain();
      exit_code = kPoolLostExitCode;
      break;
    }
    if (watchdog && now - acceptor.last_turn_ms() < kStuckLoopMs && now - sessions.last_turn_ms() < kStuckLoopMs &&
        now - data_plane.last_turn_ms() < kStuckLoopMs) {
      Notify("WATCHDOG=1");
    }
    if (shutting_down) {
      if (lifecycle.state() == ServingState::kDrained) break;
      if (now >= drain_deadline_ms) {
        log::Warning("daemon", "drain timeout: {} request(s) still in flight; exiting anyway", lifecycle.inflight());
        break;
      }
    }
  }

  acceptor.Stop();
  kv_events->Close();  // event subscriptions end now (UNAVAILABLE), not at the grace period's end
  // The data plane is drained; control calls still running get a short grace period, then are cancelled.
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  // Every tier's requests end while the sessions still exist (SSD promotions answered and written blocks unpinned,
  // pulls answered; the node leaves the cluster: its directory entries go at once).
  tiers.StopAll();
  sessions.Stop();
  data_plane.Stop();
  if (exit_code != 0) return exit_code;
  log::Info("daemon", "stopped cleanly");
  return 0;
}

}  // namespace flexkv
