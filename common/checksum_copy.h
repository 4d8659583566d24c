// A copy of a run of a block that returns the run's checksum term sum (common/block_checksum.h) in the same pass, at
// memcpy speed where the CPU has AVX2: the host store path's copy into pool slots, and the slot order upgrade's
// rewrite (common/slot_order.h).
#pragma once

#include <cstddef>
#include <cstdint>

namespace flexkv {

// As CopyWithChecksum (common/block_checksum.h): copies `bytes` (a multiple of 16) from `src` to `dst` (not
// overlapping, no alignment needed) and returns ChecksumTermSum(dst, bytes, first_unit). Uses AVX2 when the
// CPU has it (checked once), else the portable loop.
uint64_t CopyRunWithChecksum(void* dst, const void* src, size_t bytes, uint32_t first_unit);

}  // namespace flexkv
