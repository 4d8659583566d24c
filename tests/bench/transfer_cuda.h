// flexkv-bench transfer's CUDA plumbing: errors that end the run (Die, CK), the registered host pool, two-stream
// timing with CUDA events, and the host helpers. Included by transfer_bench.cc only (built with CUDA).
#pragma once

#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/mapped_region.h"

namespace flexkv::bench::transfer {

[[noreturn]] inline void Die(const std::string& what) {
  std::fprintf(stderr, "flexkv-bench transfer: %s\n", what.c_str());
  std::exit(1);
}

inline void Check(cudaError_t e, const char* expr, int line) {
  if (e != cudaSuccess) Die(fmt::format("line {}: {}: {}", line, expr, cudaGetErrorString(e)));
}
#define CK(expr) ::flexkv::bench::transfer::Check((expr), #expr, __LINE__)

// cuda_runtime_api.h takes void**; these keep the pointer types.
template <class T>
cudaError_t DeviceAlloc(T** p, size_t bytes) {
  void* v = nullptr;
  const cudaError_t e = cudaMalloc(&v, bytes);
  *p = static_cast<T*>(v);
  return e;
}

inline constexpr uint64_t kKiB = 1024;
// The pool is registered in pieces of at most 64 GiB, as the daemon's CUDA backend does.
inline constexpr uint64_t kMaxRegister = 64ull << 30;


// ---- host helpers -------------------------------------------------------------------------------------

inline uint64_t Mix(uint64_t x) {  // splitmix64 finalizer
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Runs fn(begin, end) over [0, n) split across the machine's cores.
inline void ParallelFor(uint64_t n, const std::function<void(uint64_t, uint64_t)>& fn) {
  const uint64_t workers = std::max(1u, std::min(32u, std::thread::hardware_concurrency()));
  std::vector<std::thread> threads;
  const uint64_t per = (n + workers - 1) / workers;
  for (uint64_t w = 0; w < workers; ++w) {
    const uint64_t b = w * per, e = std::min(n, b + per);
    if (b >= e) break;
    threads.emplace_back([&fn, b, e] { fn(b, e); });
  }
  for (auto& t : threads) t.join();
}

inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The pool: anonymous page-aligned memory, registered for DMA; unmapped and unregistered on destruction.
class RegisteredPool {
 public:
  RegisteredPool(uint64_t bytes, uint64_t piece_multiple) {
    auto map = flexkv::MappedRegion::Anonymous("the pool", bytes, MAP_POPULATE);
    if (!map.ok()) Die(map.status().message());
    map_ = std::move(*map);
    base_ = map_.bytes();
    const uint64_t piece = std::max<uint64_t>(piece_multiple, kMaxRegister / piece_multiple * piece_multiple);
    for (uint64_t off = 0; off < bytes; off += piece) {
      const uint64_t n = std::min(piece, bytes - off);
      CK(cudaHostRegister(base_ + off, n, cudaHostRegisterPortable | cudaHostRegisterMapped));
      pieces_.push_back(off);
    }
    void* dev = nullptr;
    CK(cudaHostGetDevicePointer(&dev, base_, 0));
    if (dev != base_) Die("registered pool has a device address different from its host address (no UVA?)");
  }
  ~RegisteredPool() {
    for (uint64_t off : pieces_) (void)cudaHostUnregister(base_ + off);
  }
  RegisteredPool(const RegisteredPool&) = delete;
  RegisteredPool& operator=(const RegisteredPool&) = delete;
  uint8_t* base() const { return base_; }

 private:
  flexkv::MappedRegion map_;  // unregistered (destructor body) before it unmaps
  uint8_t* base_ = nullptr;
  std::vector<uint64_t> pieces_;
};

// ---- timing -------------------------------------------------------------------------------------------

struct Streams {
  cudaStream_t s1 = nullptr, s2 = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr, joined = nullptr, s1_done = nullptr;
};

// Median milliseconds of `op` (which enqueues on s1 and, when `two_streams`, on s2 too; s2 starts with s1).
// With two streams, `s1_ms` / `s2_ms` (if given) get the medians of each stream's own finish.
inline double TimeMs(Streams& st, int warmup, int iters, bool two_streams, const std::function<void()>& op,
              double* s1_ms = nullptr, double* s2_ms = nullptr) {
  std::vector<double> ms, ms1, ms2;
  for (int i = 0; i < warmup + iters; ++i) {
    CK(cudaEventRecord(st.start, st.s1));
    if (two_streams) CK(cudaStreamWaitEvent(st.s2, st.start, 0));
    op();
    if (two_streams) {
      CK(cudaEventRecord(st.s1_done, st.s1));
      CK(cudaEventRecord(st.joined, st.s2));
      CK(cudaStreamWaitEvent(st.s1, st.joined, 0));
    }
    CK(cudaEventRecord(st.stop, st.s1));
    CK(cudaEventSynchronize(st.stop));
    CK(cudaGetLastError());
    float t = 0, t1 = 0, t2 = 0;
    CK(cudaEventElapsedTime(&t, st.start, st.stop));
    if (two_streams) {
      CK(cudaEventElapsedTime(&t1, st.start, st.s1_done));
      CK(cudaEventElapsedTime(&t2, st.start, st.joined));
    }
    if (i >= warmup) {
      ms.push_back(static_cast<double>(t));
      ms1.push_back(static_cast<double>(t1));
      ms2.push_back(static_cast<double>(t2));
    }
  }
  if (s1_ms) *s1_ms = Median(ms1);
  if (s2_ms) *s2_ms = Median(ms2);
  return Median(ms);
}

inline double Gbps(uint64_t bytes, double ms) { return static_cast<double>(bytes) / (ms * 1e6); }

}  // namespace flexkv::bench::transfer
