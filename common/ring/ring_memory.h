// What both ends of the session ring transport share: the owner of one ring mapping and the futex calls on
// the completion index. Internal to common/ring/.
#pragma once

#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <utility>

#include "common/ring_layout.h"

namespace flexkv::ring {

// Owns one MAP_SHARED mapping of a ring memfd; unmaps it on destruction. Move-only.
class RingMapping {
 public:
  RingMapping() = default;
  RingMapping(uint8_t* base, uint64_t bytes) : base_(base), bytes_(bytes) {}
  ~RingMapping() {
    if (base_ != nullptr) munmap(base_, bytes_);
  }
  RingMapping(const RingMapping&) = delete;
  RingMapping& operator=(const RingMapping&) = delete;
  RingMapping(RingMapping&& other) noexcept
      : base_(std::exchange(other.base_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  RingMapping& operator=(RingMapping&& other) noexcept {
    if (this != &other) {
      if (base_ != nullptr) munmap(base_, bytes_);
      base_ = std::exchange(other.base_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }

  uint8_t* base() const { return base_; }
  uint64_t bytes() const { return bytes_; }
  RingHeader* header() const { return reinterpret_cast<RingHeader*>(base_); }

 private:
  uint8_t* base_ = nullptr;
  uint64_t bytes_ = 0;
};

// The futex is shared between processes (no FUTEX_PRIVATE_FLAG): the word lives in the ring memfd.
inline void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

// Sleeps while *word == expected, at most `timeout_ns`; spurious returns are fine (callers re-check).
inline void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns) {
  timespec ts{static_cast<time_t>(timeout_ns / 1000000000), static_cast<long>(timeout_ns % 1000000000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

}  // namespace flexkv::ring
