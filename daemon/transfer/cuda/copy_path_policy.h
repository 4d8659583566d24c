// Which GPU copy path a direction may use for a geometry. The copy-engine path (--load-path copy-engine:
// cudaMemcpyBatchAsync, one descriptor per chunk) is refused where it is known slow, with the reason, so that an
// operator's choice never silently costs a tenth of the bandwidth. Pure: no CUDA, unit-tested.
#pragma once

#include <cstdint>

#include "flexkv/geometry.h"
#include "flexkv/status.h"

namespace flexkv {

// The smallest per-rank chunk (one layer, plane and block of one TP rank) a copy-engine *load* may move. Measured on
// the H200 (issue 19): 8-16 KiB chunks load at only 3.4-4.5 GB/s by the copy engine against ~51 GB/s by the scatter
// kernel; at 32 KiB and above it is within reach of the kernels.
inline constexpr uint64_t kCopyEngineLoadMinChunkBytes = 32 * 1024;

// OK when `geometry` (a registration's copy geometry) may be loaded by the path the daemon was started with
// (`load_copy_engine`: --load-path copy-engine). FAILED_PRECONDITION otherwise, naming the chunk size asked for,
// the sizes allowed and the path to use instead. Stores are not restricted (not measured slow).
Status CheckCopyEngineLoad(bool load_copy_engine, const Geometry& geometry);

}  // namespace flexkv
