// `flexkv-bench transfer --two-way`: where a store and a load at once lose against the link's two-way ceiling
// (issue 19). Each variant moves the same bytes as the same run's contiguous ceilings, per chunk size:
//   ceiling      one contiguous cudaMemcpyAsync each way (both: half each way on two streams), at the start
//                and again at the end (the run's own spread);
//   ce pieces    the contiguous copy cut into pieces (a slot's bytes, or a chunk's), in address or random order,
//                as one cudaMemcpyBatchAsync: what the copy engine does with many copies instead of one;
//   kernel       the gather/scatter kernels (default shapes) on a random block -> slot map, on the identity map,
//                on a pool in transparent huge pages, and as a plain contiguous copy (what SM-issued PCIe
//                traffic does without the scatter);
//   staged       the kernels pack / unpack whole slots in a GPU staging ring (HBM to HBM) and the copy engine moves
//                each slot over PCIe as one copy (pipelined: --stage-blocks per batch, --stage-buffers in flight);
//   mixed        one direction staged, the other by the kernels.
// Every staged variant's bytes are checked (hash data, poisoned destination) before it is timed.
#pragma once

#ifdef FLEXKV_BENCH_TRANSFER
int RunTwoWayStudy(int argc, char** argv);
#else
#include <cstdio>
inline int RunTwoWayStudy(int /*argc*/, char** /*argv*/) {
  std::fprintf(stderr, "flexkv-bench transfer --two-way: this build has no CUDA backend\n");
  return 2;
}
#endif
