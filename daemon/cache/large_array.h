// LargeArray: a std::vector whose big buffers (8 MiB and up) sit on a 2 MiB boundary with transparent huge
// pages advised; the PrefixIndex's node array and hash table use it. Internal to daemon/cache.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <vector>

namespace flexkv {

// Allocates the arrays; from 8 MiB up (nodes: 210 K slots), on transparent huge pages
// where the kernel allows them (madvise mode; elsewhere the advice is a no-op). Lookups land at random in
// these arrays, and with 4 KiB pages each would miss the TLB as well as the caches. The mapping starts on a
// 2 MiB boundary and ends at the next 4 KiB page, so it adds no memory: a tail shorter than 2 MiB stays on
// small pages.
// This is an allocator, not an owner: the vector owns the buffer and hands it back through deallocate(), so the
// mapping is not wrapped in a MappedRegion (which could not trim the alignment slack either).
template <typename T>
struct LargeArrayAllocator {
  using value_type = T;
  static constexpr size_t kHugePage = size_t{2} << 20;
  static constexpr size_t kThreshold = size_t{8} << 20;

  LargeArrayAllocator() = default;
  template <typename U>
  explicit LargeArrayAllocator(const LargeArrayAllocator<U>&) {}

  static size_t MappedBytes(size_t n) {
    const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    return (n * sizeof(T) + page - 1) / page * page;
  }
  T* allocate(size_t n) {
    if (n * sizeof(T) < kThreshold) return std::allocator<T>().allocate(n);
    const size_t len = MappedBytes(n);
    void* p = mmap(nullptr, len + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    const auto start = reinterpret_cast<uintptr_t>(p);
    const uintptr_t aligned = (start + kHugePage - 1) & ~(kHugePage - 1);
    if (aligned > start) munmap(p, aligned - start);
    if (start + kHugePage > aligned) munmap(reinterpret_cast<void*>(aligned + len), start + kHugePage - aligned);
    madvise(reinterpret_cast<void*>(aligned), len, MADV_HUGEPAGE);  // advice only: failure leaves small pages
    return reinterpret_cast<T*>(aligned);
  }
  void deallocate(T* p, size_t n) {
    if (n * sizeof(T) < kThreshold) {
      std::allocator<T>().deallocate(p, n);
    } else {
      munmap(p, MappedBytes(n));
    }
  }
  friend bool operator==(const LargeArrayAllocator&, const LargeArrayAllocator&) { return true; }
};
template <typename T>
using LargeArray = std::vector<T, LargeArrayAllocator<T>>;

}  // namespace flexkv
