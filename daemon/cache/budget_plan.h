// How the daemon's DRAM budget is shared between its cache domains (docs/operations.md "Several models"): in
// proportion to each domain's demand - the bytes it stored and loaded lately - each within its floor (the least
// pool it can serve with) and its limit (the operator's pool_size for its namespace, else the whole budget).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace flexkv {

struct DomainNeed {
  double demand = 0;           // bytes per second stored + loaded, smoothed (DemandMeter); 0: idle
  uint64_t floor_bytes = 0;    // the least it keeps
  uint64_t limit_bytes = 0;    // the most it may have (>= floor_bytes)
  uint64_t current_bytes = 0;  // what it has now
};

// Each domain's share. When every domain is idle (no demand), the current sizes (clamped to [floor, limit]): moving
// memory between idle domains would only evict blocks. Otherwise water-filling: share_i = clamp(lambda * demand_i,
// floor_i, limit_i) with the largest lambda whose shares fit the budget, so the budget left by a domain held at
// its limit goes to the others in proportion to their demand; an idle domain gets its floor. The shares sum to at
// most max(budget, sum of floors) (the caller admits no domain whose floor does not fit).
std::vector<uint64_t> PlanShares(uint64_t budget_bytes, std::span<const DomainNeed> domains);

// One domain in a rebalance's step towards its planned share.
struct DomainStep {
  uint64_t current_bytes = 0;  // what it has now
  uint64_t target_bytes = 0;   // its planned share (PlanShares)
  uint64_t min_move = 0;       // a move smaller than this is not made (one grant of each component; hysteresis)
  uint64_t max_move = 0;       // the most it moves in one step, either way (growing pins memory for DMA)
};

// One step from the current sizes towards the targets, symmetric so that the budget stays assigned: each domain
// moves towards its target by at most max_move; the domains that grow take what is free of the budget and what
// the shrinking ones give up, and a domain shrinks only by what the growing ones take at once beyond the free
// budget (in proportion to how far each is above its target): memory is never taken from one domain before
// another can use it. No move below its min_move is made, on either side. Returns each domain's size after the
// step; their sum is at most max(budget, sum of current sizes) and, when something grows into given-up memory,
// the whole budget minus less than the step's rounding.
std::vector<uint64_t> StepShares(uint64_t budget_bytes, std::span<const DomainStep> domains);

// One sub-pool (component) of a hybrid cache domain whose split follows demand (docs/hybrid.md "Pool and eviction").
struct SubPoolNeed {
  double demand = 0;        // bytes per second the component stores, smoothed (DemandMeter); 0: idle
  uint64_t slot_bytes = 0;  // its slot
  uint32_t grant = 0;       // its active size moves in grants of this many slots (>= 1)
  uint32_t capacity = 0;    // the most slots it may have (its layout)
  uint32_t active = 0;      // its active slots now
  uint32_t used = 0;        // of those, holding an entry (committed or being stored)
};

// One step of a domain's sub-pools towards the split their demand says, the domain budget's rules applied to the
// bytes the sub-pools hold together now: PlanShares (each component's floor one grant, its limit its layout), then
// StepShares (no move below max(one grant, `min_move`), at most `max_move` either way, as much given up as grown
// into). Each size is rounded down to whole grants (a component keeps at least one, and a grow never passes its
// layout), so the sizes never add up to more than they held. Nothing moves unless a component with demand is under
// pressure (nine tenths of its slots used: its next stores evict), or when none has demand. Returns each
// component's active slots after the step.
std::vector<uint32_t> PlanSubPools(std::span<const SubPoolNeed> parts, uint64_t min_move, uint64_t max_move);

// A byte counter's rate, smoothed with a half-life: the demand PlanShares divides by. Not thread-safe.
class DemandMeter {
 public:
  explicit DemandMeter(double half_life_s = 60) : half_life_s_(half_life_s) {}
  // `total_bytes`: the counter's value now (it only grows); `now_ms`: a monotonic clock. The first call only
  // remembers where the counter is.
  void Observe(uint64_t total_bytes, int64_t now_ms);
  // Starts the meter at `bytes_per_s` (a new domain: the mean of the others, so that it is not starved before
  // it has shown what it needs).
  void Seed(double bytes_per_s) { rate_ = bytes_per_s; }
  double rate() const { return rate_; }

 private:
  double half_life_s_;
  double rate_ = 0;
  bool started_ = false;
  uint64_t last_bytes_ = 0;
  int64_t last_ms_ = 0;
};

}  // namespace flexkv
