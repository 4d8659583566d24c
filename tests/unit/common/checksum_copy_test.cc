// CopyRunWithChecksum: the host store path's fused copy gives exactly ChecksumTermSum of what it wrote, for any
// length, alignment and first unit (the AVX2 loop, its scalar tail, and the portable loop agree).
#include "common/checksum_copy.h"

#include <catch2/catch.hpp>
#include <cstring>
#include <vector>

#include "common/block_checksum.h"

TEST_CASE("CopyRunWithChecksum copies and sums as ChecksumTermSum does, at any length, offset and first unit",
          "[unit][checksum]") {
  std::vector<uint8_t> src(4096 + 64), dst(4096 + 64);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 131 + (i >> 7));
  for (size_t units : {0u, 1u, 2u, 3u, 4u, 5u, 63u, 64u, 65u, 255u}) {
    for (size_t misalign : {0u, 1u, 8u, 16u, 31u}) {
      for (uint32_t first_unit : {0u, 1u, 7u, 0xFFFFFFF0u}) {
        const size_t bytes = units * flexkv::kChecksumUnitBytes;
        std::fill(dst.begin(), dst.end(), uint8_t{0xEE});
        const uint64_t sum = flexkv::CopyRunWithChecksum(dst.data() + misalign, src.data() + misalign, bytes, first_unit);
        INFO("units " << units << ", misalign " << misalign << ", first unit " << first_unit);
        CHECK(std::memcmp(dst.data() + misalign, src.data() + misalign, bytes) == 0);
        CHECK(dst[misalign + bytes] == 0xEE);  // not a byte further
        CHECK(sum == flexkv::ChecksumTermSum(src.data() + misalign, bytes, first_unit));
        CHECK(sum == flexkv::CopyWithChecksum(dst.data(), src.data() + misalign, bytes, first_unit));
      }
    }
  }
}
