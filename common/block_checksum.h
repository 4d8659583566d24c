// BlockChecksum: the content checksum of a pool block, computed wherever the block's bytes are written (the
// host copy loop, the GPU gather kernel, the SSD tier) and verified wherever they are read back after a
// restart or by the scrubber. Header-only and usable from CUDA device code.
//
// The checksum is a sum, modulo 2^64, of one term per 16-byte unit of the block: the NH hash (UMAC, Adiantum)
// of the unit's four little-endian 32-bit words, each offset by a key derived from the unit's index in the
// block. Because it is a sum, the units may be taken in any order and by any number of writers (GPU threads,
// TP-rank shards, host workers): each adds its partial sum and the block's checksum is FinishBlockChecksum of
// the total. Every 16-byte unit lies wholly inside one (layer, plane, TP shard) chunk (Geometry keeps chunks a
// multiple of 16 bytes), so no writer ever splits a unit.
//
// What it catches: any change confined to one unit except with probability about 2^-32 (a flipped bit in one
// word goes unnoticed only when its partner word plus key is 0 mod 2^32); units swapped or moved within the
// block (the keys differ per index); a block whose bytes are another block's. It is not a MAC: it guards
// against corruption and operator mistakes, not against an attacker who can write the pool file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FLEXKV_HOST_DEVICE __host__ __device__
#else
#define FLEXKV_HOST_DEVICE
#endif

namespace flexkv {

inline constexpr uint32_t kChecksumUnitBytes = 16;

// The term of one unit: words w0..w3 at unit index `unit` (byte offset in the block / 16).
FLEXKV_HOST_DEVICE inline uint64_t ChecksumTerm(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3, uint32_t unit) {
  const uint32_t k0 = unit * 0x9E3779B1u + 0x85EBCA77u;
  const uint32_t k1 = unit * 0xC2B2AE3Du + 0x27D4EB2Fu;
  const uint32_t k2 = unit * 0x165667B1u + 0xD3A2646Cu;
  const uint32_t k3 = unit * 0xFD7046C5u + 0xB55A4F09u;
  return uint64_t{w0 + k0} * uint64_t{w1 + k1} + uint64_t{w2 + k2} * uint64_t{w3 + k3};
}

// The block's checksum from the sum of all its units' terms and its size in bytes. Never 0, so that 0 can
// mean "no checksum" in a slot entry.
FLEXKV_HOST_DEVICE inline uint64_t FinishBlockChecksum(uint64_t term_sum, uint64_t block_bytes) {
  uint64_t h = term_sum ^ (block_bytes * 0x9E3779B97F4A7C15ull);
  h ^= h >> 33;
  h *= 0xFF51AFD7ED558CCDull;
  h ^= h >> 33;
  h *= 0xC4CEB9FE1A85EC53ull;
  h ^= h >> 33;
  return h == 0 ? 1 : h;
}

// Sum of the terms of `bytes` bytes at `data`, whose first unit has index `first_unit` in its block. `bytes`
// must be a multiple of kChecksumUnitBytes; `data` needs no alignment.
inline uint64_t ChecksumTermSum(const void* data, size_t bytes, uint32_t first_unit) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t sum = 0;
  const size_t units = bytes / kChecksumUnitBytes;
  for (size_t u = 0; u < units; ++u) {
    uint32_t w[4];
    std::memcpy(w, p + u * kChecksumUnitBytes, sizeof(w));
    sum += ChecksumTerm(w[0], w[1], w[2], w[3], first_unit + static_cast<uint32_t>(u));
  }
  return sum;
}

// Copies `bytes` bytes (a multiple of kChecksumUnitBytes) from `src` to `dst` and returns their term sum, as
// ChecksumTermSum(dst, bytes, first_unit) would after the copy. The regions must not overlap.
inline uint64_t CopyWithChecksum(void* dst, const void* src, size_t bytes, uint32_t first_unit) {
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  uint64_t sum = 0;
  const size_t units = bytes / kChecksumUnitBytes;
  for (size_t u = 0; u < units; ++u) {
    uint32_t w[4];
    std::memcpy(w, s + u * kChecksumUnitBytes, sizeof(w));
    std::memcpy(d + u * kChecksumUnitBytes, w, sizeof(w));
    sum += ChecksumTerm(w[0], w[1], w[2], w[3], first_unit + static_cast<uint32_t>(u));
  }
  return sum;
}

// The checksum of a whole block held contiguously.
inline uint64_t BlockChecksum(const void* data, size_t block_bytes) {
  return FinishBlockChecksum(ChecksumTermSum(data, block_bytes, 0), block_bytes);
}

}  // namespace flexkv
