// libflexkv Client: gRPC control calls plus the session channel; see flexkv/client.h.
#include "flexkv/client.h"

#include <fmt/format.h>
#include <grpcpp/grpcpp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <mutex>
#include <thread>

#include "common/grpc_convert.h"
#include "common/paths.h"
#include "common/session_channel.h"
#include "common/uds.h"
#include "common/version.h"
#include "flexkv/v1/control.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace flexkv {

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
    return Status::FailedPrecondition(fmt::format("this client is already attached as session {}", impl_->session_id));
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
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  FLEXKV_RETURN_IF_ERROR(impl_->Call(impl_->stub->Attach(&ctx, req, &resp)));
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
  timeval tv{static_cast<time_t>(impl_->options.call_timeout.count() / 1000),
             static_cast<suseconds_t>((impl_->options.call_timeout.count() % 1000) * 1000)};
  setsockopt(fd->get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  Status got = RecvWithFds(fd->get(), &reply, sizeof(reply), nullptr);
  if (!got.ok()) return abandon(got);
  if (std::memcmp(reply.magic, kSessionChannelMagic, 4) != 0) {
    return abandon(Status::Internal("the daemon's hello reply has a bad magic"));
  }
  if (reply.status_code != 0) {
    reply.message[sizeof(reply.message) - 1] = '\0';
    return abandon(Status(static_cast<StatusCode>(reply.status_code), reply.message));
  }
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
  impl_->session_channel.reset();
  impl_->session_id = 0;
  impl_->session_token.clear();
  if (st.code() == StatusCode::kNotFound) return Status::Ok();  // already gone (e.g. timed out)
  return st;
}

bool Client::attached() const {
  std::lock_guard lock(impl_->mu);
  return impl_->session_id != 0;
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
