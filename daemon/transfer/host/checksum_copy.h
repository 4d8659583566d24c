// The host store path's copy: copies a run of a block into its pool slot and returns the run's checksum term sum
// (common/block_checksum.h) in the same pass, at memcpy speed where the CPU has AVX2.
#pragma once

#include <cstddef>
#include <cstdint>

namespace flexkv {

// As CopyWithChecksum (common/block_checksum.h): copies `bytes` (a multiple of 16) from `src` to `dst` (not
// overlapping, no alignment needed) and returns ChecksumTermSum(dst, bytes, first_unit). Uses AVX2 when the
// CPU has it (checked once), else the portable loop.
uint64_t CopyRunWithChecksum(void* dst, const void* src, size_t bytes, uint32_t first_unit);

}  // namespace flexkv
