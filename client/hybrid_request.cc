// See hybrid_request.h.
#include "client/hybrid_request.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/hybrid_ids.h"

namespace flexkv {

Result<std::vector<uint32_t>> LayOutComponentIds(const Geometry& g, bool store, uint32_t count,
                                                 std::span<const std::span<const uint32_t>> component_ids,
                                                 std::span<const uint32_t> state_boundaries, uint32_t first_block,
                                                 uint32_t window_keys) {
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
  if (first_block > count) {
    return Status::InvalidArgument(fmt::format("load from block {} of a prefix of {} blocks; expected at most {}",
                                               first_block, count, count));
  }
  if (window_keys != 0) {
    const uint32_t least = MinWindowKeys(g, count);
    if (least == 0) {
      return Status::InvalidArgument(fmt::format(
          "window_keys {} but the geometry has no sliding-window component; expected 0", window_keys));
    }
    if (window_keys < least || window_keys > count) {
      return Status::InvalidArgument(fmt::format(
          "window_keys {} for a store of {} keys; expected 0 (each window's last min(window_blocks, n) keys) or "
          "{}..{}", window_keys, count, least, count));
    }
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
  IdExtent extent;
  extent.state_count = static_cast<uint32_t>(state_boundaries.size());
  extent.first_block = store ? 0 : first_block;
  extent.window_keys = store ? window_keys : 0;
  for (size_t i = 0; i < g.component_count(); ++i) {
    const uint64_t expected = ComponentIdCount(g, i, store, count, extent);
    if (component_ids[i].size() == expected) continue;
    const ComponentKind kind = g.component_kind(i);
    std::string why;
    switch (kind) {
      case ComponentKind::kFull:
        why = store ? "one per key" : fmt::format("one per block of the prefix from block {}", first_block);
        break;
      case ComponentKind::kSlidingWindow:
        if (store && window_keys != 0) {
          why = fmt::format("window_keys {}: the last keys", window_keys);
        } else if (store || first_block == 0) {
          why = fmt::format("min(window_blocks {}, {}): the trailing window", g.window_blocks(i), count);
        } else {
          why = fmt::format("min(window_blocks {}, {} - first_block {}): the trailing window past the engine's prefix",
                            g.window_blocks(i), count, first_block);
        }
        break;
      case ComponentKind::kState:
        why = store ? "one per state boundary" : "the one snapshot at the prefix end";
        break;
    }
    return Status::InvalidArgument(fmt::format("{}: component {} ({}) has {} block ids; expected {} ({})", op, i,
                                               ComponentKindName(kind), component_ids[i].size(), expected, why));
  }
  const HybridIdLayout layout = LayoutIds(g, store, count, extent);
  std::vector<uint32_t> ids(layout.total);
  for (size_t i = 0; i < g.component_count(); ++i) {
    std::copy(component_ids[i].begin(), component_ids[i].end(), ids.begin() + static_cast<ptrdiff_t>(layout.offset[i]));
  }
  std::copy(state_boundaries.begin(), state_boundaries.end(),
            ids.begin() + static_cast<ptrdiff_t>(layout.boundaries_offset));
  return ids;
}

}  // namespace flexkv
