// Geometry validation and cache-domain compatibility.
#include "flexkv/geometry.h"

#include <fmt/format.h>

#include <string_view>

#include "common/slot_order.h"

namespace flexkv {
namespace {

Status CheckRange(const char* field, uint64_t value, uint64_t lo, uint64_t hi) {
  if (value < lo || value > hi) {
    return Status::InvalidArgument(fmt::format("geometry.{} is {}; expected {}..{}", field, value, lo, hi));
  }
  return Status::Ok();
}

}  // namespace

const char* KvLayoutName(KvLayout layout) {
  switch (layout) {
    case KvLayout::kLayerFirst:
      return "LAYER_FIRST";
    case KvLayout::kBlockFirst:
      return "BLOCK_FIRST";
    case KvLayout::kLayerBlock:
      return "LAYER_BLOCK";
    case KvLayout::kLayerBlockRegions:
      return "LAYER_BLOCK_REGIONS";
  }
  return "unknown";
}

bool IsKnownKvLayout(KvLayout layout) { return std::string_view(KvLayoutName(layout)) != "unknown"; }

bool KvLayoutHasRegionPerLayer(KvLayout layout) {
  return layout == KvLayout::kLayerFirst || layout == KvLayout::kLayerBlockRegions;
}

const char* KvLayoutsAccepted() {
  return "LAYER_FIRST (1), BLOCK_FIRST (2), LAYER_BLOCK (3) or LAYER_BLOCK_REGIONS (4)";
}

const char* ComponentKindName(ComponentKind kind) {
  switch (kind) {
    case ComponentKind::kFull:
      return "full";
    case ComponentKind::kSlidingWindow:
      return "sliding_window";
    case ComponentKind::kState:
      return "state";
  }
  return "unknown";
}

namespace {

Status ValidateComponent(const Geometry& g, size_t i) {
  const ComponentSpec& c = g.components[i];
  const std::string name = fmt::format("components[{}]", i);
  auto range = [&](const char* field, uint64_t value, uint64_t lo, uint64_t hi) {
    return CheckRange(fmt::format("{}.{}", name, field).c_str(), value, lo, hi);
  };
  FLEXKV_RETURN_IF_ERROR(range("num_layers", c.num_layers, 1, 1024));
  switch (c.kind) {
    case ComponentKind::kSlidingWindow: {
      FLEXKV_RETURN_IF_ERROR(range("kv_planes", c.kv_planes, 1, 2));
      FLEXKV_RETURN_IF_ERROR(range("kv_heads_per_rank", c.kv_heads_per_rank, 1, 1024));
      FLEXKV_RETURN_IF_ERROR(range("head_dim", c.head_dim, 1, 65536));
      if (c.dtype_bytes != 1 && c.dtype_bytes != 2 && c.dtype_bytes != 4) {
        return Status::InvalidArgument(
            fmt::format("geometry.{}.dtype_bytes is {}; expected 1, 2 or 4", name, c.dtype_bytes));
      }
      FLEXKV_RETURN_IF_ERROR(range("window_tokens", c.window_tokens, 1, 1u << 20));
      if (c.state_bytes_per_layer != 0) {
        return Status::InvalidArgument(fmt::format(
            "geometry.{}.state_bytes_per_layer is {}; expected 0 for a sliding_window component", name,
            c.state_bytes_per_layer));
      }
      break;
    }
    case ComponentKind::kState: {
      if (c.state_bytes_per_layer < 16 || c.state_bytes_per_layer > (uint64_t{1} << 30) ||
          c.state_bytes_per_layer % 16 != 0) {
        return Status::InvalidArgument(fmt::format(
            "geometry.{}.state_bytes_per_layer is {}; expected a multiple of 16 in 16..1073741824", name,
            c.state_bytes_per_layer));
      }
      if (c.window_tokens != 0) {
        return Status::InvalidArgument(
            fmt::format("geometry.{}.window_tokens is {}; expected 0 for a state component", name, c.window_tokens));
      }
      break;
    }
    case ComponentKind::kFull:
      return Status::InvalidArgument(fmt::format(
          "geometry.{}.kind is full; expected sliding_window or state (the full-attention layers are the geometry's "
          "own fields, component 0)",
          name));
    default:
      return Status::InvalidArgument(fmt::format("geometry.{}.kind is {}; expected sliding_window (2) or state (3)",
                                                 name, static_cast<uint32_t>(c.kind)));
  }
  return g.Component(i + 1).Validate();
}

}  // namespace

Status Geometry::Validate() const {
  if (state_bytes_per_layer != 0 && components.empty() && tokens_per_block == 1 && kv_planes == 1 &&
      kv_heads_per_rank == 1) {
    // A state component's copy geometry (Component()): only its own bounds apply.
    FLEXKV_RETURN_IF_ERROR(CheckRange("num_layers", num_layers, 1, 1024));
    FLEXKV_RETURN_IF_ERROR(CheckRange("tp_size", tp_size, 1, 256));
    if (host_block_bytes() > (uint64_t{1} << 32)) {
      return Status::InvalidArgument(fmt::format(
          "geometry: one state snapshot would be {} bytes (num_layers x tp_size x state_bytes_per_layer); expected "
          "at most 4 GiB",
          host_block_bytes()));
    }
    return Status::Ok();
  }
  if (state_bytes_per_layer != 0) {
    return Status::InvalidArgument(fmt::format(
        "geometry.state_bytes_per_layer is {}; expected 0 (state sizes belong to a state component)",
        state_bytes_per_layer));
  }
  if (components.size() > kMaxComponents - 1) {
    return Status::InvalidArgument(fmt::format("geometry has {} components beside the full-attention layers; "
                                               "expected at most {}",
                                               components.size(), kMaxComponents - 1));
  }
  FLEXKV_RETURN_IF_ERROR(ValidateSingle());
  for (size_t i = 0; i < components.size(); ++i) FLEXKV_RETURN_IF_ERROR(ValidateComponent(*this, i));
  return Status::Ok();
}

uint32_t Geometry::total_layers() const {
  uint32_t total = num_layers;
  for (const ComponentSpec& c : components) total += c.num_layers;
  return total;
}

std::vector<LayerStep> Geometry::LayerOrder() const {
  std::vector<uint32_t> counts{num_layers};
  for (const ComponentSpec& c : components) counts.push_back(c.num_layers);
  std::vector<uint32_t> next(counts.size(), 0);
  std::vector<LayerStep> order;
  order.reserve(total_layers());
  for (size_t c = 1; c < counts.size(); ++c) {  // the states first, whole
    if (component_kind(c) != ComponentKind::kState) continue;
    for (; next[c] < counts[c]; ++next[c]) order.push_back({static_cast<uint32_t>(c), next[c]});
  }
  for (;;) {
    // The component whose next layer is the shallowest: (next + 1) / count smallest, compared without division.
    size_t best = counts.size();
    for (size_t c = 0; c < counts.size(); ++c) {
      if (next[c] >= counts[c]) continue;
      if (best == counts.size() ||
          uint64_t{next[c] + 1} * counts[best] < uint64_t{next[best] + 1} * counts[c]) {
        best = c;
      }
    }
    if (best == counts.size()) return order;
    order.push_back({static_cast<uint32_t>(best), next[best]++});
  }
}

Geometry Geometry::Component(size_t i) const {
  Geometry g = *this;
  g.components.clear();
  if (i == 0) return g;
  const ComponentSpec& c = components[i - 1];
  g.num_layers = c.num_layers;
  if (c.kind == ComponentKind::kState) {
    g.tokens_per_block = 1;
    g.kv_planes = 1;
    g.kv_heads_per_rank = 1;
    g.head_dim = 1;
    g.dtype_bytes = 1;
    g.state_bytes_per_layer = c.state_bytes_per_layer;
  } else {
    g.kv_planes = c.kv_planes;
    g.kv_heads_per_rank = c.kv_heads_per_rank;
    g.head_dim = c.head_dim;
    g.dtype_bytes = c.dtype_bytes;
  }
  return g;
}

uint32_t Geometry::window_blocks(size_t i) const {
  if (component_kind(i) != ComponentKind::kSlidingWindow) return 0;
  const uint32_t w = components[i - 1].window_tokens;
  return (w + tokens_per_block - 1) / tokens_per_block;
}

Status Geometry::ValidateSingle() const {
  if (tokens_per_block == 0 || (tokens_per_block & (tokens_per_block - 1)) != 0 || tokens_per_block > 4096) {
    return Status::InvalidArgument(
        fmt::format("geometry.tokens_per_block is {}; expected a power of two in 1..4096", tokens_per_block));
  }
  FLEXKV_RETURN_IF_ERROR(CheckRange("num_layers", num_layers, 1, 1024));
  FLEXKV_RETURN_IF_ERROR(CheckRange("kv_planes", kv_planes, 1, 2));
  FLEXKV_RETURN_IF_ERROR(CheckRange("kv_heads_per_rank", kv_heads_per_rank, 1, 1024));
  FLEXKV_RETURN_IF_ERROR(CheckRange("head_dim", head_dim, 1, 65536));
  if (dtype_bytes != 1 && dtype_bytes != 2 && dtype_bytes != 4) {
    return Status::InvalidArgument(fmt::format("geometry.dtype_bytes is {}; expected 1, 2 or 4", dtype_bytes));
  }
  FLEXKV_RETURN_IF_ERROR(CheckRange("tp_size", tp_size, 1, 256));
  // Chunks are copied with 16-byte accesses; keep every chunk a multiple of 16 bytes.
  if (chunk_bytes_per_rank() % 16 != 0) {
    return Status::InvalidArgument(fmt::format(
        "geometry: one (layer, plane, block) chunk is {} bytes (tokens_per_block*kv_heads_per_rank*head_dim*"
        "dtype_bytes); expected a multiple of 16",
        chunk_bytes_per_rank()));
  }
  constexpr uint64_t kMaxBlockBytes = uint64_t{1} << 32;
  if (host_block_bytes() > kMaxBlockBytes) {
    return Status::InvalidArgument(
        fmt::format("geometry: a host block would be {} bytes; expected at most 4 GiB", host_block_bytes()));
  }
  return Status::Ok();
}

Status Geometry::CheckSameHostLayout(const Geometry& pool) const {
  auto differ = [](const char* field, uint64_t mine, uint64_t theirs) {
    return Status::FailedPrecondition(fmt::format(
        "geometry.{} is {} but this daemon's cache domain has {}; one cache domain per daemon", field, mine,
        theirs));
  };
  if (tokens_per_block != pool.tokens_per_block) return differ("tokens_per_block", tokens_per_block, pool.tokens_per_block);
  if (num_layers != pool.num_layers) return differ("num_layers", num_layers, pool.num_layers);
  if (kv_planes != pool.kv_planes) return differ("kv_planes", kv_planes, pool.kv_planes);
  if (head_dim != pool.head_dim) return differ("head_dim", head_dim, pool.head_dim);
  if (dtype_bytes != pool.dtype_bytes) return differ("dtype_bytes", dtype_bytes, pool.dtype_bytes);
  if (host_kv_heads() != pool.host_kv_heads()) {
    if (tp_size != pool.tp_size) return differ("tp_size", tp_size, pool.tp_size);
    return differ("kv_heads_per_rank", kv_heads_per_rank, pool.kv_heads_per_rank);
  }
  // A host block holds K/V as [tp shard][layer][plane][chunk of one rank]: the same heads at another TP size
  // sit at other offsets, so only MLA (one latent plane, the same on every rank) may mix TP sizes.
  if (!is_mla() && tp_size != pool.tp_size) return differ("tp_size", tp_size, pool.tp_size);
  // The same for every other component: a sliding window of K/V planes and a state are sharded over TP ranks, so
  // their slots are laid out per TP size even when the FULL layers are MLA.
  if (tp_size != pool.tp_size) {
    for (size_t i = 1; i < component_count(); ++i) {
      if (!Component(i).is_mla()) return differ("tp_size", tp_size, pool.tp_size);
    }
  }
  if (components.size() != pool.components.size()) {
    return differ("components (count)", components.size(), pool.components.size());
  }
  for (size_t i = 0; i < components.size(); ++i) {
    const ComponentSpec& a = components[i];
    const ComponentSpec& b = pool.components[i];
    const bool same = a.kind == b.kind && a.num_layers == b.num_layers &&
                      (a.kind == ComponentKind::kState
                           ? a.state_bytes_per_layer == b.state_bytes_per_layer
                           : a.kv_planes == b.kv_planes && a.kv_heads_per_rank == b.kv_heads_per_rank &&
                                 a.head_dim == b.head_dim && a.dtype_bytes == b.dtype_bytes &&
                                 a.window_tokens == b.window_tokens);
    if (same) continue;
    // Components shard over TP like K/V (never replicated), so any difference changes the host layout.
    return Status::FailedPrecondition(fmt::format(
        "geometry.components[{}] is {} but this daemon's cache domain has {}; one cache domain per daemon", i,
        Component(i + 1).ToString() + " " + ComponentKindName(a.kind),
        pool.Component(i + 1).ToString() + " " + ComponentKindName(b.kind)));
  }
  return Status::Ok();
}

std::string Geometry::ToString() const {
  if (state_bytes_per_layer != 0) {
    return fmt::format("{{state: num_layers={}, state_bytes_per_layer={}, tp_size={}, snapshot_bytes={}}}",
                       num_layers, state_bytes_per_layer, tp_size, host_block_bytes());
  }
  std::string s = fmt::format(
      "{{tokens_per_block={}, num_layers={}, kv_planes={}, kv_heads_per_rank={}, head_dim={}, dtype_bytes={}, "
      "tp_size={}, host_block_bytes={}",
      tokens_per_block, num_layers, kv_planes, kv_heads_per_rank, head_dim, dtype_bytes, tp_size,
      host_block_bytes());
  for (size_t i = 1; i < component_count(); ++i) {
    const ComponentSpec& c = components[i - 1];
    if (c.kind == ComponentKind::kSlidingWindow) {
      s += fmt::format(", sliding_window{{num_layers={}, kv_planes={}, kv_heads_per_rank={}, head_dim={}, "
                       "dtype_bytes={}, window_tokens={}, slot_bytes={}}}",
                       c.num_layers, c.kv_planes, c.kv_heads_per_rank, c.head_dim, c.dtype_bytes, c.window_tokens,
                       Component(i).host_block_bytes());
    } else {
      s += fmt::format(", state{{num_layers={}, state_bytes_per_layer={}, slot_bytes={}}}", c.num_layers,
                       c.state_bytes_per_layer, Component(i).host_block_bytes());
    }
  }
  // Sharded slots say their byte order (common/slot_order.h): the string names a block's bytes wherever it is
  // compared (SSD domains, peer lookups), and the layer-major order of older releases is not these bytes.
  if (HasShardedSlots(*this)) s += kRankMajorSlotsTag;
  return s + "}";
}

namespace {

Geometry Attention(uint32_t layers, uint32_t planes, uint32_t kv_heads, uint32_t head_dim) {
  Geometry g;
  g.tokens_per_block = 16;
  g.num_layers = layers;
  g.kv_planes = planes;
  g.kv_heads_per_rank = kv_heads;
  g.head_dim = head_dim;
  g.dtype_bytes = 2;
  g.tp_size = 1;
  return g;
}

}  // namespace

Geometry Llama3_8B() { return Attention(32, 2, 8, 128); }
Geometry Qwen3_8B() { return Attention(36, 2, 8, 128); }
Geometry DeepSeekMla() { return Attention(61, 1, 1, 576); }

namespace {

ComponentSpec SlidingWindow(uint32_t layers, uint32_t kv_heads, uint32_t head_dim, uint32_t window_tokens) {
  ComponentSpec c;
  c.kind = ComponentKind::kSlidingWindow;
  c.num_layers = layers;
  c.kv_planes = 2;
  c.kv_heads_per_rank = kv_heads;
  c.head_dim = head_dim;
  c.dtype_bytes = 2;
  c.window_tokens = window_tokens;
  return c;
}

ComponentSpec State(uint32_t layers, uint64_t bytes_per_layer) {
  ComponentSpec c;
  c.kind = ComponentKind::kState;
  c.num_layers = layers;
  c.kv_planes = 0;
  c.kv_heads_per_rank = 0;
  c.head_dim = 0;
  c.dtype_bytes = 0;
  c.state_bytes_per_layer = bytes_per_layer;
  return c;
}

}  // namespace

// openai/gpt-oss-20b config.json: num_hidden_layers 24, layer_types alternating "sliding_attention" and
// "full_attention" (12 each), sliding_window 128, num_key_value_heads 8, head_dim 64; KV in bf16.
Geometry GptOss20B() {
  Geometry g = Attention(12, 2, 8, 64);
  g.components = {SlidingWindow(12, 8, 64, 128)};
  return g;
}

// google/gemma-3-27b-it config.json (text_config): num_hidden_layers 62, sliding_window_pattern 6 (5 local layers
// per global one: 10 global, 52 local), sliding_window 1024, num_key_value_heads 16, head_dim 128; KV in bf16.
Geometry Gemma3_27B() {
  Geometry g = Attention(10, 2, 16, 128);
  g.components = {SlidingWindow(52, 16, 128, 1024)};
  return g;
}

// Qwen/Qwen3-Next-80B-A3B-Instruct config.json: num_hidden_layers 48, full_attention_interval 4 (12 gated full
// attention layers: num_key_value_heads 2, head_dim 256), 36 Gated-DeltaNet layers: linear_num_key_heads 16,
// linear_num_value_heads 32, linear_key_head_dim 128, linear_value_head_dim 128, linear_conv_kernel_dim 4. One
// layer's state: recurrent 32 x 128 x 128 fp32 (2 MiB) + conv (2 x 16 x 128 + 32 x 128 = 8192 channels) x 3 bf16
// (48 KiB) = 2,146,304 bytes at TP 1.
Geometry Qwen3Next80B() {
  Geometry g = Attention(12, 2, 2, 256);
  g.components = {State(36, 32ull * 128 * 128 * 4 + 8192ull * 3 * 2)};
  return g;
}

// ai21labs/Jamba-v0.1 config.json: num_hidden_layers 32, attn_layer_period 8 (4 attention layers:
// num_key_value_heads 8, head_dim 4096 / 32 = 128), 28 Mamba layers: mamba_expand 2 (d_inner 8192), mamba_d_state
// 16, mamba_d_conv 4. One layer's state: ssm 8192 x 16 fp32 (512 KiB) + conv 8192 x 3 bf16 (48 KiB) = 573,440 bytes.
Geometry JambaLike() {
  Geometry g = Attention(4, 2, 8, 128);
  g.components = {State(28, 8192ull * 16 * 4 + 8192ull * 3 * 2)};
  return g;
}

}  // namespace flexkv
