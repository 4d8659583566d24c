// Validation of the submit descriptors a client writes into its ring: untrusted input, checked by pure
// functions (no state, no side effects) so that they can be fuzzed (tests/fuzz/fuzz_ring_descriptor.cc) and
// unit-tested apart from the poller that calls them (DataPlane::Process).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "common/hybrid_ids.h"
#include "common/ring_layout.h"
#include "flexkv/block_key.h"
#include "flexkv/geometry.h"
#include "flexkv/status.h"

namespace flexkv {

// What a descriptor is checked against.
struct DescriptorLimits {
  uint32_t max_blocks_per_request = 0;  // Match, Load and Store carry 1..this blocks
  // KV blocks the session registered (host buffers, or the fewest of its GPU ranks). Block ids must be below
  // it. 0 while nothing is registered: Load and Store are then refused (FAILED_PRECONDITION) with `kv_missing`
  // as the reason ("no KV buffers registered (RegisterKv)" when empty).
  uint32_t registered_blocks = 0;
  std::string_view kv_missing;
  // A hybrid session (docs/hybrid.md): its geometry, and the blocks each component registered (registered_blocks
  // is then the least of them). Null for a full-attention session.
  const Geometry* geometry = nullptr;
  std::vector<uint32_t> component_blocks;
};

// What a valid descriptor carries, copied out of the arena. A Store's parent is d.parent (any value: whether
// it is cached is state, checked where the store is reserved).
struct DescriptorPayload {
  std::vector<BlockKey> keys;       // Match, Store: `count` keys; empty otherwise
  // Load, Store: `count` ids (a Load's: count - first_block), each below registered_blocks; empty otherwise.
  std::vector<uint32_t> block_ids;
  // Hybrid sessions: block_ids is the whole id array (LayoutIds: every component's ids, and a Store's
  // boundaries), and `boundaries` a copy of the Store's state boundaries.
  std::vector<uint32_t> boundaries;
};

// Checks descriptor `d` (already copied out of the submit ring) against `limits`, and copies its keys and block
// ids out of `arena` (the session's payload arena). The client may be writing the arena concurrently: each byte
// is read once, and the checks apply to the copy that is returned, never to the shared bytes.
//
// Returns the payload, or an error naming the field, its value and what was expected:
//   INVALID_ARGUMENT     reserved word not zero; opcode not 1..4 (RingOp); a parent that is not all zero on an
//                        opcode other than Store; flags outside those of the opcode
//                        (Match: kMatchFlagPin, Load: kLoadFlagLayerwise, none otherwise); count of a Match, Load
//                        or Store not in 1..max_blocks_per_request;
//   OUT_OF_RANGE         keys (count x 16 bytes, 8-aligned) or block ids (count x 4 bytes, 4-aligned) not inside
//                        the arena; a block id not below registered_blocks;
//   FAILED_PRECONDITION  Load or Store while registered_blocks is 0;
//   INVALID_ARGUMENT     a Store key that is all zero (reserved: the pool records it as a root block's parent).
// Layout 5: a Load's first_block (the word of a Store's state_count) not below count (INVALID_ARGUMENT; a hybrid
// Load's may equal count: only the state moves). Hybrid sessions also: state_count not 0 outside a Store, or above
// count (INVALID_ARGUMENT); on a Store, window_keys neither 0 nor in MinWindowKeys..count (INVALID_ARGUMENT; the
// word at 60 is a Load's event_set, whose layers follow Geometry::LayerOrder, and 0 on other opcodes); the id array (LayoutIds with ExtentOf(d)) outside the arena (OUT_OF_RANGE); an id of component c
// not below what c registered (OUT_OF_RANGE, naming the component); boundaries not strictly increasing in 1..count
// (INVALID_ARGUMENT). A full-attention session's Store carries state_count and window_keys 0.
// Layout 6: a Load's launch_deadline_ns (the word of keys_offset) above INT64_MAX (INVALID_ARGUMENT, checked right
// after first_block). Any other value is valid here: whether it has passed is decided where the copy is launched.
// The checks run in that order; the first failure is returned. Match handles are not checked here: whether the
// session holds one is state, looked up where it is used (ValidateHandleUse).
Result<DescriptorPayload> ValidateDescriptor(const SubmitDescriptor& d, std::span<const uint8_t> arena,
                                             const DescriptorLimits& limits);

// What a valid descriptor's id array covers (common/hybrid_ids.h): a Load's first_block, a Store's state_count and
// window_keys; zero for every other opcode.
IdExtent ExtentOf(const SubmitDescriptor& d);

// The match handle of a Load or Release, once looked up: `handle_blocks` is how many blocks d.match_handle
// pins when this session holds it (and has not released it), nullopt otherwise. Returns OK, NOT_FOUND for a
// handle the session does not hold, or OUT_OF_RANGE for a Load of more blocks than the handle pins. OK for
// other opcodes.
Status ValidateHandleUse(const SubmitDescriptor& d, std::optional<size_t> handle_blocks);

}  // namespace flexkv
