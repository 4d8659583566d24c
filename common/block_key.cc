// Block keys; see flexkv/block_key.h and docs/protocol.md "Block keys".
#include "flexkv/block_key.h"

#include <xxhash.h>

#include <bit>
#include <cstddef>
#include <cstdio>
#include <cstring>

namespace flexkv {
namespace {

// Explicit little-endian stores: the key bytes are a wire contract, independent of the host's byte order. On a
// little-endian host they are plain copies (GCC -O2 kept the byte loops as loops: 2/3 of the time of 32k tokens).
constexpr bool kLittleEndian = std::endian::native == std::endian::little;

inline void StoreLe64(unsigned char* p, uint64_t v) {
  if constexpr (kLittleEndian) {
    std::memcpy(p, &v, sizeof(v));
  } else {
    for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
  }
}

inline void StoreLe32(unsigned char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}

}  // namespace

std::string BlockKey::ToHex() const {
  char buf[33];
  std::snprintf(buf, sizeof(buf), "%016llx%016llx", static_cast<unsigned long long>(hi),
                static_cast<unsigned long long>(lo));
  return std::string(buf, 32);
}

uint64_t NamespaceHash(std::string_view model_namespace) {
  return XXH3_64bits(model_namespace.data(), model_namespace.size());
}

std::vector<BlockKey> ComputeBlockKeys(std::string_view model_namespace, std::span<const int32_t> tokens,
                                       uint32_t tokens_per_block) {
  return ComputeBlockKeys(model_namespace, tokens, tokens_per_block, {});
}

std::vector<BlockKey> ComputeBlockKeys(std::string_view model_namespace, std::span<const int32_t> tokens,
                                       uint32_t tokens_per_block, std::span<const BlockExtra> extras) {
  std::vector<BlockKey> keys;
  if (tokens_per_block == 0) return keys;
  const size_t tpb = tokens_per_block;
  const size_t num_blocks = tokens.size() / tpb;  // a trailing partial block is not keyed
  if (num_blocks == 0) return keys;
  keys.reserve(num_blocks);

  const XXH64_hash_t seed = NamespaceHash(model_namespace);

  // One buffer for every block: [prev key lo64 LE][prev key hi64 LE][tokens as int32 LE][its extra, if any].
  const size_t plain = 16 + 4 * tpb;
  std::vector<unsigned char> buf(plain + sizeof(BlockExtra));
  unsigned char* const data = buf.data();
  constexpr BlockExtra kNoExtra{};
  BlockKey prev;  // key[-1] = 0
  for (size_t b = 0; b < num_blocks; ++b) {
    StoreLe64(data, prev.lo);
    StoreLe64(data + 8, prev.hi);
    const int32_t* block = tokens.data() + b * tpb;
    if constexpr (kLittleEndian) {
      std::memcpy(data + 16, block, 4 * tpb);
    } else {
      for (size_t t = 0; t < tpb; ++t) StoreLe32(data + 16 + 4 * t, static_cast<uint32_t>(block[t]));
    }
    size_t bytes = plain;
    if (b < extras.size() && extras[b] != kNoExtra) {
      std::memcpy(data + plain, extras[b].data(), sizeof(BlockExtra));
      bytes += sizeof(BlockExtra);
    }
    const XXH128_hash_t h = XXH3_128bits_withSeed(data, bytes, seed);
    prev = BlockKey{.lo = h.low64, .hi = h.high64};
    keys.push_back(prev);
  }
  return keys;
}

}  // namespace flexkv
