// MappedRegion: owns one mmap'ed range and unmaps it exactly once, on destruction or reset(). Move-only,
// like UniqueFd; the raw mmap/munmap pair lives only here. Memfds and their seals stay with their owners.
#pragma once

#include <sys/mman.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <utility>

#include "flexkv/status.h"

namespace flexkv {

class MappedRegion {
 public:
  MappedRegion() = default;

  // mmap(nullptr, bytes, prot, flags, fd, offset). `what` names the mapping in the error, e.g. "pool file
  // /dev/shm/x". RESOURCE_EXHAUSTED (with the errno text) when the kernel refuses, INVALID_ARGUMENT for
  // zero bytes. Not thread-safe to share one object; the mapped memory itself is the caller's to guard.
  static Result<MappedRegion> Map(std::string_view what, size_t bytes, int prot, int flags, int fd, off_t offset = 0);
  // Read-write MAP_SHARED view of `bytes` of `fd` from offset 0 (memfds, the pool file).
  static Result<MappedRegion> Shared(std::string_view what, int fd, size_t bytes) {
    return Map(what, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd);
  }
  // Read-write private anonymous memory; `extra_flags` e.g. MAP_POPULATE.
  static Result<MappedRegion> Anonymous(std::string_view what, size_t bytes, int extra_flags = 0) {
    return Map(what, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | extra_flags, -1);
  }
  // Takes ownership of a range mapped elsewhere (e.g. trimmed to an alignment); nullptr/0 gives an empty region.
  static MappedRegion Adopt(void* addr, size_t bytes) { return MappedRegion(addr, bytes); }

  ~MappedRegion() { reset(); }
  MappedRegion(const MappedRegion&) = delete;
  MappedRegion& operator=(const MappedRegion&) = delete;
  MappedRegion(MappedRegion&& other) noexcept
      : addr_(std::exchange(other.addr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  MappedRegion& operator=(MappedRegion&& other) noexcept {
    if (this != &other) {
      reset();
      addr_ = std::exchange(other.addr_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }

  void* data() const { return addr_; }
  uint8_t* bytes() const { return static_cast<uint8_t*>(addr_); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(addr_);
  }
  size_t size() const { return bytes_; }
  bool valid() const { return addr_ != nullptr; }
  explicit operator bool() const { return valid(); }

  // Unmaps now (no-op when empty).
  void reset();
  // Gives up ownership without unmapping; the caller must munmap(first, second).
  std::pair<void*, size_t> release() {
    return {std::exchange(addr_, nullptr), std::exchange(bytes_, 0)};
  }

 private:
  MappedRegion(void* addr, size_t bytes) : addr_(addr), bytes_(addr == nullptr ? 0 : bytes) {}

  void* addr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace flexkv
