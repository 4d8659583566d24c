// Where each component's block ids sit in a hybrid Load or Store (common/ring_layout.h, docs/hybrid.md "Ring
// requests"): the one place the client library and the daemon compute the layout from. Header-only, no state.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "flexkv/geometry.h"

namespace flexkv {

// How many ids of one component a request carries.
//   Load:  FULL count, SLIDING_WINDOW min(window_blocks, count), STATE 1.
//   Store: FULL count, SLIDING_WINDOW min(window_blocks, count), STATE state_count.
inline uint64_t ComponentIdCount(const Geometry& g, size_t component, bool store, uint32_t count,
                                 uint32_t state_count) {
  switch (g.component_kind(component)) {
    case ComponentKind::kFull:
      return count;
    case ComponentKind::kSlidingWindow:
      return std::min<uint64_t>(g.window_blocks(component), count);
    case ComponentKind::kState:
      return store ? state_count : 1;
  }
  return 0;
}

// The layout of a request's ids: component i's ids are [offset[i], offset[i] + ComponentIdCount) of the id array;
// a Store's state boundaries are [boundaries_offset, boundaries_offset + state_count), before the STATE ids.
// For a full-attention geometry: offset = {0}, total = count.
struct HybridIdLayout {
  std::vector<uint64_t> offset;  // per component
  uint64_t boundaries_offset = 0;
  uint64_t total = 0;            // u32 values in the array
};

inline HybridIdLayout LayoutIds(const Geometry& g, bool store, uint32_t count, uint32_t state_count) {
  HybridIdLayout l;
  l.offset.resize(g.component_count());
  uint64_t at = 0;
  // FULL and SLIDING_WINDOW ids first, in component order; then (Store) the boundaries; then STATE ids.
  for (size_t i = 0; i < g.component_count(); ++i) {
    if (g.component_kind(i) == ComponentKind::kState) continue;
    l.offset[i] = at;
    at += ComponentIdCount(g, i, store, count, state_count);
  }
  l.boundaries_offset = at;
  if (store) at += state_count;
  for (size_t i = 0; i < g.component_count(); ++i) {
    if (g.component_kind(i) != ComponentKind::kState) continue;
    l.offset[i] = at;
    at += ComponentIdCount(g, i, store, count, state_count);
  }
  l.total = at;
  return l;
}

}  // namespace flexkv
