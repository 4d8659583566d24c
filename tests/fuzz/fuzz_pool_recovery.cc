// Fuzz target: a restarted daemon reading an arbitrary or corrupted pool file. Input byte 0 picks what is
// fuzzed: even = the whole file (header included), odd = the slot table of an otherwise valid pool of 64
// tiny slots (so mutations reach the recovery logic past the header checksum). Whatever the bytes,
// Pool::Open refuses with a Status or the recovered chains are accepted by the index: no crash, no slot
// restored twice, parents before children.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_set>

#include "daemon/cache/pool.h"
#include "daemon/cache/prefix_index.h"

namespace {

constexpr uint32_t kSlots = 64;
const flexkv::Geometry kTiny{1, 1, 1, 1, 8, 2, 1};  // 16-byte blocks

std::string PoolPath() {
  static const std::string path = "/dev/shm/flexkv-fuzz-pool-" + std::to_string(getpid());
  return path;
}

[[noreturn]] void Violated(const char* what) {
  std::fprintf(stderr, "invariant violated: %s\n", what);
  std::abort();
}

void RecoverAndCheck(const std::string& path, uint64_t budget) {
  auto pool = flexkv::Pool::Open(path, budget);
  if (!pool.ok()) {
    if (pool.status().message().empty()) Violated("a refusal without a reason");
    return;
  }
  uint64_t dropped = 0;
  const auto committed = (*pool)->Recover(&dropped);
  flexkv::PrefixIndex index((*pool)->capacity());
  std::unordered_set<uint32_t> slots;
  for (const auto& c : committed) {
    if (!slots.insert(c.slot).second) Violated("a slot restored twice");
    if (!index.Restore(c.slot, c.key, c.parent).ok()) Violated("Recover returned a chain the index refuses");
  }
  index.CheckInvariants();
  // A second recovery of the cleaned table restores exactly the same blocks and drops nothing.
  uint64_t dropped_again = 0;
  if ((*pool)->Recover(&dropped_again).size() != committed.size() || dropped_again != 0) {
    Violated("recovery is not idempotent");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1 || size > (1 << 20)) return 0;
  const std::string path = PoolPath();
  unlink(path.c_str());
  if ((data[0] & 1) == 0) {
    const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return 0;
    const bool written = write(fd, data + 1, size - 1) == static_cast<ssize_t>(size - 1);
    close(fd);
    if (written) RecoverAndCheck(path, uint64_t{kSlots} * kTiny.host_block_bytes());
  } else {
    {
      auto created = flexkv::Pool::Create(path, "fuzz", kTiny, uint64_t{kSlots} * kTiny.host_block_bytes());
      if (!created.ok()) return 0;
    }
    const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return 0;
    const size_t table = std::min<size_t>(size - 1, kSlots * 64);
    const bool written = pwrite(fd, data + 1, table, 4096) == static_cast<ssize_t>(table);
    close(fd);
    if (written) RecoverAndCheck(path, uint64_t{kSlots} * kTiny.host_block_bytes());
  }
  unlink(path.c_str());
  return 0;
}
