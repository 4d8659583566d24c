// Unix-domain socket helpers: connect, peer credentials, and passing fds with SCM_RIGHTS.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "common/unique_fd.h"
#include "flexkv/status.h"

namespace flexkv {

// Identity of the process on the other end, from SO_PEERCRED (taken by the kernel at connect time).
struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;  // supplementary groups (SO_PEERGROUPS)

  bool InGroup(gid_t g) const;
};

// Reads SO_PEERCRED and SO_PEERGROUPS.
Result<PeerCredentials> GetPeerCredentials(int fd);

// strerror-style text for an errno value.
std::string ErrnoText(int err);

// Connects a blocking, close-on-exec stream socket to `path`. Errors keep the cause distinguishable:
// NOT_FOUND (no socket there), UNAVAILABLE (nobody listening), PERMISSION_DENIED, INVALID_ARGUMENT
// (path too long); each message names the path.
Result<UniqueFd> ConnectUnix(const std::string& path);

// Sends all of `data` with `fds` attached to the first byte. Retries EINTR and short writes.
Status SendWithFds(int sock, const void* data, size_t len, std::span<const int> fds = {});

// Receives exactly `len` bytes (blocking socket) and any fds attached to them (at most 8). Fds that
// arrive are owned by `fds`. UNAVAILABLE on EOF or a socket error; DEADLINE_EXCEEDED when SO_RCVTIMEO expires
// (or nothing is there on a non-blocking socket); DATA_LOSS when the kernel truncated the fd list.
Status RecvWithFds(int sock, void* data, size_t len, std::vector<UniqueFd>* fds);

}  // namespace flexkv
