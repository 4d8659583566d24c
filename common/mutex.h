// flexkv::Mutex: a mutex that both checkers see. Clang's -Wthread-safety reads its annotations (ABSL_GUARDED_BY
// and friends work with it as with absl::Mutex), and ThreadSanitizer sees its synchronisation, because it is a
// std::mutex (pthread, which TSan intercepts). absl::Mutex has only the first property in this project's builds:
// Debian's abseil is not compiled with -fsanitize=thread, so TSan cannot see absl::Mutex lock or unlock and
// reports every access it guards as a data race (tests/tsan.supp). Header-only.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"

namespace flexkv {

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  // Releases the lock, waits for `cv` to be notified (or a spurious wake-up), takes the lock again. Callers loop
  // on their condition: `while (!done_) mu_.Wait(&cv_);`.
  void Wait(std::condition_variable* cv) ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    std::unique_lock<std::mutex> lock(mu_, std::adopt_lock);
    cv->wait(lock);
    lock.release();  // still held: the caller's MutexLock unlocks it
  }
  // Wait, but for at most `timeout`.
  template <typename Rep, typename Period>
  void WaitFor(std::condition_variable* cv, std::chrono::duration<Rep, Period> timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    std::unique_lock<std::mutex> lock(mu_, std::adopt_lock);
    cv->wait_for(lock, timeout);
    lock.release();
  }

 private:
  std::mutex mu_;
};

// Holds a Mutex for its scope, like absl::MutexLock.
class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

}  // namespace flexkv
