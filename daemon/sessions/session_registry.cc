// Sessions and their reaper; see session_registry.h.
#include "daemon/sessions/session_registry.h"

#include <dirent.h>
#include <sys/resource.h>

#include <fmt/format.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "common/log.h"
#include "common/version.h"
#include "common/clock.h"

namespace flexkv {
namespace {

// epoll tags: session id * 2 (+1 for the pidfd); 0 is the stop eventfd.
constexpr uint64_t kStopTag = 0;
uint64_t ChannelTag(uint64_t id) { return id * 2; }
uint64_t PidfdTag(uint64_t id) { return id * 2 + 1; }

bool TokensEqual(std::span<const uint8_t> a, const SessionToken& b) {
  if (a.size() != b.size()) return false;
  uint8_t diff = 0;
  for (size_t i = 0; i < b.size(); ++i) diff = static_cast<uint8_t>(diff | (a[i] ^ b[i]));
  return diff == 0;
}

uint64_t UnixMs() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
}

bool ReplyHello(int fd, StatusCode code, const std::string& message, std::span<const int> fds = {}) {
  SessionHelloReply reply{};
  std::memcpy(reply.magic, kSessionChannelMagic, 4);
  reply.status_code = static_cast<uint32_t>(code);
  std::snprintf(reply.message, sizeof(reply.message), "%s", message.c_str());
  Status sent = SendWithFds(fd, &reply, sizeof(reply), fds);
  if (!sent.ok()) log::Debug("sessions", "hello reply not delivered: {}", sent.ToString());
  return sent.ok();
}

// Fds a session may have offered and not yet registered: one KV memfd (host backend) or, for a GPU cache in
// cuMem/VMM memory (PyTorch's expandable segments: 20 MiB physical allocations), one per allocation; 8192
// covers 160 GiB of such a cache. The daemon raises its RLIMIT_NOFILE soft limit to the hard one at start.
constexpr size_t kMaxOfferedFds = 8192;

// Offered fds of all sessions together: half the fd limit, so that one tenant's registrations cannot take the fds
// every connection and session channel needs.
size_t OfferedFdBudget() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return kMaxOfferedFds * 8;
  return std::max<size_t>(64, static_cast<size_t>(limit.rlim_cur / 2));
}

// Fds this process may still open: RLIMIT_NOFILE minus the entries of /proc/self/fd (one readdir; Attach only).
// SIZE_MAX when either is unknown.
size_t FreeFds() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return SIZE_MAX;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return SIZE_MAX;
  size_t open_fds = 0;
  while (const dirent* entry = readdir(dir)) {
    if (entry->d_name[0] != '.') ++open_fds;
  }
  closedir(dir);
  --open_fds;  // the directory's own fd
  return open_fds >= limit.rlim_cur ? 0 : static_cast<size_t>(limit.rlim_cur) - open_fds;
}

}  // namespace

// Ids start from the wall clock (ms << 8), so a restarted daemon does not hand out an id an old client may
// still hold; 256 sessions per millisecond before two restarts could overlap.
SessionRegistry::SessionRegistry(SessionLimits limits) : limits_(limits), next_id_(UnixMs() << 8) {}

SessionRegistry::~SessionRegistry() { Stop(); }

void SessionRegistry::SetEndCallback(EndCallback cb) { on_end_ = std::move(cb); }

void SessionRegistry::SetChannelOpenCallback(ChannelOpenCallback cb) { on_channel_open_ = std::move(cb); }

Status SessionRegistry::Start() {
  epoll_fd_.reset(epoll_create1(EPOLL_CLOEXEC));
  stop_fd_.reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!epoll_fd_ || !stop_fd_) return Status::Internal(fmt::format("epoll/eventfd: {}", ErrnoText(errno)));
  Watch(stop_fd_.get(), kStopTag);
  last_turn_ms_ = MonotonicMs();
  reaper_ = std::thread([this] { ReaperLoop(); });
  return Status::Ok();
}

void SessionRegistry::Stop() {
  if (!reaper_.joinable()) return;
  uint64_t one = 1;
  ssize_t ignored = write(stop_fd_.get(), &one, sizeof(one));
  (void)ignored;
  reaper_.join();
  std::vector<uint64_t> ids;
  {
    MutexLock lock(&mu_);
    for (const auto& [id, s] : sessions_) ids.push_back(id);
  }
  for (uint64_t id : ids) End(id, "daemon stopping");
}

void SessionRegistry::Watch(int fd, uint64_t tag) {
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP;
  ev.data.u64 = tag;
  if (epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) {
    log::Error("sessions", "epoll_ctl(add fd {}): {}", fd, ErrnoText(errno));
  }
}

Result<SessionRegistry::Grant> SessionRegistry::Open(SessionIdentity identity, const PeerCredentials& peer,
                                                     SessionAccess access) {
  auto session = std::make_unique<Session>();
  if (getrandom(session->token.data(), session->token.size(), 0) != static_cast<ssize_t>(session->token.size())) {
    return Status::Internal(fmt::format("getrandom: {}", ErrnoText(errno)));
  }
  session->identity = std::move(identity);
  session->peer = peer;
  session->access = std::move(access);
  session->opened_ms = MonotonicMs();
  session->attached_unix_ms = UnixMs();
  if (peer.pid > 0) {
    session->pidfd.reset(static_cast<int>(syscall(SYS_pidfd_open, peer.pid, 0)));
    if (!session->pidfd) {
      if (errno == ESRCH) return Status::Unavailable(fmt::format("the attaching process {} already exited", peer.pid));
      log::Warning("sessions", "pidfd_open({}): {}; the session channel alone will detect its exit", peer.pid,
                   ErrnoText(errno));
    }
  }
  Grant grant{};
  grant.token = session->token;
  {
    MutexLock lock(&mu_);
    Status bounded = CheckPendingBounds(peer);
    if (!bounded.ok()) {
      refusal_log_.Warning("sessions", "Attach from pid {} uid {} refused: {}", peer.pid, peer.uid, bounded.message());
      return bounded;
    }
    grant.session_id = session->id = next_id_++;
    if (session->pidfd) Watch(session->pidfd.get(), PidfdTag(session->id));
    log::Info("sessions", "session {} opened: '{}' pid {} uid {} dp_rank {} tp_rank {} namespace '{}'{}", session->id,
              session->identity.client_name, peer.pid, peer.uid, session->identity.dp_rank,
              session->identity.tp_rank, session->identity.model_namespace,
              session->access.may_store() ? "" : " (read-only: " + session->access.store.message() + ")");
    sessions_.emplace(session->id, std::move(session));
  }
  return grant;
}

Status SessionRegistry::CheckPendingBounds(const PeerCredentials& peer) const {
  size_t pending_total = 0;
  size_t pending_uid = 0;
  for (const auto& [id, s] : sessions_) {
    if (s->channel) continue;
    ++pending_total;
    if (s->peer.uid == peer.uid) ++pending_uid;
  }
  if (limits_.max_pending_per_uid > 0 && pending_uid >= limits_.max_pending_per_uid) {
    return Status::ResourceExhausted(fmt::format(
        "uid {} already has {} sessions that have not opened their session channel (limit {} per uid, "
        "--max-pending-sessions-per-uid); open the channel of each session Attach granted (libflexkv does), "
        "Detach the ones you do not use, or retry once they time out ({} ms)",
        peer.uid, pending_uid, limits_.max_pending_per_uid, limits_.attach_timeout_ms));
  }
  if (limits_.max_pending_total > 0 && pending_total >= limits_.max_pending_total) {
    return Status::ResourceExhausted(fmt::format(
        "{} sessions of all uids have not opened their session channel (limit {}, --max-pending-sessions; uid {} "
        "holds {}); retry later, or have the operator raise the limit or find the client that does not open them",
        pending_total, limits_.max_pending_total, peer.uid, pending_uid));
  }
  if (limits_.fd_reserve > 0) {
    const size_t free_fds = FreeFds();
    if (free_fds < limits_.fd_reserve) {
      return Status::ResourceExhausted(fmt::format(
          "flexkvd has {} free fds, under its reserve of {} kept for the control plane (--fd-reserve); uid {} holds "
          "{} pending sessions; retry later, or have the operator raise LimitNOFILE",
          free_fds, limits_.fd_reserve, peer.uid, pending_uid));
    }
  }
  return Status::Ok();
}

Status SessionRegistry::Close(uint64_t session_id, std::span<const uint8_t> token, bool admin) {
  {
    MutexLock lock(&mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) return Status::NotFound(fmt::format("session {} does not exist", session_id));
    if (!admin && !TokensEqual(token, it->second->token)) {
      return Status::PermissionDenied(
          fmt::format("session_token does not match session {}; only its owner or an admin may detach it", session_id));
    }
  }
  End(session_id, "detached");
  return Status::Ok();
}

void SessionRegistry::AdoptChannel(UniqueFd fd, const PeerCredentials& peer) {
  SessionHello hello{};
  const ssize_t n = recv(fd.get(), &hello, sizeof(hello), MSG_DONTWAIT);
  if (n != static_cast<ssize_t>(sizeof(hello))) return;  // the acceptor saw it whole; a racing close drops it
  if (hello.protocol_version != kProtocolVersion) {
    ReplyHello(fd.get(), StatusCode::kFailedPrecondition,
               fmt::format("session channel protocol_version {} is not supported; this daemon speaks {}",
                           hello.protocol_version, kProtocolVersion));
    return;
  }
  MutexLock lock(&mu_);
  auto it = sessions_.find(hello.session_id);
  if (it == sessions_.end()) {
    ReplyHello(fd.get(), StatusCode::kNotFound, fmt::format("session {} does not exist (it may have timed out)", hello.session_id));
    return;
  }
  Session& s = *it->second;
  if (peer.uid != s.peer.uid || !TokensEqual(hello.token, s.token)) {
    ReplyHello(fd.get(), StatusCode::kPermissionDenied,
               fmt::format("session {} belongs to another process or the token is wrong", hello.session_id));
    return;
  }
  if (s.channel) {
    ReplyHello(fd.get(), StatusCode::kAlreadyExists, fmt::format("session {} already has its channel open", s.id));
    return;
  }
  std::vector<UniqueFd> fds;
  if (on_channel_open_) {
    auto opened = on_channel_open_(s.id, s.identity, s.access);
    if (!opened.ok()) {
      ReplyHello(fd.get(), opened.status().code(), opened.status().message());
      return;
    }
    fds = std::move(*opened);
  }
  std::vector<int> raw;
  for (const auto& f : fds) raw.push_back(f.get());
  if (!ReplyHello(fd.get(), StatusCode::kOk, "", raw)) return;  // the reaper ends it (attach timeout)
  s.channel = std::move(fd);
  Watch(s.channel.get(), ChannelTag(s.id));
  log::Debug("sessions", "session {} channel open (pid {})", s.id, peer.pid);
}

void SessionRegistry::End(uint64_t session_id, const std::string& reason) {
  std::unique_ptr<Session> gone;
  {
    MutexLock lock(&mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) return;
    gone = std::move(it->second);
    sessions_.erase(it);
    last_ended_ms_[gone->identity.model_namespace] = MonotonicMs();
  }
  // Closing the fds removes them from the epoll set.
  if (gone->channel) epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, gone->channel.get(), nullptr);
  if (gone->pidfd) epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, gone->pidfd.get(), nullptr);
  if (on_end_) on_end_(session_id, reason);
  log::Info("sessions", "session {} ('{}' pid {}) ended: {}", session_id, gone->identity.client_name, gone->peer.pid,
            reason);
}

void SessionRegistry::ReaperLoop() {
  epoll_event events[64];
  for (;;) {
    const int n = epoll_wait(epoll_fd_.get(), events, 64, 100);
    const int64_t now = MonotonicMs();
    last_turn_ms_.store(now, std::memory_order_relaxed);
    for (int i = 0; i < n; ++i) {
      const uint64_t tag = events[i].data.u64;
      if (tag == kStopTag) return;
      const uint64_t id = tag / 2;
      if (tag % 2 == 1) {
        End(id, "process exited");
        continue;
      }
      std::string reason;
      if (!ReadChannel(id, &reason)) End(id, reason);
    }
    std::vector<uint64_t> expired;
    {
      MutexLock lock(&mu_);
      for (const auto& [id, s] : sessions_) {
        if (!s->channel && now - s->opened_ms > limits_.attach_timeout_ms) expired.push_back(id);
      }
    }
    for (uint64_t id : expired) {
      End(id, fmt::format("never opened its session channel within {} ms of Attach", limits_.attach_timeout_ms));
    }
  }
}

bool SessionRegistry::ReadChannel(uint64_t session_id, std::string* reason) {
  int fd = -1;
  {
    MutexLock lock(&mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end() || !it->second->channel) return true;  // already ended
    fd = it->second->channel.get();
  }
  ChannelMessage msg{};
  std::vector<UniqueFd> fds;
  char peek;
  if (recv(fd, &peek, 1, MSG_PEEK | MSG_DONTWAIT) == 0) {
    *reason = "session channel closed";
    return false;
  }
  Status got = RecvWithFds(fd, &msg, sizeof(msg), &fds);
  if (!got.ok()) {
    *reason = "session channel: " + got.message();
    return false;
  }
  if (std::memcmp(msg.magic, kChannelMessageMagic, 4) != 0 ||
      msg.type != static_cast<uint32_t>(ChannelMessageType::kOfferFd) || fds.size() != 1) {
    *reason = fmt::format("protocol violation on the session channel (type {}, {} fds)", msg.type, fds.size());
    return false;
  }
  ChannelMessage ack{};
  std::memcpy(ack.magic, kChannelMessageMagic, 4);
  ack.type = static_cast<uint32_t>(ChannelMessageType::kOfferFdAck);
  ack.tag = msg.tag;
  {
    MutexLock lock(&mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) return true;
    size_t offered_total = 0;
    for (const auto& [id, other] : sessions_) offered_total += other->offered_fds.size();
    if (it->second->offered_fds.size() >= kMaxOfferedFds || offered_total >= OfferedFdBudget()) {
      ack.status_code = static_cast<uint32_t>(StatusCode::kResourceExhausted);
      log::Warning("sessions", "session {} offered an fd beyond the budget ({} of {} per session, {} of {} in all)",
                   session_id, it->second->offered_fds.size(), kMaxOfferedFds, offered_total, OfferedFdBudget());
    } else {
      it->second->offered_fds[msg.tag] = std::move(fds[0]);
    }
  }
  Status sent = SendWithFds(fd, &ack, sizeof(ack));
  if (!sent.ok()) {
    *reason = "session channel: " + sent.message();
    return false;
  }
  return true;
}

Status SessionRegistry::Authenticate(uint64_t session_id, std::span<const uint8_t> token) const {
  MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return Status::NotFound(fmt::format("session {} does not exist", session_id));
  if (!TokensEqual(token, it->second->token)) {
    return Status::PermissionDenied(fmt::format("session_token does not match session {}", session_id));
  }
  return Status::Ok();
}

Result<UniqueFd> SessionRegistry::TakeOfferedFd(uint64_t session_id, std::span<const uint8_t> token, uint32_t tag) {
  FLEXKV_RETURN_IF_ERROR(Authenticate(session_id, token));
  MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return Status::NotFound(fmt::format("session {} does not exist", session_id));
  auto fd = it->second->offered_fds.find(tag);
  if (fd == it->second->offered_fds.end()) {
    return Status::NotFound(fmt::format("no fd was offered under tag {} on session {}'s channel", tag, session_id));
  }
  UniqueFd out = std::move(fd->second);
  it->second->offered_fds.erase(fd);
  return out;
}

std::vector<SessionSnapshot> SessionRegistry::List() const {
  MutexLock lock(&mu_);
  std::vector<SessionSnapshot> out;
  out.reserve(sessions_.size());
  for (const auto& [id, s] : sessions_) {
    SessionSnapshot snap;
    snap.id = id;
    snap.identity = s->identity;
    snap.peer = s->peer;
    snap.channel_open = s->channel.valid();
    snap.attached_unix_ms = s->attached_unix_ms;
    out.push_back(std::move(snap));
  }
  return out;
}

size_t SessionRegistry::Count() const {
  MutexLock lock(&mu_);
  return sessions_.size();
}

Result<std::string> SessionRegistry::NamespaceOf(uint64_t session_id) const {
  MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return Status::NotFound(fmt::format("session {} is not attached", session_id));
  return it->second->identity.model_namespace;
}

size_t SessionRegistry::CountIn(std::string_view model_namespace) const {
  MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [id, s] : sessions_) n += s->identity.model_namespace == model_namespace ? 1 : 0;
  return n;
}

std::optional<int64_t> SessionRegistry::LastEndedMs(std::string_view model_namespace) const {
  MutexLock lock(&mu_);
  auto it = last_ended_ms_.find(model_namespace);
  if (it == last_ended_ms_.end()) return std::nullopt;
  return it->second;
}

}  // namespace flexkv
