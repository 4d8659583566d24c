// Where one TP rank's GPU KV chunks lie, from its registration's layout and regions (docs/protocol.md, "KV
// layouts"): the checks of a GPU registration against its geometry and the address arithmetic the CUDA backend's
// kernels, copy-engine batches and staged copies index (kv_copy.h GpuKvView). Pure: no CUDA, unit-tested.
#pragma once

#include <cstdint>
#include <vector>

#include "daemon/transfer/kv_registration.h"
#include "flexkv/geometry.h"
#include "flexkv/status.h"

namespace flexkv {

// Chunk (layer l, plane p, block b) lies at
//   start of regions[layer_region[l]] + layer_offset[l] + p * plane_stride + b * block_stride
// where a region's start is its allocation's mapped base + GpuKvRegion::offset.
struct GpuKvLayoutPlan {
  uint64_t region_bytes = 0;            // the bytes every region must hold
  std::vector<uint32_t> layer_region;   // per layer: the region holding it
  std::vector<uint64_t> layer_offset;   // per layer: its first chunk's offset in that region
  uint64_t plane_stride = 0;            // bytes
  uint64_t block_stride = 0;            // bytes
  // Every layer in one region (one allocation), so a copy may run across a layer boundary; false for a region per
  // layer, whose allocations may happen to be adjacent yet must never be crossed by one copy.
  bool layers_in_one_allocation = false;
};

// Checks `d` (untrusted: from the engine) against `g` (the registration's copy geometry) and returns where its
// chunks lie. INVALID_ARGUMENT, naming what was wrong and what was expected, for an unknown layout, num_blocks 0,
// a tp_rank not below g.tp_size (K/V; MLA's plane is the same on every rank), a region count other than the
// layout's (one per layer for LAYER_FIRST and LAYER_BLOCK_REGIONS, else one), or a region smaller than the layout
// needs for d.num_blocks (naming the region, its layer where regions are per layer, its bytes and the bytes
// expected).
Result<GpuKvLayoutPlan> PlanGpuKvLayout(const GpuKvDescription& d, const Geometry& g);

}  // namespace flexkv
