// See mapped_region.h.
#include "common/mapped_region.h"

#include <fmt/format.h>

#include <cerrno>

#include "common/uds.h"

namespace flexkv {

Result<MappedRegion> MappedRegion::Map(std::string_view what, size_t bytes, int prot, int flags, int fd, off_t offset) {
  if (bytes == 0) return Status::InvalidArgument(fmt::format("mmap {}: 0 bytes; expected a size above 0", what));
  void* p = ::mmap(nullptr, bytes, prot, flags, fd, offset);
  if (p == MAP_FAILED) {
    return Status::ResourceExhausted(fmt::format("mmap {} ({} bytes): {}", what, bytes, ErrnoText(errno)));
  }
  return MappedRegion(p, bytes);
}

void MappedRegion::reset() {
  if (addr_ != nullptr) ::munmap(addr_, bytes_);
  addr_ = nullptr;
  bytes_ = 0;
}

}  // namespace flexkv
