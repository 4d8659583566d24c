// BlockChecksum: additivity across writers, and what it detects.
#include "common/block_checksum.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>
#include <random>
#include <vector>

namespace flexkv {
namespace {

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

TEST_CASE("block checksum: partial sums of any split add up to the whole", "[unit][checksum]") {
  const auto block = RandomBytes(64 * 1024, 1);
  const uint64_t whole = BlockChecksum(block.data(), block.size());
  // Split at unit boundaries into uneven pieces taken in reverse order, as writers of shards would.
  const std::vector<size_t> cuts = {0, 16, 4096, 4112, 30000 / 16 * 16, block.size()};
  uint64_t sum = 0;
  for (size_t i = cuts.size() - 1; i > 0; --i) {
    const size_t begin = cuts[i - 1];
    sum += ChecksumTermSum(block.data() + begin, cuts[i] - begin, static_cast<uint32_t>(begin / kChecksumUnitBytes));
  }
  CHECK(FinishBlockChecksum(sum, block.size()) == whole);
}

TEST_CASE("block checksum: the copy loop returns the sum of what it wrote", "[unit][checksum]") {
  const auto src = RandomBytes(8192 + 48, 2);
  std::vector<uint8_t> dst(src.size() + 1);
  const uint64_t sum = CopyWithChecksum(dst.data() + 1, src.data(), src.size(), 7);  // unaligned destination
  CHECK(std::memcmp(dst.data() + 1, src.data(), src.size()) == 0);
  CHECK(sum == ChecksumTermSum(src.data(), src.size(), 7));
}

TEST_CASE("block checksum: every single-bit flip of a block is detected", "[unit][checksum]") {
  for (const uint32_t seed : {3u, 4u}) {
    auto block = RandomBytes(4096, seed);
    if (seed == 4) std::fill(block.begin(), block.end(), 0);  // an all-zero block too
    const uint64_t good = BlockChecksum(block.data(), block.size());
    size_t missed = 0;
    for (size_t byte = 0; byte < block.size(); ++byte) {
      for (int bit = 0; bit < 8; ++bit) {
        block[byte] ^= static_cast<uint8_t>(1u << bit);
        missed += BlockChecksum(block.data(), block.size()) == good ? 1 : 0;
        block[byte] ^= static_cast<uint8_t>(1u << bit);
      }
    }
    CHECK(missed == 0);
  }
}

TEST_CASE("block checksum: swapped or moved units, and another block's bytes, are detected", "[unit][checksum]") {
  auto block = RandomBytes(2 * 1024 * 1024, 5);
  const uint64_t good = BlockChecksum(block.data(), block.size());
  auto swapped = block;
  std::swap_ranges(swapped.begin(), swapped.begin() + 16, swapped.begin() + 4096);
  CHECK(BlockChecksum(swapped.data(), swapped.size()) != good);
  auto shifted = block;
  std::rotate(shifted.begin(), shifted.begin() + 16, shifted.end());
  CHECK(BlockChecksum(shifted.data(), shifted.size()) != good);
  const auto other = RandomBytes(block.size(), 6);
  CHECK(BlockChecksum(other.data(), other.size()) != good);
  // Two identical units at different places still count differently (a zeroed block vs a zeroed prefix).
  std::vector<uint8_t> zeros(block.size(), 0);
  auto almost = zeros;
  almost[block.size() - 1] = 1;
  CHECK(BlockChecksum(zeros.data(), zeros.size()) != BlockChecksum(almost.data(), almost.size()));
}

TEST_CASE("block checksum: never 0, and the size is part of it", "[unit][checksum]") {
  std::vector<uint8_t> zeros(4096, 0);
  CHECK(BlockChecksum(zeros.data(), 4096) != 0);
  CHECK(BlockChecksum(zeros.data(), 4096) != BlockChecksum(zeros.data(), 2048));
  CHECK(FinishBlockChecksum(0, 0) != 0);
}

}  // namespace
}  // namespace flexkv
