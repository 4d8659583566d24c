// PoolLock: keeps a second flexkvd off a pool file. Exclusive flock(2) locks on `<pool>.lock` (which names the
// holder's pid) and on the pool file itself, held for the daemon's life.
#pragma once

#include <string>

#include "common/unique_fd.h"
#include "flexkv/status.h"

namespace flexkv {

// Removing `<pool>.lock` (a cleaner, an operator) must not let a second daemon in: the lock that counts is the
// one on the pool file's inode, taken as soon as the file exists. Not thread-safe; owned by the Cache, whose
// lock serializes its calls. Move-only; the locks go with the fds when it is destroyed.
class PoolLock {
 public:
  PoolLock() = default;
  PoolLock(PoolLock&&) noexcept = default;
  PoolLock& operator=(PoolLock&&) noexcept = default;

  // Locks `<pool_path>.lock` (created if missing; this pid is written to it) and the pool file when it exists.
  // FAILED_PRECONDITION naming the holder's pid (from /proc/locks, else from the .lock file) when another
  // process holds either; FAILED_PRECONDITION with the errno text when a file cannot be opened.
  static Result<PoolLock> Acquire(const std::string& pool_path);

  // Locks the pool file at the path given to Acquire, replacing the lock on an earlier file there (a pool
  // created or replaced after Acquire). Same errors as Acquire.
  Status LockPoolFile();

 private:
  std::string pool_path_;
  UniqueFd lock_file_;
  UniqueFd pool_file_;
};

}  // namespace flexkv
