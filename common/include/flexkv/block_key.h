// Block keys: 128-bit chained hashes that name a block of tokens together with everything before it
// (docs/protocol.md, "Block keys"). Computed in the client; the daemon only compares them.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace flexkv {

struct BlockKey {
  uint64_t lo = 0;  // XXH128_hash_t.low64
  uint64_t hi = 0;  // XXH128_hash_t.high64
  friend bool operator==(const BlockKey&, const BlockKey&) = default;
  // 32 lowercase hex digits, high half first (as XXH128 canonical form prints).
  std::string ToHex() const;
};

// key[i] = XXH3_128(seed = XXH3_64(model_namespace), bytes = key[i-1] as 16 bytes little-endian (lo then hi)
//          ‖ tokens of block i as little-endian int32), key[-1] = 0. Only whole blocks are keyed: a trailing
// partial block is ignored. `tokens_per_block` must be > 0 (returns no keys otherwise).
std::vector<BlockKey> ComputeBlockKeys(std::string_view model_namespace, std::span<const int32_t> tokens,
                                       uint32_t tokens_per_block);

struct BlockKeyHash {
  size_t operator()(const BlockKey& k) const { return static_cast<size_t>(k.lo ^ (k.hi * 0x9E3779B97F4A7C15ULL)); }
};

}  // namespace flexkv
