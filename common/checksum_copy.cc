// See checksum_copy.h. The AVX2 loop takes two 16-byte units per 32-byte vector: each 64-bit lane multiplies
// its two 32-bit words (offset by their keys) as ChecksumTerm does, so the lanes' sum is the units' terms' sum.
#include "common/checksum_copy.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common/block_checksum.h"

namespace flexkv {

#if defined(__x86_64__)
namespace {

// The four keys of unit `u`, as ChecksumTerm computes them.
void UnitKeys(uint32_t u, uint32_t* k) {
  k[0] = u * 0x9E3779B1u + 0x85EBCA77u;
  k[1] = u * 0xC2B2AE3Du + 0x27D4EB2Fu;
  k[2] = u * 0x165667B1u + 0xD3A2646Cu;
  k[3] = u * 0xFD7046C5u + 0xB55A4F09u;
}

__attribute__((target("avx2"))) uint64_t CopyAvx2(void* dst, const void* src, size_t bytes, uint32_t first_unit) {
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  const size_t pairs = bytes / 32;  // two units per vector
  // Keys grow by the multipliers per unit, so by twice them per vector (wrapping mod 2^32, as ChecksumTerm's).
  const __m256i step = _mm256_setr_epi32(static_cast<int>(2 * 0x9E3779B1u), static_cast<int>(2 * 0xC2B2AE3Du),
                                         static_cast<int>(2 * 0x165667B1u), static_cast<int>(2 * 0xFD7046C5u),
                                         static_cast<int>(2 * 0x9E3779B1u), static_cast<int>(2 * 0xC2B2AE3Du),
                                         static_cast<int>(2 * 0x165667B1u), static_cast<int>(2 * 0xFD7046C5u));
  uint32_t keys[8];
  UnitKeys(first_unit, keys);
  UnitKeys(first_unit + 1, keys + 4);
  __m256i k0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys));
  __m256i k1 = _mm256_add_epi32(k0, step);
  const __m256i step2 = _mm256_add_epi32(step, step);
  __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
  size_t i = 0;
  for (; i + 2 <= pairs; i += 2) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i * 32));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i * 32 + 32));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i * 32), w0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i * 32 + 32), w1);
    const __m256i a0 = _mm256_add_epi32(w0, k0);
    const __m256i a1 = _mm256_add_epi32(w1, k1);
    acc0 = _mm256_add_epi64(acc0, _mm256_mul_epu32(a0, _mm256_srli_epi64(a0, 32)));
    acc1 = _mm256_add_epi64(acc1, _mm256_mul_epu32(a1, _mm256_srli_epi64(a1, 32)));
    k0 = _mm256_add_epi32(k0, step2);
    k1 = _mm256_add_epi32(k1, step2);
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi64(acc0, acc1));
  uint64_t sum = lanes[0] + lanes[1] + lanes[2] + lanes[3];
  const size_t done = i * 32;
  if (done < bytes) {
    sum += CopyWithChecksum(d + done, s + done, bytes - done,
                            first_unit + static_cast<uint32_t>(done / kChecksumUnitBytes));
  }
  return sum;
}

}  // namespace

uint64_t CopyRunWithChecksum(void* dst, const void* src, size_t bytes, uint32_t first_unit) {
  static const bool have_avx2 = (__builtin_cpu_init(), __builtin_cpu_supports("avx2"));
  if (have_avx2) return CopyAvx2(dst, src, bytes, first_unit);
  return CopyWithChecksum(dst, src, bytes, first_unit);
}
#else
uint64_t CopyRunWithChecksum(void* dst, const void* src, size_t bytes, uint32_t first_unit) {
  return CopyWithChecksum(dst, src, bytes, first_unit);  // no AVX2 off x86-64: the portable loop
}
#endif

}  // namespace flexkv
