// Where a default flexkvd puts its socket and pool, so that flexkvctl and the client library find it
// without flags. The systemd unit passes explicit paths; these defaults serve `scripts/run.sh`.
#pragma once

#include <string>

namespace flexkv {

// The socket of the systemd service (systemd/flexkvd.socket).
inline constexpr const char* kSystemSocketPath = "/run/flexkvd/flexkvd.sock";

// Root: /run/flexkvd/flexkvd.sock. Others: $XDG_RUNTIME_DIR/flexkvd/flexkvd.sock, or
// /tmp/flexkvd-<uid>/flexkvd.sock without XDG_RUNTIME_DIR.
std::string DefaultSocketPath();

// The socket a client should use: `flag` when non-empty, else $FLEXKV_SOCKET, else DefaultSocketPath(),
// else (when that does not exist but the service's does) kSystemSocketPath.
std::string ResolveSocketPath(const std::string& flag);

}  // namespace flexkv
