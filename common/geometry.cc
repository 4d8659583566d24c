// Geometry validation and cache-domain compatibility.
#include "flexkv/geometry.h"

#include <fmt/format.h>

namespace flexkv {
namespace {

Status CheckRange(const char* field, uint64_t value, uint64_t lo, uint64_t hi) {
  if (value < lo || value > hi) {
    return Status::InvalidArgument(fmt::format("geometry.{} is {}; expected {}..{}", field, value, lo, hi));
  }
  return Status::Ok();
}

}  // namespace

Status Geometry::Validate() const {
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
  // A host block holds K/V as [layer][plane][tp shard][chunk of one rank]: the same heads at another TP size
  // sit at other offsets, so only MLA (one latent plane, the same on every rank) may mix TP sizes.
  if (!is_mla() && tp_size != pool.tp_size) return differ("tp_size", tp_size, pool.tp_size);
  return Status::Ok();
}

std::string Geometry::ToString() const {
  return fmt::format(
      "{{tokens_per_block={}, num_layers={}, kv_planes={}, kv_heads_per_rank={}, head_dim={}, dtype_bytes={}, "
      "tp_size={}, host_block_bytes={}}}",
      tokens_per_block, num_layers, kv_planes, kv_heads_per_rank, head_dim, dtype_bytes, tp_size,
      host_block_bytes());
}

Geometry Llama3_8B() { return Geometry{16, 32, 2, 8, 128, 2, 1}; }
Geometry Qwen3_8B() { return Geometry{16, 36, 2, 8, 128, 2, 1}; }
Geometry DeepSeekMla() { return Geometry{16, 61, 1, 1, 576, 2, 1}; }

}  // namespace flexkv
