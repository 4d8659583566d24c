// See hybrid_request.h.
#include "client/hybrid_request.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/hybrid_ids.h"

namespace flexkv {

Result<std::vector<uint32_t>> LayOutComponentIds(const Geometry& g, bool store, uint32_t count,
                                                 std::span<const std::span<const uint32_t>> component_ids,
                                                 std::span<const uint32_t> state_boundaries) {
  const char* op = store ? "store" : "load";
  if (component_ids.size() != g.component_count()) {
    return Status::InvalidArgument(fmt::format(
        "{} of {} id spans; expected one per geometry component: {} (component 0, full attention, first)", op,
        component_ids.size(), g.component_count()));
  }
  if (count == 0) {
    return Status::InvalidArgument(fmt::format(
        "{} of 0 blocks: component 0 (full) has no ids; expected at least one", op));
  }
  bool has_state = false;
  for (size_t i = 0; i < g.component_count(); ++i) has_state |= g.component_kind(i) == ComponentKind::kState;
  if (!store && !state_boundaries.empty()) {
    return Status::InvalidArgument("a load takes no state boundaries (it loads the one snapshot at its prefix end)");
  }
  if (!state_boundaries.empty() && !has_state) {
    return Status::InvalidArgument(fmt::format(
        "{} state boundaries given but the geometry has no state component; expected none", state_boundaries.size()));
  }
  if (state_boundaries.size() > count) {
    return Status::InvalidArgument(fmt::format("{} state boundaries for a store of {} keys; expected at most {}",
                                               state_boundaries.size(), count, count));
  }
  for (size_t i = 0; i < state_boundaries.size(); ++i) {
    const uint32_t b = state_boundaries[i];
    if (b < 1 || b > count) {
      return Status::InvalidArgument(fmt::format(
          "state boundary {} is {}; expected 1..{} (boundary b = the snapshot after keys[b - 1])", i, b, count));
    }
    if (i > 0 && b <= state_boundaries[i - 1]) {
      return Status::InvalidArgument(fmt::format(
          "state boundary {} is {} after {}; expected strictly increasing boundaries", i, b, state_boundaries[i - 1]));
    }
  }
  const auto state_count = static_cast<uint32_t>(state_boundaries.size());
  for (size_t i = 0; i < g.component_count(); ++i) {
    const uint64_t expected = ComponentIdCount(g, i, store, count, state_count);
    if (component_ids[i].size() == expected) continue;
    const ComponentKind kind = g.component_kind(i);
    std::string why;
    switch (kind) {
      case ComponentKind::kFull:
        why = store ? "one per key" : "one per block of the prefix";
        break;
      case ComponentKind::kSlidingWindow:
        why = fmt::format("min(window_blocks {}, {}): the trailing window", g.window_blocks(i), count);
        break;
      case ComponentKind::kState:
        why = store ? "one per state boundary" : "the one snapshot at the prefix end";
        break;
    }
    return Status::InvalidArgument(fmt::format("{}: component {} ({}) has {} block ids; expected {} ({})", op, i,
                                               ComponentKindName(kind), component_ids[i].size(), expected, why));
  }
  const HybridIdLayout layout = LayoutIds(g, store, count, state_count);
  std::vector<uint32_t> ids(layout.total);
  for (size_t i = 0; i < g.component_count(); ++i) {
    std::copy(component_ids[i].begin(), component_ids[i].end(), ids.begin() + static_cast<ptrdiff_t>(layout.offset[i]));
  }
  std::copy(state_boundaries.begin(), state_boundaries.end(),
            ids.begin() + static_cast<ptrdiff_t>(layout.boundaries_offset));
  return ids;
}

}  // namespace flexkv
