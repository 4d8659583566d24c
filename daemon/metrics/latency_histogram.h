// LatencyHistogram: a Prometheus-style histogram of durations with fixed buckets, cheap enough for the
// data plane's hot path. Observe is a bucket search plus two relaxed atomic adds: no lock, no allocation.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

namespace flexkv {

// Aligned to a cache line so that histograms of different operation kinds, written by different threads, do
// not share one.
class alignas(64) LatencyHistogram {
 public:
  // Upper bounds ("le") of the finite buckets, in nanoseconds: 1 µs to 10 s in 1-2.5-5 steps. A ring Match
  // takes microseconds, a host copy of a few blocks tens of microseconds, a large load milliseconds to seconds.
  static constexpr std::array<int64_t, 22> kUpperBoundsNs = {
      1'000,         2'500,         5'000,         10'000,        25'000,        50'000,
      100'000,       250'000,       500'000,       1'000'000,     2'500'000,     5'000'000,
      10'000'000,    25'000'000,    50'000'000,    100'000'000,   250'000'000,   500'000'000,
      1'000'000'000, 2'500'000'000, 5'000'000'000, 10'000'000'000};
  static constexpr size_t kFiniteBuckets = kUpperBoundsNs.size();

  // Records one duration. A negative one (a clock read out of order) counts as 0. Thread-safe, wait-free.
  void Observe(int64_t ns) noexcept {
    if (ns < 0) ns = 0;
    // First bound >= ns: Prometheus buckets count observations less than or equal to their bound.
    const size_t bucket = static_cast<size_t>(
        std::lower_bound(kUpperBoundsNs.begin(), kUpperBoundsNs.end(), ns) - kUpperBoundsNs.begin());
    counts_[bucket].fetch_add(1, std::memory_order_relaxed);
    sum_ns_.fetch_add(static_cast<uint64_t>(ns), std::memory_order_relaxed);
  }

  struct Snapshot {
    // cumulative[i]: observations <= kUpperBoundsNs[i]; the last entry is the +Inf bucket, equal to count.
    std::array<uint64_t, kFiniteBuckets + 1> cumulative{};
    uint64_t count = 0;
    double sum_seconds = 0;
  };
  // A reading for exposition. Taken while others observe, the sum may include an observation the buckets
  // do not yet show (or the reverse); count always equals the +Inf bucket.
  Snapshot Read() const noexcept {
    Snapshot s;
    uint64_t running = 0;
    for (size_t i = 0; i < counts_.size(); ++i) {
      running += counts_[i].load(std::memory_order_relaxed);
      s.cumulative[i] = running;
    }
    s.count = running;
    s.sum_seconds = static_cast<double>(sum_ns_.load(std::memory_order_relaxed)) / 1e9;
    return s;
  }

 private:
  std::array<std::atomic<uint64_t>, kFiniteBuckets + 1> counts_{};  // per bucket, not cumulative; last: +Inf
  std::atomic<uint64_t> sum_ns_{0};
};

}  // namespace flexkv
