// PoolGuard: a running flexkvd whose pool file shrinks under it (truncated by a cleaner, an operator, another
// program) exits with a clear fatal message and kPoolLostExitCode instead of dying silently of SIGBUS.
#pragma once

#include <cstdint>
#include <string>

#include "flexkv/status.h"

namespace flexkv {

// The exit code of a flexkvd whose pool file was truncated under it: 75 (EX_TEMPFAIL). Not 0, so systemd's
// Restart=on-failure restarts it; the restarted daemon refuses the short file (its blocks are lost) until it is
// started with --discard-pool, so no lost block is ever served.
inline constexpr int kPoolLostExitCode = 75;

// Installs the process-wide SIGBUS handler (sigaction, SA_SIGINFO). A fault inside the watched pool's mapping
// writes one fixed line naming the pool file and the faulting offset to stderr (write(2), async-signal-safe)
// and _exits with kPoolLostExitCode; any other SIGBUS gets the default action (a core dump), as before.
// Call once at start, before any thread starts; calling again is harmless.
void InstallPoolFaultHandler();

// OK while every watched pool file still has the size it was mapped with (or no pool is watched). DATA_LOSS, naming
// the first file that shrank, its size now and the size it must have. One fstat(2); thread-safe. The daemon's main
// loop calls it once a tick, so that a shrunk file is reported before a copy faults on it.
Status CheckWatchedPoolFile();

// PoolFileWatch: for its lifetime, the pool mapping [base, base + bytes) of the file open as `fd` is one of those
// the SIGBUS handler and CheckWatchedPoolFile guard: up to 64 pools at once (one per cache domain); a newer watch of
// the same base replaces an older one, whose destruction then changes nothing. `fd` is duplicated; the caller
// keeps its own.
// Not copyable or movable; construct and destroy it on one thread at a time.
class PoolFileWatch {
 public:
  PoolFileWatch(const std::string& path, int fd, const uint8_t* base, uint64_t bytes);
  ~PoolFileWatch();
  PoolFileWatch(const PoolFileWatch&) = delete;
  PoolFileWatch& operator=(const PoolFileWatch&) = delete;

 private:
  const uint8_t* base_;
};

}  // namespace flexkv
