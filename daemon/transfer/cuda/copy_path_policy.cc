// See copy_path_policy.h.
#include "daemon/transfer/cuda/copy_path_policy.h"

#include <fmt/format.h>

namespace flexkv {

Status CheckCopyEngineLoad(bool load_copy_engine, const Geometry& geometry) {
  if (!load_copy_engine) return Status::Ok();
  const uint64_t chunk = geometry.chunk_bytes_per_rank();
  if (chunk >= kCopyEngineLoadMinChunkBytes) return Status::Ok();
  return Status::FailedPrecondition(fmt::format(
      "the copy-engine load path (--load-path copy-engine) is refused for {}-byte chunks ({}, one layer, plane and "
      "block of one TP rank): it loads chunks under {} bytes at only 3.4-4.5 GB/s (8-16 KiB measured, issue 19); "
      "expected chunks of at least {} bytes on that path; restart flexkvd with --load-path kernel (the default: "
      "gather/scatter kernels) for this geometry",
      chunk, geometry.ToString(), kCopyEngineLoadMinChunkBytes, kCopyEngineLoadMinChunkBytes));
}

}  // namespace flexkv
