// See lifecycle.h.
#include "daemon/lifecycle/lifecycle.h"

namespace flexkv {

const char* ServingStateName(ServingState state) {
  switch (state) {
    case ServingState::kServing: return "serving";
    case ServingState::kDraining: return "draining";
    case ServingState::kDrained: return "drained";
  }
  return "serving";
}

void Lifecycle::SetListener(Listener listener) { listener_ = std::move(listener); }

void Lifecycle::Set(ServingState next) {
  const ServingState prev = state_.exchange(next);
  if (prev != next && listener_) listener_(next);
}

ServingState Lifecycle::Drain() {
  MutexLock lock(&mu_);
  if (state() == ServingState::kServing) Set(ServingState::kDraining);
  MaybeDrained();
  return state();
}

ServingState Lifecycle::Resume() {
  MutexLock lock(&mu_);
  Set(ServingState::kServing);
  return state();
}

InFlight::InFlight(InFlight&& other) noexcept : lifecycle_(other.lifecycle_) { other.lifecycle_ = nullptr; }

InFlight& InFlight::operator=(InFlight&& other) noexcept {
  if (this != &other) {
    End();
    lifecycle_ = other.lifecycle_;
    other.lifecycle_ = nullptr;
  }
  return *this;
}

void InFlight::End() {
  if (lifecycle_ == nullptr) return;
  Lifecycle* lifecycle = lifecycle_;
  lifecycle_ = nullptr;
  lifecycle->Finish();
}

InFlight Lifecycle::Admit() { return TryBegin() ? InFlight(this) : InFlight(); }

bool Lifecycle::TryBegin() {
  inflight_.fetch_add(1);
  if (state() != ServingState::kServing) {
    Finish();
    return false;
  }
  return true;
}

void Lifecycle::Finish() {
  if (inflight_.fetch_sub(1) == 1 && state() == ServingState::kDraining) {
    MutexLock lock(&mu_);
    MaybeDrained();
  }
}

void Lifecycle::MaybeDrained() {
  if (state() == ServingState::kDraining && inflight_.load() == 0) {
    Set(ServingState::kDrained);
  }
}

}  // namespace flexkv
