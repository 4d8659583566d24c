// Sharing the budget between cache domains; see budget_plan.h.
#include "daemon/cache/budget_plan.h"

#include <algorithm>
#include <cmath>

namespace flexkv {
namespace {

uint64_t Clamp(double v, const DomainNeed& d) {
  if (!(v > static_cast<double>(d.floor_bytes))) return d.floor_bytes;
  if (v >= static_cast<double>(d.limit_bytes)) return d.limit_bytes;
  return static_cast<uint64_t>(v);
}

uint64_t SharesAt(double lambda, std::span<const DomainNeed> domains, std::vector<uint64_t>* out) {
  uint64_t sum = 0;
  out->clear();
  for (const DomainNeed& d : domains) {
    out->push_back(Clamp(lambda * d.demand, d));
    sum += out->back();
  }
  return sum;
}

}  // namespace

std::vector<uint64_t> PlanShares(uint64_t budget_bytes, std::span<const DomainNeed> domains) {
  std::vector<uint64_t> shares;
  double max_demand = 0;
  for (const DomainNeed& d : domains) max_demand = std::max(max_demand, d.demand);
  if (!(max_demand > 0)) {
    for (const DomainNeed& d : domains) shares.push_back(std::clamp(d.current_bytes, d.floor_bytes, d.limit_bytes));
    return shares;
  }
  // The shares' sum is non-decreasing in lambda: bisect for the largest lambda that fits. At `hi` every domain with
  // demand is at its limit (the least demand times hi exceeds every limit); when even that fits, it is the answer.
  double min_demand = max_demand;
  for (const DomainNeed& d : domains) {
    if (d.demand > 0) min_demand = std::min(min_demand, d.demand);
  }
  double lo = 0;
  uint64_t max_limit = 0;
  for (const DomainNeed& d : domains) max_limit = std::max(max_limit, d.limit_bytes);
  double hi = static_cast<double>(std::max(max_limit, budget_bytes)) / min_demand * 2;
  std::vector<uint64_t> trial;
  if (SharesAt(hi, domains, &trial) <= budget_bytes) return trial;  // every limit fits
  for (int i = 0; i < 200 && hi - lo > hi * 1e-12; ++i) {
    const double mid = (lo + hi) / 2;
    if (SharesAt(mid, domains, &trial) <= budget_bytes) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  SharesAt(lo, domains, &shares);
  return shares;
}

void DemandMeter::Observe(uint64_t total_bytes, int64_t now_ms) {
  if (!started_) {
    started_ = true;
    last_bytes_ = total_bytes;
    last_ms_ = now_ms;
    return;
  }
  const int64_t elapsed_ms = now_ms - last_ms_;
  if (elapsed_ms <= 0) return;
  const double instant = static_cast<double>(total_bytes - std::min(total_bytes, last_bytes_)) * 1000.0 /
                         static_cast<double>(elapsed_ms);
  // Weight of the past after `elapsed`: 2^(-elapsed / half_life).
  const double keep = std::exp2(-static_cast<double>(elapsed_ms) / 1000.0 / half_life_s_);
  rate_ = rate_ * keep + instant * (1 - keep);
  last_bytes_ = total_bytes;
  last_ms_ = now_ms;
}

}  // namespace flexkv
