// The daemon's listening socket and its lock. Created with its final mode (0660) before anyone can
// connect; a second daemon on the same path is refused with the holder's pid; a stale socket from a
// killed daemon is replaced. Under systemd socket activation the passed socket is adopted instead.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>

#include "common/unique_fd.h"
#include "flexkv/status.h"

namespace flexkv {

class ControlSocket {
 public:
  // Takes `<path>.lock` (flock, holds our pid), then binds a listening socket at `path` with mode 0660
  // and group `group` (when set). Creates a missing parent directory with `dir_mode`.
  // FAILED_PRECONDITION naming the pid when another daemon holds the lock.
  static Result<ControlSocket> Bind(const std::string& path, std::optional<gid_t> group, mode_t dir_mode);

  // Adopts the single listening socket systemd passed (LISTEN_FDS); NOT_FOUND when none was passed.
  static Result<ControlSocket> FromSystemd(const std::string& path_hint);

  ControlSocket(ControlSocket&& other) noexcept;
  ControlSocket& operator=(ControlSocket&&) = delete;
  ControlSocket(const ControlSocket&) = delete;
  ControlSocket& operator=(const ControlSocket&) = delete;
  // Removes the socket and the lock file when this process created them.
  ~ControlSocket();

  int fd() const { return listen_fd_.get(); }
  const std::string& path() const { return path_; }
  bool activated_by_systemd() const { return from_systemd_; }

 private:
  ControlSocket() = default;
  UniqueFd listen_fd_;
  UniqueFd lock_fd_;
  std::string path_;
  bool owns_path_ = false;
  bool from_systemd_ = false;
};

}  // namespace flexkv
