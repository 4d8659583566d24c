// `flexkv-bench transfer --tp-ranks` (issue 32): TP ranks at the PCIe limit both ways. For each TP size and rank
// chunk size, `tp` ranks' GPU KV caches on this GPU (LAYERFIRST per-layer tensors each, as vLLM's) and one host pool
// in the rank-major slot order (each rank's part of a slot one run of bytes: common/slot_order.h); every rank's blocks
// are stored, loaded, and half stored while the other half loads, one rank's job after another on one stream per
// direction (as the daemon's copy workers serve every rank of a GPU), by the staged copies (kv_copy.h StagedCopy)
// and by the kernels; each against the same run's contiguous copy of the same bytes (store, load, half each way at
// once), timed in turns with it (a slow stretch of a shared link lands on both; the ratio is the median of each
// turn's own). Every path's bytes are checked (a poisoned pool and poisoned GPU tensors, every chunk compared) before it is
// timed. The SMs column is what each path keeps busy (transfer_two_way.cc SmsOf). The ranks are one process's
// allocations: the daemon copies between the engines' memory it mapped and its pool in one process, so where the
// ranks' processes run does not change these copies (the e2e test "TP=2: two worker processes on one GPU..." runs
// them as processes).
#pragma once

#ifdef FLEXKV_BENCH_TRANSFER
int RunTpStudy(int argc, char** argv);
#else
#include <cstdio>
inline int RunTpStudy(int /*argc*/, char** /*argv*/) {
  std::fprintf(stderr, "flexkv-bench transfer --tp-ranks: this build has no CUDA backend\n");
  return 2;
}
#endif
