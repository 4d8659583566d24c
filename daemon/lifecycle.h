// Lifecycle: the daemon's serving state (serving → draining → drained → serving) and the count of
// data-plane requests in flight that drain waits for. Thread-safe; transitions are reported to a
// listener (the systemd notifier) while the transition lock is held, so the listener sees them in order.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"

namespace flexkv {

enum class ServingState { kServing, kDraining, kDrained };

// "serving" | "draining" | "drained" (the GetStatus contract).
const char* ServingStateName(ServingState state);

class Lifecycle {
 public:
  using Listener = std::function<void(ServingState)>;
  void SetListener(Listener listener);

  ServingState state() const { return state_.load(); }
  bool admitting() const { return state() == ServingState::kServing; }

  // Stops admitting new work. Returns the state after the call (drained at once when nothing is in flight).
  ServingState Drain();
  // Admits work again. Returns kServing.
  ServingState Resume();

  // Admission of one data-plane request: false while draining. Every true must be paired with Finish().
  bool TryBegin();
  void Finish();
  uint64_t inflight() const { return inflight_.load(); }

 private:
  void Set(ServingState next) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeDrained() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Mutex mu_;  // serializes transitions; state_ and inflight_ are read without it
  std::atomic<ServingState> state_{ServingState::kServing};
  std::atomic<uint64_t> inflight_{0};
  Listener listener_;
};

}  // namespace flexkv
