// Clocks and the spin-wait hint, one copy for the daemon, the client library and the benches. Header-only: these
// sit on the ring hot path and must inline.
#pragma once

#include <time.h>

#include <cstdint>

namespace flexkv {

// CLOCK_MONOTONIC in nanoseconds: for intervals and latency figures, never for wall time.
inline int64_t NowNs() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

// CLOCK_MONOTONIC in milliseconds: liveness stamps and timeouts.
inline int64_t MonotonicMs() { return NowNs() / 1000000; }

// Tells the CPU this thread is spin-waiting (x86 `pause`): saves power and yields the core's pipeline to a
// sibling hyper-thread. A no-op elsewhere.
inline void CpuRelax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

}  // namespace flexkv
