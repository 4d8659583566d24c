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

// The shares at lambda (share_i = clamp(lambda * demand_i, floor_i, limit_i)) and their sum, exactly.
long double SumAt(long double lambda, std::span<const DomainNeed> domains, std::span<const double> demand) {
  long double sum = 0;
  for (size_t i = 0; i < domains.size(); ++i) {
    const long double v = lambda * demand[i];
    sum += std::clamp<long double>(v, domains[i].floor_bytes, domains[i].limit_bytes);
  }
  return sum;
}

}  // namespace

std::vector<uint64_t> PlanShares(uint64_t budget_bytes, std::span<const DomainNeed> given) {
  // A limit below the floor is the floor (std::clamp needs floor <= limit).
  std::vector<DomainNeed> normalized(given.begin(), given.end());
  for (DomainNeed& d : normalized) d.limit_bytes = std::max(d.limit_bytes, d.floor_bytes);
  const std::span<const DomainNeed> domains = normalized;
  std::vector<uint64_t> shares;
  double max_demand = 0;
  for (const DomainNeed& d : domains) max_demand = std::max(max_demand, d.demand);
  if (!(max_demand > 0) || !std::isfinite(max_demand)) {
    for (const DomainNeed& d : domains) shares.push_back(std::clamp(d.current_bytes, d.floor_bytes, d.limit_bytes));
    return shares;
  }
  // Demands are taken relative to the largest; one below 1e-12 of it is none (it would only put lambda's range
  // out of reach of floating point, and its share is its floor either way).
  std::vector<double> demand;
  for (const DomainNeed& d : domains) {
    const double rel = d.demand / max_demand;
    demand.push_back(rel >= 1e-12 ? rel : 0);
  }
  // The sum is piecewise linear and non-decreasing in lambda, with breakpoints where a share leaves its floor
  // (floor / demand) or reaches its limit (limit / demand): find the segment where it crosses the budget and
  // solve it there, exactly.
  std::vector<long double> points{0};
  for (size_t i = 0; i < domains.size(); ++i) {
    if (demand[i] == 0) continue;
    points.push_back(static_cast<long double>(domains[i].floor_bytes) / demand[i]);
    points.push_back(static_cast<long double>(domains[i].limit_bytes) / demand[i]);
  }
  std::sort(points.begin(), points.end());
  const auto budget = static_cast<long double>(budget_bytes);
  long double lambda = points.back();  // every share at its limit, when even that fits
  for (size_t k = 0; k + 1 < points.size(); ++k) {
    const long double lo = points[k], hi = points[k + 1];
    const long double at_hi = SumAt(hi, domains, demand);
    if (at_hi <= budget) continue;
    const long double at_lo = SumAt(lo, domains, demand);
    lambda = at_lo >= budget || at_hi == at_lo ? lo : lo + (budget - at_lo) * (hi - lo) / (at_hi - at_lo);
    break;
  }
  for (size_t i = 0; i < domains.size(); ++i) {
    shares.push_back(Clamp(static_cast<double>(lambda * demand[i]), domains[i]));
  }
  // Rounding of the solved lambda: never above the budget (unless the floors are).
  uint64_t sum = 0;
  for (uint64_t v : shares) sum += v;
  for (size_t i = 0; sum > budget_bytes && i < shares.size(); ++i) {
    const uint64_t take = std::min(sum - budget_bytes, shares[i] - domains[i].floor_bytes);
    shares[i] -= take;
    sum -= take;
  }
  return shares;
}

std::vector<uint64_t> StepShares(uint64_t budget_bytes, std::span<const DomainStep> domains) {
  const size_t n = domains.size();
  // Signed moves: what each domain wants, within max_move and above min_move.
  std::vector<uint64_t> grow(n, 0), shrink(n, 0);
  uint64_t held = 0;
  for (size_t i = 0; i < n; ++i) {
    const DomainStep& d = domains[i];
    held += d.current_bytes;
    const uint64_t want = d.target_bytes > d.current_bytes ? d.target_bytes - d.current_bytes
                                                           : d.current_bytes - d.target_bytes;
    const uint64_t move = std::min(want, d.max_move);
    if (move == 0 || move < d.min_move) continue;
    (d.target_bytes > d.current_bytes ? grow : shrink)[i] = move;
  }
  const uint64_t free = budget_bytes > held ? budget_bytes - held : 0;
  // Scales `moves` down to `total` when they add up to more, in proportion, each part rounded down (they then add
  // up to at most `total`) or up (at least `total`); a move that falls below its min_move is dropped. Returns
  // whether one was dropped.
  const auto scale = [&](std::vector<uint64_t>& moves, uint64_t total, bool round_up) {
    long double all = 0;
    for (uint64_t m : moves) all += static_cast<long double>(m);
    if (all <= static_cast<long double>(total)) return false;
    bool dropped = false;
    for (size_t i = 0; i < n; ++i) {
      if (moves[i] == 0) continue;
      const long double part = static_cast<long double>(moves[i]) * static_cast<long double>(total) / all;
      moves[i] = std::min<uint64_t>(moves[i], static_cast<uint64_t>(round_up ? std::ceil(part) : std::floor(part)));
      if (moves[i] < domains[i].min_move || moves[i] == 0) {
        moves[i] = 0;
        dropped = true;
      }
    }
    return dropped;
  };
  // Each round that changes anything drops a move, so this ends within 2n + 1 rounds; once no move is dropped, the
  // grows fit in the free budget plus what the shrinks give up, and the shrinks give up no more than that needs.
  const auto sum = [](const std::vector<uint64_t>& v) {
    uint64_t s = 0;
    for (uint64_t x : v) s += x;
    return s;
  };
  bool settled = false;
  for (size_t round = 0; round <= 2 * n && !settled; ++round) {
    bool dropped = scale(grow, free + sum(shrink), /*round_up=*/false);
    const uint64_t taken = sum(grow);
    dropped = scale(shrink, taken > free ? taken - free : 0, /*round_up=*/true) || dropped;
    settled = !dropped;
  }
  if (!settled || sum(grow) > free + sum(shrink)) {  // cannot happen (see above); never hand out what is not there
    std::fill(grow.begin(), grow.end(), 0);
    std::fill(shrink.begin(), shrink.end(), 0);
  }
  std::vector<uint64_t> sizes(n);
  for (size_t i = 0; i < n; ++i) sizes[i] = domains[i].current_bytes + grow[i] - shrink[i];
  return sizes;
}

std::vector<uint32_t> PlanSubPools(std::span<const SubPoolNeed> parts, uint64_t min_move, uint64_t max_move) {
  std::vector<uint32_t> sizes;
  for (const SubPoolNeed& p : parts) sizes.push_back(p.active);
  bool pressure = false;
  uint64_t held = 0;
  for (const SubPoolNeed& p : parts) {
    if (p.grant == 0 || p.slot_bytes == 0 || p.capacity == 0) return sizes;  // not a sub-pool: nothing to plan
    pressure = pressure || (p.demand > 0 && uint64_t{p.used} * 10 >= uint64_t{p.active} * 9);
    held += uint64_t{p.active} * p.slot_bytes;
  }
  if (!pressure) return sizes;
  std::vector<DomainNeed> needs;
  for (const SubPoolNeed& p : parts) {
    needs.push_back(DomainNeed{p.demand, uint64_t{std::min(p.grant, p.capacity)} * p.slot_bytes,
                               uint64_t{p.capacity} * p.slot_bytes, uint64_t{p.active} * p.slot_bytes});
  }
  const std::vector<uint64_t> shares = PlanShares(held, needs);
  std::vector<DomainStep> steps;
  for (size_t i = 0; i < parts.size(); ++i) {
    const uint64_t grant_bytes = uint64_t{parts[i].grant} * parts[i].slot_bytes;
    steps.push_back(DomainStep{needs[i].current_bytes, shares[i], std::max(min_move, grant_bytes),
                               std::max(max_move, grant_bytes)});
  }
  const std::vector<uint64_t> stepped = StepShares(held, steps);
  for (size_t i = 0; i < parts.size(); ++i) {
    const SubPoolNeed& p = parts[i];
    const uint64_t slots = std::min<uint64_t>(stepped[i] / p.slot_bytes, p.capacity);
    if (slots == p.active) continue;
    // Whole grants, rounded down: a shrink gives up at least what the step says, a grow takes at most that.
    const uint64_t whole = slots / p.grant * p.grant;
    if (slots > p.active) {
      sizes[i] = static_cast<uint32_t>(std::max<uint64_t>(whole, p.active));
    } else {
      sizes[i] = static_cast<uint32_t>(std::max<uint64_t>(whole, std::min(p.grant, p.capacity)));
    }
  }
  return sizes;
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
  // Below a byte a second a domain has no traffic: the rate would otherwise only decay towards 0 for hours.
  if (rate_ < 1) rate_ = 0;
  last_bytes_ = total_bytes;
  last_ms_ = now_ms;
}

}  // namespace flexkv
