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

class Lifecycle;

// One admitted data-plane request (Lifecycle::Admit), counted in flight - which a drain waits for - until it ends:
// End() or destruction, whichever comes first, exactly once. Move-only, so that the request's last owner (an
// answer path, a copy's completion, a waiting store) ends it and no path can forget or repeat it. An empty one (the
// answer while draining, or moved from) counts nothing.
class InFlight {
 public:
  InFlight() = default;
  InFlight(InFlight&& other) noexcept;
  InFlight& operator=(InFlight&& other) noexcept;
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;
  ~InFlight() { End(); }

  explicit operator bool() const { return lifecycle_ != nullptr; }
  // Ends the request now (the drain may complete); nothing when it was ended or is empty.
  void End();

 private:
  friend class Lifecycle;
  explicit InFlight(Lifecycle* lifecycle) : lifecycle_(lifecycle) {}
  Lifecycle* lifecycle_ = nullptr;
};

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

  // Admission of one data-plane request: empty (false) while draining. The Lifecycle must outlive it.
  InFlight Admit();
  uint64_t inflight() const { return inflight_.load(); }

 private:
  friend class InFlight;
  bool TryBegin();
  void Finish();
  void Set(ServingState next) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeDrained() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Mutex mu_;  // serializes transitions; state_ and inflight_ are read without it
  std::atomic<ServingState> state_{ServingState::kServing};
  std::atomic<uint64_t> inflight_{0};
  Listener listener_;
};

}  // namespace flexkv
