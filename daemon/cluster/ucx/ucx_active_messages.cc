// UcxTransport's active messages (their wire format is in ucx_transport_impl.h): what every protocol shares (a
// message that owns its bytes until sent, reply headers, binding a reply to its request by id, token and endpoint,
// refusals), and the get protocol, whose serving side reads only ranges inside the regions registered here
// (UcxTransport::Register, RegisteredRegion; the descriptor a peer parses with RemoteRegion::Parse).
#include "daemon/cluster/ucx/ucx_transport_impl.h"

#include <openssl/crypto.h>
#include <openssl/rand.h>
#include <sys/random.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace flexkv::cluster {
namespace {

// Descriptor: "FKVU", version u16, reserved u16, base u64, length u64, rkey_len u32 (0), little endian. Version 2
// carries no rkey: no transport serves one-sided reads any more (see kAmGetRequest), so there is nothing to unlock.
constexpr char kMagic[4] = {'F', 'K', 'V', 'U'};
constexpr uint16_t kVersion = 2;
constexpr size_t kHeaderBytes = 4 + 2 + 2 + 8 + 8 + 4;

// A fresh request token (OpenSSL's DRBG; getrandom where it fails).
void NewToken(uint8_t (&token)[kTokenBytes]) {
  if (RAND_bytes(token, static_cast<int>(kTokenBytes)) == 1) return;
  size_t got = 0;
  while (got < kTokenBytes) {
    const ssize_t r = getrandom(token + got, kTokenBytes - got, 0);
    if (r > 0) {
      got += static_cast<size_t>(r);
    } else if (r < 0 && errno != EINTR) {
      log::Error(kLog, "no random bytes for a request token (OpenSSL and getrandom: {})", std::strerror(errno));
      std::abort();  // a node without randomness cannot tell its replies from forged ones
    }
  }
}

}  // namespace

ucs_status_t UcxCore::SendAm(ucp_ep_h ep, unsigned am_id, AmHeader header, std::string data, bool want_reply) {
  auto* out = new Outgoing{header, std::move(data)};
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = want_reply ? UCP_AM_SEND_FLAG_REPLY : 0;
  p.cb.send = &UcxCore::OnOutgoingSent;
  p.user_data = out;
  void* r = ucp_am_send_nbx(ep, am_id, &out->header, sizeof out->header, out->data.data(), out->data.size(), &p);
  if (UCS_PTR_IS_PTR(r)) return UCS_OK;
  const ucs_status_t st = UCS_PTR_STATUS(r);
  OnOutgoingSent(nullptr, st, out);
  return st;
}

void UcxCore::OnOutgoingSent(void* request, ucs_status_t status, void* user_data) {
  if (request != nullptr) ucp_request_free(request);
  if (status != UCS_OK) log::Debug(kLog, "a message was not delivered: {}", UcsError(status));
  delete static_cast<Outgoing*>(user_data);
}

AmHeader UcxCore::ReplyHeader(uint64_t id, const uint8_t* token, uint32_t code) {
  AmHeader h{id, code, 0, {}};
  std::memcpy(h.token, token, kTokenBytes);
  return h;
}

AmHeader UcxCore::RequestHeader(uint64_t id, uint32_t aux, uint8_t (&token)[kTokenBytes]) {
  NewToken(token);
  AmHeader h{id, 0, aux, {}};
  std::memcpy(h.token, token, kTokenBytes);
  return h;
}

void UcxCore::SendStatus(ucp_ep_h ep, unsigned am_id, uint64_t id, const uint8_t* token, const Status& status) {
  std::string message = status.message().substr(0, kMaxErrorBytes);
  (void)SendAm(ep, am_id, ReplyHeader(id, token, static_cast<uint32_t>(status.code())), std::move(message), true);
}

void UcxCore::SendStatus(ucp_ep_h ep, unsigned am_id, const AmHeader& request, const Status& status) {
  SendStatus(ep, am_id, request.id, request.token, status);
}

UcxCore::Accepted* UcxCore::FindAccepted(const ucp_am_recv_param_t* param) {
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return nullptr;
  auto it = accepted.find(param->reply_ep);
  return it == accepted.end() ? nullptr : &it->second;
}

bool UcxCore::Authenticated(const ucp_am_recv_param_t* param) {
  if (options.secret.empty()) return true;
  const Accepted* a = FindAccepted(param);
  return a != nullptr && a->authenticated;
}

std::string UcxCore::Who(const ucp_am_recv_param_t* param) {
  const Accepted* a = FindAccepted(param);
  return a != nullptr ? a->who : std::string("a connection we made");
}

void UcxCore::CountRefused(std::string_view what, const ucp_am_recv_param_t* param) {
  log::Warning(kLog, "refused {} from {}: the connection has not proven the cluster secret", what, Who(param));
  MutexLock lock(&info_mu);
  ++stats.requests_refused;
}

void UcxCore::CountMalformed(std::string_view what, const ucp_am_recv_param_t* param) {
  log::Warning(kLog, "refused a malformed {} from {}", what, Who(param));
  MutexLock lock(&info_mu);
  ++stats.requests_refused;
}

UcxCore::Op* UcxCore::TakeReplyOp(uint64_t id, const uint8_t* token, Op::Kind kind, std::string_view what,
                                  const ucp_am_recv_param_t* param, int stage) {
  auto it = am_ops.find(id);
  if (it == am_ops.end()) {
    DropReply(what, "no request of this id is waiting", param);
    return nullptr;
  }
  Op* op = it->second;
  if (op->kind != kind || (stage != 0 && op->stage != stage)) {
    DropReply(what, "the request of this id is of another kind", param);
    return nullptr;
  }
  if (CRYPTO_memcmp(op->token, token, kTokenBytes) != 0) {
    DropReply(what, "it does not carry its request's token", param);
    return nullptr;
  }
  auto pit = peers.find(op->peer_id);
  Peer* peer = pit == peers.end() ? nullptr : pit->second.get();
  if (peer == nullptr || peer->ep == nullptr || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ||
      param->reply_ep != peer->ep) {
    DropReply(what, "it did not come on the endpoint its request went out on", param);
    return nullptr;
  }
  if (kind != Op::Kind::kHandshake && !options.secret.empty() && (peer->connecting || peer->node_id.empty())) {
    DropReply(what, "its endpoint has not completed the handshake", param);
    return nullptr;
  }
  am_ops.erase(it);
  op->am_waiting = false;
  return op;
}

void UcxCore::DropReply(std::string_view what, std::string_view why, const ucp_am_recv_param_t* param) {
  {
    MutexLock lock(&info_mu);
    ++stats.replies_dropped;
  }
  std::string from = "an endpoint that did not say";
  if (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) {
    if (const Accepted* a = FindAccepted(param); a != nullptr) {
      from = "a connection from " + a->who;
    } else {
      from = "an unknown endpoint";
      for (const auto& [pid, peer] : peers) {
        if (peer->ep == param->reply_ep) from = "peer " + peer->endpoint;
      }
    }
  }
  dropped_log.Warning(kLog, "dropped a {} from {} on lane {}: {} (forged, or for a request that ended)", what,
                      from, lane, why);
}

void UcxCore::OnGetRequestSent(void* request, ucs_status_t, void* user_data) {
  if (request != nullptr) ucp_request_free(request);
  delete static_cast<AmRequestHeader*>(user_data);
}

void UcxCore::OnReplySent(void* request, ucs_status_t status, void* user_data) {
  if (request != nullptr) ucp_request_free(request);
  auto* reply = static_cast<Reply*>(user_data);
  if (status != UCS_OK) log::Debug(kLog, "a get reply was not delivered: {}", UcsError(status));
  if (auto it = reply->core->regions.find(reply->region_id); it != reply->core->regions.end()) {
    --it->second.replies;
  }
  delete reply;
}

void UcxCore::OnAmData(void* request, ucs_status_t status, size_t, void* user_data) {
  OnOpDone(request, status, user_data);
}

ucs_status_t UcxCore::OnAmGetRequest(void* arg, const void* header, size_t header_length, void*, size_t,
                                     const ucp_am_recv_param_t* param) {
  auto* core = static_cast<UcxCore*>(arg);
  if (header_length != sizeof(AmRequestHeader) || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ||
      core->shutting_down.load()) {
    return UCS_OK;
  }
  AmRequestHeader req;
  std::memcpy(&req, header, sizeof req);
  auto* reply = new Reply;
  reply->core = core;
  reply->header.id = req.id;
  reply->header.status = kGetRangeRefused;
  std::memcpy(reply->header.token, req.token, kTokenBytes);
  if (!core->Authenticated(param)) {
    core->CountRefused("a get", param);
    reply->header.status = kGetNotAuthenticated;
    ucp_request_param_t rp{};
    // With the reply flag the requester learns which of its endpoints the reply came on (UCP_AM_RECV_ATTR_FIELD_REPLY_EP).
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_AM_SEND_FLAG_REPLY;
    rp.cb.send = &UcxCore::OnReplySent;
    rp.user_data = reply;
    void* r = ucp_am_send_nbx(param->reply_ep, kAmGetReply, &reply->header, sizeof reply->header, nullptr, 0, &rp);
    if (!UCS_PTR_IS_PTR(r)) OnReplySent(nullptr, UCS_PTR_STATUS(r), reply);
    return UCS_OK;
  }
  const void* data = nullptr;
  size_t data_len = 0;
  ucp_mem_h memh = nullptr;
  for (auto& [id, region] : core->regions) {
    if (req.length != 0 && req.address >= region.base && req.length <= region.bytes &&
        req.address - region.base <= region.bytes - req.length) {
      reply->header.status = 0;
      reply->region_id = id;
      ++region.replies;
      data = reinterpret_cast<const void*>(req.address);
      data_len = req.length;
      memh = region.memh;
      break;
    }
  }
  if (reply->header.status != 0) {
    core->refused_log.Warning(kLog, "refused a get of {} bytes at {:#x} from {}: not in a registered region",
                              req.length, req.address, core->Who(param));
    MutexLock lock(&core->info_mu);
    ++core->stats.requests_refused;
  }
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  rp.flags = UCP_AM_SEND_FLAG_REPLY;
  rp.cb.send = &UcxCore::OnReplySent;
  rp.user_data = reply;
  if (memh != nullptr) {
    rp.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    rp.memh = memh;
  }
  void* r = ucp_am_send_nbx(param->reply_ep, kAmGetReply, &reply->header, sizeof reply->header, data, data_len, &rp);
  if (!UCS_PTR_IS_PTR(r)) OnReplySent(nullptr, UCS_PTR_STATUS(r), reply);
  return UCS_OK;
}

ucs_status_t UcxCore::OnAmGetReply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                   const ucp_am_recv_param_t* param) {
  auto* core = static_cast<UcxCore*>(arg);
  if (header_length != sizeof(AmReplyHeader)) {
    core->DropReply("get reply", "a header of " + std::to_string(header_length) + " bytes", param);
    return UCS_OK;
  }
  AmReplyHeader rep;
  std::memcpy(&rep, header, sizeof rep);
  Op* op = core->TakeReplyOp(rep.id, rep.token, Op::Kind::kGet, "get reply", param);
  if (op == nullptr) return UCS_OK;
  if (rep.status == kGetNotAuthenticated) {
    op->ucs = UCS_ERR_REJECTED;
    op->result = Status::PermissionDenied("the peer refused the get: this connection has not proven the cluster "
                                          "secret (is a secret configured on this node?)");
  } else if (rep.status != 0) {
    op->ucs = UCS_ERR_INVALID_PARAM;
    op->result = Status::NotFound("the peer refused the range: no region it registered covers it (a stale or "
                                  "wrong descriptor)");
  } else if (length != op->len) {
    op->ucs = UCS_ERR_MESSAGE_TRUNCATED;
    op->result = Status::Unavailable("the peer sent " + std::to_string(length) + " bytes for a get of " +
                                     std::to_string(op->len));
  } else if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.recv_am = &UcxCore::OnAmData;
    rp.user_data = op;
    void* r = ucp_am_recv_data_nbx(core->worker, data, op->dst, length, &rp);
    if (UCS_PTR_IS_PTR(r)) return UCS_INPROGRESS;  // OnAmData finishes it
    op->ucs = UCS_PTR_STATUS(r);
  } else {
    std::memcpy(op->dst, data, length);
    op->ucs = UCS_OK;
  }
  core->completed.push_back(op);
  return UCS_OK;
}

void UcxCore::StartGet(Op* op, uint64_t remote_address, void* dst, uint64_t len) {
  Peer* peer = ReadyPeer(op, remote_address, dst, len);
  if (peer == nullptr) return;
  StartAmGet(peer, op, remote_address, dst, len);
}

void UcxCore::StartAmGet(Peer* peer, Op* op, uint64_t remote_address, void* dst, uint64_t len) {
  op->am_id = next_am_id++;
  op->dst = dst;
  op->len = len;
  op->am_waiting = true;
  am_ops[op->am_id] = op;
  peer->ops.insert(op);
  deadlines.insert({op->deadline, op});
  // UCX 1.13 reads the header until the send completes (there is no UCP_AM_SEND_FLAG_COPY_HEADER yet): a queued
  // send must not point at this stack frame (it did, and peers got garbage requests under load). The header lives
  // on the heap until the send callback, independent of the op, which a deadline may end first.
  NewToken(op->token);
  auto* header = new AmRequestHeader{op->am_id, remote_address, len, {}};
  std::memcpy(header->token, op->token, kTokenBytes);
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_USER_DATA;
  param.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
  param.cb.send = &UcxCore::OnGetRequestSent;
  param.user_data = header;
  void* req = ucp_am_send_nbx(peer->ep, kAmGetRequest, header, sizeof *header, nullptr, 0, &param);
  if (!UCS_PTR_IS_PTR(req)) delete header;  // done (or refused) at once: UCX no longer needs it
  op->posted = true;
  if (UCS_PTR_IS_ERR(req) && op->am_waiting) {
    op->am_waiting = false;
    am_ops.erase(op->am_id);
    FinishNow(op, UCS_PTR_STATUS(req));
  }
  // A send that fails later leaves the op waiting: the failed connection's close (or the deadline) ends it.
}

// ---------------------------------------------------------------------------------------------------------------
// Registered regions: what gets may read.

RegisteredRegion::RegisteredRegion(RegisteredRegion&& other) noexcept { *this = std::move(other); }

RegisteredRegion& RegisteredRegion::operator=(RegisteredRegion&& other) noexcept {
  if (this != &other) {
    Reset();
    state_ = std::move(other.state_);
    id_ = std::exchange(other.id_, 0);
    base_ = std::exchange(other.base_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    descriptor_ = std::move(other.descriptor_);
    other.descriptor_.clear();
  }
  return *this;
}

RegisteredRegion::~RegisteredRegion() { Reset(); }

void RegisteredRegion::Reset() {
  if (id_ == 0) return;
  const uint64_t id = std::exchange(id_, 0);
  if (auto state = state_.lock(); state && !state->shutting_down.load()) {
    // Every lane forgets it, once the replies it is sending from it are done (bounded); 1 = none left.
    bool clean = true, stopped = false;
    for (const auto& lane : state->lanes) {
      UcxCore* core = lane.get();
      const int r = core->RunSync<int>([core, id] {
        const auto until = Clock::now() + std::chrono::seconds(5);
        auto it = core->regions.find(id);
        while (it != core->regions.end() && it->second.replies != 0 && Clock::now() < until) {
          core->Turn();
          it = core->regions.find(id);
        }
        int left_clean = 1;
        if (it != core->regions.end()) {
          left_clean = it->second.replies == 0 ? 1 : 0;
          core->regions.erase(it);
        }
        return left_clean;
      }, -1);
      clean &= r == 1;
      stopped |= r == -1;
    }
    // A lane that stopped already: the transport's destructor unmaps it (or keeps it, if a reply may read it).
    if (!stopped) {
      UcxState* raw = state.get();
      (void)state->lanes[0]->RunSync<int>([raw, id, clean] {
        MutexLock lock(&raw->regions_mu);
        auto it = raw->regions.find(id);
        if (it == raw->regions.end()) return 0;
        if (clean) ucp_mem_unmap(raw->context, it->second);  // else leaked: a send may still read it
        raw->regions.erase(it);
        return 0;
      }, 0);
    }
  }
  state_.reset();
  base_ = nullptr;
  bytes_ = 0;
  descriptor_.clear();
}

Result<RemoteRegion> RemoteRegion::Parse(std::string_view d) {
  if (d.size() < kHeaderBytes) {
    return Status::InvalidArgument("region descriptor of " + std::to_string(d.size()) + " bytes; expected >= " +
                                   std::to_string(kHeaderBytes));
  }
  if (std::memcmp(d.data(), kMagic, 4) != 0) return Status::InvalidArgument("region descriptor: bad magic");
  const auto version = GetLe(d.data() + 4, 2);
  if (version != kVersion) {
    return Status::InvalidArgument("region descriptor version " + std::to_string(version) + "; expected " +
                                   std::to_string(kVersion));
  }
  RemoteRegion r;
  r.base_ = GetLe(d.data() + 8, 8);
  r.length_ = GetLe(d.data() + 16, 8);
  const auto rkey_len = GetLe(d.data() + 24, 4);
  if (r.length_ == 0) return Status::InvalidArgument("region descriptor: length 0");
  if (r.base_ == 0) return Status::InvalidArgument("region descriptor: base address 0");
  if (r.base_ + r.length_ < r.base_) return Status::InvalidArgument("region descriptor: base + length overflows");
  if (rkey_len != 0) {
    return Status::InvalidArgument("region descriptor: rkey of " + std::to_string(rkey_len) + " bytes; expected 0 "
                                   "(peers serve reads over active messages only)");
  }
  if (d.size() != kHeaderBytes) {
    return Status::InvalidArgument("region descriptor of " + std::to_string(d.size()) + " bytes; expected " +
                                   std::to_string(kHeaderBytes));
  }
  return r;
}

Result<RegisteredRegion> UcxTransport::Register(void* base, uint64_t bytes) {
  if (base == nullptr || bytes == 0) return Status::InvalidArgument("ucx: registering an empty range");
  if (state_->shutting_down.load()) return Status::FailedPrecondition("ucx: shutting down");
  UcxState* state = state_.get();
  UcxCore* first = state->lanes[0].get();
  const uint64_t id = state->next_region_id.fetch_add(1);
  auto made = first->RunSync<Result<RegisteredRegion>>([&]() -> Result<RegisteredRegion> {
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = base;
    mp.length = bytes;
    ucp_mem_h memh = nullptr;
    ucs_status_t s = ucp_mem_map(state->context, &mp, &memh);
    if (s != UCS_OK) return Status::ResourceExhausted("ucp_mem_map of " + std::to_string(bytes) + " bytes: " + UcsError(s));
    RegisteredRegion region;
    region.descriptor_.assign(kMagic, 4);
    PutLe(&region.descriptor_, kVersion, 2);
    PutLe(&region.descriptor_, 0, 2);
    PutLe(&region.descriptor_, reinterpret_cast<uintptr_t>(base), 8);
    PutLe(&region.descriptor_, bytes, 8);
    PutLe(&region.descriptor_, 0, 4);  // no rkey
    {
      MutexLock lock(&state->regions_mu);
      state->regions[id] = memh;
    }
    region.base_ = base;
    region.bytes_ = bytes;
    return region;
  }, Status::FailedPrecondition("ucx: shutting down"));
  if (!made.ok()) return made.status();
  made->state_ = state_;
  made->id_ = id;  // from here on, Reset (on an error below too) unregisters it from every lane
  // Every lane serves gets from it.
  for (auto& lane : state->lanes) {
    UcxCore* core = lane.get();
    ucp_mem_h memh;
    {
      MutexLock lock(&state->regions_mu);
      memh = state->regions.at(id);
    }
    const int ok = core->RunSync<int>([core, id, memh, base, bytes] {
      core->regions[id] = UcxCore::Region{memh, reinterpret_cast<uintptr_t>(base), bytes};
      return 1;
    }, 0);
    if (ok != 1) return Status::FailedPrecondition("ucx: shutting down");
  }
  return made;
}

}  // namespace flexkv::cluster
