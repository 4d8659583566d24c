// The parts of `flexkv-bench trace` that its parent process (trace_bench.cc) and its worker processes
// (trace_worker.cc) share: the trace's keys and geometry, the trace loader, the turn page.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "flexkv/block_key.h"
#include "flexkv/geometry.h"
#include "trace_bench.h"

namespace flexkv::bench {

inline constexpr const char* kTraceNamespace = "flexkv-bench-trace";
inline constexpr uint32_t kTraceTokensPerBlock = 512;

// The trace's semantics need 512 tokens per block; everything else is as small as Geometry allows, so that a
// block is block_bytes = 512 × head_dim bytes (1 layer, 1 plane (MLA-style), 1 head, 1-byte dtype).
Geometry TraceGeometry(uint64_t block_bytes);

// The chained keys of a request's blocks (AppendBlockTokens, namespace kTraceNamespace).
std::vector<BlockKey> TraceKeys(std::span<const uint64_t> ids);

// The trace's requests, or nullopt after printing why (file and line) to stderr: a line that does not parse, a
// hash id >= 2^22 (block tokens would collide), no request at all.
std::optional<std::vector<TraceRequest>> LoadTrace(const std::string& path);

// Shared by the parent and the workers (a MAP_SHARED memfd, fd 4 of a worker) with --order strict|match.
struct TurnPage {
  std::atomic<uint32_t> turn;   // the trace index of the request whose turn it is
  std::atomic<uint32_t> abort;  // a worker failed: everyone stops waiting
};

}  // namespace flexkv::bench
