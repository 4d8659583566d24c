// RequestMetrics: what the data plane counts per kind of ring request — requests taken, errors by status
// code, and the wait / transfer / end-to-end latency histograms. Written on the hot path with relaxed
// atomics (no lock, no allocation); read at each scrape by DaemonMetrics.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "daemon/metrics/latency_histogram.h"
#include "flexkv/status.h"

namespace flexkv {

// The `op` label. kInvalid: a descriptor whose opcode is unknown, or a submit tail that could not be trusted.
enum class OpKind : uint8_t { kMatch, kLoad, kStore, kRelease, kPrefetch, kInvalid };
inline constexpr size_t kOpKinds = 6;

// "match", "load", "store", "release", "prefetch", "invalid".
const char* OpKindName(OpKind op);
// The kind of a ring opcode (RingOp, common/ring_layout.h); unknown opcodes are kInvalid.
OpKind OpKindOf(uint16_t ring_opcode);
inline size_t Index(OpKind op) { return static_cast<size_t>(op); }

// Count of errors per StatusCode. Thread-safe; Add is one relaxed atomic add.
class ErrorCounts {
 public:
  static constexpr size_t kCodes = 17;  // StatusCode 0..16, as gRPC's

  // kOk is not an error and is ignored; a code outside the enum counts as kUnknown.
  void Add(StatusCode code) noexcept {
    auto i = static_cast<size_t>(code);
    if (i == 0) return;
    if (i >= kCodes) i = static_cast<size_t>(StatusCode::kUnknown);
    counts_[i].fetch_add(1, std::memory_order_relaxed);
  }
  uint64_t Get(StatusCode code) const noexcept {
    const auto i = static_cast<size_t>(code);
    return i < kCodes ? counts_[i].load(std::memory_order_relaxed) : 0;
  }
  uint64_t Total() const noexcept {
    uint64_t total = 0;
    for (const auto& c : counts_) total += c.load(std::memory_order_relaxed);
    return total;
  }

 private:
  std::array<std::atomic<uint64_t>, kCodes> counts_{};
};

// Per request kind, indexed by Index(OpKind). Times are monotonic:
//   wait        from the poller taking the descriptor off the submit ring to the start of its copy
//   transfer    the copy itself
//   end_to_end  from taking the descriptor to posting its final completion
// Match and Release run no copy: only their end-to-end time is recorded. Load and Store record wait and
// transfer only when a copy ran (a request refused before it has an end-to-end time only).
struct RequestMetrics {
  std::array<std::atomic<uint64_t>, kOpKinds> taken{};
  std::array<ErrorCounts, kOpKinds> errors;
  std::array<LatencyHistogram, kOpKinds> wait;
  std::array<LatencyHistogram, kOpKinds> transfer;
  std::array<LatencyHistogram, kOpKinds> end_to_end;

  uint64_t TotalErrors() const noexcept {
    uint64_t total = 0;
    for (const auto& e : errors) total += e.Total();
    return total;
  }
};

}  // namespace flexkv
