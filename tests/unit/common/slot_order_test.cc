// The slot order (common/slot_order.h): each TP shard's part of a slot is one run of bytes, the layer-major order of
// older pools maps onto it chunk for chunk, and a slot of one shard is the same bytes in both orders.
#include "common/slot_order.h"

#include <catch2/catch.hpp>
#include <cstdint>
#include <set>
#include <vector>

#include "common/block_checksum.h"

using flexkv::Geometry;

namespace {

Geometry KvTp(uint32_t tp) {
  Geometry g;
  g.tokens_per_block = 16;
  g.num_layers = 3;
  g.kv_planes = 2;
  g.kv_heads_per_rank = 2;
  g.head_dim = 16;
  g.dtype_bytes = 2;
  g.tp_size = tp;
  return g;
}

}  // namespace

TEST_CASE("slot order: every chunk has its own place, each shard's part is one run at shard x its size", "[unit]") {
  for (uint32_t tp : {1u, 2u, 4u, 8u}) {
    const Geometry g = KvTp(tp);
    const uint64_t chunk = g.chunk_bytes_per_rank();
    std::set<uint64_t> seen, seen_old;
    for (uint32_t s = 0; s < flexkv::SlotShards(g); ++s) {
      for (uint32_t l = 0; l < g.num_layers; ++l) {
        for (uint32_t p = 0; p < g.kv_planes; ++p) {
          const uint64_t at = flexkv::SlotChunkOffset(g, l, p, s);
          CHECK(at % chunk == 0);
          CHECK(at + chunk <= g.host_block_bytes());
          CHECK(at >= s * flexkv::SlotShardBytes(g));  // inside shard s's run
          CHECK(at < (s + 1) * flexkv::SlotShardBytes(g));
          seen.insert(at);
          seen_old.insert(flexkv::LayerMajorChunkOffset(g, l, p, s));
        }
      }
    }
    CHECK(seen.size() == g.host_block_bytes() / chunk);
    CHECK(seen_old.size() == seen.size());
    CHECK(flexkv::HasShardedSlots(g) == (tp > 1));
  }
}

TEST_CASE("slot order: a layer-major slot is rewritten chunk for chunk, and one shard needs no rewrite", "[unit]") {
  for (uint32_t tp : {1u, 2u, 4u}) {
    const Geometry g = KvTp(tp);
    std::vector<uint8_t> old_slot(g.host_block_bytes()), slot(g.host_block_bytes());
    for (size_t i = 0; i < old_slot.size(); ++i) old_slot[i] = static_cast<uint8_t>(i * 131 + i / 977);
    const uint64_t sum = flexkv::LayerMajorToSlotOrder(g, old_slot.data(), slot.data());
    CHECK(sum == flexkv::ChecksumTermSum(slot.data(), slot.size(), 0));  // the checksum of what it wrote, same pass
    const uint64_t chunk = g.chunk_bytes_per_rank();
    for (uint32_t s = 0; s < tp; ++s)
      for (uint32_t l = 0; l < g.num_layers; ++l)
        for (uint32_t p = 0; p < g.kv_planes; ++p)
          REQUIRE(std::equal(slot.begin() + static_cast<ptrdiff_t>(flexkv::SlotChunkOffset(g, l, p, s)),
                             slot.begin() + static_cast<ptrdiff_t>(flexkv::SlotChunkOffset(g, l, p, s) + chunk),
                             old_slot.begin() + static_cast<ptrdiff_t>(flexkv::LayerMajorChunkOffset(g, l, p, s))));
    CHECK((slot == old_slot) == (tp == 1));
  }
}

TEST_CASE("slot order: MLA slots have one shard at any TP size, states one per rank, and sharded geometries say so",
          "[unit]") {
  Geometry mla = flexkv::DeepSeekMla();
  mla.tp_size = 8;
  CHECK(flexkv::SlotShards(mla) == 1);
  CHECK_FALSE(flexkv::HasShardedSlots(mla));
  CHECK(mla.ToString().find("slots=") == std::string::npos);  // the same bytes as before: the same name
  Geometry hybrid = flexkv::Qwen3Next80B();
  hybrid.tp_size = 2;
  CHECK(flexkv::SlotShards(hybrid.Component(hybrid.component_count() - 1)) == 2);  // the state component
  CHECK(flexkv::HasShardedSlots(hybrid));
  CHECK(hybrid.ToString().find("slots=rank-major") != std::string::npos);
  CHECK(KvTp(1).ToString().find("slots=") == std::string::npos);
  CHECK(KvTp(2).ToString().find("slots=rank-major") != std::string::npos);
}
