// LaunchDeadline: the latest CLOCK_MONOTONIC time at which a Load's copies may start (SubmitDescriptor::
// launch_deadline_ns, ring layout 6). One object is shared by every copy of the load (each TP rank's, each hybrid
// component's, each host worker's part); a backend asks Launch() right before that copy moves its first byte, after
// every queue it waited in, and copies nothing when it is refused. So a client that gave up on the load at its
// deadline knows that no byte of it lands later: whatever started before the deadline finishes promptly, the rest
// never starts. Thread-safe.
#pragma once

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "common/clock.h"
#include "common/mutex.h"
#include "flexkv/status.h"

namespace flexkv {

class LaunchDeadline {
 public:
  explicit LaunchDeadline(int64_t deadline_ns) : deadline_ns_(deadline_ns) {}

  int64_t deadline_ns() const { return deadline_ns_; }

  // OK when the copy may start now (the deadline has not passed); DEADLINE_EXCEEDED, saying whether any other copy
  // of the load started before it, when it has. A refused copy must not touch the engine's memory.
  Status Launch() {
    MutexLock lock(&mu_);
    const int64_t now = NowNs();
    if (now <= deadline_ns_) {
      ++launched_;
      return Status::Ok();
    }
    // The completion's message holds 87 bytes: these fit.
    if (launched_ == 0) return Status::DeadlineExceeded("not launched by its launch deadline; nothing was copied");
    return Status::DeadlineExceeded("launch deadline passed with part of the copies started: blocks partly written");
  }

  // How many copies Launch() let start.
  uint64_t launched() const {
    MutexLock lock(&mu_);
    return launched_;
  }

 private:
  const int64_t deadline_ns_;
  mutable Mutex mu_;
  uint64_t launched_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace flexkv
