// See pool_lock.h.
#include "daemon/cache/pool_lock.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <fstream>

#include "common/uds.h"

namespace flexkv {
namespace {

// The pid holding a flock on the file open as `fd`, from /proc/locks; 0 when none is listed.
pid_t FlockHolder(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0) return 0;
  std::ifstream locks("/proc/locks");
  std::string line;
  while (std::getline(locks, line)) {
    // "1: FLOCK  ADVISORY  WRITE 1234 00:2d:5678 0 EOF"; waiters ("1: -> FLOCK ...") do not hold it.
    char kind[16] = {};
    int pid = 0;
    unsigned major_id = 0, minor_id = 0;
    unsigned long inode = 0;
    if (std::sscanf(line.c_str(), "%*d: %15s %*s %*s %d %x:%x:%lu", kind, &pid, &major_id, &minor_id, &inode) == 5 &&
        std::string_view(kind) == "FLOCK" && major_id == major(st.st_dev) && minor_id == minor(st.st_dev) &&
        inode == st.st_ino) {
      return pid;
    }
  }
  return 0;
}

// The pid written to the .lock file, or "unknown".
std::string RecordedPid(int fd) {
  char buf[32] = {};
  const ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
  if (n <= 0) return "unknown";
  return std::string(buf, static_cast<size_t>(n - (buf[n - 1] == '\n' ? 1 : 0)));
}

// Takes an exclusive flock on `fd` (the file at `path`), or says who holds it.
Status LockExclusive(int fd, const std::string& path, const std::string& pool_path, const std::string& fallback_pid) {
  if (flock(fd, LOCK_EX | LOCK_NB) == 0) return Status::Ok();
  if (errno != EWOULDBLOCK) return Status::FailedPrecondition(fmt::format("cannot lock {}: {}", path, ErrnoText(errno)));
  const pid_t holder = FlockHolder(fd);
  return Status::FailedPrecondition(fmt::format(
      "another flexkvd (pid {}) uses the pool {} (it holds the lock on {}); give each daemon its own --pool-path",
      holder > 0 ? std::to_string(holder) : fallback_pid, pool_path, path));
}

}  // namespace

Result<PoolLock> PoolLock::Acquire(const std::string& pool_path) {
  PoolLock lock;
  lock.pool_path_ = pool_path;
  const std::string lock_path = pool_path + ".lock";
  lock.lock_file_.reset(open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  if (!lock.lock_file_) return Status::FailedPrecondition(fmt::format("cannot open {}: {}", lock_path, ErrnoText(errno)));
  FLEXKV_RETURN_IF_ERROR(LockExclusive(lock.lock_file_.get(), lock_path, pool_path, RecordedPid(lock.lock_file_.get())));
  FLEXKV_RETURN_IF_ERROR(lock.LockPoolFile());
  const std::string pid = fmt::format("{}\n", getpid());
  if (ftruncate(lock.lock_file_.get(), 0) != 0 || pwrite(lock.lock_file_.get(), pid.data(), pid.size(), 0) < 0) {
    return Status::Internal(fmt::format("writing {}: {}", lock_path, ErrnoText(errno)));
  }
  return lock;
}

Status PoolLock::LockPoolFile() {
  UniqueFd pool(open(pool_path_.c_str(), O_RDONLY | O_CLOEXEC));
  if (!pool) {
    if (errno == ENOENT) return Status::Ok();  // created later (first Attach); locked then
    return Status::FailedPrecondition(fmt::format("cannot open pool file {}: {}", pool_path_, ErrnoText(errno)));
  }
  struct stat now {}, held {};
  if (pool_file_ && fstat(pool.get(), &now) == 0 && fstat(pool_file_.get(), &held) == 0 && now.st_dev == held.st_dev &&
      now.st_ino == held.st_ino) {
    return Status::Ok();  // already ours: a second flock on another open file would conflict with our own
  }
  FLEXKV_RETURN_IF_ERROR(LockExclusive(pool.get(), pool_path_, pool_path_,
                                       lock_file_ ? RecordedPid(lock_file_.get()) : std::string("unknown")));
  pool_file_ = std::move(pool);
  return Status::Ok();
}

}  // namespace flexkv
