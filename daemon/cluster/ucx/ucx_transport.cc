// UcxTransport; see ucx_transport.h. The public methods (Create: the UCP context, a worker and a progress thread per
// lane, the listener; the destructor, Connect, Disconnect, Get and Call, which hand their work to the lanes), the
// handshake and Calls (a file of their own next), and the RDMA NIC inventory. ucx_transport_impl.h has the lanes'
// state, and which file holds what.
#include "daemon/cluster/ucx/ucx_transport.h"

#include <infiniband/verbs.h>
#include <netdb.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>

#include "daemon/cluster/ucx/ucx_transport_impl.h"

namespace flexkv::cluster {
namespace {

// HMAC-SHA256(secret, len|field|len|field...): every field length-prefixed, so no two inputs read alike.
std::string Mac(const std::string& secret, std::initializer_list<std::string_view> fields) {
  std::string input;
  for (std::string_view f : fields) {
    PutLe(&input, f.size(), 4);
    input.append(f);
  }
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
           reinterpret_cast<const unsigned char*>(input.data()), input.size(), out, &len) == nullptr) {
    return std::string();  // never equal to a received MAC of kMacBytes
  }
  return std::string(reinterpret_cast<const char*>(out), len);
}

bool MacEqual(std::string_view a, std::string_view b) {
  return a.size() == kMacBytes && b.size() == kMacBytes && CRYPTO_memcmp(a.data(), b.data(), kMacBytes) == 0;
}

Result<std::string> RandomBytes(size_t n) {
  std::string out(n, '\0');
  size_t got = 0;
  while (got < n) {
    ssize_t r = getrandom(out.data() + got, n - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      return Status::Internal(std::string("getrandom: ") + std::strerror(errno));
    }
    got += static_cast<size_t>(r);
  }
  return out;
}

// An error that came over the wire: an unknown code reads UNKNOWN, the message is cut at kMaxErrorBytes.
Status StatusFromWire(uint32_t code, std::string_view message) {
  if (message.size() > kMaxErrorBytes) message = message.substr(0, kMaxErrorBytes);
  if (code == 0 || code > static_cast<uint32_t>(StatusCode::kUnauthenticated)) {
    return Status(StatusCode::kUnknown, "(code " + std::to_string(code) + ") " + std::string(message));
  }
  return Status(static_cast<StatusCode>(code), std::string(message));
}

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

void UcxCore::CountAuthFailure() {
  std::lock_guard<std::mutex> lock(info_mu);
  ++stats.auth_failures;
}

bool UcxCore::FixedHeader(const void* header, size_t header_length, AmHeader* out) {
  if (header_length != sizeof(AmHeader)) return false;
  std::memcpy(out, header, sizeof *out);
  return true;
}

UcxCore::Op* UcxCore::TakeAmOp(uint64_t id, Op::Kind kind) {
  auto it = am_ops.find(id);
  if (it == am_ops.end() || it->second->kind != kind) return nullptr;
  Op* op = it->second;
  am_ops.erase(it);
  op->am_waiting = false;
  return op;
}

void UcxCore::FailAmOp(Op* op, Status status) {
  op->ucs = UCS_ERR_REJECTED;
  op->result = std::move(status);
  completed.push_back(op);
}

std::string UcxCore::PeerName(uint64_t peer_id) {
  auto it = peers.find(peer_id);
  return "peer " + (it == peers.end() ? std::string("?") : it->second->endpoint);
}

void UcxCore::StartHandshake(Peer* peer) {
  auto* op = new Op;
  op->core = this;
  op->peer_id = peer->id;
  op->kind = Op::Kind::kHandshake;
  op->deadline = peer->connect_deadline;
  op->done = [this, id = peer->id](Status s) { ConnectDone(id, std::move(s)); };
  op->stage = 1;
  auto nonce = RandomBytes(kNonceBytes);
  if (!nonce.ok()) {
    FinishWith(op, nonce.status());
    return;
  }
  op->client_nonce = std::move(*nonce);
  op->am_id = next_am_id++;
  op->am_waiting = true;
  am_ops[op->am_id] = op;
  peer->ops.insert(op);
  deadlines.insert({op->deadline, op});
  op->posted = true;
  std::string hello;
  hello.push_back(static_cast<char>(kHandshakeVersion));
  hello.push_back(static_cast<char>(options.node_id.size()));
  hello += options.node_id;
  hello += op->client_nonce;
  const ucs_status_t st = SendAm(peer->ep, kAmHello, RequestHeader(op->am_id, 0, op->token), std::move(hello), true);
  if (st != UCS_OK && op->am_waiting) {
    op->am_waiting = false;
    am_ops.erase(op->am_id);
    FinishNow(op, st);
  }
}

ucs_status_t UcxCore::OnAmHello(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                const ucp_am_recv_param_t* param) {
  auto* core = static_cast<UcxCore*>(arg);
  AmHeader h{};
  if (core->shutting_down.load() || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return UCS_OK;
  if (!FixedHeader(header, header_length, &h)) {
    core->CountMalformed("handshake hello (header size: from a flexkvd older than this one? every node must run "
                         "the same version)",
                         param);
    return UCS_OK;
  }
  ucp_ep_h ep = param->reply_ep;
  Accepted* a = core->FindAccepted(param);
  if (a == nullptr) {
    core->CountMalformed("handshake hello (not on an accepted connection)", param);
    core->SendStatus(ep, kAmHelloReply, h, Status::PermissionDenied("a handshake on a connection this node made"));
    return UCS_OK;
  }
  if (core->options.secret.empty()) {
    core->SendStatus(ep, kAmHelloReply, h,
                     Status::PermissionDenied("this node has no cluster secret configured; every node must have the "
                                              "same --cluster-secret-file"));
    return UCS_OK;
  }
  const auto* d = static_cast<const char*>(data);
  const bool sized = !(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) && length >= 2 &&
                     length == 2 + static_cast<uint8_t>(d[1]) + kNonceBytes;
  const std::string node = sized ? std::string(d + 2, static_cast<uint8_t>(d[1])) : std::string();
  if (!sized || static_cast<uint8_t>(d[0]) != kHandshakeVersion || !ValidNodeId(node)) {
    core->CountMalformed("handshake hello", param);
    core->SendStatus(ep, kAmHelloReply, h,
                     Status::InvalidArgument("malformed hello: expected version 2 (version 1 is a flexkvd older "
                                             "than this one: every node must run the same version), a node id of "
                                             "[A-Za-z0-9._-]{1,64} and a 16-byte nonce"));
    return UCS_OK;
  }
  if (a->authenticated || a->hello_used) {
    core->CountMalformed("second handshake hello", param);
    core->SendStatus(ep, kAmHelloReply, h, Status::FailedPrecondition("a handshake already ran on this connection"));
    return UCS_OK;
  }
  auto nonce = RandomBytes(kNonceBytes);
  if (!nonce.ok()) {
    core->SendStatus(ep, kAmHelloReply, h, nonce.status());
    return UCS_OK;
  }
  a->hello_used = true;
  a->proof_pending = true;
  a->client_node = node;
  a->client_nonce.assign(d + 2 + node.size(), kNonceBytes);
  a->server_nonce = std::move(*nonce);
  const std::string& self = core->options.node_id;
  std::string out;
  out.push_back(static_cast<char>(self.size()));
  out += self;
  out += a->server_nonce;
  out += Mac(core->options.secret,
             {"flexkv-cluster-v1 server", a->client_nonce, a->server_nonce, self, a->client_node});
  (void)core->SendAm(ep, kAmHelloReply, ReplyHeader(h.id, h.token), std::move(out), true);
  return UCS_OK;
}

ucs_status_t UcxCore::OnAmHelloReply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                     const ucp_am_recv_param_t* param) {
  auto* core = static_cast<UcxCore*>(arg);
  AmHeader h{};
  if (!FixedHeader(header, header_length, &h)) {
    core->DropReply("handshake reply", "a header of " + std::to_string(header_length) + " bytes", param);
    return UCS_OK;
  }
  Op* op = core->TakeReplyOp(h.id, h.token, Op::Kind::kHandshake, "handshake reply", param, 1);
  if (op == nullptr) return UCS_OK;
  const std::string name = core->PeerName(op->peer_id);
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  const auto* d = static_cast<const char*>(data);
  if (h.code != 0) {
    core->CountAuthFailure();
    core->FailAmOp(op, Status::PermissionDenied(name + " refused the handshake: " +
                                                StatusFromWire(h.code, rndv ? "" : std::string_view(d, length))
                                                    .ToString()));
    return UCS_OK;
  }
  const bool sized = !rndv && length >= 1 && length == 1 + static_cast<uint8_t>(d[0]) + kNonceBytes + kMacBytes;
  const std::string node = sized ? std::string(d + 1, static_cast<uint8_t>(d[0])) : std::string();
  if (!sized || !ValidNodeId(node)) {
    core->FailAmOp(op, Status::PermissionDenied(name + " sent a malformed handshake reply of " +
                                                std::to_string(length) + " bytes"));
    return UCS_OK;
  }
  const std::string server_nonce(d + 1 + node.size(), kNonceBytes);
  const std::string_view mac_s(d + 1 + node.size() + kNonceBytes, kMacBytes);
  const std::string& self = core->options.node_id;
  auto pit = core->peers.find(op->peer_id);
  ucp_ep_h ep = pit == core->peers.end() ? nullptr : pit->second->ep;
  if (!MacEqual(Mac(core->options.secret, {"flexkv-cluster-v1 server", op->client_nonce, server_nonce, node, self}),
                mac_s)) {
    core->CountAuthFailure();
    log::Warning(kLog, "{} (node '{}') did not prove the cluster secret", name, node);
    if (ep != nullptr) (void)core->SendAm(ep, kAmProof, ReplyHeader(h.id, op->token), std::string(), true);
    core->FailAmOp(op, Status::PermissionDenied(name + " did not prove the cluster secret: is "
                                                "--cluster-secret-file the same on every node?"));
    return UCS_OK;
  }
  if (ep == nullptr) {
    core->FailAmOp(op, Status::Unavailable(name + ": the connection was closed during the handshake"));
    return UCS_OK;
  }
  op->server_node = node;
  op->stage = 2;
  std::string mac_c = Mac(core->options.secret, {"flexkv-cluster-v1 client", server_nonce, op->client_nonce, self,
                                                 node});
  op->am_waiting = true;
  core->am_ops[op->am_id] = op;
  const ucs_status_t st = core->SendAm(ep, kAmProof, ReplyHeader(h.id, op->token), std::move(mac_c), true);
  if (st != UCS_OK) {
    core->TakeAmOp(h.id, Op::Kind::kHandshake);
    core->FailAmOp(op, Status::Unavailable(name + ": sending the handshake proof: " + UcsError(st)));
  }
  return UCS_OK;
}

ucs_status_t UcxCore::OnAmProof(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                const ucp_am_recv_param_t* param) {
  auto* core = static_cast<UcxCore*>(arg);
  AmHeader h{};
  if (core->shutting_down.load() || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return UCS_OK;
  if (!FixedHeader(header, header_length, &h)) {
    core->CountMalformed("handshake proof (header size)", param);
    return UCS_OK;
  }
  ucp_ep_h ep = param->reply_ep;
  Accepted* a = core->FindAccepted(param);
  if (a == nullptr || !a->proof_pending || a->authenticated || core->options.secret.empty()) {
    core->CountMalformed("handshake proof (no hello before it)", param);
    core->SendStatus(ep, kAmProofReply, h, Status::FailedPrecondition("a proof without a hello before it"));
    return UCS_OK;
  }
  a->proof_pending = false;  // the nonces serve one proof
  if (length == 0) {
    log::Warning(kLog, "node '{}' at {} says this node did not prove the cluster secret: the secrets differ",
                 a->client_node, a->who);
    core->CountAuthFailure();
    return UCS_OK;
  }
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || length != kMacBytes) {
    core->CountMalformed("handshake proof (size)", param);
    core->SendStatus(ep, kAmProofReply, h,
                     Status::InvalidArgument("malformed proof of " + std::to_string(length) + " bytes; expected 32"));
    return UCS_OK;
  }
  const std::string expected = Mac(core->options.secret, {"flexkv-cluster-v1 client", a->server_nonce,
                                                          a->client_nonce, a->client_node, core->options.node_id});
  if (!MacEqual(expected, std::string_view(static_cast<const char*>(data), length))) {
    log::Warning(kLog, "node '{}' at {} did not prove the cluster secret", a->client_node, a->who);
    core->CountAuthFailure();
    core->SendStatus(ep, kAmProofReply, h,
                     Status::PermissionDenied("node '" + core->options.node_id + "' says: you did not prove the "
                                              "cluster secret: is --cluster-secret-file the same on every node?"));
    return UCS_OK;
  }
  if (core->options.is_member && !core->options.is_member(a->client_node)) {
    log::Warning(kLog, "node '{}' at {} proved the cluster secret but is not a member", a->client_node, a->who);
    core->CountAuthFailure();
    core->SendStatus(ep, kAmProofReply, h,
                     Status::PermissionDenied("node '" + a->client_node + "' is not a member of the cluster (says '" +
                                              core->options.node_id + "')"));
    return UCS_OK;
  }
  a->authenticated = true;
  log::Debug(kLog, "authenticated node '{}' at {}", a->client_node, a->who);
  (void)core->SendAm(ep, kAmProofReply, ReplyHeader(h.id, h.token), std::string(), true);
  return UCS_OK;
}

ucs_status_t UcxCore::OnAmProofReply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                     const ucp_am_recv_param_t* param) {
  auto* core = static_cast<UcxCore*>(arg);
  AmHeader h{};
  if (!FixedHeader(header, header_length, &h)) {
    core->DropReply("handshake proof reply", "a header of " + std::to_string(header_length) + " bytes", param);
    return UCS_OK;
  }
  Op* op = core->TakeReplyOp(h.id, h.token, Op::Kind::kHandshake, "handshake proof reply", param, 2);
  if (op == nullptr) return UCS_OK;
  if (h.code != 0) {
    core->CountAuthFailure();
    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    const Status why = StatusFromWire(h.code, rndv ? "" : std::string_view(static_cast<const char*>(data), length));
    core->FailAmOp(op, Status::PermissionDenied(core->PeerName(op->peer_id) + " refused us: " + why.message()));
    return UCS_OK;
  }
  if (auto pit = core->peers.find(op->peer_id); pit != core->peers.end()) pit->second->node_id = op->server_node;
  op->ucs = UCS_OK;
  core->completed.push_back(op);
  return UCS_OK;
}

void UcxCore::StartCall(Op* op) {
  Peer* peer = ReadyPeer(op, 0, nullptr, 0);
  if (peer == nullptr) return;
  op->am_id = next_am_id++;
  op->am_waiting = true;
  am_ops[op->am_id] = op;
  peer->ops.insert(op);
  deadlines.insert({op->deadline, op});
  op->posted = true;
  const ucs_status_t st =
      SendAm(peer->ep, kAmCallRequest, RequestHeader(op->am_id, op->method, op->token), std::move(op->request), true);
  if (st != UCS_OK && op->am_waiting) {
    op->am_waiting = false;
    am_ops.erase(op->am_id);
    FinishNow(op, st);
  }
  // A send that fails later leaves the op waiting: the failed connection's close (or the deadline) ends it.
}

ucs_status_t UcxCore::OnAmCallRequest(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                      const ucp_am_recv_param_t* param) {
  auto* core = static_cast<UcxCore*>(arg);
  AmHeader h{};
  if (core->shutting_down.load() || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return UCS_OK;
  if (!FixedHeader(header, header_length, &h)) {
    core->CountMalformed("call (header size)", param);
    return UCS_OK;
  }
  ucp_ep_h ep = param->reply_ep;
  if (!core->Authenticated(param)) {
    core->CountRefused("a call", param);
    core->SendStatus(ep, kAmCallReply, h,
                     Status::PermissionDenied("this connection has not proven the cluster secret"));
    return UCS_OK;
  }
  if (length > kMaxCallBytes) {
    core->SendStatus(ep, kAmCallReply, h,
                     Status::InvalidArgument("call request of " + std::to_string(length) + " bytes; at most " +
                                             std::to_string(kMaxCallBytes)));
    return UCS_OK;
  }
  const Accepted* a = core->FindAccepted(param);
  auto* call = new ServerCall;
  call->core = core;
  call->serial = a != nullptr ? a->serial : 0;
  call->ep = ep;
  call->id = h.id;
  std::memcpy(call->token, h.token, kTokenBytes);
  call->method = static_cast<uint16_t>(h.aux);
  call->node = a != nullptr ? a->client_node : std::string();
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    call->request.resize(length);
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.recv_am = &UcxCore::OnCallRequestData;
    rp.user_data = call;
    void* r = ucp_am_recv_data_nbx(core->worker, data, call->request.data(), length, &rp);
    if (UCS_PTR_IS_PTR(r)) return UCS_INPROGRESS;  // OnCallRequestData dispatches it
    OnCallRequestData(nullptr, UCS_PTR_STATUS(r), length, call);
    return UCS_OK;
  }
  call->request.assign(static_cast<const char*>(data), length);
  core->DispatchCall(call);
  return UCS_OK;
}

void UcxCore::OnCallRequestData(void* request, ucs_status_t status, size_t, void* user_data) {
  if (request != nullptr) ucp_request_free(request);
  auto* call = static_cast<ServerCall*>(user_data);
  if (status != UCS_OK) {
    log::Debug(kLog, "receiving a call request failed: {}", UcsError(status));
    delete call;
    return;
  }
  call->core->DispatchCall(call);
}

void UcxCore::DispatchCall(ServerCall* call) {
  std::unique_ptr<ServerCall> owned(call);
  UcxTransport::CallHandler handler;
  {
    std::lock_guard<std::mutex> lock(info_mu);
    handler = call_handler;
  }
  if (!handler) {
    SendStatus(call->ep, kAmCallReply, call->id, call->token, Status::Unimplemented("no call handler on this node"));
    return;
  }
  auto once = std::make_shared<std::atomic<bool>>(false);
  std::array<uint8_t, kTokenBytes> token;
  std::memcpy(token.data(), call->token, kTokenBytes);
  auto reply = [gate = gate, once, serial = call->serial, ep = call->ep, id = call->id,
                token](Result<std::string> r) {
    if (once->exchange(true)) return;
    std::lock_guard<std::mutex> lock(gate->mu);
    UcxCore* core = gate->core;
    if (core == nullptr) return;
    (void)core->Post([core, serial, ep, id, token, r = std::move(r)]() mutable {
      core->SendCallReply(serial, ep, id, token.data(), std::move(r));
    });
  };
  handler(call->node, call->method, std::move(call->request), std::move(reply));
}

void UcxCore::SendCallReply(uint64_t serial, ucp_ep_h ep, uint64_t id, const uint8_t* token, Result<std::string> r) {
  if (shutting_down.load()) return;
  if (serial != 0) {
    auto it = accepted.find(ep);
    if (it == accepted.end() || it->second.serial != serial) {
      log::Debug(kLog, "a call reply for a closed connection was dropped");
      return;
    }
  } else {
    // Without a secret a call may arrive on a connection we made: it must still be one of our peers' endpoints.
    bool found = false;
    for (auto& [pid, peer] : peers) found |= peer->ep == ep;
    if (!found) return;
  }
  if (!r.ok()) {
    SendStatus(ep, kAmCallReply, id, token, r.status());
  } else if (r->size() > kMaxCallBytes) {
    SendStatus(ep, kAmCallReply, id, token,
               Status::ResourceExhausted("the call's reply of " + std::to_string(r->size()) +
                                         " bytes exceeds the limit of " + std::to_string(kMaxCallBytes)));
  } else {
    (void)SendAm(ep, kAmCallReply, ReplyHeader(id, token), std::move(r).value(), true);
  }
}

ucs_status_t UcxCore::OnAmCallReply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                    const ucp_am_recv_param_t* param) {
  auto* core = static_cast<UcxCore*>(arg);
  AmHeader h{};
  if (!FixedHeader(header, header_length, &h)) {
    core->DropReply("call reply", "a header of " + std::to_string(header_length) + " bytes", param);
    return UCS_OK;
  }
  Op* op = core->TakeReplyOp(h.id, h.token, Op::Kind::kCall, "call reply", param);
  if (op == nullptr) return UCS_OK;
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  if (h.code != 0) {
    core->FailAmOp(op, StatusFromWire(h.code, rndv ? "(message not received)"
                                                   : std::string_view(static_cast<const char*>(data), length)));
  } else if (length > kMaxCallBytes) {
    core->FailAmOp(op, Status::Unavailable("the peer sent a reply of " + std::to_string(length) +
                                           " bytes; at most " + std::to_string(kMaxCallBytes)));
  } else if (rndv) {
    op->reply.resize(length);
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.recv_am = &UcxCore::OnAmData;
    rp.user_data = op;
    void* r = ucp_am_recv_data_nbx(core->worker, data, op->reply.data(), length, &rp);
    if (UCS_PTR_IS_PTR(r)) return UCS_INPROGRESS;  // OnAmData finishes it
    op->ucs = UCS_PTR_STATUS(r);
    core->completed.push_back(op);
  } else {
    op->reply.assign(static_cast<const char*>(data), length);
    op->ucs = UCS_OK;
    core->completed.push_back(op);
  }
  return UCS_OK;
}

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
    core->gate->core = core.get();  // no other thread sees the gate yet
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
      std::lock_guard<std::mutex> lock(lane->queue_mu);
      lane->stop = true;
    }
    uint64_t one = 1;
    ssize_t n = write(lane->wake_fd, &one, sizeof one);
    (void)n;
  }
  for (auto& lane : state_->lanes) {
    lane->thread.join();
    std::lock_guard<std::mutex> lock(lane->gate->mu);
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
  std::lock_guard<std::mutex> lock(first->info_mu);
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
    std::lock_guard<std::mutex> lock(lane->info_mu);
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
    std::lock_guard<std::mutex> lock(lane->info_mu);
    used.insert(lane->ucx_lanes.begin(), lane->ucx_lanes.end());
  }
  out.insert(out.end(), used.begin(), used.end());
  return out;
}

UcxTransport::Stats UcxTransport::stats() const {
  Stats total;
  for (const auto& lane : state_->lanes) {
    std::lock_guard<std::mutex> lock(lane->info_mu);
    const Stats& s = lane->stats;
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
