// Where a GPU registration's chunks lie in each layout, and which registrations are refused. The expected offsets are
// written out independently from docs/protocol.md's "KV layouts" (and, for LAYER_BLOCK_REGIONS, from the addressing
// of vLLM's FlashInfer / Triton per-layer tensors (num_blocks, 2, block_size, heads, head_dim)), not from
// gpu_kv_layout.cc.
#include "daemon/transfer/cuda/gpu_kv_layout.h"

#include <catch2/catch.hpp>

#include <set>
#include <string>

#include "tests/support/temp_dir.h"

using flexkv::Geometry;
using flexkv::GpuKvDescription;
using flexkv::GpuKvLayoutPlan;
using flexkv::KvLayout;
using flexkv::PlanGpuKvLayout;
using flexkv::StatusCode;

namespace {

constexpr KvLayout kLayouts[] = {KvLayout::kLayerFirst, KvLayout::kBlockFirst, KvLayout::kLayerBlock,
                                 KvLayout::kLayerBlockRegions};

bool PerLayer(KvLayout layout) { return layout == KvLayout::kLayerFirst || layout == KvLayout::kLayerBlockRegions; }

// Region r starts at a distinct, far-apart (fake) device address; only the arithmetic is under test.
uint64_t RegionStart(size_t r) { return (uint64_t{r} + 1) << 40; }

// A description of `blocks` blocks of `g` in `layout` with regions of exactly the bytes the layout needs.
GpuKvDescription Described(KvLayout layout, const Geometry& g, uint32_t blocks) {
  const uint64_t per_layer = uint64_t{g.kv_planes} * blocks * g.chunk_bytes_per_rank();
  GpuKvDescription d;
  d.gpu_uuid = "GPU-00000000-0000-0000-0000-000000000000";
  d.layout = layout;
  d.num_blocks = blocks;
  const size_t regions = PerLayer(layout) ? g.num_layers : 1;
  for (size_t r = 0; r < regions; ++r) {
    d.regions.push_back({std::string(64, 'h'), 0, PerLayer(layout) ? per_layer : per_layer * g.num_layers, {}});
  }
  return d;
}

// (region, offset in it) of chunk (l, p, b), from the layouts' definitions.
std::pair<size_t, uint64_t> Expected(KvLayout layout, const Geometry& g, uint64_t B, uint64_t l, uint64_t p, uint64_t b) {
  const uint64_t chunk = g.chunk_bytes_per_rank(), L = g.num_layers, P = g.kv_planes;
  switch (layout) {
    case KvLayout::kLayerFirst: return {l, (p * B + b) * chunk};               // per layer [plane][block][chunk]
    case KvLayout::kBlockFirst: return {0, ((b * L + l) * P + p) * chunk};     // [block][layer][plane][chunk]
    case KvLayout::kLayerBlock: return {0, ((l * B + b) * P + p) * chunk};     // [layer][block][plane][chunk]
    case KvLayout::kLayerBlockRegions: return {l, (b * P + p) * chunk};        // per layer [block][plane][chunk]
  }
  return {0, 0};
}

uint64_t Address(const GpuKvLayoutPlan& plan, uint64_t l, uint64_t p, uint64_t b) {
  return RegionStart(plan.layer_region[l]) + plan.layer_offset[l] + p * plan.plane_stride + b * plan.block_stride;
}

}  // namespace

TEST_CASE("GPU KV layouts: every chunk lies where the layout puts it, each byte of each region once", "[unit][transfer]") {
  Geometry g = flexkv::testing::TinyGeometry();  // 3 layers, K/V, 32-byte chunks
  Geometry mla = g;
  mla.kv_planes = 1;
  for (const Geometry& geometry : {g, mla}) {
    for (KvLayout layout : kLayouts) {
      INFO(flexkv::KvLayoutName(layout) << ", " << geometry.kv_planes << " plane(s)");
      constexpr uint32_t kBlocks = 5;
      const GpuKvDescription d = Described(layout, geometry, kBlocks);
      auto plan = PlanGpuKvLayout(d, geometry);
      REQUIRE(plan.ok());
      CHECK(plan->region_bytes == d.regions[0].bytes);
      CHECK(plan->layers_in_one_allocation == !PerLayer(layout));
      REQUIRE(plan->layer_region.size() == geometry.num_layers);
      const uint64_t chunk = geometry.chunk_bytes_per_rank();
      std::set<uint64_t> seen;
      for (uint64_t l = 0; l < geometry.num_layers; ++l) {
        for (uint64_t p = 0; p < geometry.kv_planes; ++p) {
          for (uint64_t b = 0; b < kBlocks; ++b) {
            const auto [region, offset] = Expected(layout, geometry, kBlocks, l, p, b);
            CHECK(Address(*plan, l, p, b) == RegionStart(region) + offset);
            CHECK(offset + chunk <= plan->region_bytes);  // inside its region
            CHECK(offset % chunk == 0);
            seen.insert(RegionStart(region) + offset);
          }
        }
      }
      // Distinct chunks, as many as the regions hold: the layout covers its regions exactly.
      CHECK(seen.size() * chunk == plan->region_bytes * d.regions.size());
    }
  }
}

TEST_CASE("GPU KV layouts: LAYER_BLOCK_REGIONS is a FlashInfer tensor per layer, LAYER_BLOCK the same back to back",
          "[unit][transfer]") {
  // vLLM's FlashInfer / Triton per-layer cache (num_blocks, 2, block_size, heads, head_dim), contiguous: block b's K
  // plane at b * 2 * chunk, its V plane at b * 2 * chunk + chunk, in each layer's own allocation.
  const Geometry g = flexkv::Llama3_8B();  // 32 layers, 32 KiB chunks
  constexpr uint32_t kBlocks = 1000;
  const uint64_t chunk = g.chunk_bytes_per_rank();
  auto regions = PlanGpuKvLayout(Described(KvLayout::kLayerBlockRegions, g, kBlocks), g);
  auto one = PlanGpuKvLayout(Described(KvLayout::kLayerBlock, g, kBlocks), g);
  REQUIRE(regions.ok());
  REQUIRE(one.ok());
  CHECK(regions->region_bytes == uint64_t{kBlocks} * 2 * chunk);
  CHECK(one->region_bytes == uint64_t{kBlocks} * 2 * chunk * g.num_layers);
  for (uint64_t l : {0ull, 7ull, 31ull}) {
    for (uint64_t b : {0ull, 1ull, 999ull}) {
      const uint64_t k = b * 2 * chunk, v = k + chunk;
      CHECK(Address(*regions, l, 0, b) == RegionStart(l) + k);
      CHECK(Address(*regions, l, 1, b) == RegionStart(l) + v);
      CHECK(Address(*one, l, 0, b) == RegionStart(0) + l * kBlocks * 2 * chunk + k);
      CHECK(Address(*one, l, 1, b) == RegionStart(0) + l * kBlocks * 2 * chunk + v);
    }
  }
  CHECK(regions->plane_stride == one->plane_stride);
  CHECK(regions->block_stride == one->block_stride);
}

TEST_CASE("GPU KV layouts: a region too small is refused naming the region, its layer and the bytes expected",
          "[unit][transfer]") {
  const Geometry g = flexkv::testing::TinyGeometry();  // 3 layers, 2 planes, 32-byte chunks
  constexpr uint32_t kBlocks = 4;
  const uint64_t per_layer = 2 * kBlocks * 32;
  for (KvLayout layout : {KvLayout::kLayerFirst, KvLayout::kLayerBlockRegions}) {
    INFO(flexkv::KvLayoutName(layout));
    GpuKvDescription d = Described(layout, g, kBlocks);
    d.regions[2].bytes = per_layer - 16;
    auto refused = PlanGpuKvLayout(d, g);
    CHECK(refused.status().code() == StatusCode::kInvalidArgument);
    const std::string m(refused.status().message());
    CHECK_THAT(m, Catch::Contains("region 2 (layer 2) has " + std::to_string(per_layer - 16) + " bytes"));
    CHECK_THAT(m, Catch::Contains(std::string("layout ") + flexkv::KvLayoutName(layout) + " needs " +
                                  std::to_string(per_layer) + " bytes in it for 4 blocks"));
    d.regions[2].bytes = per_layer + 4096;  // larger than needed is fine (a region inside a bigger tensor)
    CHECK(PlanGpuKvLayout(d, g).ok());
  }
  GpuKvDescription one = Described(KvLayout::kLayerBlock, g, kBlocks);
  one.regions[0].bytes = 3 * per_layer - 1;
  auto refused = PlanGpuKvLayout(one, g);
  CHECK(refused.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(refused.status().message()),
             Catch::Contains("region 0 has " + std::to_string(3 * per_layer - 1) + " bytes") &&
                 Catch::Contains("needs " + std::to_string(3 * per_layer)) && !Catch::Contains("(layer"));
}

TEST_CASE("GPU KV layouts: region counts, unknown layouts, zero blocks and a rank past tp_size are refused",
          "[unit][transfer]") {
  const Geometry g = flexkv::testing::TinyGeometry();
  // LAYER_BLOCK_REGIONS takes a region per layer; LAYER_BLOCK one.
  GpuKvDescription one_region = Described(KvLayout::kLayerBlock, g, 4);
  one_region.layout = KvLayout::kLayerBlockRegions;
  auto refused = PlanGpuKvLayout(one_region, g);
  CHECK(refused.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(refused.status().message()),
             Catch::Contains("1 regions for layout LAYER_BLOCK_REGIONS; expected 3 (one per layer)"));
  GpuKvDescription per_layer = Described(KvLayout::kLayerBlockRegions, g, 4);
  per_layer.layout = KvLayout::kLayerBlock;
  refused = PlanGpuKvLayout(per_layer, g);
  CHECK_THAT(std::string(refused.status().message()),
             Catch::Contains("3 regions for layout LAYER_BLOCK; expected 1 (one base region)"));

  GpuKvDescription unknown = Described(KvLayout::kLayerBlock, g, 4);
  unknown.layout = static_cast<KvLayout>(5);
  refused = PlanGpuKvLayout(unknown, g);
  CHECK(refused.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(refused.status().message()),
             Catch::Contains("layout 5 is not valid") && Catch::Contains("LAYER_BLOCK_REGIONS (4)"));

  GpuKvDescription empty = Described(KvLayout::kLayerBlockRegions, g, 4);
  empty.num_blocks = 0;
  CHECK(PlanGpuKvLayout(empty, g).status().code() == StatusCode::kInvalidArgument);

  Geometry tp2 = g;
  tp2.tp_size = 2;
  GpuKvDescription rank2 = Described(KvLayout::kLayerBlockRegions, tp2, 4);
  rank2.tp_rank = 2;
  refused = PlanGpuKvLayout(rank2, tp2);
  CHECK_THAT(std::string(refused.status().message()), Catch::Contains("tp_rank 2 is not below tp_size 2"));
  rank2.tp_rank = 1;
  CHECK(PlanGpuKvLayout(rank2, tp2).ok());
}

TEST_CASE("KV layout names: the four layouts by name, anything else unknown", "[unit][transfer]") {
  CHECK(std::string(flexkv::KvLayoutName(KvLayout::kLayerBlockRegions)) == "LAYER_BLOCK_REGIONS");
  CHECK(static_cast<uint32_t>(KvLayout::kLayerBlockRegions) == 4);
  CHECK(flexkv::IsKnownKvLayout(KvLayout::kLayerBlockRegions));
  CHECK_FALSE(flexkv::IsKnownKvLayout(static_cast<KvLayout>(0)));
  CHECK_FALSE(flexkv::IsKnownKvLayout(static_cast<KvLayout>(5)));
  CHECK(flexkv::KvLayoutHasRegionPerLayer(KvLayout::kLayerFirst));
  CHECK(flexkv::KvLayoutHasRegionPerLayer(KvLayout::kLayerBlockRegions));
  CHECK_FALSE(flexkv::KvLayoutHasRegionPerLayer(KvLayout::kLayerBlock));
  CHECK_FALSE(flexkv::KvLayoutHasRegionPerLayer(KvLayout::kBlockFirst));
}
