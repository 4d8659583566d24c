// The id array of a hybrid geometry's Load or Store: checks the engine's per-component block id spans and state
// boundaries and lays them out as the ring carries them (common/hybrid_ids.h). Internal to libflexkv; no state.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "flexkv/geometry.h"
#include "flexkv/status.h"

namespace flexkv {

// One span of engine block ids per geometry component (component 0 first), as Client::Load and Client::Store take
// them (flexkv/client.h). `count` is the Store's number of keys or the Load's prefix end e (first_block +
// component_ids[0].size()); `state_boundaries` is a Store's (empty for a Load); `first_block` a Load's (0 for a
// Store), `window_keys` a Store's (0 for a Load: the default trailing windows). Returns the ids laid out by
// LayoutIds: FULL and SLIDING_WINDOW ids in component order, then (Store) the boundaries, then the STATE ids.
// INVALID_ARGUMENT, before anything is sent, when the number of spans is not the geometry's component count, a
// span's size is not ComponentIdCount (the message names the component index, its kind, the size given and the
// size expected), or a boundary is outside 1..count or not strictly increasing, or boundaries are given to a Load
// or to a geometry without a state component, or first_block is above count, or window_keys is neither 0 nor in
// MinWindowKeys..count (or given to a geometry without a sliding window).
Result<std::vector<uint32_t>> LayOutComponentIds(const Geometry& geometry, bool store, uint32_t count,
                                                 std::span<const std::span<const uint32_t>> component_ids,
                                                 std::span<const uint32_t> state_boundaries,
                                                 uint32_t first_block = 0, uint32_t window_keys = 0);

}  // namespace flexkv
