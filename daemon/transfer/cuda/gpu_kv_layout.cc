// See gpu_kv_layout.h.
#include "daemon/transfer/cuda/gpu_kv_layout.h"

#include <fmt/format.h>

#include <string>

namespace flexkv {

Result<GpuKvLayoutPlan> PlanGpuKvLayout(const GpuKvDescription& d, const Geometry& g) {
  if (!IsKnownKvLayout(d.layout)) {
    return Status::InvalidArgument(fmt::format("layout {} is not valid; expected {}", static_cast<uint32_t>(d.layout),
                                               KvLayoutsAccepted()));
  }
  if (d.num_blocks == 0) return Status::InvalidArgument("num_blocks is 0; expected the blocks the GPU cache holds");
  if (!g.is_mla() && d.tp_rank >= g.tp_size) {
    return Status::InvalidArgument(fmt::format("tp_rank {} is not below tp_size {}", d.tp_rank, g.tp_size));
  }
  // Below 2^64: a host block (L x P x chunk x TP) is at most 4 GiB (Geometry::Validate) and B below 2^32.
  const uint64_t chunk = g.chunk_bytes_per_rank();
  const uint64_t L = g.num_layers, P = g.kv_planes, B = d.num_blocks;
  const bool per_layer = KvLayoutHasRegionPerLayer(d.layout);
  const size_t want_regions = per_layer ? L : 1;
  const char* name = KvLayoutName(d.layout);
  if (d.regions.size() != want_regions) {
    return Status::InvalidArgument(fmt::format("{} regions for layout {}; expected {} ({})", d.regions.size(), name,
                                               want_regions, per_layer ? "one per layer" : "one base region"));
  }
  GpuKvLayoutPlan plan;
  plan.region_bytes = per_layer ? P * B * chunk : L * P * B * chunk;
  // What one region holds, for the refusal: [layer] only in the one-region layouts.
  const char* shape = "";
  switch (d.layout) {
    case KvLayout::kLayerFirst:
      plan.plane_stride = B * chunk;
      plan.block_stride = chunk;
      shape = "[plane][block][chunk] of its layer";
      break;
    case KvLayout::kBlockFirst:
      plan.plane_stride = chunk;
      plan.block_stride = L * P * chunk;
      shape = "[block][layer][plane][chunk]";
      break;
    case KvLayout::kLayerBlock:
      plan.plane_stride = chunk;
      plan.block_stride = P * chunk;
      shape = "[layer][block][plane][chunk]";
      break;
    case KvLayout::kLayerBlockRegions:
      plan.plane_stride = chunk;
      plan.block_stride = P * chunk;
      shape = "[block][plane][chunk] of its layer";
      break;
  }
  for (size_t r = 0; r < d.regions.size(); ++r) {
    if (d.regions[r].bytes < plan.region_bytes) {
      return Status::InvalidArgument(fmt::format(
          "region {}{} has {} bytes; layout {} needs {} bytes in it for {} blocks ({}: {} plane(s) of {}-byte chunks)",
          r, per_layer ? fmt::format(" (layer {})", r) : std::string(), d.regions[r].bytes, name, plan.region_bytes, B,
          shape, P, chunk));
    }
  }
  plan.layers_in_one_allocation = !per_layer;
  plan.layer_region.resize(L);
  plan.layer_offset.resize(L);
  for (uint64_t l = 0; l < L; ++l) {
    plan.layer_region[l] = per_layer ? static_cast<uint32_t>(l) : 0;
    switch (d.layout) {
      case KvLayout::kLayerFirst:
      case KvLayout::kLayerBlockRegions:
        plan.layer_offset[l] = 0;
        break;
      case KvLayout::kBlockFirst:
        plan.layer_offset[l] = l * P * chunk;
        break;
      case KvLayout::kLayerBlock:
        plan.layer_offset[l] = l * B * P * chunk;
        break;
    }
  }
  return plan;
}

}  // namespace flexkv
