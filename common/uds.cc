// Unix-domain socket helpers; see uds.h.
#include "common/uds.h"

#include <fmt/format.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <cerrno>
#include <cstring>

namespace flexkv {

std::string ErrnoText(int err) {
  char buf[256];
  return std::string(strerror_r(err, buf, sizeof(buf)));
}

Result<PeerCredentials> GetPeerCredentials(int fd) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return Status::Internal(fmt::format("getsockopt(SO_PEERCRED): {}", ErrnoText(errno)));
  }
  PeerCredentials out{cred.pid, cred.uid, cred.gid, {}};
  // Supplementary groups decide admin rights (--admin-group); an empty list only ever denies.
  std::vector<gid_t> groups(64);
  socklen_t glen = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
  int rc = getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &glen);
  if (rc != 0 && errno == ERANGE) {
    groups.resize(glen / sizeof(gid_t));
    rc = getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &glen);
  }
  groups.resize(rc == 0 ? glen / sizeof(gid_t) : 0);
  out.groups = std::move(groups);
  return out;
}

bool PeerCredentials::InGroup(gid_t g) const {
  if (gid == g) return true;
  for (gid_t x : groups) {
    if (x == g) return true;
  }
  return false;
}

Result<UniqueFd> ConnectUnix(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return Status::InvalidArgument(
        fmt::format("socket path '{}' has {} bytes; expected 1..{}", path, path.size(), sizeof(addr.sun_path) - 1));
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) return Status::Internal(fmt::format("socket(AF_UNIX): {}", ErrnoText(errno)));
  int rc;
  do {
    rc = connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int err = errno;
    switch (err) {
      case ENOENT:
        return Status::NotFound(fmt::format("no socket at {} (is flexkvd running?)", path));
      case ECONNREFUSED:
        return Status::Unavailable(fmt::format("nobody is listening on {} (flexkvd stopped or starting)", path));
      case EACCES:
      case EPERM:
        return Status::PermissionDenied(fmt::format(
            "connecting to {}: {}; check that your user is in the socket's group (ls -l {})", path,
            ErrnoText(err), path));
      default:
        return Status::Unavailable(fmt::format("connecting to {}: {}", path, ErrnoText(err)));
    }
  }
  return fd;
}

Status SendWithFds(int sock, const void* data, size_t len, std::span<const int> fds) {
  const auto* bytes = static_cast<const char*>(data);
  size_t sent = 0;
  bool fds_pending = !fds.empty();
  while (sent < len) {
    iovec iov{const_cast<char*>(bytes + sent), len - sent};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 8)];
    if (fds_pending) {
      if (fds.size() > 8) return Status::InvalidArgument("at most 8 fds per message");
      std::memset(control, 0, sizeof(control));
      msg.msg_control = control;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
      cmsghdr* cm = CMSG_FIRSTHDR(&msg);
      cm->cmsg_level = SOL_SOCKET;
      cm->cmsg_type = SCM_RIGHTS;
      cm->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      std::memcpy(CMSG_DATA(cm), fds.data(), sizeof(int) * fds.size());
    }
    ssize_t n = sendmsg(sock, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::Unavailable(fmt::format("sendmsg: {}", ErrnoText(errno)));
    }
    fds_pending = false;
    sent += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status RecvWithFds(int sock, void* data, size_t len, std::vector<UniqueFd>* fds) {
  auto* bytes = static_cast<char*>(data);
  size_t got = 0;
  while (got < len) {
    iovec iov{bytes + got, len - got};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 8)];
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {  // SO_RCVTIMEO expired, or nothing on a non-blocking socket
        return Status::DeadlineExceeded("recvmsg: nothing arrived before the receive timeout");
      }
      return Status::Unavailable(fmt::format("recvmsg: {}", ErrnoText(errno)));
    }
    for (cmsghdr* cm = CMSG_FIRSTHDR(&msg); cm != nullptr; cm = CMSG_NXTHDR(&msg, cm)) {
      if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
        const size_t count = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count; ++i) {
          int fd;
          std::memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
          if (fds != nullptr) {
            fds->emplace_back(fd);
          } else {
            ::close(fd);
          }
        }
      }
    }
    if ((msg.msg_flags & MSG_CTRUNC) != 0) return Status::DataLoss("file descriptors were truncated in transit");
    if (n == 0) return Status::Unavailable("peer closed the connection");
    got += static_cast<size_t>(n);
  }
  return Status::Ok();
}

}  // namespace flexkv
