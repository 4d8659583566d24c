// See slot_order.h.
#include "common/slot_order.h"

#include <cstring>

#include "common/block_checksum.h"
#include "common/checksum_copy.h"

namespace flexkv {

bool HasShardedSlots(const Geometry& g) {
  for (size_t c = 0; c < g.component_count(); ++c) {
    if (SlotShards(g.Component(c)) > 1) return true;
  }
  return false;
}

uint64_t LayerMajorToSlotOrder(const Geometry& g, const uint8_t* from, uint8_t* to) {
  const uint64_t chunk = g.chunk_bytes_per_rank();  // a multiple of 16 (Geometry::Validate)
  const uint32_t shards = SlotShards(g);
  uint64_t sum = 0;
  // In the order of the bytes written: each shard's part is one run.
  for (uint32_t s = 0; s < shards; ++s) {
    for (uint32_t l = 0; l < g.num_layers; ++l) {
      for (uint32_t p = 0; p < g.kv_planes; ++p) {
        const uint64_t at = SlotChunkOffset(g, l, p, s);
        sum += CopyRunWithChecksum(to + at, from + LayerMajorChunkOffset(g, l, p, s), chunk,
                                   static_cast<uint32_t>(at / kChecksumUnitBytes));
      }
    }
  }
  return sum;
}

}  // namespace flexkv
