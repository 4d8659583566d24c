// Where each component's block ids sit in a hybrid Load or Store (common/ring_layout.h, docs/hybrid.md "Ring
// requests"): the one place the client library and the daemon compute the layout from. Header-only, no state.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "flexkv/geometry.h"

namespace flexkv {

// What a request's id array covers besides its kind and count. Load: `first_block` (k, 0..count) is the first block
// of the prefix it copies. Store: `state_count` boundaries, and `window_keys` (m) the last keys that carry
// sliding-window ids, 0 for the default min(window_blocks, count) of each window. The caller validates the values
// (a Load's k <= count; a Store's m in [min(window_blocks, count), count] for every window, or 0).
struct IdExtent {
  uint32_t state_count = 0;  // Store
  uint32_t first_block = 0;  // Load
  uint32_t window_keys = 0;  // Store
};

// How many ids of one component a request carries.
//   Load:  FULL count - k; SLIDING_WINDOW min(window_blocks, count - k) (the blocks [max(k, count - w), count));
//          STATE 1.
//   Store: FULL count; SLIDING_WINDOW window_keys, or min(window_blocks, count) when it is 0; STATE state_count.
inline uint64_t ComponentIdCount(const Geometry& g, size_t component, bool store, uint32_t count,
                                 const IdExtent& extent = {}) {
  switch (g.component_kind(component)) {
    case ComponentKind::kFull:
      return store ? count : count - std::min(extent.first_block, count);
    case ComponentKind::kSlidingWindow:
      if (store) return extent.window_keys != 0 ? extent.window_keys : std::min<uint64_t>(g.window_blocks(component), count);
      return std::min<uint64_t>(g.window_blocks(component), count - std::min(extent.first_block, count));
    case ComponentKind::kState:
      return store ? extent.state_count : 1;
  }
  return 0;
}

// The smallest window_keys a Store of `count` keys may name: every window's min(window_blocks, count) (0 without a
// sliding-window component).
inline uint32_t MinWindowKeys(const Geometry& g, uint32_t count) {
  uint32_t least = 0;
  for (size_t i = 0; i < g.component_count(); ++i) {
    if (g.component_kind(i) == ComponentKind::kSlidingWindow) least = std::max(least, std::min(g.window_blocks(i), count));
  }
  return least;
}

// The layout of a request's ids: component i's ids are [offset[i], offset[i] + ComponentIdCount) of the id array;
// a Store's state boundaries are [boundaries_offset, boundaries_offset + state_count), before the STATE ids.
// For a full-attention geometry: offset = {0}, total = count (a Load's: count - first_block).
struct HybridIdLayout {
  std::vector<uint64_t> offset;  // per component
  uint64_t boundaries_offset = 0;
  uint64_t total = 0;            // u32 values in the array
};

inline HybridIdLayout LayoutIds(const Geometry& g, bool store, uint32_t count, const IdExtent& extent = {}) {
  HybridIdLayout l;
  l.offset.resize(g.component_count());
  uint64_t at = 0;
  // FULL and SLIDING_WINDOW ids first, in component order; then (Store) the boundaries; then STATE ids.
  for (size_t i = 0; i < g.component_count(); ++i) {
    if (g.component_kind(i) == ComponentKind::kState) continue;
    l.offset[i] = at;
    at += ComponentIdCount(g, i, store, count, extent);
  }
  l.boundaries_offset = at;
  if (store) at += extent.state_count;
  for (size_t i = 0; i < g.component_count(); ++i) {
    if (g.component_kind(i) != ComponentKind::kState) continue;
    l.offset[i] = at;
    at += ComponentIdCount(g, i, store, count, extent);
  }
  l.total = at;
  return l;
}

}  // namespace flexkv
