// UcxTransport's handshake and Calls (their wire format is in ucx_transport_impl.h). The handshake, after the
// wire-up of a connection we made, with a secret: StartHandshake sends HELLO; the server (OnAmHello) answers with
// its node id, a nonce and MAC_s; we check MAC_s and send MAC_c (OnAmHelloReply); the server checks it and the
// membership and marks the connection authenticated (OnAmProof); its answer ends our (re)connection (OnAmProofReply,
// then ConnectDone). Calls: small request/reply RPCs, handed to the CallHandler only from authenticated connections.
#include "daemon/cluster/ucx/ucx_transport_impl.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>

#include <array>
#include <cerrno>
#include <cstring>

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

}  // namespace

void UcxCore::CountAuthFailure() {
  MutexLock lock(&info_mu);
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
    MutexLock lock(&info_mu);
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
    MutexLock lock(&gate->mu);
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

}  // namespace flexkv::cluster
