// libflexkv Client: gRPC control calls plus the session channel; see flexkv/client.h.
#include "flexkv/client.h"

#include <fmt/format.h>
#include <grpcpp/grpcpp.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <mutex>
#include <thread>

#include "client/session_rings.h"
#include "common/grpc_convert.h"
#include "common/paths.h"
#include "common/session_channel.h"
#include "common/uds.h"
#include "common/version.h"
#include "flexkv/v1/control.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace flexkv {

namespace {

Status NotAttached() { return Status::FailedPrecondition("not attached: call Attach first"); }

}  // namespace

struct Client::Impl {
  std::string socket_path;
  ConnectOptions options;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Control::Stub> stub;
  std::unique_ptr<grpc::health::v1::Health::Stub> health;

  std::mutex mu;
  uint64_t session_id = 0;         // guarded by mu; 0 = not attached
  std::string session_token;       // guarded by mu
  UniqueFd session_channel;        // guarded by mu
  // Set at Attach; guarded by mu (the pointer), thread-safe itself. Each data-plane call holds its own
  // reference, so a re-Attach that drops a lost session's rings never frees them under a running call.
  std::shared_ptr<SessionRings> rings;
  uint8_t* kv_data = nullptr;      // guarded by mu
  uint64_t kv_bytes = 0;
  // Host KV mappings of sessions the daemon lost: the engine may still hold pointers into them, so they stay
  // mapped until Detach or destruction (HostKvBuffers' contract), never reused.
  std::vector<std::pair<uint8_t*, uint64_t>> retired_kv;  // guarded by mu
  uint32_t next_fd_tag = 1;

  std::shared_ptr<SessionRings> Rings() {
    std::lock_guard lock(mu);
    return rings;
  }
  void UnmapKv() {
    if (kv_data != nullptr) munmap(kv_data, kv_bytes);
    kv_data = nullptr;
    kv_bytes = 0;
    for (const auto& [p, n] : retired_kv) munmap(p, n);
    retired_kv.clear();
  }
  // The session is gone on the daemon's side: keep its host KV mapped (see retired_kv) but forget it.
  void RetireKv() {
    if (kv_data != nullptr) retired_kv.emplace_back(kv_data, kv_bytes);
    kv_data = nullptr;
    kv_bytes = 0;
  }

  // Offers one fd on the session channel and waits for the daemon's acknowledgement; returns the tag a
  // later RegisterKv names it by. Caller holds mu.
  Result<uint32_t> OfferFd(int fd, const char* what) {
    if (!session_channel) return NotAttached();
    const uint32_t tag = next_fd_tag++;
    ChannelMessage offer{};
    std::memcpy(offer.magic, kChannelMessageMagic, 4);
    offer.type = static_cast<uint32_t>(ChannelMessageType::kOfferFd);
    offer.tag = tag;
    Status st = SendWithFds(session_channel.get(), &offer, sizeof(offer), std::span<const int>(&fd, 1));
    ChannelMessage ack{};
    // Acks come in offer order; one that arrives after its offer timed out is read (and dropped) here.
    do {
      if (st.ok()) st = RecvWithFds(session_channel.get(), &ack, sizeof(ack), nullptr);
      if (st.code() == StatusCode::kDeadlineExceeded) {
        st = Status::DeadlineExceeded(fmt::format("the daemon did not acknowledge the {} within {} ms", what,
                                                  options.call_timeout.count()));
      }
    } while (st.ok() && std::memcmp(ack.magic, kChannelMessageMagic, 4) == 0 &&
             ack.type == static_cast<uint32_t>(ChannelMessageType::kOfferFdAck) && ack.tag < tag);
    if (st.ok() && (std::memcmp(ack.magic, kChannelMessageMagic, 4) != 0 ||
                    ack.type != static_cast<uint32_t>(ChannelMessageType::kOfferFdAck) || ack.tag != tag)) {
      st = Status::Internal(fmt::format("unexpected reply on the session channel (type {}, tag {}; expected the ack of {})",
                                        ack.type, ack.tag, tag));
    }
    if (st.ok() && ack.status_code != 0) {
      st = Status(static_cast<StatusCode>(ack.status_code),
                  fmt::format("the daemon refused the {} (too many fds offered and not registered?)", what));
    }
    if (!st.ok()) return st.WithContext(fmt::format("offering the {}", what));
    return tag;
  }

  void Prepare(grpc::ClientContext* ctx) const {
    ctx->set_deadline(std::chrono::system_clock::now() + options.call_timeout);
  }
  // Adds the socket path to transport-level failures, so the reader knows where it looked.
  Status Call(const grpc::Status& s) const {
    Status st = FromGrpc(s);
    if (st.code() == StatusCode::kUnavailable || st.code() == StatusCode::kDeadlineExceeded) {
      return st.WithContext("flexkvd at " + socket_path);
    }
    return st;
  }
};

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Client::~Client() {
  Status ignored = Detach();
  (void)ignored;
}

const std::string& Client::socket_path() const { return impl_->socket_path; }

Result<std::unique_ptr<Client>> Client::Connect(const ConnectOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->socket_path = ResolveSocketPath(options.socket_path);
  const auto deadline = std::chrono::steady_clock::now() + options.connect_timeout;
  // Probe with a plain connect first: it tells "not up yet" (retry) from everything else (fail now).
  for (;;) {
    auto probe = ConnectUnix(impl->socket_path);
    if (probe.ok()) break;
    const StatusCode code = probe.status().code();
    const bool not_up_yet = code == StatusCode::kNotFound || code == StatusCode::kUnavailable;
    if (!not_up_yet) return probe.status();
    if (std::chrono::steady_clock::now() >= deadline) {
      return Status::Unavailable(fmt::format("{} (waited {} ms)", probe.status().message(),
                                             options.connect_timeout.count()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(16 << 20);
  impl->channel = grpc::CreateCustomChannel("unix:" + impl->socket_path, grpc::InsecureChannelCredentials(), args);
  if (!impl->channel->WaitForConnected(deadline > std::chrono::steady_clock::now()
                                           ? std::chrono::system_clock::now() + (deadline - std::chrono::steady_clock::now())
                                           : std::chrono::system_clock::now() + std::chrono::milliseconds(500))) {
    return Status::Unavailable(fmt::format("flexkvd at {} accepted the connection but did not speak gRPC", impl->socket_path));
  }
  impl->stub = v1::Control::NewStub(impl->channel);
  impl->health = grpc::health::v1::Health::NewStub(impl->channel);
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

Result<SessionInfo> Client::Attach(const AttachOptions& options) {
  std::lock_guard lock(impl_->mu);
  if (impl_->session_id != 0) {
    // A session the daemon has closed (it stopped or restarted) is dropped locally, so Attach works again.
    pollfd pfd{impl_->session_channel.get(), POLLRDHUP, 0};
    const bool lost = poll(&pfd, 1, 0) > 0 && (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
    if (!lost) {
      return Status::FailedPrecondition(fmt::format("this client is already attached as session {}", impl_->session_id));
    }
    if (impl_->rings) impl_->rings->Abandon();
    impl_->rings.reset();
    impl_->session_channel.reset();
    impl_->RetireKv();
    impl_->session_id = 0;
    impl_->session_token.clear();
  }
  v1::AttachRequest req;
  req.set_client_name(options.client_name);
  req.set_pid(static_cast<uint32_t>(getpid()));
  req.set_dp_rank(options.dp_rank);
  req.set_tp_rank(options.tp_rank);
  req.set_model_namespace(options.model_namespace);
  ToProto(options.geometry, req.mutable_geometry());
  req.set_protocol_version(kProtocolVersion);
  v1::AttachResponse resp;
  grpc::Status attached;
  {
    grpc::ClientContext ctx;
    impl_->Prepare(&ctx);
    attached = impl_->stub->Attach(&ctx, req, &resp);
  }
  if (attached.error_code() == grpc::StatusCode::UNAVAILABLE) {
    // After a daemon restart the channel's first call can still go to the dead connection ("Broken pipe"):
    // wait for the channel to reconnect (up to connect_timeout) and try once more. Should the first call have
    // reached the daemon after all, its session never gets a session channel and the daemon reaps it.
    if (impl_->channel->WaitForConnected(std::chrono::system_clock::now() + impl_->options.connect_timeout)) {
      grpc::ClientContext ctx;
      impl_->Prepare(&ctx);
      resp.Clear();
      attached = impl_->stub->Attach(&ctx, req, &resp);
    }
  }
  FLEXKV_RETURN_IF_ERROR(impl_->Call(attached));
  if (resp.session_token().size() != kSessionTokenBytes) {
    return Status::Internal(fmt::format("daemon sent a {}-byte session token; expected {}", resp.session_token().size(),
                                        kSessionTokenBytes));
  }

  // Open the session channel: it ties the session to this process and carries fds later.
  auto abandon = [&](const Status& why) {
    v1::DetachRequest dreq;
    dreq.set_session_id(resp.session_id());
    dreq.set_session_token(resp.session_token());
    v1::DetachResponse dresp;
    grpc::ClientContext dctx;
    impl_->Prepare(&dctx);
    grpc::Status ignored = impl_->stub->Detach(&dctx, dreq, &dresp);
    (void)ignored;
    return why.WithContext("opening the session channel");
  };
  auto fd = ConnectUnix(impl_->socket_path);
  if (!fd.ok()) return abandon(fd.status());
  SessionHello hello{};
  std::memcpy(hello.magic, kSessionChannelMagic, 4);
  hello.protocol_version = kProtocolVersion;
  hello.session_id = resp.session_id();
  std::memcpy(hello.token, resp.session_token().data(), kSessionTokenBytes);
  Status sent = SendWithFds(fd->get(), &hello, sizeof(hello));
  if (!sent.ok()) return abandon(sent);
  SessionHelloReply reply{};
  std::vector<UniqueFd> fds;
  timeval tv{static_cast<time_t>(impl_->options.call_timeout.count() / 1000),
             static_cast<suseconds_t>((impl_->options.call_timeout.count() % 1000) * 1000)};
  setsockopt(fd->get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  Status got = RecvWithFds(fd->get(), &reply, sizeof(reply), &fds);
  if (!got.ok()) return abandon(got);
  if (std::memcmp(reply.magic, kSessionChannelMagic, 4) != 0) {
    return abandon(Status::Internal("the daemon's hello reply has a bad magic"));
  }
  if (reply.status_code != 0) {
    reply.message[sizeof(reply.message) - 1] = '\0';
    return abandon(Status(static_cast<StatusCode>(reply.status_code), reply.message));
  }
  if (fds.size() != 2) {
    return abandon(Status::Internal(fmt::format("the daemon sent {} fds with the hello reply; expected 2", fds.size())));
  }
  auto rings = SessionRings::Map(std::move(fds[0]), std::move(fds[1]), fd->get());
  if (!rings.ok()) return abandon(rings.status());
  impl_->rings = std::move(*rings);
  impl_->session_id = resp.session_id();
  impl_->session_token = resp.session_token();
  impl_->session_channel = std::move(*fd);
  return SessionInfo{resp.session_id(), resp.block_bytes(), resp.capacity_blocks()};
}

Status Client::Detach() {
  std::lock_guard lock(impl_->mu);
  if (impl_->session_id == 0) return Status::Ok();
  v1::DetachRequest req;
  req.set_session_id(impl_->session_id);
  req.set_session_token(impl_->session_token);
  v1::DetachResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  Status st = impl_->Call(impl_->stub->Detach(&ctx, req, &resp));
  // Closing the channel ends the session on the daemon side even when the call failed.
  if (impl_->rings) impl_->rings->Abandon();
  impl_->rings.reset();
  impl_->session_channel.reset();
  impl_->UnmapKv();
  impl_->session_id = 0;
  impl_->session_token.clear();
  if (st.code() == StatusCode::kNotFound) return Status::Ok();  // already gone (e.g. timed out)
  return st;
}

bool Client::attached() const {
  std::lock_guard lock(impl_->mu);
  return impl_->session_id != 0;
}

Result<HostKvBuffers> Client::CreateHostKv(KvLayout layout, uint32_t num_blocks) {
  std::lock_guard lock(impl_->mu);
  if (impl_->session_id == 0) return Status::FailedPrecondition("CreateHostKv before Attach");
  if (impl_->kv_data != nullptr) return Status::AlreadyExists("this session already registered its KV buffers");
  if (num_blocks == 0) return Status::InvalidArgument("num_blocks is 0; expected at least 1");
  // The daemon validates the geometry; the size follows from the one this session attached with.
  v1::GetStatusResponse st;
  {
    grpc::ClientContext ctx;
    impl_->Prepare(&ctx);
    FLEXKV_RETURN_IF_ERROR(impl_->Call(impl_->stub->GetStatus(&ctx, v1::GetStatusRequest(), &st)));
  }
  const Geometry g = FromProto(st.geometry());
  const uint64_t bytes = uint64_t{num_blocks} * g.num_layers * g.kv_planes * g.chunk_bytes_per_rank();
  if (bytes == 0) return Status::FailedPrecondition("the daemon reports no geometry for this session's domain");
  UniqueFd memfd(static_cast<int>(syscall(SYS_memfd_create, "flexkv-kv", MFD_CLOEXEC | MFD_ALLOW_SEALING)));
  if (!memfd) return Status::ResourceExhausted(fmt::format("memfd_create: {}", ErrnoText(errno)));
  if (ftruncate(memfd.get(), static_cast<off_t>(bytes)) != 0 ||
      fcntl(memfd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    return Status::ResourceExhausted(fmt::format("sizing the {}-byte KV memfd: {}", bytes, ErrnoText(errno)));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd.get(), 0);
  if (p == MAP_FAILED) return Status::ResourceExhausted(fmt::format("mmap KV memfd: {}", ErrnoText(errno)));
  auto tag = impl_->OfferFd(memfd.get(), "KV memfd");
  if (!tag.ok()) {
    munmap(p, bytes);
    return tag.status();
  }
  v1::RegisterKvRequest req;
  req.set_session_id(impl_->session_id);
  req.set_session_token(impl_->session_token);
  req.set_layout(static_cast<v1::KvLayout>(static_cast<int>(layout)));
  req.set_num_blocks(num_blocks);
  req.mutable_host()->set_fd_tag(*tag);
  req.mutable_host()->set_bytes(bytes);
  v1::RegisterKvResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  Status registered = impl_->Call(impl_->stub->RegisterKv(&ctx, req, &resp));
  if (!registered.ok()) {
    munmap(p, bytes);
    return registered;
  }
  impl_->kv_data = static_cast<uint8_t*>(p);
  impl_->kv_bytes = bytes;
  return HostKvBuffers{impl_->kv_data, bytes, num_blocks, layout};
}

Result<Ticket> Client::Match(std::span<const BlockKey> keys, bool pin) {
  std::shared_ptr<SessionRings> r = impl_->Rings();
  if (r == nullptr) return NotAttached();
  if (keys.empty()) return Status::InvalidArgument("keys is empty; expected at least one block key");
  return r->Submit(RingOp::kMatch, pin ? kMatchFlagPin : 0, static_cast<uint32_t>(keys.size()), keys, {}, 0);
}

Result<Ticket> Client::Load(uint64_t match_handle, std::span<const uint32_t> dst_block_ids, bool layerwise) {
  std::shared_ptr<SessionRings> r = impl_->Rings();
  if (r == nullptr) return NotAttached();
  if (dst_block_ids.empty()) return Status::InvalidArgument("dst_block_ids is empty; expected at least one block");
  return r->Submit(RingOp::kLoad, layerwise ? kLoadFlagLayerwise : 0, static_cast<uint32_t>(dst_block_ids.size()), {},
                   dst_block_ids, match_handle);
}

Result<uint32_t> Client::WaitLayers(Ticket ticket, uint32_t layers, std::chrono::microseconds timeout) {
  std::shared_ptr<SessionRings> r = impl_->Rings();
  if (r == nullptr) return NotAttached();
  return r->WaitLayers(ticket, layers, timeout);
}

Status Client::RegisterGpuKv(const GpuKvRegistration& reg) {
  v1::RegisterKvRequest req;
  std::vector<uint32_t> tags;  // of reg.vmm_allocations, offered on the session channel
  {
    std::lock_guard lock(impl_->mu);
    if (impl_->session_id == 0) return NotAttached();
    req.set_session_id(impl_->session_id);
    req.set_session_token(impl_->session_token);
    for (size_t ri = 0; ri < reg.regions.size(); ++ri) {  // before any fd is offered
      for (uint32_t index : reg.regions[ri].vmm_allocations) {
        if (index >= reg.vmm_allocations.size()) {
          return Status::InvalidArgument(fmt::format("region {} names vmm allocation {}; there are {}", ri, index,
                                                     reg.vmm_allocations.size()));
        }
      }
    }
    for (size_t i = 0; i < reg.vmm_allocations.size(); ++i) {
      const auto& a = reg.vmm_allocations[i];
      if (!a.fd || *a.fd < 0) return Status::InvalidArgument(fmt::format("vmm_allocations[{}] has no fd", i));
      auto tag = impl_->OfferFd(*a.fd, "fd of a cuMem/VMM allocation");
      if (!tag.ok()) return tag.status();
      tags.push_back(*tag);
    }
  }
  req.set_layout(static_cast<v1::KvLayout>(static_cast<int>(reg.layout)));
  req.set_num_blocks(reg.num_blocks);
  auto* cuda = req.mutable_cuda();
  cuda->set_gpu_uuid(reg.gpu_uuid);
  cuda->set_tp_rank(reg.tp_rank);
  for (size_t ri = 0; ri < reg.regions.size(); ++ri) {
    const auto& region = reg.regions[ri];
    auto* r = cuda->add_regions();
    r->set_ipc_handle(region.ipc_handle);
    r->set_offset(region.offset);
    r->set_bytes(region.bytes);
    for (uint32_t index : region.vmm_allocations) {  // indices checked above
      auto* a = r->add_vmm_allocations();
      a->set_fd_tag(tags[index]);
      a->set_bytes(reg.vmm_allocations[index].bytes);
    }
  }
  v1::RegisterKvResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  return impl_->Call(impl_->stub->RegisterKv(&ctx, req, &resp));
}

Result<Ticket> Client::Store(std::span<const BlockKey> keys, std::span<const uint32_t> src_block_ids) {
  std::shared_ptr<SessionRings> r = impl_->Rings();
  if (r == nullptr) return NotAttached();
  if (keys.empty() || keys.size() != src_block_ids.size()) {
    return Status::InvalidArgument(fmt::format("{} keys and {} source block ids; expected the same non-zero number",
                                               keys.size(), src_block_ids.size()));
  }
  return r->Submit(RingOp::kStore, 0, static_cast<uint32_t>(keys.size()), keys, src_block_ids, 0);
}

Result<Ticket> Client::Release(uint64_t match_handle) {
  std::shared_ptr<SessionRings> r = impl_->Rings();
  if (r == nullptr) return NotAttached();
  return r->Submit(RingOp::kRelease, 0, 0, {}, {}, match_handle);
}

Result<uint32_t> Client::MatchViaControl(std::span<const BlockKey> keys) {
  v1::MatchRequest req;
  {
    std::lock_guard lock(impl_->mu);
    if (impl_->session_id == 0) return NotAttached();
    req.set_session_id(impl_->session_id);
    req.set_session_token(impl_->session_token);
  }
  req.set_keys(reinterpret_cast<const char*>(keys.data()), keys.size() * sizeof(BlockKey));
  v1::MatchResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  FLEXKV_RETURN_IF_ERROR(impl_->Call(impl_->stub->Match(&ctx, req, &resp)));
  return resp.matched_blocks();
}

Result<OpResult> Client::Wait(Ticket ticket, std::chrono::microseconds timeout) {
  std::shared_ptr<SessionRings> r = impl_->Rings();
  if (r == nullptr) return NotAttached();
  return r->Wait(ticket, timeout);
}

std::optional<OpResult> Client::TryWait(Ticket ticket) {
  std::shared_ptr<SessionRings> r = impl_->Rings();
  if (r == nullptr) return std::nullopt;
  return r->TryWait(ticket);
}

Result<DaemonStatus> Client::GetStatus() {
  v1::GetStatusResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  FLEXKV_RETURN_IF_ERROR(impl_->Call(impl_->stub->GetStatus(&ctx, v1::GetStatusRequest(), &resp)));
  DaemonStatus out;
  out.state = resp.state();
  out.version = resp.version();
  out.pid = resp.pid();
  out.uptime_s = resp.uptime_s();
  out.pool = {resp.pool().block_bytes(),   resp.pool().capacity_blocks(), resp.pool().used_blocks(),
              resp.pool().pinned_blocks(), resp.pool().budget_bytes(),    resp.pool().backing()};
  out.index_blocks = resp.index().blocks();
  out.sessions = resp.sessions();
  const v1::Counters& c = resp.counters();
  if (c.has_match_requests()) out.counters["match_requests"] = c.match_requests();
  if (c.has_match_blocks()) out.counters["match_blocks"] = c.match_blocks();
  if (c.has_hit_blocks()) out.counters["hit_blocks"] = c.hit_blocks();
  if (c.has_load_blocks()) out.counters["load_blocks"] = c.load_blocks();
  if (c.has_store_blocks()) out.counters["store_blocks"] = c.store_blocks();
  if (c.has_evicted_blocks()) out.counters["evicted_blocks"] = c.evicted_blocks();
  if (c.has_bytes_loaded()) out.counters["bytes_loaded"] = c.bytes_loaded();
  if (c.has_bytes_stored()) out.counters["bytes_stored"] = c.bytes_stored();
  if (c.has_errors()) out.counters["errors"] = c.errors();
  for (const auto& b : resp.backends()) {
    out.backends.push_back({b.name(), std::vector<std::string>(b.devices().begin(), b.devices().end())});
  }
  out.model_namespace = resp.model_namespace();
  return out;
}

Result<std::vector<SessionEntry>> Client::ListSessions() {
  v1::ListSessionsResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  FLEXKV_RETURN_IF_ERROR(impl_->Call(impl_->stub->ListSessions(&ctx, v1::ListSessionsRequest(), &resp)));
  std::vector<SessionEntry> out;
  for (const auto& s : resp.sessions()) {
    out.push_back(SessionEntry{s.session_id(), s.client_name(), s.pid(), s.uid(), s.gid(), s.dp_rank(), s.tp_rank(),
                               s.model_namespace(), s.state(), s.attached_unix_ms(), s.pinned_blocks(),
                               s.inflight_requests()});
  }
  return out;
}

Result<std::string> Client::GetMetrics() {
  v1::GetMetricsResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  FLEXKV_RETURN_IF_ERROR(impl_->Call(impl_->stub->GetMetrics(&ctx, v1::GetMetricsRequest(), &resp)));
  return resp.text();
}

Result<std::string> Client::Drain() {
  v1::DrainResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  FLEXKV_RETURN_IF_ERROR(impl_->Call(impl_->stub->Drain(&ctx, v1::DrainRequest(), &resp)));
  return resp.state();
}

Result<std::string> Client::Resume() {
  v1::ResumeResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  FLEXKV_RETURN_IF_ERROR(impl_->Call(impl_->stub->Resume(&ctx, v1::ResumeRequest(), &resp)));
  return resp.state();
}

Status Client::CheckHealth() {
  grpc::health::v1::HealthCheckResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  FLEXKV_RETURN_IF_ERROR(impl_->Call(impl_->health->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp)));
  if (resp.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    return Status::Unavailable(fmt::format("flexkvd at {} reports {}", impl_->socket_path,
                                           grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status())));
  }
  return Status::Ok();
}

}  // namespace flexkv
