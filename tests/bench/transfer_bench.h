// `flexkv-bench transfer`: GPU <-> host-pool block copies (gather/scatter kernels and the copy-engine batch)
// against contiguous pinned copies measured in the same run. argv[0] is the subcommand name ("transfer").
#pragma once

#ifdef FLEXKV_BENCH_TRANSFER
int RunTransferBench(int argc, char** argv);
#else
#include <cstdio>
// Built without a CUDA toolkit: the subcommand exists and says why it cannot run.
inline int RunTransferBench(int /*argc*/, char** /*argv*/) {
  std::fprintf(stderr, "flexkv-bench transfer: this build has no CUDA backend\n");
  return 2;
}
#endif
