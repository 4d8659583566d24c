// PoolGuard: the SIGBUS handler and size check for the pool file; see pool_guard.h.
#include "daemon/cache/pool_guard.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "common/log.h"
#include "common/mutex.h"
#include "common/uds.h"
#include "common/unique_fd.h"

namespace flexkv {
namespace {

// Pools guarded at once: one per cache domain (--max-domains is at most 64).
constexpr size_t kMaxWatches = 64;

// What the signal handler reads, per watched pool: plain atomics and a fixed buffer, no locks, no allocation. A
// buffer is rewritten only while its base is 0 (that slot guards nothing), so the handler never reads it half
// written.
struct FaultRange {
  std::atomic<uintptr_t> base{0};
  std::atomic<uint64_t> bytes{0};
  char message[512];
  std::atomic<size_t> message_len{0};
};
FaultRange g_fault[kMaxWatches];

// What the size check reads.
struct WatchedFile {
  const uint8_t* owner = nullptr;  // null: a free slot
  std::string path;
  UniqueFd fd;
  uint64_t bytes = 0;
};
Mutex g_watch_mu;
WatchedFile g_watched[kMaxWatches] ABSL_GUARDED_BY(g_watch_mu);

void WriteAll(const char* data, size_t len) {
  while (len > 0) {
    const ssize_t n = ::write(STDERR_FILENO, data, len);
    if (n <= 0) return;
    data += n;
    len -= static_cast<size_t>(n);
  }
}

// Decimal digits of `value` into `out` (at least 20 chars); returns the length. Async-signal-safe.
size_t FormatDecimal(uint64_t value, char* out) {
  char reversed[20];
  size_t n = 0;
  do {
    reversed[n++] = static_cast<char>('0' + value % 10);
    value /= 10;
  } while (value != 0);
  for (size_t i = 0; i < n; ++i) out[i] = reversed[n - 1 - i];
  return n;
}

void OnSigbus(int signo, siginfo_t* info, void*) {
  const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  for (FaultRange& range : g_fault) {
    const uintptr_t base = range.base.load(std::memory_order_acquire);
    const uint64_t bytes = range.bytes.load(std::memory_order_acquire);
    // si_code > 0: a fault the kernel raised (BUS_ADRERR), not a signal someone sent, whose si_addr means nothing.
    if (info->si_code > 0 && base != 0 && addr >= base && addr - base < bytes) {
      WriteAll(range.message, range.message_len.load(std::memory_order_acquire));
      char offset[24];
      const size_t n = FormatDecimal(addr - base, offset);
      WriteAll(offset, n);
      static constexpr char kTail[] =
          " of the pool file, past its end); its blocks are lost. Exiting with code 75; restart with --discard-pool\n";
      WriteAll(kTail, sizeof(kTail) - 1);
      _exit(kPoolLostExitCode);
    }
  }
  // Not the pool: a real bug. The default action (a core dump) as if no handler were installed: for a hardware
  // fault the returning instruction faults again, for a sent signal the re-raised one is pending until return.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(signo, &dfl, nullptr);
  raise(signo);
}

}  // namespace

void InstallPoolFaultHandler() {
  struct sigaction action {};
  action.sa_sigaction = OnSigbus;
  action.sa_flags = SA_SIGINFO;
  sigemptyset(&action.sa_mask);
  if (sigaction(SIGBUS, &action, nullptr) != 0) {
    log::Warning("pool", "cannot install the SIGBUS handler: {}; a truncated pool file kills flexkvd without a "
                 "message", ErrnoText(errno));
  }
}

Status CheckWatchedPoolFile() {
  MutexLock lock(&g_watch_mu);
  for (const WatchedFile& watched : g_watched) {
    if (watched.owner == nullptr) continue;
    struct stat st {};
    if (fstat(watched.fd.get(), &st) != 0) {
      return Status::Internal(fmt::format("fstat of pool file {}: {}", watched.path, ErrnoText(errno)));
    }
    if (static_cast<uint64_t>(st.st_size) >= watched.bytes) continue;
    return Status::DataLoss(fmt::format(
        "pool file {} was truncated under the running daemon: it is {} bytes, expected {}; its blocks are lost. "
        "Exiting with code {}; restart with --discard-pool",
        watched.path, st.st_size, watched.bytes, kPoolLostExitCode));
  }
  return Status::Ok();
}

PoolFileWatch::PoolFileWatch(const std::string& path, int fd, const uint8_t* base, uint64_t bytes) : base_(base) {
  MutexLock lock(&g_watch_mu);
  // The slot this pool already has (a newer watch of the same mapping replaces it), else a free one.
  size_t slot = kMaxWatches;
  for (size_t i = 0; i < kMaxWatches && slot == kMaxWatches; ++i) {
    if (g_watched[i].owner == base) slot = i;
  }
  for (size_t i = 0; i < kMaxWatches && slot == kMaxWatches; ++i) {
    if (g_watched[i].owner == nullptr) slot = i;
  }
  if (slot == kMaxWatches) {
    log::Warning("pool", "more than {} pool files are open: {} is not guarded against truncation", kMaxWatches, path);
    return;
  }
  WatchedFile& watched = g_watched[slot];
  FaultRange& range = g_fault[slot];
  watched.owner = base;
  watched.path = path;
  watched.fd.reset(fcntl(fd, F_DUPFD_CLOEXEC, 0));
  watched.bytes = bytes;
  if (!watched.fd) {
    log::Warning("pool", "cannot duplicate the fd of pool file {}: {}; its size is not checked", path, ErrnoText(errno));
    watched.owner = nullptr;
  }
  range.base.store(0, std::memory_order_release);
  const std::string head = fmt::format(
      "FATAL pool: pool file {} was truncated under the running daemon (a copy touched byte ", path);
  const size_t len = std::min(head.size(), sizeof(range.message));
  std::memcpy(range.message, head.data(), len);
  range.message_len.store(len, std::memory_order_release);
  range.bytes.store(bytes, std::memory_order_release);
  range.base.store(reinterpret_cast<uintptr_t>(base), std::memory_order_release);
}

PoolFileWatch::~PoolFileWatch() {
  MutexLock lock(&g_watch_mu);
  for (size_t i = 0; i < kMaxWatches; ++i) {
    if (g_watched[i].owner != base_) continue;
    g_fault[i].base.store(0, std::memory_order_release);
    g_watched[i] = WatchedFile{};
    return;
  }
}

}  // namespace flexkv
