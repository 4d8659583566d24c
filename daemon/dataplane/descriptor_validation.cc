// See descriptor_validation.h.
#include "daemon/dataplane/descriptor_validation.h"

#include <fmt/format.h>

#include <cstdint>
#include <cstring>

#include "common/hybrid_ids.h"

namespace flexkv {
namespace {

// Checks that `bytes` at `offset` lie inside an arena of `arena_bytes`, aligned to `align`, without overflow.
Status CheckArenaRange(const char* what, uint64_t offset, uint64_t bytes, uint64_t arena_bytes, uint64_t align) {
  if (offset % align != 0) {
    return Status::OutOfRange(fmt::format("{} at offset {} are unaligned; expected a multiple of {}", what, offset, align));
  }
  if (offset > arena_bytes || bytes > arena_bytes - offset) {
    return Status::OutOfRange(fmt::format("{} [{}, +{}) are outside the {}-byte arena", what, offset, bytes, arena_bytes));
  }
  return Status::Ok();
}

const char* OpName(RingOp op) {
  switch (op) {
    case RingOp::kMatch:
      return "Match";
    case RingOp::kLoad:
      return "Load";
    case RingOp::kStore:
      return "Store";
    case RingOp::kRelease:
      return "Release";
    case RingOp::kPrefetch:
      return "Prefetch";
  }
  return "?";
}

// A hybrid request's ids (already copied into payload->block_ids): each component's below what it registered, and
// a Store's boundaries strictly increasing in 1..count (copied into payload->boundaries).
Status CheckHybridIds(const Geometry& g, bool store, const SubmitDescriptor& d, const HybridIdLayout& layout,
                      const DescriptorLimits& limits, DescriptorPayload* payload) {
  const std::vector<uint32_t>& ids = payload->block_ids;
  for (size_t c = 0; c < g.component_count(); ++c) {
    const uint64_t n = ComponentIdCount(g, c, store, d.count, ExtentOf(d));
    const uint32_t registered = c < limits.component_blocks.size() ? limits.component_blocks[c] : 0;
    for (uint64_t i = 0; i < n; ++i) {
      const uint32_t id = ids[layout.offset[c] + i];
      if (id >= registered) {
        return Status::OutOfRange(fmt::format(
            "block id {} at {} of component {} ({}) is outside its {} registered blocks; expected 0..{}", id, i, c,
            ComponentKindName(g.component_kind(c)), registered, registered == 0 ? 0 : registered - 1));
      }
    }
  }
  if (!store) return Status::Ok();
  payload->boundaries.assign(ids.begin() + static_cast<ptrdiff_t>(layout.boundaries_offset),
                             ids.begin() + static_cast<ptrdiff_t>(layout.boundaries_offset + d.state_count));
  uint32_t previous = 0;
  for (size_t i = 0; i < payload->boundaries.size(); ++i) {
    const uint32_t b = payload->boundaries[i];
    if (b <= previous || b > d.count) {
      return Status::InvalidArgument(fmt::format(
          "state boundary {} at {} is out of order or range; expected strictly increasing values in 1..{} (after {})",
          b, i, d.count, previous));
    }
    previous = b;
  }
  return Status::Ok();
}

}  // namespace

Result<DescriptorPayload> ValidateDescriptor(const SubmitDescriptor& d, std::span<const uint8_t> arena,
                                             const DescriptorLimits& limits) {
  const auto op = static_cast<RingOp>(d.opcode);
  const bool hybrid = limits.geometry != nullptr && limits.geometry->is_hybrid();
  const bool hybrid_store = hybrid && op == RingOp::kStore;
  // The word at 60: a Load's event_set, a hybrid Store's window_keys.
  if (d.event_set != 0 && op != RingOp::kLoad && !hybrid_store) {
    return Status::InvalidArgument(fmt::format(
        "event_set is {} on opcode {}; expected 0 (only a Load names a layer-event set)", d.event_set, d.opcode));
  }
  if (op != RingOp::kMatch && op != RingOp::kLoad && op != RingOp::kStore && op != RingOp::kRelease &&
      op != RingOp::kPrefetch) {
    return Status::InvalidArgument(fmt::format("opcode {} is unknown; expected 1..5", d.opcode));
  }
  if (op == RingOp::kPrefetch && d.match_handle != 0) {
    return Status::InvalidArgument(
        fmt::format("match_handle is {} on a Prefetch; expected 0 (a Prefetch pins nothing)", d.match_handle));
  }
  if (op != RingOp::kStore && d.parent != BlockKey{}) {
    return Status::InvalidArgument(fmt::format("parent is {} on a {}; expected all zero (only a Store has a parent)",
                                               d.parent.ToHex(), OpName(op)));
  }
  const uint16_t allowed_flags = op == RingOp::kMatch ? kMatchFlagPin : op == RingOp::kLoad ? kLoadFlagLayerwise : 0;
  if ((d.flags & ~allowed_flags) != 0) {
    return Status::InvalidArgument(
        fmt::format("flags 0x{:x} are not valid for opcode {}; expected a subset of 0x{:x}", d.flags, d.opcode,
                    allowed_flags));
  }
  // The word at 56: a Load's first_block, a hybrid Store's state_count.
  if (d.state_count != 0 && op != RingOp::kLoad && !hybrid_store) {
    return Status::InvalidArgument(fmt::format(
        "state_count is {} on a {}; expected 0 (only a Store of a hybrid geometry carries state boundaries)",
        d.state_count, OpName(op)));
  }
  if (op == RingOp::kLoad && d.first_block != 0 && d.first_block >= d.count && !(hybrid && d.first_block == d.count)) {
    return Status::InvalidArgument(fmt::format(
        "first_block {} of a Load of {} blocks; expected {}",
        d.first_block, d.count,
        hybrid ? fmt::format("at most {}", d.count) : fmt::format("below {}", d.count)));
  }
  // The word at 16: a Load's launch_deadline_ns (layout 6), the keys_offset of the opcodes that carry keys.
  if (op == RingOp::kLoad && d.launch_deadline_ns > static_cast<uint64_t>(INT64_MAX)) {
    return Status::InvalidArgument(fmt::format(
        "launch_deadline_ns {} of a Load; expected 0 (none) or a CLOCK_MONOTONIC time in ns of at most {}",
        d.launch_deadline_ns, INT64_MAX));
  }
  if (op == RingOp::kLoad && d.event_set != 0 && (d.flags & kLoadFlagLayerwise) != 0) {
    return Status::InvalidArgument(fmt::format(
        "a Load with event_set {} has the layer-wise flag; expected one completion kind: the set's CUDA events "
        "(flags 0) or progress completions (kLoadFlagLayerwise, event_set 0)", d.event_set));
  }
  if (op == RingOp::kRelease) return DescriptorPayload{};  // only its match handle matters (ValidateHandleUse)

  if (d.count == 0 || d.count > limits.max_blocks_per_request) {
    return Status::InvalidArgument(
        fmt::format("count {} is out of range; expected 1..{}", d.count, limits.max_blocks_per_request));
  }
  const bool has_keys = op == RingOp::kMatch || op == RingOp::kStore || op == RingOp::kPrefetch;
  const bool has_ids = op == RingOp::kLoad || op == RingOp::kStore;
  if (hybrid_store && d.state_count > d.count) {
    return Status::InvalidArgument(
        fmt::format("state_count {} is above count {}; expected at most one state boundary per key", d.state_count,
                    d.count));
  }
  if (hybrid_store && d.window_keys != 0) {
    const uint32_t least = MinWindowKeys(*limits.geometry, d.count);
    if (least == 0) {
      return Status::InvalidArgument(fmt::format(
          "window_keys {} but the geometry has no sliding window; expected 0", d.window_keys));
    }
    if (d.window_keys < least || d.window_keys > d.count) {
      return Status::InvalidArgument(fmt::format(
          "window_keys {} of a Store of {} keys; expected 0 or {}..{}", d.window_keys, d.count, least, d.count));
    }
  }
  const IdExtent extent = ExtentOf(d);
  const HybridIdLayout layout = hybrid ? LayoutIds(*limits.geometry, op == RingOp::kStore, d.count, extent)
                                       : HybridIdLayout{};
  const uint64_t key_bytes = uint64_t{d.count} * sizeof(BlockKey);
  // A full-attention Load carries the ids of the blocks [first_block, count).
  const uint64_t plain_ids = op == RingOp::kLoad ? uint64_t{d.count} - d.first_block : uint64_t{d.count};
  const uint64_t id_bytes = (hybrid ? layout.total : plain_ids) * sizeof(uint32_t);
  if (has_keys) FLEXKV_RETURN_IF_ERROR(CheckArenaRange("keys", d.keys_offset, key_bytes, arena.size(), 8));
  if (has_ids) FLEXKV_RETURN_IF_ERROR(CheckArenaRange("block ids", d.block_ids_offset, id_bytes, arena.size(), 4));
  if (has_ids && limits.registered_blocks == 0) {
    return Status::FailedPrecondition(fmt::format(
        "{}: {}", OpName(op), limits.kv_missing.empty() ? "no KV buffers registered (RegisterKv)" : limits.kv_missing));
  }

  DescriptorPayload payload;
  if (has_keys) {
    payload.keys.resize(d.count);
    std::memcpy(payload.keys.data(), arena.data() + d.keys_offset, key_bytes);
  }
  if (has_ids && hybrid) {
    payload.block_ids.resize(layout.total);
    std::memcpy(payload.block_ids.data(), arena.data() + d.block_ids_offset, id_bytes);
    FLEXKV_RETURN_IF_ERROR(CheckHybridIds(*limits.geometry, op == RingOp::kStore, d, layout, limits, &payload));
  } else if (has_ids) {
    payload.block_ids.resize(plain_ids);
    std::memcpy(payload.block_ids.data(), arena.data() + d.block_ids_offset, id_bytes);
    // The copy is checked, not the arena: the client cannot change an id after this.
    for (size_t i = 0; i < payload.block_ids.size(); ++i) {
      const uint32_t id = payload.block_ids[i];
      if (id >= limits.registered_blocks) {
        return Status::OutOfRange(fmt::format("block id {} at {} is outside the {} registered blocks; expected 0..{}",
                                              id, i, limits.registered_blocks, limits.registered_blocks - 1));
      }
    }
  }
  // The all-zero key is what the pool records as a root block's parent, so a stored one would link
  // differently after a restart than before it; the copy is checked, as for block ids.
  // A Prefetch's keys are published and pulled under the same rule.
  if (op == RingOp::kStore || op == RingOp::kPrefetch) {
    for (uint32_t i = 0; i < d.count; ++i) {
      if (payload.keys[i] == BlockKey{}) {
        return Status::InvalidArgument(fmt::format(
            "key {} of the {} is all zero; expected a non-zero key (the all-zero key is reserved for a "
            "chain's root)",
            i, OpName(op)));
      }
    }
  }
  return payload;
}

IdExtent ExtentOf(const SubmitDescriptor& d) {
  IdExtent e;
  const auto op = static_cast<RingOp>(d.opcode);
  if (op == RingOp::kLoad) e.first_block = d.first_block;
  if (op == RingOp::kStore) {
    e.state_count = d.state_count;
    e.window_keys = d.window_keys;
  }
  return e;
}

Status ValidateHandleUse(const SubmitDescriptor& d, std::optional<size_t> handle_blocks) {
  const auto op = static_cast<RingOp>(d.opcode);
  if (op != RingOp::kLoad && op != RingOp::kRelease) return Status::Ok();
  if (!handle_blocks) {
    return Status::NotFound(fmt::format("match handle {} is not held by this session", d.match_handle));
  }
  if (op == RingOp::kLoad && d.count > *handle_blocks) {
    return Status::OutOfRange(
        fmt::format("count {} exceeds the {} blocks of match handle {}", d.count, *handle_blocks, d.match_handle));
  }
  return Status::Ok();
}

}  // namespace flexkv
