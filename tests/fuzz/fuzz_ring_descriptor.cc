// Fuzz target: the validation of ring submit descriptors (daemon/dataplane/descriptor_validation.h). Arbitrary
// bytes become the session limits, the handles it holds, one descriptor and the arena contents. Whatever they
// are, validation never crashes or reads outside the arena, and whenever it accepts a descriptor, an independent
// check here (128-bit arithmetic, no shared helpers) confirms that every field, offset, length and block id is
// within the limits and that the payload is exactly the arena's bytes.
//
// Input: 16-byte header | 64-byte SubmitDescriptor | arena (the rest, any length).
//   header: u32 max_blocks (1 + value % 2^20), u32 registered_blocks, u8 kv_missing selector,
//           u8 blocks[4] pinned by match handles 1..4 (0: not held), 3 bytes unused.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>

#include "common/hybrid_ids.h"
#include "daemon/dataplane/descriptor_validation.h"

namespace {

using flexkv::RingOp;
using flexkv::StatusCode;
using flexkv::SubmitDescriptor;

constexpr size_t kHeaderBytes = 16;

[[noreturn]] void Violation() { __builtin_trap(); }
void Require(bool holds) {
  if (!holds) Violation();
}

// [offset, offset + count * width) inside `arena_bytes` and `align`-aligned, in 128 bits so nothing can wrap.
bool InsideArena(uint64_t offset, uint32_t count, uint64_t width, uint64_t align, uint64_t arena_bytes) {
  const unsigned __int128 end = static_cast<unsigned __int128>(offset) + static_cast<unsigned __int128>(count) * width;
  return offset % align == 0 && end <= arena_bytes;
}

// A hybrid session's accepted Load or Store: its id array is exactly LayoutIds' size and bytes, every component's ids
// are below what it registered, a Store's boundaries strictly increase in 1..count.
void CheckAcceptedHybrid(const SubmitDescriptor& d, std::span<const uint8_t> arena,
                         const flexkv::DescriptorLimits& limits, const flexkv::DescriptorPayload& p) {
  const flexkv::Geometry& g = *limits.geometry;
  const auto op = static_cast<RingOp>(d.opcode);
  // The word at 56 is a Store's state_count or a Load's first_block; the word at 60 a Store's window_keys or a
  // Load's event set (then never with the layer-wise flag: one completion kind).
  Require(d.state_count == 0 || op == RingOp::kStore || op == RingOp::kLoad);
  Require(d.window_keys == 0 || op == RingOp::kStore ||
          (op == RingOp::kLoad && (d.flags & flexkv::kLoadFlagLayerwise) == 0));
  if (op == RingOp::kRelease || op == RingOp::kMatch || op == RingOp::kPrefetch) return;
  const bool store = op == RingOp::kStore;
  Require(d.state_count <= d.count);  // a Load's first_block too: at most its prefix end
  if (store && d.window_keys != 0) {
    Require(d.window_keys >= flexkv::MinWindowKeys(g, d.count) && d.window_keys <= d.count);
  }
  const flexkv::IdExtent extent = flexkv::ExtentOf(d);
  const flexkv::HybridIdLayout layout = flexkv::LayoutIds(g, store, d.count, extent);
  Require(p.block_ids.size() == layout.total);
  Require(InsideArena(d.block_ids_offset, static_cast<uint32_t>(layout.total), 4, 4, arena.size()));
  Require(std::memcmp(p.block_ids.data(), arena.data() + d.block_ids_offset, layout.total * 4) == 0);
  for (size_t c = 0; c < g.component_count(); ++c) {
    const uint64_t n = flexkv::ComponentIdCount(g, c, store, d.count, extent);
    for (uint64_t i = 0; i < n; ++i) Require(p.block_ids[layout.offset[c] + i] < limits.component_blocks[c]);
  }
  Require(p.boundaries.size() == (store ? d.state_count : 0));
  uint32_t previous = 0;
  for (uint32_t b : p.boundaries) {
    Require(b > previous && b <= d.count);
    previous = b;
  }
}

void CheckAccepted(const SubmitDescriptor& d, std::span<const uint8_t> arena, const flexkv::DescriptorLimits& limits,
                   const flexkv::DescriptorPayload& p) {
  const bool hybrid = limits.geometry != nullptr;
  Require(d.opcode >= 1 && d.opcode <= 5);
  const auto op = static_cast<RingOp>(d.opcode);
  // A full-attention session: the word at 56 only as a Load's first_block (below count), nothing at 60 but a
  // Load's event set.
  if (!hybrid) Require(d.state_count == 0 || (op == RingOp::kLoad && d.first_block < d.count));
  Require(d.event_set == 0 || (op == RingOp::kLoad && (d.flags & 1) == 0) || (op == RingOp::kStore && hybrid));
  Require(op != RingOp::kPrefetch || d.match_handle == 0);
  Require(op == RingOp::kStore || d.parent == flexkv::BlockKey{});
  // Layout 6: a Load's launch deadline fits the daemon's int64 clock.
  Require(op != RingOp::kLoad || d.launch_deadline_ns <= static_cast<uint64_t>(INT64_MAX));
  const uint16_t allowed = op == RingOp::kMatch ? 1 : op == RingOp::kLoad ? 1 : 0;
  Require((d.flags | allowed) == allowed);
  if (op == RingOp::kRelease) {
    Require(p.keys.empty() && p.block_ids.empty());
    return;
  }
  Require(d.count >= 1 && d.count <= limits.max_blocks_per_request);
  const bool keys = op != RingOp::kLoad;
  const bool ids = op == RingOp::kLoad || op == RingOp::kStore;
  if (keys) {
    Require(InsideArena(d.keys_offset, d.count, 16, 8, arena.size()));  // 16-byte keys, 8-aligned
    Require(p.keys.size() == d.count);
    Require(std::memcmp(p.keys.data(), arena.data() + d.keys_offset, size_t{d.count} * 16) == 0);
    if (op == RingOp::kStore || op == RingOp::kPrefetch) {
      for (const flexkv::BlockKey& k : p.keys) Require(!(k == flexkv::BlockKey{}));  // the root's reserved key
    }
  } else {
    Require(p.keys.empty());
  }
  if (hybrid) {
    if (ids) Require(limits.registered_blocks > 0);
    CheckAcceptedHybrid(d, arena, limits, p);
    if (!ids) Require(p.block_ids.empty());
  } else if (ids) {
    Require(limits.registered_blocks > 0);
    const uint32_t n = op == RingOp::kLoad ? d.count - d.first_block : d.count;  // a Load's: [first_block, count)
    Require(InsideArena(d.block_ids_offset, n, 4, 4, arena.size()));
    Require(p.block_ids.size() == n);
    Require(std::memcmp(p.block_ids.data(), arena.data() + d.block_ids_offset, size_t{n} * 4) == 0);
    for (uint32_t id : p.block_ids) Require(id < limits.registered_blocks);
  } else {
    Require(p.block_ids.empty());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < kHeaderBytes + sizeof(SubmitDescriptor)) return 0;
  uint32_t max_blocks = 0;
  flexkv::DescriptorLimits limits;
  std::memcpy(&max_blocks, data, 4);
  limits.max_blocks_per_request = 1 + max_blocks % (1u << 20);
  std::memcpy(&limits.registered_blocks, data + 4, 4);
  if (data[8] % 2 == 1) limits.kv_missing = "tp rank 1 of 2 has not registered its GPU KV buffers";
  // Bit 1: a hybrid session (a 2-block window and a state), its components' registered blocks from the input.
  static const flexkv::Geometry hybrid = [] {
    flexkv::Geometry g = flexkv::GptOss20B();
    g.components[0].window_tokens = 32;
    flexkv::ComponentSpec state;
    state.kind = flexkv::ComponentKind::kState;
    state.num_layers = 1;
    state.state_bytes_per_layer = 64;
    g.components.push_back(state);
    return g;
  }();
  if ((data[8] & 2) != 0) {
    limits.geometry = &hybrid;
    limits.component_blocks = {limits.registered_blocks, 1u + data[9] % 64u, 1u + data[10] % 8u};
  }
  const uint8_t* handle_blocks = data + 9;
  SubmitDescriptor d;
  std::memcpy(&d, data + kHeaderBytes, sizeof(d));
  const std::span<const uint8_t> arena(data + kHeaderBytes + sizeof(d), size - kHeaderBytes - sizeof(d));

  const auto result = flexkv::ValidateDescriptor(d, arena, limits);
  if (result.ok()) {
    CheckAccepted(d, arena, limits, *result);
  } else {
    const flexkv::Status& st = result.status();
    Require(st.code() == StatusCode::kInvalidArgument || st.code() == StatusCode::kOutOfRange ||
            st.code() == StatusCode::kFailedPrecondition);
    Require(!st.message().empty());
    // FAILED_PRECONDITION only for Load/Store with nothing registered; everything else is the descriptor's fault.
    if (st.code() == StatusCode::kFailedPrecondition) {
      Require(limits.registered_blocks == 0 && (d.opcode == 2 || d.opcode == 3));
    }
  }
  // Pure: the same input gives the same answer.
  const auto again = flexkv::ValidateDescriptor(d, arena, limits);
  Require(again.ok() == result.ok());
  if (!result.ok()) {
    Require(again.status().code() == result.status().code() && again.status().message() == result.status().message());
  }

  // The handle check, after an accepted descriptor, against a table of handles 1..4.
  if (result.ok()) {
    std::optional<size_t> held;
    if (d.match_handle >= 1 && d.match_handle <= 4 && handle_blocks[d.match_handle - 1] != 0) {
      held = handle_blocks[d.match_handle - 1];
    }
    const flexkv::Status use = flexkv::ValidateHandleUse(d, held);
    const auto op = static_cast<RingOp>(d.opcode);
    if (op == RingOp::kMatch || op == RingOp::kStore || op == RingOp::kPrefetch) {
      Require(use.ok());
    } else if (use.ok()) {
      Require(held.has_value());
      if (op == RingOp::kLoad) Require(d.count <= *held);
    } else {
      Require(!use.message().empty());
      Require(held ? use.code() == StatusCode::kOutOfRange && op == RingOp::kLoad && d.count > *held
                   : use.code() == StatusCode::kNotFound);
    }
  }
  return 0;
}
