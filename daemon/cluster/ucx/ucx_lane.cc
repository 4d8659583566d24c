// A lane of UcxTransport (ucx_transport_impl.h): its progress thread and loop, its endpoints (the connections it
// makes, and those lane 0's listener accepts and hands to a lane), the completion of ops with their deadlines,
// reconnects and the lane's shutdown. UcxTransport::Create (ucx_transport.cc) makes the UCP context and the lanes.
#include <poll.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <regex>

#include "daemon/cluster/ucx/ucx_transport_impl.h"

namespace flexkv::cluster {

UcxState::~UcxState() {
  lanes.clear();  // workers before their context
  if (context != nullptr) ucp_cleanup(context);
}

bool UcxState::OnAnyLoopThread() const {
  for (const auto& lane : lanes) {
    if (lane->OnLoopThread()) return true;
  }
  return false;
}

UcxCore::~UcxCore() {
  if (worker != nullptr) ucp_worker_destroy(worker);
  if (wake_fd >= 0) close(wake_fd);
}

bool UcxCore::Post(std::function<void()> fn) {
  {
    MutexLock lock(&queue_mu);
    if (stop) return false;
    queue.push_back(std::move(fn));
  }
  uint64_t one = 1;
  ssize_t n = write(wake_fd, &one, sizeof one);
  (void)n;
  return true;
}

void UcxCore::OnOpDone(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<Op*>(user_data);
  op->ucs = status;
  ucp_request_free(request);
  op->core->completed.push_back(op);
}

// `arg` is the core, not the peer: a peer may be gone (Disconnect) by the time UCX reports on an old endpoint.
void UcxCore::OnPeerError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* core = static_cast<UcxCore*>(arg);
  for (auto& [id, peer] : core->peers) {
    if (peer->ep != ep) continue;
    if (peer->healthy) {
      log::Info(kLog, "connection to {} failed: {}", peer->endpoint, UcsError(status));
    } else {
      log::Debug(kLog, "connection to {} failed: {}", peer->endpoint, UcsError(status));
    }
    peer->healthy = false;
    peer->failed = true;
  }
}

void UcxCore::OnAcceptedError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* core = static_cast<UcxCore*>(arg);
  log::Debug(kLog, "accepted connection ended: {}", UcsError(status));
  if (core->accepted.count(ep)) core->accepted_failed.push_back(ep);
}

void UcxCore::OnConnRequest(ucp_conn_request_h request, void* arg) {
  auto* core = static_cast<UcxCore*>(arg);
  ucp_conn_request_attr_t attr{};
  attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
  bool accept = false;
  std::string who = "?";
  if (ucp_conn_request_query(request, &attr) == UCS_OK) {
    who = FormatSockaddr(attr.client_address);
    std::function<bool(const sockaddr&)> filter;
    {
      MutexLock lock(&core->info_mu);
      filter = core->accept_filter;
    }
    accept = !filter || filter(*reinterpret_cast<const sockaddr*>(&attr.client_address));
  }
  if (!accept || core->shutting_down.load()) {
    log::Warning(kLog, "refused a connection request from {}", who);
    ucp_listener_reject(core->listener, request);
    MutexLock lock(&core->info_mu);
    ++core->stats.connections_rejected;
    return;
  }
  // The next lane takes the connection: its worker creates the endpoint (UCX moves an accepted connection to
  // the worker that creates its endpoint), its thread serves it. Not here, inside ucp_worker_progress, but once
  // the progress call returns (HandOffAccepts).
  const auto& lanes = core->state->lanes;
  const uint32_t next = core->state->next_accept_lane.fetch_add(1, std::memory_order_relaxed);
  core->pending_accepts.push_back({request, who, lanes[next % lanes.size()].get()});
}

// Why lane 0 waits for each ucp_ep_create of another lane: ucp_ep_create of another lane's worker moves the
// connection's socket from this worker's async context to that lane's (uct_tcp_sockcm_ep_server_create removes the fd's
// handler and adds it again under the new context). UCX 1.13 leaves an event of that fd that its async thread queued as
// "missed" on this worker (an event that came while this worker's context was blocked) in this worker's queue, and the
// next ucp_worker_progress here then finds the fd's handler under another context and aborts the process ("async.c:
// Assertion handler->async == async"; UCX 1.18 purges a removed handler's missed events). This worker's queue was just
// drained (the last thing ucp_worker_progress does), and while this thread waits it makes no UCP call: the only time
// this worker's context is blocked while the socket moves is inside the other lane's ucp_ep_create (which blocks it to
// move the fd; microseconds, while the client has nothing to send: it waits for our answer). Nor does this thread touch
// its listener and connection manager while that ucp_ep_create uses them.
void UcxCore::HandOffAccepts() {
  std::vector<PendingAccept> batch;
  batch.swap(pending_accepts);
  for (PendingAccept& p : batch) {
    if (shutting_down.load() && listener != nullptr) {
      ucp_listener_reject(listener, p.request);
      continue;
    }
    if (p.target == this) {
      Accept(p.request, p.who);
      continue;
    }
    Rendezvous<int> taken;
    UcxCore* target = p.target;
    if (target->Post([target, &p, &taken] {
          target->Accept(p.request, p.who);
          taken.Set(1);
        })) {
      (void)taken.Take();  // lanes never wait on one another otherwise, and every command ends: no deadlock
    } else {
      Accept(p.request, p.who);  // that lane has stopped: this one serves the connection
    }
  }
}

void UcxCore::Accept(ucp_conn_request_h request, const std::string& who) {
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.conn_request = request;
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &UcxCore::OnAcceptedError;
  params.err_handler.arg = this;
  ucp_ep_h ep = nullptr;
  ucs_status_t s = ucp_ep_create(worker, &params, &ep);
  if (s != UCS_OK) {
    log::Warning(kLog, "accepting a connection from {} failed: {}", who, UcsError(s));
    return;
  }
  if (shutting_down.load()) {  // this lane shut down meanwhile: nothing serves it
    CloseEp(ep);
    return;
  }
  Accepted a;
  a.serial = next_accepted_serial++;
  a.since = Clock::now();
  a.who = who;
  accepted.emplace(ep, std::move(a));
  log::Debug(kLog, "lane {} accepted a connection from {}", lane, who);
  MutexLock lock(&info_mu);
  ++stats.connections_accepted;
}

void UcxCore::CloseEp(ucp_ep_h ep, bool force) {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  void* req = ucp_ep_close_nbx(ep, &param);
  if (UCS_PTR_IS_PTR(req)) closing.push_back(req);
  closed_since_progress = true;
}

void UcxCore::ClosePeerEp(Peer* peer, bool force) {
  if (peer->ep == nullptr) return;
  ucp_ep_h ep = peer->ep;
  peer->ep = nullptr;
  peer->failed = false;
  CloseEp(ep, force);  // pending requests complete (UCS_ERR_CANCELED) through OnOpDone
  // Active-message gets still waiting for their reply: nothing of UCX writes their dst; end them.
  for (Op* op : peer->ops) {
    if (op->am_waiting) {
      op->am_waiting = false;
      am_ops.erase(op->am_id);
      op->ucs = UCS_ERR_CANCELED;
      completed.push_back(op);
    }
  }
}

Status UcxCore::CreatePeerEp(Peer* peer) {
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&peer->addr);
  params.sockaddr.addrlen = peer->addrlen;
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &UcxCore::OnPeerError;
  params.err_handler.arg = this;
  ucs_status_t s = ucp_ep_create(worker, &params, &peer->ep);
  if (s != UCS_OK) {
    peer->ep = nullptr;
    return Status::Unavailable("connecting to " + peer->endpoint + ": " + UcsError(s));
  }
  peer->failed = false;
  peer->closed_by_deadline = false;
  if (peer->connected_once) {
    MutexLock lock(&info_mu);
    ++stats.reconnects;
  }
  peer->connected_once = true;
  return Status::Ok();
}

void UcxCore::RecordLanes(Peer* peer) {
  if (peer->ep == nullptr) return;
  char* text = nullptr;
  size_t size = 0;
  FILE* f = open_memstream(&text, &size);
  if (f == nullptr) return;
  ucp_ep_print_info(peer->ep, f);
  fclose(f);
  std::string info(text, size);
  free(text);
  // Lines like "#   lane[0]:  1:tcp/lo.0 md[1] ..." or "... rc_mlx5/mlx5_0:1 ...": take "tl/dev" tokens.
  static const std::regex kLane(R"(lane\[\d+\]:\s+\d+:([A-Za-z0-9_]+)/([A-Za-z0-9_.:\-]+))");
  MutexLock lock(&info_mu);
  for (std::sregex_iterator it(info.begin(), info.end(), kLane), end; it != end; ++it) {
    std::string dev = (*it)[2].str();
    if (auto dot = dev.rfind('.'); dot != std::string::npos && dot + 1 < dev.size() &&
                                   dev.find_first_not_of("0123456789", dot + 1) == std::string::npos) {
      dev.resize(dot);  // "lo.0": drop the path index
    }
    ucx_lanes.insert((*it)[1].str() + "/" + dev);
  }
}

void UcxCore::FinishCompleted() {
  while (!completed.empty()) {
    std::vector<Op*> batch;
    batch.swap(completed);
    for (Op* op : batch) Finish(op);
  }
}

void UcxCore::Finish(Op* op) {
  deadlines.erase({op->deadline, op});
  bool closed_by_deadline = false;
  if (auto it = peers.find(op->peer_id); it != peers.end()) {
    it->second->ops.erase(op);
    closed_by_deadline = it->second->closed_by_deadline;
  }
  Status status;
  if (op->ucs == UCS_OK) {
    status = Status::Ok();
  } else if (op->result.has_value()) {
    status = *op->result;
  } else if (op->deadline_hit) {
    status = Status::DeadlineExceeded("no completion within " + std::to_string(options.get_deadline.count()) +
                                      " ms; request cancelled, endpoint closed");
  } else if (shutting_down.load()) {
    status = Status::Cancelled("the transport is shutting down");
  } else if (op->ucs == UCS_ERR_CANCELED && closed_by_deadline) {
    status = Status::Unavailable("cancelled: another request to this peer hit its deadline");
  } else if (op->ucs == UCS_ERR_CANCELED) {
    status = Status::Unavailable("cancelled: the connection was closed");
  } else {
    status = Status::Unavailable(std::string("peer: ") + UcsError(op->ucs));
  }
  Deliver(op, std::move(status));
}

void UcxCore::Deliver(Op* op, Status status) {
  if (op->kind == Op::Kind::kGet || op->kind == Op::Kind::kCall) {
    MutexLock lock(&info_mu);
    const bool get = op->kind == Op::Kind::kGet;
    if (status.ok()) {
      ++(get ? stats.gets_ok : stats.calls_ok);
    } else {
      ++(get ? stats.gets_failed : stats.calls_failed);
      if (op->deadline_hit) ++stats.deadlines;
    }
  }
  auto done = std::move(op->done);
  auto call_done = std::move(op->call_done);
  std::string reply = std::move(op->reply);
  if (op->counted()) state->inflight.fetch_sub(1);
  const bool call = op->kind == Op::Kind::kCall;
  delete op;
  if (call) {
    if (call_done) call_done(status.ok() ? Result<std::string>(std::move(reply)) : Result<std::string>(status));
  } else if (done) {
    done(std::move(status));
  }
}

void UcxCore::FinishNow(Op* op, ucs_status_t ucs) {
  op->ucs = ucs;
  Finish(op);
}

void UcxCore::FinishWith(Op* op, Status status) {
  deadlines.erase({op->deadline, op});
  if (auto it = peers.find(op->peer_id); it != peers.end()) it->second->ops.erase(op);
  Deliver(op, std::move(status));
}

void UcxCore::CheckDeadlines() {
  const auto now = Clock::now();
  std::vector<Peer*> to_close;
  for (auto it = deadlines.begin(); it != deadlines.end() && it->first <= now;) {
    Op* op = it->second;
    it = deadlines.erase(it);
    op->deadline_hit = true;
    auto pit = peers.find(op->peer_id);
    if (pit != peers.end() && pit->second->ep != nullptr) to_close.push_back(pit->second.get());
  }
  for (Peer* peer : to_close) {
    if (peer->ep == nullptr) continue;
    log::Warning(kLog, "a request to {} had no completion within {} ms: closing the endpoint", peer->endpoint,
                 options.get_deadline.count());
    peer->closed_by_deadline = true;
    ClosePeerEp(peer);
  }
}

int UcxCore::PollTimeoutMs() const {
  if (deadlines.empty()) return 1000;
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadlines.begin()->first - Clock::now());
  return static_cast<int>(std::clamp<int64_t>(left.count() + 1, 0, 1000));
}

void UcxCore::Housekeeping() {
  for (auto& [id, peer] : peers) {
    if (peer->failed && peer->ep != nullptr) ClosePeerEp(peer.get());
  }
  for (ucp_ep_h ep : accepted_failed) {
    if (accepted.erase(ep)) CloseEp(ep);
  }
  accepted_failed.clear();
  // With a secret, a connection that has not completed its handshake within get_deadline is closed.
  if (!options.secret.empty()) {
    const auto now = Clock::now();
    for (auto it = accepted.begin(); it != accepted.end();) {
      if (!it->second.authenticated && now - it->second.since > options.get_deadline) {
        log::Warning(kLog, "closing the connection from {}: no handshake within {} ms", it->second.who,
                     options.get_deadline.count());
        CloseEp(it->first);
        it = accepted.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto it = closing.begin(); it != closing.end();) {
    if (ucp_request_check_status(*it) != UCS_INPROGRESS) {
      ucp_request_free(*it);
      it = closing.erase(it);
    } else {
      ++it;
    }
  }
}

// The last thing each ucp_worker_progress call does is run the async events its worker missed (events of UCX's
// async thread that came while this thread blocked the worker's context). A socket closed since then (an endpoint
// closed) may have left such an event behind in UCX 1.13, under the fd's number: it must run here before another
// lane's new socket can take that number and register it under its own context, or the event would run under the
// wrong one and abort the process (see HandOffAccepts). Hence every close is followed by a progress call before
// anything else waits or sleeps.
void UcxCore::Progress() {
  for (;;) {
    const unsigned n = ucp_worker_progress(worker);
    closed_since_progress = false;
    if (!pending_accepts.empty()) HandOffAccepts();
    if (n == 0 && !closed_since_progress) break;
  }
}

void UcxCore::ProgressIfClosed() {
  if (closed_since_progress) Progress();
}

void UcxCore::Turn() {
  Progress();
  FinishCompleted();
  Housekeeping();
  ProgressIfClosed();
  FinishCompleted();
  CheckDeadlines();
  ProgressIfClosed();
  FinishCompleted();
}

void UcxCore::Loop() {
  for (;;) {
    std::deque<std::function<void()>> work;
    bool stopping;
    {
      MutexLock lock(&queue_mu);
      work.swap(queue);
      stopping = stop;
    }
    for (auto& fn : work) fn();
    Turn();
    if (stopping) break;
    {
      MutexLock lock(&queue_mu);
      if (!queue.empty() || stop) continue;
    }
    if (!completed.empty() || closed_since_progress) continue;
    ucs_status_t s = ucp_worker_arm(worker);
    if (s == UCS_ERR_BUSY) continue;
    pollfd fds[2] = {{worker_efd, POLLIN, 0}, {wake_fd, POLLIN, 0}};
    int rc = poll(fds, 2, PollTimeoutMs());
    if (rc > 0 && (fds[1].revents & POLLIN)) {
      uint64_t v;
      ssize_t n = read(wake_fd, &v, sizeof v);
      (void)n;
    }
  }
}

UcxCore::Peer* UcxCore::ReadyPeer(Op* op, uint64_t remote_address, void* dst, uint64_t len) {
  auto pit = peers.find(op->peer_id);
  if (pit == peers.end()) {
    FinishWith(op, Status::Unavailable("the peer was disconnected"));
    return nullptr;
  }
  Peer* peer = pit->second.get();
  if (peer->ep != nullptr && peer->failed) ClosePeerEp(peer);
  if (peer->ep == nullptr) {
    Status s = Reconnect(peer);
    if (!s.ok()) {
      FinishWith(op, s);
      return nullptr;
    }
  }
  if (peer->connecting) {
    peer->waiting.push_back({op, remote_address, dst, len});
    return nullptr;
  }
  return peer;
}

Status UcxCore::Reconnect(Peer* peer) {
  FLEXKV_RETURN_IF_ERROR(CreatePeerEp(peer));
  peer->connecting = true;
  peer->node_id.clear();
  peer->connect_deadline = Clock::now() + options.get_deadline;
  auto* op = new Op;
  op->core = this;
  op->peer_id = peer->id;
  op->kind = Op::Kind::kFlush;
  op->deadline = peer->connect_deadline;
  op->done = [this, id = peer->id](Status s) { OnReconnected(id, std::move(s)); };
  StartFlush(op);
  return Status::Ok();
}

void UcxCore::OnReconnected(uint64_t peer_id, Status s) {
  auto it = peers.find(peer_id);
  if (it == peers.end()) return;
  if (s.ok() && !options.secret.empty() && it->second->ep != nullptr) {
    StartHandshake(it->second.get());
    return;
  }
  ConnectDone(peer_id, std::move(s));
}

void UcxCore::ConnectDone(uint64_t peer_id, Status s) {
  auto it = peers.find(peer_id);
  if (it == peers.end()) return;
  Peer* peer = it->second.get();
  peer->connecting = false;
  // A refused handshake leaves a working endpoint that must not be used: the next request reconnects. Closed
  // with a flush: our "your proof failed" message (OnAmHelloReply) must reach the peer, which counts it.
  if (s.code() == StatusCode::kPermissionDenied) ClosePeerEp(peer, /*force=*/false);
  std::vector<Peer::Waiting> waiting;
  waiting.swap(peer->waiting);
  if (s.ok()) {
    RecordLanes(peer);
    peer->healthy = true;
  }
  if (auto notify = std::move(peer->on_connected)) {
    peer->on_connected = nullptr;
    notify(s, peer->node_id);
  }
  for (auto& w : waiting) {
    if (s.ok() && Clock::now() < w.op->deadline) {
      if (w.op->kind == Op::Kind::kCall) {
        StartCall(w.op);
      } else {
        StartGet(w.op, w.address, w.dst, w.len);
      }
    } else if (s.code() == StatusCode::kPermissionDenied) {
      FinishWith(w.op, s);
    } else if (s.ok() || s.code() == StatusCode::kDeadlineExceeded) {
      {
        MutexLock lock(&info_mu);
        ++stats.deadlines;
      }
      FinishWith(w.op, Status::DeadlineExceeded("reconnecting to " + peer->endpoint + ": no answer within " +
                                                std::to_string(options.get_deadline.count()) + " ms"));
    } else {
      FinishWith(w.op, Status::Unavailable("reconnecting to " + peer->endpoint + ": " + s.message()));
    }
  }
}

void UcxCore::StartFlush(Op* op) {
  auto pit = peers.find(op->peer_id);
  if (pit == peers.end() || pit->second->ep == nullptr) {
    FinishWith(op, Status::Unavailable("no connection"));
    return;
  }
  Peer* peer = pit->second.get();
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &UcxCore::OnOpDone;
  param.user_data = op;
  peer->ops.insert(op);
  deadlines.insert({op->deadline, op});
  void* req = ucp_ep_flush_nbx(peer->ep, &param);
  if (req == nullptr) {
    FinishNow(op, UCS_OK);
  } else if (UCS_PTR_IS_ERR(req)) {
    FinishNow(op, UCS_PTR_STATUS(req));
  }
}

void UcxCore::Shutdown() {
  shutting_down.store(true);
  if (listener != nullptr) {
    // Every connection request received so far was handed over (or refused) when its progress call returned.
    ucp_listener_destroy(listener);
    listener = nullptr;
  }
  for (auto& [id, peer] : peers) ClosePeerEp(peer.get());
  for (auto& [ep, a] : accepted) CloseEp(ep);
  accepted.clear();
  // Let the cancellations and closes finish (bounded: a close that never completes is abandoned).
  const auto until = Clock::now() + std::chrono::seconds(5);
  for (;;) {
    Turn();
    bool ops_left = false;
    for (auto& [id, peer] : peers) ops_left |= !peer->ops.empty();
    if ((!ops_left && closing.empty()) || Clock::now() > until) break;
  }
  for (auto& [id, peer] : peers) {
    for (Op* op : std::vector<Op*>(peer->ops.begin(), peer->ops.end())) {
      log::Error(kLog, "a request to {} never completed after its endpoint was closed", peer->endpoint);
      (void)op;  // leaked on purpose: UCX may still own it
    }
  }
  for (void* req : closing) ucp_request_free(req);
  closing.clear();
  for (auto& [id, region] : regions) {
    if (region.replies != 0) leaked_regions.push_back(id);  // a send may still read it: never unmapped
  }
  regions.clear();
  peers.clear();
}

}  // namespace flexkv::cluster
