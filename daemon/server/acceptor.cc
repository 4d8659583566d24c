// Connection routing; see acceptor.h.
#include "daemon/server/acceptor.h"

#include <fmt/format.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>

#include <cerrno>
#include <cstring>
#include <chrono>
#include <thread>
#include <vector>

#include "common/log.h"
#include "common/session_channel.h"

namespace flexkv {
namespace {

constexpr int64_t kRouteTimeoutMs = 5000;  // a connection must say what it is within this
constexpr size_t kMaxPending = 1024;       // unrouted connections kept at once

}  // namespace

Acceptor::Acceptor(int listen_fd, Handlers handlers) : listen_fd_(listen_fd), handlers_(std::move(handlers)) {}

Acceptor::~Acceptor() { Stop(); }

Status Acceptor::Start() {
  epoll_fd_.reset(epoll_create1(EPOLL_CLOEXEC));
  stop_fd_.reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!epoll_fd_ || !stop_fd_) return Status::Internal(fmt::format("epoll/eventfd: {}", ErrnoText(errno)));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = listen_fd_;
  if (epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, listen_fd_, &ev) != 0) {
    return Status::Internal(fmt::format("epoll_ctl(listen): {}", ErrnoText(errno)));
  }
  ev.data.fd = stop_fd_.get();
  if (epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, stop_fd_.get(), &ev) != 0) {
    return Status::Internal(fmt::format("epoll_ctl(stop): {}", ErrnoText(errno)));
  }
  last_turn_ms_ = MonotonicMs();
  thread_ = std::thread([this] { Loop(); });
  return Status::Ok();
}

void Acceptor::Stop() {
  if (!thread_.joinable()) return;
  uint64_t one = 1;
  ssize_t ignored = write(stop_fd_.get(), &one, sizeof(one));
  (void)ignored;
  thread_.join();
  pending_.clear();  // closes them
}

void Acceptor::Loop() {
  std::vector<epoll_event> events(64);
  for (;;) {
    const int n = epoll_wait(epoll_fd_.get(), events.data(), static_cast<int>(events.size()), 500);
    const int64_t now = MonotonicMs();
    last_turn_ms_.store(now, std::memory_order_relaxed);
    if (n < 0 && errno != EINTR) {
      log::Error("server", "epoll_wait in acceptor: {}", ErrnoText(errno));
      continue;
    }
    for (int i = 0; i < n; ++i) {
      const int fd = events[i].data.fd;
      if (fd == stop_fd_.get()) return;
      if (fd == listen_fd_) {
        AcceptAll();
      } else {
        Route(fd);
      }
    }
    std::vector<int> expired;
    for (const auto& [fd, p] : pending_) {
      if (p.deadline_ms <= now) expired.push_back(fd);
    }
    for (int fd : expired) {
      silent_log_.Warning("server", "closing connection from pid {} uid {}: it sent no request within {} ms",
                   pending_[fd].peer.pid, pending_[fd].peer.uid, kRouteTimeoutMs);
      Drop(fd);
    }
  }
}

void Acceptor::AcceptAll() {
  for (;;) {
    UniqueFd fd(accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!fd) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE) {
        // Out of fds: the listening socket stays readable, so back off instead of spinning.
        out_of_fds_log_.Warning("server", "accept: {}; connections wait until fds are free (raise LimitNOFILE?)",
                                ErrnoText(errno));
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        return;
      }
      if (errno != EAGAIN && errno != EWOULDBLOCK) log::Warning("server", "accept: {}", ErrnoText(errno));
      return;
    }
    auto peer = GetPeerCredentials(fd.get());
    if (!peer.ok() || pending_.size() >= kMaxPending) {
      refused_log_.Warning("server", "refusing a connection: {}",
                   peer.ok() ? std::string("too many connections that have not sent a request yet")
                             : peer.status().ToString());
      continue;  // closed here
    }
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.fd = fd.get();
    if (epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, fd.get(), &ev) != 0) {
      log::Warning("server", "epoll_ctl(accepted): {}", ErrnoText(errno));
      continue;  // closed here
    }
    const int key = fd.get();
    pending_[key] = Pending{std::move(fd), *peer, MonotonicMs() + kRouteTimeoutMs};
  }
}

void Acceptor::Drop(int fd) {
  epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, fd, nullptr);
  pending_.erase(fd);  // closes it
}

void Acceptor::Route(int fd) {
  auto it = pending_.find(fd);
  if (it == pending_.end()) return;
  char head[sizeof(SessionHello)];
  const ssize_t n = recv(fd, head, sizeof(head), MSG_PEEK | MSG_DONTWAIT);
  if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
    Drop(fd);  // closed before saying anything
    return;
  }
  if (n < 4) return;  // wait for more bytes
  const PeerCredentials peer = it->second.peer;
  if (std::memcmp(head, "PRI ", 4) == 0) {
    epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, fd, nullptr);
    UniqueFd owned = std::move(it->second.fd);
    pending_.erase(it);
    handlers_.on_grpc(owned.release(), peer);  // it owns the fd from here (gRPC takes it over)
    return;
  }
  if (std::memcmp(head, kSessionChannelMagic, 4) == 0) {
    if (static_cast<size_t>(n) < sizeof(SessionHello)) return;  // the rest of the hello is on its way
    epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, fd, nullptr);
    UniqueFd owned = std::move(it->second.fd);
    pending_.erase(it);
    handlers_.on_session_channel(std::move(owned), peer);
    return;
  }
  log::Warning("server", "closing connection from pid {} uid {}: it speaks neither gRPC (HTTP/2) nor the session channel",
               peer.pid, peer.uid);
  Drop(fd);
}

}  // namespace flexkv
