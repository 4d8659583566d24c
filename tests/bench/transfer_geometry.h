// `flexkv-bench transfer --geometry NAME`: the GPU <-> pool copies of one cache hit of a named geometry preset,
// component by component (full, sliding-window, state) and for the whole hybrid block set, against contiguous
// copies of the same bytes measured in the same run. Built with CUDA only (transfer_bench.cc parses the options).
#pragma once

#include <cstdint>
#include <string>

namespace flexkv::bench::transfer {

struct GeometryTransferOptions {
  std::string geometry;          // a preset name: GeometryPresetNames()
  uint32_t tp = 1;               // the model's TP size; the bench copies TP rank 0's shards
  uint32_t prefix_blocks = 1024; // the hit's prefix end e, in blocks
  int iters = 7;
  int warmup = 2;
  bool json = false;
};

// "llama3-8b, qwen3-8b, deepseek-mla, gpt-oss-20b, gemma3-27b, qwen3-next, jamba"
const char* GeometryPresetNames();
bool IsGeometryPreset(const std::string& name);

// Prints the report (a table, or one JSON line with `json`) and returns the exit status; dies with a message on
// a CUDA error or a wrong byte.
int RunGeometryTransfer(const GeometryTransferOptions& options);

}  // namespace flexkv::bench::transfer
