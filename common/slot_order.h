// The byte order of a block in a pool slot (docs/protocol.md, "Pool file"), shared by every path that places or
// finds a chunk in a slot: the GPU kernels and copy-engine copies (daemon/transfer/cuda, which mirror it on the
// device), the pool's upgrade of older slots (daemon/cache), tests and benchmarks.
//
// A slot of a single-component copy geometry g (Geometry::Component) holds each TP shard's part contiguous:
//   [tp shard][layer][plane][chunk]      chunk = g.chunk_bytes_per_rank(), shards = SlotShards(g)
// so one TP rank's part of a slot is one run of num_layers * kv_planes * chunk bytes (a staged copy moves it as
// one copy). Pools written before issue 32 held [layer][plane][tp shard][chunk] ("layer-major"); the two orders
// are the same bytes when a slot has one shard (TP 1, MLA), so only sharded pools were upgraded.
#pragma once

#include <cstdint>

#include "flexkv/geometry.h"

namespace flexkv {

// Shards per (layer, plane) in a slot of `g` (a component's copy geometry): tp_size for K/V and states, 1 for MLA.
inline uint32_t SlotShards(const Geometry& g) { return g.is_mla() ? 1 : g.tp_size; }

// Whether any component of `g` has slots of more than one shard (where the slot order matters).
bool HasShardedSlots(const Geometry& g);

// What Geometry::ToString() ends with (before its closing brace) for a geometry with sharded slots: the string names
// a block's bytes wherever it is compared (SSD domains, peer lookups). Without it, the string of an older release.
inline constexpr const char* kRankMajorSlotsTag = ", slots=rank-major";

// Bytes of one shard's part of a slot of `g`: num_layers * kv_planes * chunk.
inline uint64_t SlotShardBytes(const Geometry& g) {
  return uint64_t{g.num_layers} * g.kv_planes * g.chunk_bytes_per_rank();
}

// Offset in a slot of `g` of chunk (layer, plane, shard), in today's order and in the layer-major order of older pools.
inline uint64_t SlotChunkOffset(const Geometry& g, uint32_t layer, uint32_t plane, uint32_t shard) {
  return (uint64_t{shard} * g.num_layers + layer) * g.kv_planes * g.chunk_bytes_per_rank() +
         uint64_t{plane} * g.chunk_bytes_per_rank();
}
inline uint64_t LayerMajorChunkOffset(const Geometry& g, uint32_t layer, uint32_t plane, uint32_t shard) {
  return ((uint64_t{layer} * g.kv_planes + plane) * SlotShards(g) + shard) * g.chunk_bytes_per_rank();
}

// Writes the layer-major slot `from` of `g` to `to` in today's order (host_block_bytes() bytes each; they must not
// overlap). Returns the checksum term sum of what it wrote (common/block_checksum.h: FinishBlockChecksum of it is
// the slot's content checksum), taken in the same pass.
uint64_t LayerMajorToSlotOrder(const Geometry& g, const uint8_t* from, uint8_t* to);

}  // namespace flexkv
