// libflexkv Client: gRPC control calls plus the session channel; see flexkv/client.h.
// Over 700 lines: one place for every Client method's control call or ring submission; the hybrid id checks and
// layout are in hybrid_request.cc, the rings in session_rings.cc.
#include "flexkv/client.h"

#include <fmt/format.h>
#include <grpcpp/grpcpp.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "client/attached_session.h"
#include "client/hybrid_request.h"
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

// The single-span Load/Store of a hybrid session: its ids cannot say which component they are for.
Status UseComponentOverload(const char* op, const Geometry& g) {
  return Status::InvalidArgument(fmt::format(
      "{} with one span of block ids on a hybrid session ({} components); expected the per-component overload: one "
      "span per component, component 0 (full attention) first",
      op, g.component_count()));
}

// A request word that ring layout 5 added (a Load's first_block, a Store's window_keys): a layout-4 daemon refuses
// it, so it is refused here, before anything is sent, naming both versions.
Status CheckDaemonTakes(const AttachedSession& s, const char* word, uint32_t value) {
  if (value == 0 || s.rings->layout_version() >= 5) return Status::Ok();
  return Status::FailedPrecondition(fmt::format(
      "{} {} needs ring layout 5, and the daemon speaks layout {}: upgrade flexkvd, or send {} 0", word, value,
      s.rings->layout_version(), word));
}

// A Load's launch deadline (ring layout 6): a daemon of layout 4 or 5 would ignore it - and might start the copies
// after the client gave up on them - so it is refused here, before anything is sent; a negative one is refused too.
Status CheckLaunchDeadline(const AttachedSession& s, int64_t launch_deadline_ns) {
  if (launch_deadline_ns < 0) {
    return Status::InvalidArgument(fmt::format(
        "launch_deadline_ns {}; expected 0 (none) or a CLOCK_MONOTONIC time in ns", launch_deadline_ns));
  }
  return CheckLaunchDeadlineLayout(s.rings->layout_version(), launch_deadline_ns);
}

// The count a Load from `first_block` with `ids` more blocks covers; INVALID_ARGUMENT past the ring's u32.
Result<uint32_t> LoadEnd(uint32_t first_block, size_t ids) {
  const uint64_t end = uint64_t{first_block} + ids;
  if (end > UINT32_MAX) {
    return Status::InvalidArgument(fmt::format("load of blocks [{}, {}); expected an end of at most {}", first_block,
                                               end, UINT32_MAX));
  }
  return static_cast<uint32_t>(end);
}

Status AlreadyRegistered(const Geometry& g, uint32_t component) {
  if (!g.is_hybrid()) return Status::AlreadyExists("this session already registered its KV buffers");
  return Status::AlreadyExists(fmt::format("this session already registered the KV buffers of component {} ({})",
                                           component, ComponentKindName(g.component_kind(component))));
}

Status CheckStoreKeys(std::span<const BlockKey> keys) {
  for (size_t i = 0; i < keys.size(); ++i) {
    if (keys[i] == BlockKey{}) {
      return Status::InvalidArgument(fmt::format(
          "key {} of the store is all zero; the all-zero key is reserved (it marks a chain's root) and cannot be "
          "stored: derive keys with ComputeBlockKeys",
          i));
    }
  }
  return Status::Ok();
}

// The last session generation issued in this process (Ticket::generation); every Attach of any Client takes the
// next one, so a ticket names exactly one session.
std::atomic<uint64_t> g_last_generation{0};

}  // namespace

struct Client::Impl {
  std::string socket_path;
  ConnectOptions options;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Control::Stub> stub;
  std::unique_ptr<grpc::health::v1::Health::Stub> health;

  // One Attach or Detach at a time (they make daemon round trips; `mu` is never held across one).
  absl::Mutex attach_mu;
  absl::Mutex mu;
  std::shared_ptr<AttachedSession> session ABSL_GUARDED_BY(mu);  // null: not attached
  // Host KV mappings of sessions the daemon lost: the engine may still hold pointers into them, so they stay
  // mapped until Detach or destruction (HostKvBuffers' contract), never reused.
  std::vector<KvMapping> retired_kv ABSL_GUARDED_BY(mu);

  std::shared_ptr<AttachedSession> Current() {
    absl::MutexLock lock(&mu);
    return session;
  }
  // The current session if `ticket` is one of its tickets; FAILED_PRECONDITION saying why not otherwise.
  Result<std::shared_ptr<AttachedSession>> SessionOf(Ticket ticket) {
    std::shared_ptr<AttachedSession> s = Current();
    if (s != nullptr && ticket.generation == s->generation) return s;
    if (ticket.generation == 0 || ticket.generation > g_last_generation.load()) {
      return Status::FailedPrecondition(fmt::format(
          "ticket {} names session generation {}, which this process never issued: not a ticket of this client",
          ticket.id, ticket.generation));
    }
    if (s == nullptr) {
      return Status::FailedPrecondition(fmt::format(
          "not attached: ticket {} belongs to session generation {}, which has ended", ticket.id, ticket.generation));
    }
    return Status::FailedPrecondition(fmt::format(
        "ticket {} belongs to session generation {}, which has ended or is another Client's; this client's session "
        "is generation {}",
        ticket.id, ticket.generation, s->generation));
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
  absl::MutexLock attach_lock(&impl_->attach_mu);
  if (std::shared_ptr<AttachedSession> old = impl_->Current()) {
    // A session the daemon has closed (it stopped or restarted) is dropped locally, so Attach works again.
    if (!old->Lost()) {
      return Status::FailedPrecondition(fmt::format("this client is already attached as session {}", old->session_id));
    }
    std::vector<KvMapping> kv =
        old->Drop(Status::Unavailable("flexkvd closed this session (daemon stopped or restarted); Attach again"));
    absl::MutexLock lock(&impl_->mu);
    impl_->session.reset();
    for (KvMapping& m : kv) impl_->retired_kv.push_back(std::move(m));
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
  UniqueFd watched(fcntl(fd->get(), F_DUPFD_CLOEXEC, 0));
  if (!watched) return abandon(Status::ResourceExhausted(fmt::format("dup of the session channel: {}", ErrnoText(errno))));
  auto rings = SessionRings::Map(std::move(fds[0]), std::move(fds[1]), std::move(watched));
  if (!rings.ok()) return abandon(rings.status());
  auto session = std::make_shared<AttachedSession>();
  session->generation = g_last_generation.fetch_add(1) + 1;
  session->session_id = resp.session_id();
  session->token = resp.session_token();
  session->geometry = options.geometry;
  {
    absl::MutexLock lock(&session->mu);
    session->kv.resize(options.geometry.component_count());
  }
  session->channel = std::move(*fd);
  session->rings = std::move(*rings);
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->session = std::move(session);
  }
  SessionInfo info;
  info.session_id = resp.session_id();
  info.block_bytes = resp.block_bytes();
  info.capacity_blocks = resp.capacity_blocks();
  info.read_only = resp.read_only();
  info.component_slot_bytes.assign(resp.component_slot_bytes().begin(), resp.component_slot_bytes().end());
  info.component_capacity.assign(resp.component_capacity().begin(), resp.component_capacity().end());
  // A daemon that does not report per-component sizes serves one component: the whole pool.
  if (info.component_slot_bytes.empty()) info.component_slot_bytes = {info.block_bytes};
  if (info.component_capacity.empty()) info.component_capacity = {info.capacity_blocks};
  return info;
}

Status Client::Detach() {
  absl::MutexLock attach_lock(&impl_->attach_mu);
  std::shared_ptr<AttachedSession> s;
  std::vector<KvMapping> retired;  // unmapped on return
  {
    absl::MutexLock lock(&impl_->mu);
    s = std::move(impl_->session);
    impl_->session.reset();
    retired = std::move(impl_->retired_kv);
    impl_->retired_kv.clear();
  }
  if (s == nullptr) return Status::Ok();
  const Status detached = Status::FailedPrecondition(
      fmt::format("session {} (generation {}) was detached while this call ran", s->session_id, s->generation));
  s->rings->Abandon(detached);  // waits running on it end now, not after the daemon's answer
  v1::DetachRequest req;
  req.set_session_id(s->session_id);
  req.set_session_token(s->token);
  v1::DetachResponse resp;
  Status st;
  // A restarted daemon: the first call goes out on the connection the old one closed and fails UNAVAILABLE at
  // once, the channel then reconnects. Detach is idempotent (an unknown session is NOT_FOUND), so it tries twice.
  for (int attempt = 0; attempt < 2; ++attempt) {
    grpc::ClientContext ctx;
    impl_->Prepare(&ctx);
    st = impl_->Call(impl_->stub->Detach(&ctx, req, &resp));
    if (st.code() != StatusCode::kUnavailable) break;
  }
  // Hanging up the channel ends the session on the daemon side even when the call failed.
  std::vector<KvMapping> kv = s->Drop(detached);
  (void)kv;  // unmapped here: Detach ends the buffers' validity
  if (st.code() == StatusCode::kNotFound) return Status::Ok();  // already gone (e.g. timed out)
  return st;
}

bool Client::attached() const { return impl_->Current() != nullptr; }

Result<HostKvBuffers> Client::CreateHostKv(KvLayout layout, uint32_t num_blocks) {
  return CreateHostKv(0, layout, num_blocks);
}

Result<HostKvBuffers> Client::CreateHostKv(uint32_t component, KvLayout layout, uint32_t num_blocks) {
  std::shared_ptr<AttachedSession> s = impl_->Current();
  if (s == nullptr) return Status::FailedPrecondition("CreateHostKv before Attach");
  const Geometry& geometry = s->geometry;
  if (component >= geometry.component_count()) {
    return Status::InvalidArgument(fmt::format("component {} is not in this session's geometry; expected 0..{}",
                                               component, geometry.component_count() - 1));
  }
  {
    absl::MutexLock lock(&s->mu);
    if (s->kv[component]) return AlreadyRegistered(geometry, component);
  }
  if (num_blocks == 0) return Status::InvalidArgument("num_blocks is 0; expected at least 1");
  // The engine's buffers of one TP rank in the component's copy geometry (the daemon accepted the session's
  // geometry, so its host layout is the domain's): blocks x layers x planes x one rank's chunk.
  const Geometry g = geometry.Component(component);
  const uint64_t bytes = uint64_t{num_blocks} * g.num_layers * g.kv_planes * g.chunk_bytes_per_rank();
  UniqueFd memfd(static_cast<int>(syscall(SYS_memfd_create, "flexkv-kv", MFD_CLOEXEC | MFD_ALLOW_SEALING)));
  if (!memfd) return Status::ResourceExhausted(fmt::format("memfd_create: {}", ErrnoText(errno)));
  // Allocated up front: the engine's memory is charged to the engine (the daemon refuses a sparse buffer), and
  // a node short of memory fails here rather than with SIGBUS on first touch.
  if (ftruncate(memfd.get(), static_cast<off_t>(bytes)) != 0 ||
      fallocate(memfd.get(), 0, 0, static_cast<off_t>(bytes)) != 0 ||
      fcntl(memfd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    return Status::ResourceExhausted(fmt::format("allocating the {}-byte KV memfd: {}", bytes, ErrnoText(errno)));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd.get(), 0);
  if (p == MAP_FAILED) return Status::ResourceExhausted(fmt::format("mmap KV memfd: {}", ErrnoText(errno)));
  KvMapping kv(static_cast<uint8_t*>(p), bytes);
  auto tag = s->OfferFd(memfd.get(), "KV memfd", impl_->options.call_timeout);
  if (!tag.ok()) return tag.status();
  v1::RegisterKvRequest req;
  req.set_session_id(s->session_id);
  req.set_session_token(s->token);
  req.set_layout(static_cast<v1::KvLayout>(static_cast<int>(layout)));
  req.set_num_blocks(num_blocks);
  req.set_component(component);
  req.mutable_host()->set_fd_tag(*tag);
  req.mutable_host()->set_bytes(bytes);
  v1::RegisterKvResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  FLEXKV_RETURN_IF_ERROR(impl_->Call(impl_->stub->RegisterKv(&ctx, req, &resp)));
  absl::MutexLock lock(&s->mu);
  // Dropped meanwhile (Detach): the buffers would be unmapped under the caller, so they are not handed out.
  if (s->dropped) return Status::FailedPrecondition("the session was detached while CreateHostKv ran");
  if (s->kv[component]) return AlreadyRegistered(geometry, component);
  s->kv[component] = std::move(kv);
  return HostKvBuffers{s->kv[component].data(), bytes, num_blocks, layout};
}

Result<Ticket> Client::Match(std::span<const BlockKey> keys, bool pin) {
  std::shared_ptr<AttachedSession> s = impl_->Current();
  if (s == nullptr) return NotAttached();
  if (keys.empty()) return Status::InvalidArgument("keys is empty; expected at least one block key");
  auto t = s->rings->Submit(RingOp::kMatch, pin ? kMatchFlagPin : 0, static_cast<uint32_t>(keys.size()), keys, {}, 0,
                            kRootParent);
  if (!t.ok()) return t.status();
  return Ticket{t->id, s->generation};
}

Result<Ticket> Client::Prefetch(std::span<const BlockKey> keys) {
  std::shared_ptr<AttachedSession> s = impl_->Current();
  if (s == nullptr) return NotAttached();
  if (keys.empty()) return Status::InvalidArgument("keys is empty; expected at least one block key");
  auto t = s->rings->Submit(RingOp::kPrefetch, 0, static_cast<uint32_t>(keys.size()), keys, {}, 0, kRootParent);
  if (!t.ok()) return t.status();
  return Ticket{t->id, s->generation};
}

Result<Ticket> Client::Load(uint64_t match_handle, std::span<const uint32_t> dst_block_ids, bool layerwise,
                            uint32_t first_block, int64_t launch_deadline_ns) {
  std::shared_ptr<AttachedSession> s = impl_->Current();
  if (s == nullptr) return NotAttached();
  if (s->geometry.is_hybrid()) return UseComponentOverload("Load", s->geometry);
  if (dst_block_ids.empty()) return Status::InvalidArgument("dst_block_ids is empty; expected at least one block");
  FLEXKV_RETURN_IF_ERROR(CheckDaemonTakes(*s, "first_block", first_block));
  FLEXKV_RETURN_IF_ERROR(CheckLaunchDeadline(*s, launch_deadline_ns));
  auto end = LoadEnd(first_block, dst_block_ids.size());
  if (!end.ok()) return end.status();
  auto t = s->rings->Submit(RingOp::kLoad, layerwise ? kLoadFlagLayerwise : 0, *end, {}, dst_block_ids, match_handle,
                            kRootParent, first_block, 0, launch_deadline_ns);
  if (!t.ok()) return t.status();
  return Ticket{t->id, s->generation};
}

Result<Ticket> Client::Load(uint64_t match_handle, std::span<const std::span<const uint32_t>> component_ids,
                            uint32_t first_block, int64_t launch_deadline_ns, bool layerwise) {
  return LoadComponents(match_handle, component_ids, first_block, launch_deadline_ns, layerwise, 0);
}

Result<Ticket> Client::LoadWithEvents(uint64_t match_handle, std::span<const std::span<const uint32_t>> component_ids,
                                      uint32_t event_set, uint32_t first_block, int64_t launch_deadline_ns) {
  if (event_set == 0) return Status::InvalidArgument("event_set is 0; expected an id RegisterLayerEvents returned");
  return LoadComponents(match_handle, component_ids, first_block, launch_deadline_ns, false, event_set);
}

Result<Ticket> Client::LoadComponents(uint64_t match_handle, std::span<const std::span<const uint32_t>> component_ids,
                                      uint32_t first_block, int64_t launch_deadline_ns, bool layerwise,
                                      uint32_t event_set) {
  std::shared_ptr<AttachedSession> s = impl_->Current();
  if (s == nullptr) return NotAttached();
  auto count = LoadEnd(first_block, component_ids.empty() ? 0 : component_ids[0].size());
  if (!count.ok()) return count.status();
  auto ids = LayOutComponentIds(s->geometry, false, *count, component_ids, {}, first_block);
  if (!ids.ok()) return ids.status();
  FLEXKV_RETURN_IF_ERROR(CheckDaemonTakes(*s, "first_block", first_block));
  FLEXKV_RETURN_IF_ERROR(CheckLaunchDeadline(*s, launch_deadline_ns));
  auto t = s->rings->Submit(RingOp::kLoad, layerwise ? kLoadFlagLayerwise : 0, *count, {}, *ids, match_handle,
                            kRootParent, first_block, event_set, launch_deadline_ns);
  if (!t.ok()) return t.status();
  return Ticket{t->id, s->generation};
}

Result<Ticket> Client::LoadWithEvents(uint64_t match_handle, std::span<const uint32_t> dst_block_ids,
                                      uint32_t event_set, uint32_t first_block, int64_t launch_deadline_ns) {
  std::shared_ptr<AttachedSession> s = impl_->Current();
  if (s == nullptr) return NotAttached();
  if (s->geometry.is_hybrid()) return UseComponentOverload("LoadWithEvents", s->geometry);
  if (event_set == 0) return Status::InvalidArgument("event_set is 0; expected an id RegisterLayerEvents returned");
  if (dst_block_ids.empty()) return Status::InvalidArgument("dst_block_ids is empty; expected at least one block");
  FLEXKV_RETURN_IF_ERROR(CheckDaemonTakes(*s, "first_block", first_block));
  FLEXKV_RETURN_IF_ERROR(CheckLaunchDeadline(*s, launch_deadline_ns));
  auto end = LoadEnd(first_block, dst_block_ids.size());
  if (!end.ok()) return end.status();
  auto t = s->rings->Submit(RingOp::kLoad, 0, *end, {}, dst_block_ids, match_handle, kRootParent, first_block,
                            event_set, launch_deadline_ns);
  if (!t.ok()) return t.status();
  return Ticket{t->id, s->generation};
}

Status Client::WaitLaunched(Ticket ticket, std::chrono::microseconds timeout) {
  auto s = impl_->SessionOf(ticket);
  if (!s.ok()) return s.status();
  return (*s)->rings->WaitLaunched(ticket, timeout);
}

Result<uint32_t> Client::RegisterLayerEvents(std::span<const LayerEventHandles> ranks) {
  std::shared_ptr<AttachedSession> s = impl_->Current();
  if (s == nullptr) return NotAttached();
  v1::RegisterLayerEventsRequest req;
  req.set_session_id(s->session_id);
  req.set_session_token(s->token);
  for (const LayerEventHandles& r : ranks) {
    auto* rank = req.add_ranks();
    rank->set_tp_rank(r.tp_rank);
    rank->set_gpu_uuid(r.gpu_uuid);
    for (const std::string& h : r.handles) rank->add_handles(h);
  }
  v1::RegisterLayerEventsResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  Status st = impl_->Call(impl_->stub->RegisterLayerEvents(&ctx, req, &resp));
  if (!st.ok()) return st;
  return resp.event_set();
}

Status Client::ReleaseLayerEvents(uint32_t event_set) {
  std::shared_ptr<AttachedSession> s = impl_->Current();
  if (s == nullptr) return NotAttached();
  v1::ReleaseLayerEventsRequest req;
  req.set_session_id(s->session_id);
  req.set_session_token(s->token);
  req.set_event_set(event_set);
  v1::ReleaseLayerEventsResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  return impl_->Call(impl_->stub->ReleaseLayerEvents(&ctx, req, &resp));
}

Result<LayerEventSet> LayerEventSet::Register(Client& client, std::span<const LayerEventHandles> ranks) {
  auto id = client.RegisterLayerEvents(ranks);
  if (!id.ok()) return id.status();
  LayerEventSet set;
  set.client_ = &client;
  set.id_ = *id;
  return set;
}

LayerEventSet::~LayerEventSet() { (void)Release(); }

LayerEventSet::LayerEventSet(LayerEventSet&& other) noexcept
    : client_(std::exchange(other.client_, nullptr)), id_(std::exchange(other.id_, 0)) {}

LayerEventSet& LayerEventSet::operator=(LayerEventSet&& other) noexcept {
  if (this != &other) {
    (void)Release();
    client_ = std::exchange(other.client_, nullptr);
    id_ = std::exchange(other.id_, 0);
  }
  return *this;
}

Status LayerEventSet::Release() {
  if (client_ == nullptr || id_ == 0) return Status::Ok();
  Client* client = std::exchange(client_, nullptr);
  const uint32_t id = std::exchange(id_, 0);
  return client->ReleaseLayerEvents(id);
}

Result<uint32_t> Client::WaitLayers(Ticket ticket, uint32_t layers, std::chrono::microseconds timeout) {
  auto s = impl_->SessionOf(ticket);
  if (!s.ok()) return s.status();
  return (*s)->rings->WaitLayers(ticket, layers, timeout);
}

Status Client::RegisterGpuKv(const GpuKvRegistration& reg) {
  std::shared_ptr<AttachedSession> s = impl_->Current();
  if (s == nullptr) return NotAttached();
  if (reg.component >= s->geometry.component_count()) {
    return Status::InvalidArgument(fmt::format("component {} is not in this session's geometry; expected 0..{}",
                                               reg.component, s->geometry.component_count() - 1));
  }
  v1::RegisterKvRequest req;
  req.set_session_id(s->session_id);
  req.set_session_token(s->token);
  for (size_t ri = 0; ri < reg.regions.size(); ++ri) {  // before any fd is offered
    for (uint32_t index : reg.regions[ri].vmm_allocations) {
      if (index >= reg.vmm_allocations.size()) {
        return Status::InvalidArgument(fmt::format("region {} names vmm allocation {}; there are {}", ri, index,
                                                   reg.vmm_allocations.size()));
      }
    }
  }
  std::vector<uint32_t> tags;  // of reg.vmm_allocations, offered on the session channel
  for (size_t i = 0; i < reg.vmm_allocations.size(); ++i) {
    const auto& a = reg.vmm_allocations[i];
    if (!a.fd || *a.fd < 0) return Status::InvalidArgument(fmt::format("vmm_allocations[{}] has no fd", i));
    auto tag = s->OfferFd(*a.fd, "fd of a cuMem/VMM allocation", impl_->options.call_timeout);
    if (!tag.ok()) return tag.status();
    tags.push_back(*tag);
  }
  req.set_layout(static_cast<v1::KvLayout>(static_cast<int>(reg.layout)));
  req.set_num_blocks(reg.num_blocks);
  auto* cuda = req.mutable_cuda();
  req.set_component(reg.component);
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

Result<Ticket> Client::Store(const BlockKeyChain& chain, std::span<const uint32_t> src_block_ids) {
  const std::span<const BlockKey> keys = chain.keys();
  std::shared_ptr<AttachedSession> s = impl_->Current();
  if (s == nullptr) return NotAttached();
  if (s->geometry.is_hybrid()) return UseComponentOverload("Store", s->geometry);
  if (keys.empty() || keys.size() != src_block_ids.size()) {
    return Status::InvalidArgument(fmt::format("{} keys and {} source block ids; expected the same non-zero number",
                                               keys.size(), src_block_ids.size()));
  }
  FLEXKV_RETURN_IF_ERROR(CheckStoreKeys(keys));
  auto t = s->rings->Submit(RingOp::kStore, 0, static_cast<uint32_t>(keys.size()), keys, src_block_ids, 0,
                            chain.parent());
  if (!t.ok()) return t.status();
  return Ticket{t->id, s->generation};
}

Result<Ticket> Client::Store(const BlockKeyChain& chain, std::span<const std::span<const uint32_t>> component_ids,
                             std::span<const uint32_t> state_boundaries, uint32_t window_keys) {
  const std::span<const BlockKey> keys = chain.keys();
  std::shared_ptr<AttachedSession> s = impl_->Current();
  if (s == nullptr) return NotAttached();
  if (keys.empty() || keys.size() > UINT32_MAX) {
    return Status::InvalidArgument(fmt::format("store of {} keys; expected 1..{}", keys.size(), UINT32_MAX));
  }
  FLEXKV_RETURN_IF_ERROR(CheckStoreKeys(keys));
  const auto count = static_cast<uint32_t>(keys.size());
  auto ids = LayOutComponentIds(s->geometry, true, count, component_ids, state_boundaries, 0, window_keys);
  if (!ids.ok()) return ids.status();
  FLEXKV_RETURN_IF_ERROR(CheckDaemonTakes(*s, "window_keys", window_keys));
  auto t = s->rings->Submit(RingOp::kStore, 0, count, keys, *ids, 0, chain.parent(),
                            static_cast<uint32_t>(state_boundaries.size()), window_keys);
  if (!t.ok()) return t.status();
  return Ticket{t->id, s->generation};
}

Result<Ticket> Client::Release(uint64_t match_handle) {
  std::shared_ptr<AttachedSession> s = impl_->Current();
  if (s == nullptr) return NotAttached();
  auto t = s->rings->Submit(RingOp::kRelease, 0, 0, {}, {}, match_handle, kRootParent);
  if (!t.ok()) return t.status();
  return Ticket{t->id, s->generation};
}

Result<uint32_t> Client::MatchViaControl(std::span<const BlockKey> keys) {
  std::shared_ptr<AttachedSession> s = impl_->Current();
  if (s == nullptr) return NotAttached();
  v1::MatchRequest req;
  req.set_session_id(s->session_id);
  req.set_session_token(s->token);
  req.set_keys(reinterpret_cast<const char*>(keys.data()), keys.size() * sizeof(BlockKey));
  v1::MatchResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  FLEXKV_RETURN_IF_ERROR(impl_->Call(impl_->stub->Match(&ctx, req, &resp)));
  return resp.matched_blocks();
}

Result<OpResult> Client::Wait(Ticket ticket, std::chrono::microseconds timeout) {
  auto s = impl_->SessionOf(ticket);
  if (!s.ok()) return s.status();
  return (*s)->rings->Wait(ticket, timeout);
}

Result<std::optional<OpResult>> Client::TryWait(Ticket ticket) {
  auto s = impl_->SessionOf(ticket);
  if (!s.ok()) return s.status();
  return (*s)->rings->TryWait(ticket);
}

namespace {

DaemonStatus::Pool PoolFromProto(const v1::PoolStatus& p) {
  DaemonStatus::Pool out;
  out.block_bytes = p.block_bytes();
  out.capacity_blocks = p.capacity_blocks();
  out.used_blocks = p.used_blocks();
  out.pinned_blocks = p.pinned_blocks();
  out.budget_bytes = p.budget_bytes();
  out.backing = p.backing();
  out.unverified_blocks = p.unverified_blocks();
  out.preparation = p.preparation();
  out.active_bytes = p.active_bytes();
  out.target_bytes = p.target_bytes();
  out.prepare_ms = p.prepare_ms();
  out.first_serve_ms = p.first_serve_ms();
  for (const v1::ComponentPoolStatus& c : p.components()) {
    DaemonStatus::Pool::Component pc;
    pc.kind = static_cast<ComponentKind>(c.kind());
    pc.slot_bytes = c.slot_bytes();
    pc.capacity = c.capacity();
    pc.used = c.used();
    pc.pinned = c.pinned();
    pc.evicted = c.evicted();
    pc.unanchored = c.unanchored();
    out.components.push_back(pc);
  }
  return out;
}

std::map<std::string, uint64_t> CountersFromProto(const v1::Counters& c) {
  std::map<std::string, uint64_t> out;
  if (c.has_match_requests()) out["match_requests"] = c.match_requests();
  if (c.has_match_blocks()) out["match_blocks"] = c.match_blocks();
  if (c.has_hit_blocks()) out["hit_blocks"] = c.hit_blocks();
  if (c.has_load_blocks()) out["load_blocks"] = c.load_blocks();
  if (c.has_store_blocks()) out["store_blocks"] = c.store_blocks();
  if (c.has_evicted_blocks()) out["evicted_blocks"] = c.evicted_blocks();
  if (c.has_bytes_loaded()) out["bytes_loaded"] = c.bytes_loaded();
  if (c.has_bytes_stored()) out["bytes_stored"] = c.bytes_stored();
  if (c.has_errors()) out["errors"] = c.errors();
  if (c.has_data_loss_blocks()) out["data_loss_blocks"] = c.data_loss_blocks();
  return out;
}

}  // namespace

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
  out.pool = PoolFromProto(resp.pool());
  out.index_blocks = resp.index().blocks();
  out.sessions = resp.sessions();
  out.counters = CountersFromProto(resp.counters());
  for (const auto& b : resp.backends()) {
    out.backends.push_back({b.name(), std::vector<std::string>(b.devices().begin(), b.devices().end())});
  }
  out.model_namespace = resp.model_namespace();
  for (const v1::DomainStatus& d : resp.domains()) {
    DaemonStatus::Domain domain;
    domain.model_namespace = d.model_namespace();
    domain.geometry = FromProto(d.geometry());
    domain.pool = PoolFromProto(d.pool());
    domain.index_blocks = d.index().blocks();
    domain.counters = CountersFromProto(d.counters());
    domain.sessions = d.sessions();
    domain.idle_s = d.idle_s();
    domain.limit_bytes = d.limit_bytes();
    out.domains.push_back(std::move(domain));
  }
  for (const v1::TierStatus& t : resp.tiers()) {
    DaemonStatus::Tier tier;
    tier.name = t.name();
    tier.state = t.state();
    tier.capacity_blocks = t.capacity_blocks();
    tier.used_blocks = t.used_blocks();
    tier.capacity_bytes = t.capacity_bytes();
    tier.block_bytes = t.block_bytes();
    tier.read_bytes_per_s = t.read_bytes_per_s();
    tier.write_bytes_per_s = t.write_bytes_per_s();
    tier.rebuild_s = t.rebuild_s();
    tier.counters = {{"promoted_blocks", t.promoted_blocks()},
                     {"promotion_requests", t.promotion_requests()},
                     {"promotion_refused_blocks", t.promotion_refused_blocks()},
                     {"promotion_failed_blocks", t.promotion_failed_blocks()},
                     {"written_back_blocks", t.written_back_blocks()},
                     {"writeback_refused_blocks", t.writeback_refused_blocks()},
                     {"writeback_failed_blocks", t.writeback_failed_blocks()},
                     {"evicted_written_blocks", t.evicted_written_blocks()},
                     {"evicted_unwritten_blocks", t.evicted_unwritten_blocks()},
                     {"store_waits", t.store_waits()},
                     {"store_wait_expired", t.store_wait_expired()},
                     {"promotion_waits", t.promotion_waits()},
                     {"promotion_wait_expired", t.promotion_wait_expired()},
                     {"evicted_blocks", t.evicted_blocks()},
                     {"reads_in_flight", t.reads_in_flight()},
                     {"writes_in_flight", t.writes_in_flight()},
                     {"read_bytes", t.read_bytes()},
                     {"write_bytes", t.write_bytes()},
                     {"read_errors", t.read_errors()},
                     {"write_errors", t.write_errors()},
                     {"data_loss_blocks", t.data_loss_blocks()},
                     {"refused", t.refused()},
                     {"rebuilt_blocks", t.rebuilt_blocks()},
                     {"rebuild_corrupt_headers", t.rebuild_corrupt_headers()},
                     {"rebuild_truncated", t.rebuild_truncated()}};
    for (const v1::TierFile& f : t.files()) tier.files.push_back({f.path(), f.filesystem(), f.direct_io(), f.slots()});
    tier.notes.assign(t.notes().begin(), t.notes().end());
    out.tiers.push_back(std::move(tier));
  }
  if (resp.has_cluster()) {
    const v1::ClusterStatus& c = resp.cluster();
    DaemonStatus::Cluster cluster;
    cluster.state = c.state();
    cluster.node_id = c.node_id();
    cluster.endpoint = c.endpoint();
    cluster.last_error = c.last_error();
    cluster.epoch = c.epoch();
    for (const v1::ClusterMember& m : c.members()) cluster.members.push_back({m.node_id(), m.endpoint(), m.epoch(), m.self()});
    cluster.counters = {{"published_keys", c.published_keys()},
                        {"publish_queue", c.publish_queue()},
                        {"publish_failures", c.publish_failures()},
                        {"rejoins", c.rejoins()},
                        {"prefetches", c.prefetches()},
                        {"pulls_ok", c.pulls_ok()},
                        {"pulls_failed", c.pulls_failed()},
                        {"pulled_blocks", c.pulled_blocks()},
                        {"pulled_bytes", c.pulled_bytes()},
                        {"pulled_entries", c.pulled_entries()},
                        {"pulled_entry_bytes", c.pulled_entry_bytes()},
                        {"verify_failures", c.verify_failures()},
                        {"pulls_in_flight", c.pulls_in_flight()},
                        {"lookups_served", c.lookups_served()},
                        {"blocks_offered", c.blocks_offered()},
                        {"peer_reads_ok", c.peer_reads_ok()},
                        {"peer_reads_failed", c.peer_reads_failed()},
                        {"peer_read_deadlines", c.peer_read_deadlines()},
                        {"connections_accepted", c.connections_accepted()},
                        {"connections_rejected", c.connections_rejected()},
                        {"auth_failures", c.auth_failures()},
                        {"replies_dropped", c.replies_dropped()},
                        {"requests_refused", c.requests_refused()},
                        {"directory_unauthenticated", c.directory_unauthenticated()}};
    cluster.transports.assign(c.transports().begin(), c.transports().end());
    cluster.rdma_devices.assign(c.rdma_devices().begin(), c.rdma_devices().end());
    out.cluster = std::move(cluster);
  }
  if (resp.has_kv_events()) {
    const auto& ev = resp.kv_events();
    out.kv_events.instance_id = ev.instance_id();
    out.kv_events.last_seq = ev.last_seq();
    out.kv_events.subscribers = ev.subscribers();
    out.kv_events.cut_off = ev.cut_off();
    out.kv_events.buffer_events = ev.buffer_events();
    out.kv_events.zmq_endpoint = ev.zmq_endpoint();
    out.kv_events.zmq_batches = ev.zmq_batches();
    out.kv_events.zmq_events = ev.zmq_events();
    out.kv_events.zmq_resyncs = ev.zmq_resyncs();
  }
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

Result<uint64_t> Client::DropDomain(const std::string& model_namespace, uint64_t min_idle_s) {
  v1::DropDomainRequest req;
  req.set_model_namespace(model_namespace);
  req.set_min_idle_s(min_idle_s);
  v1::DropDomainResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  FLEXKV_RETURN_IF_ERROR(impl_->Call(impl_->stub->DropDomain(&ctx, req, &resp)));
  return resp.dropped_blocks();
}

Result<ScrubResult> Client::Scrub(uint64_t max_bytes_per_s, std::chrono::milliseconds timeout,
                                  const std::string& model_namespace) {
  v1::ScrubRequest req;
  req.set_max_bytes_per_s(max_bytes_per_s);
  req.set_model_namespace(model_namespace);
  v1::ScrubResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  FLEXKV_RETURN_IF_ERROR(impl_->Call(impl_->stub->Scrub(&ctx, req, &resp)));
  return ScrubResult{resp.checked_blocks(), resp.failed_blocks(), resp.dropped_blocks(), resp.bytes(), resp.seconds()};
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
