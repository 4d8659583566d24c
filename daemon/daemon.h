// Daemon: assembles flexkvd's parts and runs them until SIGTERM/SIGINT. Destruction order matters:
// the gRPC server stops before the sessions it answers about, the sessions before the cache they pin.
#pragma once

#include "daemon/config/config.h"

namespace flexkv {

// Serves until SIGTERM or SIGINT, then drains (bounded by config.drain_timeout_s) and exits.
// Returns the process exit code: 0 after a clean stop, 1 when startup failed (reason logged),
// kPoolLostExitCode (75, daemon/cache/pool_guard.h) when the pool file was truncated under it (reason logged).
int RunDaemon(const DaemonConfig& config);

}  // namespace flexkv
