// The shape of an engine's KV cache and the host block it maps to (docs/protocol.md).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flexkv/status.h"

namespace flexkv {

// How an engine lays out its KV cache; `chunk` is one (layer, plane, block) of one TP rank (docs/protocol.md,
// "KV layouts"). GPU buffers of kLayerFirst and kLayerBlockRegions are one region per layer, the others one region;
// host buffers are always one memfd, the layers back to back in it.
enum class KvLayout : uint32_t {
  kLayerFirst = 1,         // [layer][plane][block][chunk] (vLLM FLASH_ATTN's per-layer tensors)
  kBlockFirst = 2,         // [block][layer][plane][chunk]
  kLayerBlock = 3,         // [layer][block][plane][chunk], the layers back to back in one region
  kLayerBlockRegions = 4,  // [layer][block][plane][chunk], one region per layer (FlashInfer / Triton tensors)
};
// "LAYER_FIRST", "BLOCK_FIRST", "LAYER_BLOCK", "LAYER_BLOCK_REGIONS"; "unknown" for any other value.
const char* KvLayoutName(KvLayout layout);
// Whether `layout` is one of the four above (a value off the wire may be anything).
bool IsKnownKvLayout(KvLayout layout);
// Whether a GPU registration in `layout` has one region per layer (kLayerFirst, kLayerBlockRegions).
bool KvLayoutHasRegionPerLayer(KvLayout layout);
// The layouts, as refusals list them: "LAYER_FIRST (1), BLOCK_FIRST (2), LAYER_BLOCK (3) or LAYER_BLOCK_REGIONS (4)".
const char* KvLayoutsAccepted();

// The kinds of cache a model keeps per layer group (docs/hybrid.md). A block key names a prefix end; what a
// prefix end e (in blocks) needs of each component:
//   kFull           every block of the prefix: [0, e)
//   kSlidingWindow  the trailing window only: [e - window_blocks, e) (clamped at 0)
//   kState          one snapshot taken at e (linear attention / Mamba: a fixed-size state per layer)
enum class ComponentKind : uint32_t {
  kFull = 1,
  kSlidingWindow = 2,
  kState = 3,
};
const char* ComponentKindName(ComponentKind kind);  // "full", "sliding_window", "state"

// A component of a hybrid model beside its full-attention layers (Geometry's own fields are component 0, the
// FULL layers). The same TP size and tokens per block as the geometry.
struct ComponentSpec {
  ComponentKind kind = ComponentKind::kSlidingWindow;  // kSlidingWindow or kState (kFull only as component 0)
  uint32_t num_layers = 0;                             // 1..1024
  // kSlidingWindow: the attention shape of its layers, as Geometry's fields of the same name.
  uint32_t kv_planes = 2;
  uint32_t kv_heads_per_rank = 0;
  uint32_t head_dim = 0;
  uint32_t dtype_bytes = 2;
  uint32_t window_tokens = 0;  // kSlidingWindow: 1..1048576 tokens; rounded up to whole blocks
  // kState: bytes of one layer's state snapshot on one TP rank (a multiple of 16, 16..1 GiB); the state is
  // sharded over TP ranks (each rank holds its heads' state), never replicated.
  uint64_t state_bytes_per_layer = 0;
};

// One layer of a layer-wise Load of a hybrid geometry: which component, and which of its layers (Geometry::LayerOrder).
struct LayerStep {
  uint32_t component = 0;
  uint32_t layer = 0;
  bool operator==(const LayerStep&) const = default;
};

struct Geometry {
  uint32_t tokens_per_block = 16;  // power of two, 1..4096
  uint32_t num_layers = 0;         // 1..1024
  uint32_t kv_planes = 2;          // 2 = K and V; 1 = MLA (one latent plane, identical on every TP rank)
  uint32_t kv_heads_per_rank = 0;  // 1..1024 (1 for MLA)
  uint32_t head_dim = 0;           // 1..65536
  uint32_t dtype_bytes = 2;        // 1, 2 or 4
  uint32_t tp_size = 1;            // 1..256
  // Hybrid models: the components beside the FULL layers above, in the order the engine registers and passes
  // their buffers (at most kMaxComponents - 1). Empty: a full-attention model, exactly as before components.
  std::vector<ComponentSpec> components;
  // Set only in the copy geometry of a kState component (Component()): one plane of state_bytes_per_layer per
  // layer and TP rank, sharded (not replicated as MLA's plane is). Never set by clients (Validate refuses it).
  uint64_t state_bytes_per_layer = 0;

  static constexpr size_t kMaxComponents = 8;

  bool is_mla() const { return kv_planes == 1 && state_bytes_per_layer == 0; }
  bool is_hybrid() const { return !components.empty(); }
  // KV heads in one host block: all TP shards for K/V; MLA stores its latent plane once.
  uint64_t host_kv_heads() const { return is_mla() ? kv_heads_per_rank : uint64_t{kv_heads_per_rank} * tp_size; }
  // Bytes of one (layer, plane, block) chunk as one TP rank holds it on its GPU (a state copy geometry: one
  // layer's state on one rank).
  uint64_t chunk_bytes_per_rank() const {
    if (state_bytes_per_layer != 0) return state_bytes_per_layer;
    return uint64_t{tokens_per_block} * kv_heads_per_rank * head_dim * dtype_bytes;
  }
  // Bytes of one host block of component 0: all layers, planes and TP shards (Llama-3-8B at 16 tokens: 2 MiB).
  uint64_t host_block_bytes() const {
    return uint64_t{num_layers} * kv_planes * chunk_bytes_per_rank() * (is_mla() ? 1 : tp_size);
  }

  // Components including component 0 (FULL): 1 + components.size().
  size_t component_count() const { return 1 + components.size(); }
  ComponentKind component_kind(size_t i) const { return i == 0 ? ComponentKind::kFull : components[i - 1].kind; }
  // The single-component geometry that describes component i's blocks for copies and pools: component 0 is this
  // geometry without `components`; a kSlidingWindow component has its layers' shape; a kState component has
  // tokens_per_block 1, kv_planes 1, kv_heads_per_rank 1 and state_bytes_per_layer set (one slot = one snapshot
  // of every layer and TP rank). i < component_count().
  Geometry Component(size_t i) const;
  // kSlidingWindow: ceil(window_tokens / tokens_per_block); 0 for other kinds.
  uint32_t window_blocks(size_t i) const;
  // Every component's layers together (num_layers for a full-attention geometry).
  uint32_t total_layers() const;
  // The order in which a layer-wise Load copies and reports a hybrid geometry's layers: its layer index i (progress
  // completions, the i-th event of a layer-event set) is entry i. First every kState component's layers (one
  // snapshot each: small, and engines such as vLLM run their linear-attention / Mamba layers without a per-layer
  // wait, so they must be in place before the forward starts), then the attention components (FULL, sliding window)
  // merged by depth - component c's layer j sits at (j + 1) / c's layer count, ties to the lower component - so in a
  // model whose attention kinds interleave evenly (gpt-oss 1:1, Gemma 3 5:1) each layer lands within a step of its
  // place in the forward (docs/hybrid.md, "Layer-wise loads"). Each component's layers in order. A full-attention
  // geometry: component 0's layers 0..num_layers-1.
  std::vector<LayerStep> LayerOrder() const;

  // OK when every field is in range; otherwise INVALID_ARGUMENT naming the field (components[i].field for a
  // component) and the accepted range. A hybrid geometry has component 0 (FULL) plus 1..7 components.
  Status Validate() const;

  // Two geometries can share host blocks when their host layout is identical: same shape and, for K/V,
  // the same TP size (blocks hold per-rank shards); MLA may mix TP sizes. Returns OK, or
  // FAILED_PRECONDITION naming the first differing field and both values.
  Status CheckSameHostLayout(const Geometry& pool) const;

  std::string ToString() const;

 private:
  // Validate() of component 0's fields alone (also a sliding-window component's copy geometry).
  Status ValidateSingle() const;
};

// Reference geometries used by tests and benchmarks (bf16, 16 tokens per block).
Geometry Llama3_8B();  // 32 layers, K/V, 8 KV heads, head_dim 128: 2 MiB per block
Geometry Qwen3_8B();   // 36 layers, same heads: 2.25 MiB per block
Geometry DeepSeekMla();  // 61 layers, one 576-wide latent plane: 18 KiB per chunk
// Hybrid presets (numbers from the models' published config.json, in geometry.cc).
Geometry GptOss20B();         // 12 full + 12 sliding (128 tokens) layers, 8 KV heads x 64, bf16
Geometry Gemma3_27B();        // 10 global + 52 local (1024-token window) layers, 16 KV heads x 128, bf16
Geometry Qwen3Next80B();      // 12 full-attention layers + 36 Gated-DeltaNet layers (one state component)
Geometry JambaLike();         // 4 attention + 28 Mamba layers (one state component)

}  // namespace flexkv
