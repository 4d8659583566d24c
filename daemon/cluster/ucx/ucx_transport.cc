// UcxTransport; see ucx_transport.h. The public methods: Create (the UCP context, a worker and a progress thread per
// lane, the listener), the destructor, Connect, Disconnect, Get and Call, which hand their work to the lanes; and the
// RDMA NIC inventory. ucx_transport_impl.h has the rest: the lanes' state, and which file holds what.
#include "daemon/cluster/ucx/ucx_transport.h"

#include <infiniband/verbs.h>
#include <netdb.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "daemon/cluster/ucx/ucx_transport_impl.h"

namespace flexkv::cluster {
namespace {

bool IsSharedMemoryTransport(std::string_view t) {
  static const char* const kBad[] = {"all", "sm", "shm", "posix", "sysv", "cma", "knem", "xpmem", "self", "cuda_ipc",
                                     "rocm_ipc"};
  for (const char* b : kBad) {
    if (t == b) return true;
  }
  return false;
}

// "host:port" or "[v6]:port" (numeric host) -> sockaddr.
Result<std::pair<sockaddr_storage, socklen_t>> ParseEndpoint(const std::string& endpoint, bool port_required) {
  std::string host, port;
  if (!endpoint.empty() && endpoint[0] == '[') {
    auto close = endpoint.find(']');
    if (close == std::string::npos) return Status::InvalidArgument("endpoint '" + endpoint + "': missing ']'");
    host = endpoint.substr(1, close - 1);
    if (close + 1 < endpoint.size()) {
      if (endpoint[close + 1] != ':') return Status::InvalidArgument("endpoint '" + endpoint + "': expected ':port'");
      port = endpoint.substr(close + 2);
    }
  } else {
    auto colon = endpoint.rfind(':');
    if (colon == std::string::npos || endpoint.find(':') != colon) {
      host = endpoint;  // no port, or a bare IPv6 address
    } else {
      host = endpoint.substr(0, colon);
      port = endpoint.substr(colon + 1);
    }
  }
  if (host.empty()) return Status::InvalidArgument("endpoint '" + endpoint + "': empty host");
  if (port_required && port.empty()) return Status::InvalidArgument("endpoint '" + endpoint + "': no port");
  unsigned long port_value = 0;
  if (!port.empty()) {
    if (port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos)
      return Status::InvalidArgument("endpoint '" + endpoint + "': bad port");
    port_value = std::stoul(port);
    if (port_value > 65535 || (port_required && port_value == 0))
      return Status::InvalidArgument("endpoint '" + endpoint + "': bad port");
  }
  addrinfo hints{};
  hints.ai_flags = AI_NUMERICHOST;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || res == nullptr) {
    return Status::InvalidArgument("endpoint '" + endpoint + "': host is not a numeric address (" +
                                   gai_strerror(rc) + ")");
  }
  sockaddr_storage ss{};
  socklen_t len = static_cast<socklen_t>(res->ai_addrlen);
  std::memcpy(&ss, res->ai_addr, res->ai_addrlen);
  freeaddrinfo(res);
  const auto p = htons(static_cast<uint16_t>(port_value));
  if (ss.ss_family == AF_INET) {
    reinterpret_cast<sockaddr_in*>(&ss)->sin_port = p;
  } else {
    reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port = p;
  }
  return std::make_pair(ss, len);
}

}  // namespace

Result<std::unique_ptr<UcxTransport>> UcxTransport::Create(const UcxOptions& options) {
  // Validate the transport restriction.
  if (options.transports.empty()) return Status::InvalidArgument("ucx: transports is empty");
  {
    size_t start = 0;
    while (start <= options.transports.size()) {
      size_t comma = options.transports.find(',', start);
      if (comma == std::string::npos) comma = options.transports.size();
      std::string t = options.transports.substr(start, comma - start);
      if (!t.empty() && t[0] == '^') {
        return Status::InvalidArgument("ucx: transports '" + options.transports +
                                       "': exclusion lists ('^') are refused; list the transports to use");
      }
      if (t.empty() || IsSharedMemoryTransport(t)) {
        return Status::InvalidArgument("ucx: transports '" + options.transports + "': '" + t +
                                       "' is not allowed (peers must be reached over the network; shared memory "
                                       "would bypass it between namespaces of one host)");
      }
      start = comma + 1;
    }
  }
  if (options.max_inflight_gets == 0) return Status::InvalidArgument("ucx: max_inflight_gets is 0");
  if (options.lanes == 0 || options.lanes > kMaxLanes) {
    return Status::InvalidArgument("ucx: " + std::to_string(options.lanes) + " lanes; expected 1.." +
                                   std::to_string(kMaxLanes));
  }
  if (!options.secret.empty()) {
    if (options.secret.size() < kMinSecretBytes) {
      return Status::InvalidArgument("ucx: the cluster secret is " + std::to_string(options.secret.size()) +
                                     " bytes; expected at least " + std::to_string(kMinSecretBytes));
    }
    if (!ValidNodeId(options.node_id)) {
      return Status::InvalidArgument("ucx: node id '" + options.node_id +
                                     "': expected 1 to 64 characters of [A-Za-z0-9._-] (required with a secret)");
    }
  }
  if (options.get_deadline.count() <= 0) return Status::InvalidArgument("ucx: get_deadline must be > 0");
  std::optional<std::pair<sockaddr_storage, socklen_t>> listen_addr;
  if (!options.listen_address.empty()) {
    std::string ep = options.listen_address;
    if (ep.find(':') != std::string::npos && ep[0] != '[') ep = "[" + ep + "]";  // bare IPv6
    auto parsed = ParseEndpoint(ep + ":" + std::to_string(options.listen_port), false);
    if (!parsed.ok()) return parsed.status().WithContext("ucx: listen_address");
    listen_addr = *parsed;
  }

  auto state = std::make_shared<UcxState>();
  state->options = options;
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return Status::Internal("ucp_config_read: " + UcsError(s));
  s = ucp_config_modify(config, "TLS", options.transports.c_str());
  if (s == UCS_OK && !options.devices.empty()) s = ucp_config_modify(config, "NET_DEVICES", options.devices.c_str());
  // SO_REUSEADDR on the listener (UCX_CM_REUSEADDR, the tcp and rdma connection managers' common key): a restarted
  // daemon listens again at once, where the connections its previous run served leave the port in TIME_WAIT for a
  // minute ("Device is busy" without it). Linux still refuses a second live listener on the same address and port.
  if (s == UCS_OK) s = ucp_config_modify(config, "CM_REUSEADDR", "y");
  if (s != UCS_OK) {
    ucp_config_release(config);
    return Status::InvalidArgument("ucx: transports '" + options.transports + "' / devices '" + options.devices +
                                   "': " + UcsError(s));
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;  // never UCP_FEATURE_RMA: see kAmGetRequest
  params.mt_workers_shared = options.lanes > 1 ? 1 : 0;  // lanes' threads share the context (its memory maps)
  s = ucp_init(&params, config, &state->context);
  ucp_config_release(config);
  if (s != UCS_OK) {
    state->context = nullptr;
    return Status::Unavailable("ucp_init (transports '" + options.transports + "', devices '" + options.devices +
                               "'): " + UcsError(s));
  }
  for (uint32_t i = 0; i < options.lanes; ++i) {
    auto core = std::make_unique<UcxCore>();
    core->options = options;
    core->state = state.get();
    core->lane = i;
    core->context = state->context;
    ucp_worker_params_t wparams{};
    wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wparams.thread_mode = UCS_THREAD_MODE_SINGLE;
    s = ucp_worker_create(state->context, &wparams, &core->worker);
    if (s != UCS_OK) {
      core->worker = nullptr;
      return Status::Unavailable("ucp_worker_create: " + UcsError(s));
    }
    using Handler = std::pair<unsigned, ucp_am_recv_callback_t>;
    for (auto [id, cb] :
         {Handler{kAmGetRequest, &UcxCore::OnAmGetRequest}, Handler{kAmGetReply, &UcxCore::OnAmGetReply},
          Handler{kAmHello, &UcxCore::OnAmHello}, Handler{kAmHelloReply, &UcxCore::OnAmHelloReply},
          Handler{kAmProof, &UcxCore::OnAmProof}, Handler{kAmProofReply, &UcxCore::OnAmProofReply},
          Handler{kAmCallRequest, &UcxCore::OnAmCallRequest}, Handler{kAmCallReply, &UcxCore::OnAmCallReply}}) {
      ucp_am_handler_param_t hp{};
      hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
      hp.id = id;
      hp.cb = cb;
      hp.arg = core.get();
      s = ucp_worker_set_am_recv_handler(core->worker, &hp);
      if (s != UCS_OK) return Status::Internal("ucp_worker_set_am_recv_handler: " + UcsError(s));
    }
    s = ucp_worker_get_efd(core->worker, &core->worker_efd);
    if (s != UCS_OK) return Status::Unavailable("ucp_worker_get_efd: " + UcsError(s));
    core->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (core->wake_fd < 0) return Status::Internal(std::string("eventfd: ") + std::strerror(errno));
    state->lanes.push_back(std::move(core));
  }

  UcxCore* first = state->lanes[0].get();
  if (listen_addr) {
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&listen_addr->first);
    lp.sockaddr.addrlen = listen_addr->second;
    lp.conn_handler.cb = &UcxCore::OnConnRequest;
    lp.conn_handler.arg = first;
    s = ucp_listener_create(first->worker, &lp, &first->listener);
    if (s != UCS_OK) {
      first->listener = nullptr;
      return Status::Unavailable("ucx: listening on " + FormatSockaddr(listen_addr->first) + ": " + UcsError(s));
    }
    ucp_listener_attr_t la{};
    la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    s = ucp_listener_query(first->listener, &la);
    if (s != UCS_OK) {
      ucp_listener_destroy(first->listener);
      first->listener = nullptr;
      return Status::Internal("ucp_listener_query: " + UcsError(s));
    }
    first->endpoint_text = FormatSockaddr(la.sockaddr);
  }

  for (auto& core : state->lanes) {
    {
      MutexLock gate(&core->gate->mu);  // no other thread sees the gate yet; taken for the analysis's sake
      core->gate->core = core.get();
    }
    core->thread = std::thread([c = core.get()] { c->Loop(); });
    core->thread_id = core->thread.get_id();
  }
  log::Info(kLog, "transport up: transports '{}', devices '{}', listener '{}', {} lane(s)", options.transports,
            options.devices.empty() ? "all" : options.devices, first->endpoint_text, options.lanes);
  return std::unique_ptr<UcxTransport>(new UcxTransport(std::move(state)));
}

UcxTransport::~UcxTransport() {
  if (!state_) return;
  state_->shutting_down.store(true);
  // Lane 0 first: it destroys the listener once the connections it handed to the other lanes are taken.
  for (auto& lane : state_->lanes) {
    UcxCore* core = lane.get();
    core->RunSync<int>([core] {
      core->Shutdown();
      return 0;
    }, 0);
  }
  for (auto& lane : state_->lanes) {
    {
      MutexLock lock(&lane->queue_mu);
      lane->stop = true;
    }
    uint64_t one = 1;
    ssize_t n = write(lane->wake_fd, &one, sizeof one);
    (void)n;
  }
  for (auto& lane : state_->lanes) {
    lane->thread.join();
    MutexLock lock(&lane->gate->mu);
    lane->gate->core = nullptr;  // a CallHandler's late reply is dropped from now on
  }
  // Commands posted after the shutdown (a region's Reset racing with it) ran in the last turn or are dropped. No
  // thread uses the context now: unmap what is left, but never memory a reply may still read.
  MutexLock lock(&state_->regions_mu);
  for (const auto& lane : state_->lanes) {
    state_->leaked_regions.insert(lane->leaked_regions.begin(), lane->leaked_regions.end());
  }
  for (auto& [id, memh] : state_->regions) {
    if (state_->leaked_regions.count(id) == 0) ucp_mem_unmap(state_->context, memh);
  }
  state_->regions.clear();
}

std::string UcxTransport::endpoint() const { return state_->lanes[0]->endpoint_text; }

void UcxTransport::set_accept_filter(std::function<bool(const sockaddr&)> filter) {
  UcxCore* first = state_->lanes[0].get();
  MutexLock lock(&first->info_mu);
  first->accept_filter = std::move(filter);
}

Result<PeerHandle> UcxTransport::Connect(const std::string& endpoint) {
  auto addr = ParseEndpoint(endpoint, true);
  if (!addr.ok()) return addr.status().WithContext("ucx: connect");
  if (state_->shutting_down.load()) return Status::FailedPrecondition("ucx: shutting down");
  const uint64_t id = state_->next_peer_id.fetch_add(1);
  PeerHandle handle{id, endpoint, {}};
  // One endpoint per lane, connected in parallel. The outcomes live on this caller's stack: each lane's progress
  // thread sets its own once and never touches it again (a shared_ptr released on a progress thread trips
  // ThreadSanitizer through libstdc++ 12's shared_ptr release fast path).
  const bool wait = !state_->OnAnyLoopThread();
  const size_t n = state_->lanes.size();
  std::vector<Rendezvous<std::pair<Status, std::string>>> outcomes(n);
  std::vector<bool> posted(n, false);
  for (size_t i = 0; i < n; ++i) {
    UcxCore* core = state_->lanes[i].get();
    auto* outcome = wait ? &outcomes[i] : nullptr;
    posted[i] = core->Post([core, id, endpoint, addr = *addr, outcome] {
      auto peer = std::make_unique<UcxCore::Peer>();
      peer->id = id;
      peer->endpoint = endpoint;
      peer->addr = addr.first;
      peer->addrlen = addr.second;
      // Wait for the wire-up (a flush completes once the connection is established, or fails); gets posted
      // meanwhile (from a callback on a progress thread, which cannot wait here) queue until then.
      if (outcome != nullptr) {
        peer->on_connected = [outcome](Status s, const std::string& node) { outcome->Set({std::move(s), node}); };
      }
      UcxCore::Peer* raw = peer.get();
      core->peers.emplace(id, std::move(peer));
      Status s = core->Reconnect(raw);
      if (!s.ok()) {
        core->peers.erase(id);
        if (outcome != nullptr) outcome->Set({std::move(s), std::string()});
      }
    });
  }
  if (!wait) return handle;  // called from a callback: cannot wait for the loops
  Status failed;
  for (size_t i = 0; i < n; ++i) {
    auto [s, node] = posted[i] ? outcomes[i].Take() : std::make_pair(Status::FailedPrecondition("ucx: shutting down"),
                                                                      std::string());
    if (i == 0) handle.node_id = node;
    if (!s.ok() && failed.ok()) failed = std::move(s);
  }
  if (failed.ok()) return handle;
  Disconnect(handle);
  if (failed.code() == StatusCode::kFailedPrecondition) return failed;
  if (failed.code() == StatusCode::kPermissionDenied) return Status::PermissionDenied("ucx: " + failed.message());
  if (failed.code() == StatusCode::kDeadlineExceeded) {
    // A peer of another flexkvd version drops our hello unanswered (its header has another size): say so here, the
    // peer's log names the version it expected.
    return Status::DeadlineExceeded(
        "ucx: connecting to " + endpoint + ": no answer within " + std::to_string(state_->options.get_deadline.count()) +
        " ms (the peer is down or unreachable, or runs a flexkvd of another cluster protocol version: every node must "
        "run the same version)");
  }
  return Status::Unavailable("ucx: connecting to " + endpoint + ": " + failed.message());
}

void UcxTransport::Disconnect(const PeerHandle& peer) {
  if (state_->shutting_down.load()) return;
  const bool wait = !state_->OnAnyLoopThread();
  for (auto& lane : state_->lanes) {
    UcxCore* core = lane.get();
    auto close = [core, id = peer.id] {
      auto it = core->peers.find(id);
      if (it == core->peers.end()) return 0;
      core->ClosePeerEp(it->second.get());
      // Wait for the cancelled requests (their dst must not be written after their done ran).
      const auto until = Clock::now() + std::chrono::seconds(5);
      while (!it->second->ops.empty() && Clock::now() < until) core->Turn();
      if (it->second->ops.empty()) core->peers.erase(it);  // else kept: the ops still point at it
      return 0;
    };
    if (wait || core->OnLoopThread()) {
      core->RunSync<int>(close, 0);
    } else {
      (void)core->Post([close] { (void)close(); });  // another lane's thread: never wait across lanes
    }
  }
}

Status UcxTransport::Get(const PeerHandle& peer, const RemoteRegion& remote, uint64_t remote_offset, void* dst,
                         uint64_t len, std::function<void(Status)> done) {
  if (dst == nullptr || len == 0) return Status::InvalidArgument("ucx: get of 0 bytes or into a null buffer");
  if (remote_offset > remote.length() || len > remote.length() - remote_offset) {
    return Status::InvalidArgument("ucx: get of [" + std::to_string(remote_offset) + ", +" + std::to_string(len) +
                                   ") outside the peer region of " + std::to_string(remote.length()) + " bytes");
  }
  if (remote.base() == 0) return Status::InvalidArgument("ucx: empty remote region");
  if (peer.id == 0) return Status::NotFound("ucx: invalid peer handle");
  if (state_->shutting_down.load()) return Status::FailedPrecondition("ucx: shutting down");
  const uint32_t before = state_->inflight.fetch_add(1);
  if (before >= state_->options.max_inflight_gets) {
    state_->inflight.fetch_sub(1);
    return Status::ResourceExhausted("ucx: " + std::to_string(state_->options.max_inflight_gets) +
                                     " gets already in flight");
  }
  UcxCore* core = state_->Pick();
  auto* op = new UcxCore::Op;
  op->core = core;
  op->peer_id = peer.id;
  op->kind = UcxCore::Op::Kind::kGet;
  op->deadline = Clock::now() + state_->options.get_deadline;
  op->done = std::move(done);
  const uint64_t address = remote.base() + remote_offset;
  const bool posted = core->Post([core, op, address, dst, len]() mutable {
    if (core->shutting_down.load()) {
      core->FinishWith(op, Status::Cancelled("the transport is shutting down"));
      return;
    }
    core->StartGet(op, address, dst, len);
  });
  if (!posted) {
    state_->inflight.fetch_sub(1);
    delete op;
    return Status::FailedPrecondition("ucx: shutting down");
  }
  return Status::Ok();
}

void UcxTransport::set_call_handler(CallHandler handler) {
  for (auto& lane : state_->lanes) {
    MutexLock lock(&lane->info_mu);
    lane->call_handler = handler;
  }
}

Status UcxTransport::Call(const PeerHandle& peer, uint16_t method, std::string request,
                          std::function<void(Result<std::string>)> done) {
  if (request.size() > kMaxCallBytes) {
    return Status::InvalidArgument("ucx: call request of " + std::to_string(request.size()) + " bytes; at most " +
                                   std::to_string(kMaxCallBytes));
  }
  if (peer.id == 0) return Status::NotFound("ucx: invalid peer handle");
  if (state_->shutting_down.load()) return Status::FailedPrecondition("ucx: shutting down");
  const uint32_t before = state_->inflight.fetch_add(1);
  if (before >= state_->options.max_inflight_gets) {
    state_->inflight.fetch_sub(1);
    return Status::ResourceExhausted("ucx: " + std::to_string(state_->options.max_inflight_gets) +
                                     " requests already in flight");
  }
  UcxCore* core = state_->Pick();
  auto* op = new UcxCore::Op;
  op->core = core;
  op->peer_id = peer.id;
  op->kind = UcxCore::Op::Kind::kCall;
  op->deadline = Clock::now() + state_->options.get_deadline;
  op->method = method;
  op->request = std::move(request);
  op->call_done = std::move(done);
  const bool posted = core->Post([core, op] {
    if (core->shutting_down.load()) {
      core->FinishWith(op, Status::Cancelled("the transport is shutting down"));
      return;
    }
    core->StartCall(op);
  });
  if (!posted) {
    state_->inflight.fetch_sub(1);
    delete op;
    return Status::FailedPrecondition("ucx: shutting down");
  }
  return Status::Ok();
}

Result<std::string> UcxTransport::CallSync(const PeerHandle& peer, uint16_t method, std::string request) {
  if (state_->OnAnyLoopThread()) {
    return Status::FailedPrecondition("ucx: CallSync on a progress thread (from a callback) would never return");
  }
  Rendezvous<Result<std::string>> outcome;
  Status s = Call(peer, method, std::move(request), [&outcome](Result<std::string> r) { outcome.Set(std::move(r)); });
  if (!s.ok()) return s;
  return outcome.Take();
}

std::vector<std::string> UcxTransport::transports_in_use() const {
  std::vector<std::string> out;
  out.push_back("config: TLS=" + state_->options.transports +
                " NET_DEVICES=" + (state_->options.devices.empty() ? "all" : state_->options.devices) +
                (state_->lanes.size() > 1 ? " LANES=" + std::to_string(state_->lanes.size()) : std::string()));
  std::set<std::string> used;
  for (const auto& lane : state_->lanes) {
    MutexLock lock(&lane->info_mu);
    used.insert(lane->ucx_lanes.begin(), lane->ucx_lanes.end());
  }
  out.insert(out.end(), used.begin(), used.end());
  return out;
}

UcxTransport::Stats UcxTransport::stats() const {
  Stats total;
  for (const auto& lane : state_->lanes) {
    Stats s;
    {
      MutexLock lock(&lane->info_mu);
      s = lane->stats;
    }
    total.gets_ok += s.gets_ok;
    total.gets_failed += s.gets_failed;
    total.deadlines += s.deadlines;
    total.connections_accepted += s.connections_accepted;
    total.connections_rejected += s.connections_rejected;
    total.reconnects += s.reconnects;
    total.auth_failures += s.auth_failures;
    total.requests_refused += s.requests_refused;
    total.calls_ok += s.calls_ok;
    total.calls_failed += s.calls_failed;
    total.replies_dropped += s.replies_dropped;
  }
  return total;
}

// ---------------------------------------------------------------------------------------------------------------

std::vector<RdmaPort> ListRdmaPorts() {
  std::vector<RdmaPort> out;
  int n = 0;
  errno = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (list == nullptr) {
    log::Debug(kLog, "no RDMA devices (ibv_get_device_list: {})", std::strerror(errno));
    return out;
  }
  for (int i = 0; i < n; ++i) {
    const char* name = ibv_get_device_name(list[i]);
    ibv_context* ctx = ibv_open_device(list[i]);
    if (ctx == nullptr) {
      log::Warning(kLog, "RDMA device {}: open failed: {}", name ? name : "?", std::strerror(errno));
      continue;
    }
    ibv_device_attr attr{};
    if (ibv_query_device(ctx, &attr) == 0) {
      for (int port = 1; port <= attr.phys_port_cnt; ++port) {
        ibv_port_attr pa{};
        if (ibv_query_port(ctx, static_cast<uint8_t>(port), &pa) != 0) continue;
        out.push_back(RdmaPort{name ? name : "?", port, ibv_port_state_str(pa.state),
                               pa.link_layer == IBV_LINK_LAYER_ETHERNET ? "Ethernet" : "InfiniBand"});
      }
    }
    ibv_close_device(ctx);
  }
  ibv_free_device_list(list);
  return out;
}

std::vector<std::string> ListRdmaDevices() {
  std::vector<std::string> out;
  for (const RdmaPort& p : ListRdmaPorts()) out.push_back(p.device + ":" + std::to_string(p.port));
  return out;
}

}  // namespace flexkv::cluster
