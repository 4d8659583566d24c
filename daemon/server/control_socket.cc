// Listening socket with lock; see control_socket.h.
#include "daemon/server/control_socket.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include "common/log.h"
#include "common/uds.h"

namespace flexkv {
namespace {

Status MakeParentDir(const std::string& path, mode_t mode) {
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (dir.empty() || std::filesystem::exists(dir)) return Status::Ok();
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec || chmod(dir.c_str(), mode) != 0) {
    return Status::FailedPrecondition(fmt::format("cannot create socket directory {}: {}", dir.string(),
                                                  ec ? ec.message() : ErrnoText(errno)));
  }
  return Status::Ok();
}

}  // namespace

Result<ControlSocket> ControlSocket::Bind(const std::string& path, std::optional<gid_t> group, mode_t dir_mode) {
  FLEXKV_RETURN_IF_ERROR(MakeParentDir(path, dir_mode));
  ControlSocket sock;
  sock.path_ = path;

  const std::string lock_path = path + ".lock";
  sock.lock_fd_.reset(open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
  if (!sock.lock_fd_) {
    return Status::FailedPrecondition(fmt::format("cannot open lock file {}: {}", lock_path, ErrnoText(errno)));
  }
  if (flock(sock.lock_fd_.get(), LOCK_EX | LOCK_NB) != 0) {
    char buf[32] = {};
    ssize_t n = pread(sock.lock_fd_.get(), buf, sizeof(buf) - 1, 0);
    std::string holder = n > 0 ? std::string(buf, static_cast<size_t>(n)) : "unknown";
    while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
    return Status::FailedPrecondition(fmt::format(
        "another flexkvd (pid {}) is serving {} (it holds {}); stop it first or pick another --socket", holder, path,
        lock_path));
  }
  const std::string pid = fmt::format("{}\n", getpid());
  if (ftruncate(sock.lock_fd_.get(), 0) != 0 ||
      pwrite(sock.lock_fd_.get(), pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    return Status::Internal(fmt::format("cannot write pid into {}: {}", lock_path, ErrnoText(errno)));
  }

  // Bind under a temporary name, give it its final mode and group, listen, then rename it into place:
  // nobody can connect before the mode is right, and a stale socket is replaced atomically.
  const std::string tmp = fmt::format("{}.{}.tmp", path, getpid());
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (tmp.size() >= sizeof(addr.sun_path)) {
    return Status::InvalidArgument(
        fmt::format("socket path {} is too long ({} bytes incl. temp suffix; expected < {})", path, tmp.size(),
                    sizeof(addr.sun_path)));
  }
  std::memcpy(addr.sun_path, tmp.c_str(), tmp.size() + 1);
  ::unlink(tmp.c_str());
  sock.listen_fd_.reset(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!sock.listen_fd_) return Status::Internal(fmt::format("socket(): {}", ErrnoText(errno)));
  // The socket file is created by bind() with mode ~umask; a restrictive umask keeps it 0600 until chmod.
  const mode_t old_umask = umask(0177);
  const int rc = bind(sock.listen_fd_.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  const int bind_errno = errno;
  umask(old_umask);
  if (rc != 0) return Status::FailedPrecondition(fmt::format("bind({}): {}", tmp, ErrnoText(bind_errno)));
  if (group.has_value() && chown(tmp.c_str(), static_cast<uid_t>(-1), *group) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return Status::FailedPrecondition(fmt::format("chown({}, group {}): {}", tmp, *group, ErrnoText(err)));
  }
  if (chmod(tmp.c_str(), 0660) != 0 || listen(sock.listen_fd_.get(), 512) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return Status::FailedPrecondition(fmt::format("chmod/listen({}): {}", tmp, ErrnoText(err)));
  }
  struct stat st {};
  if (lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      ::unlink(tmp.c_str());
      return Status::FailedPrecondition(fmt::format("{} exists and is not a socket; refusing to replace it", path));
    }
    log::Warning("server", "replacing stale socket {} left by a daemon that did not exit cleanly", path);
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return Status::FailedPrecondition(fmt::format("rename({} -> {}): {}", tmp, path, ErrnoText(err)));
  }
  sock.owns_path_ = true;
  return sock;
}

Result<ControlSocket> ControlSocket::FromSystemd(const std::string& path_hint) {
  const int n = sd_listen_fds(1);
  if (n <= 0) return Status::NotFound("no socket passed by systemd");
  if (n > 1) return Status::InvalidArgument(fmt::format("systemd passed {} sockets; expected exactly 1", n));
  const int fd = SD_LISTEN_FDS_START;
  if (sd_is_socket_unix(fd, SOCK_STREAM, 1, nullptr, 0) <= 0) {
    return Status::InvalidArgument("the socket systemd passed is not a listening AF_UNIX stream socket");
  }
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0 || fcntl(fd, F_SETFD, FD_CLOEXEC) != 0) {
    return Status::Internal(fmt::format("fcntl on the activated socket: {}", ErrnoText(errno)));
  }
  ControlSocket sock;
  sock.listen_fd_.reset(fd);
  sockaddr_un addr{};
  socklen_t len = sizeof(addr);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0 && addr.sun_path[0] != '\0') {
    sock.path_ = addr.sun_path;
  } else {
    sock.path_ = path_hint;
  }
  sock.from_systemd_ = true;
  return sock;
}

ControlSocket::ControlSocket(ControlSocket&& other) noexcept
    : listen_fd_(std::move(other.listen_fd_)),
      lock_fd_(std::move(other.lock_fd_)),
      path_(std::move(other.path_)),
      owns_path_(std::exchange(other.owns_path_, false)),
      from_systemd_(other.from_systemd_) {}

ControlSocket::~ControlSocket() {
  if (owns_path_) {
    ::unlink(path_.c_str());
    ::unlink((path_ + ".lock").c_str());
  }
}

}  // namespace flexkv
