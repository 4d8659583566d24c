// PoolRegion: where the DRAM pool's slot bytes sit in this process, as the cache announces it to the
// engine-memory backends (which copy into and out of slots, and may register the range for DMA).
#pragma once

#include <cstdint>

#include "daemon/cache/prefix_index.h"

namespace flexkv {

struct PoolRegion {
  uint8_t* base = nullptr;  // slot 0's first byte; valid for the pool's lifetime
  uint64_t bytes = 0;       // slots * slot_bytes
  uint64_t slot_bytes = 0;  // one block, BLOCKFIRST and contiguous
  uint32_t slots = 0;

  uint8_t* SlotData(SlotId slot) const { return base + uint64_t{slot} * slot_bytes; }
};

}  // namespace flexkv
