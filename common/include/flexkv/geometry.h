// The shape of an engine's KV cache and the host block it maps to (docs/protocol.md).
#pragma once

#include <cstdint>
#include <string>

#include "flexkv/status.h"

namespace flexkv {

// How an engine lays out its KV cache; `chunk` is one (layer, plane, block) of one TP rank.
enum class KvLayout : uint32_t {
  kLayerFirst = 1,  // [layer][plane][block][chunk] (vLLM-style per-layer tensors, as one region)
  kBlockFirst = 2,  // [block][layer][plane][chunk]
  kLayerBlock = 3,  // [layer][block][plane][chunk]
};

struct Geometry {
  uint32_t tokens_per_block = 16;  // power of two, 1..4096
  uint32_t num_layers = 0;         // 1..1024
  uint32_t kv_planes = 2;          // 2 = K and V; 1 = MLA (one latent plane, identical on every TP rank)
  uint32_t kv_heads_per_rank = 0;  // 1..1024 (1 for MLA)
  uint32_t head_dim = 0;           // 1..65536
  uint32_t dtype_bytes = 2;        // 1, 2 or 4
  uint32_t tp_size = 1;            // 1..256

  bool is_mla() const { return kv_planes == 1; }
  // KV heads in one host block: all TP shards for K/V; MLA stores its latent plane once.
  uint64_t host_kv_heads() const { return is_mla() ? kv_heads_per_rank : uint64_t{kv_heads_per_rank} * tp_size; }
  // Bytes of one (layer, plane, block) chunk as one TP rank holds it on its GPU.
  uint64_t chunk_bytes_per_rank() const {
    return uint64_t{tokens_per_block} * kv_heads_per_rank * head_dim * dtype_bytes;
  }
  // Bytes of one host block: all layers, planes and TP shards (Llama-3-8B at 16 tokens: 2 MiB).
  uint64_t host_block_bytes() const {
    return uint64_t{tokens_per_block} * num_layers * kv_planes * host_kv_heads() * head_dim * dtype_bytes;
  }

  // OK when every field is in range; otherwise INVALID_ARGUMENT naming the field and the accepted range.
  Status Validate() const;

  // Two geometries can share host blocks when their host layout is identical: same shape and, for K/V,
  // the same TP size (blocks hold per-rank shards); MLA may mix TP sizes. Returns OK, or
  // FAILED_PRECONDITION naming the first differing field and both values.
  Status CheckSameHostLayout(const Geometry& pool) const;

  std::string ToString() const;
};

// Reference geometries used by tests and benchmarks (bf16, 16 tokens per block).
Geometry Llama3_8B();  // 32 layers, K/V, 8 KV heads, head_dim 128: 2 MiB per block
Geometry Qwen3_8B();   // 36 layers, same heads: 2.25 MiB per block
Geometry DeepSeekMla();  // 61 layers, one 576-wide latent plane: 18 KiB per chunk

}  // namespace flexkv
