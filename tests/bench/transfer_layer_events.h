// `flexkv-bench transfer`'s layer-wise section through a real flexkvd: how soon an engine's stream may run layer 0
// (and the last layer) of a layer-wise Load, for both completion kinds side by side - progress completions (the
// engine's CPU sees each layer, then launches) and CUDA layer events (the engine's stream waits on the daemon's
// recordings; docs/protocol.md "Layer events"). Needs the CUDA toolkit (built with transfer_bench.cc).
#pragma once

#include <cstdint>
#include <string>

namespace flexkv::bench::transfer {

struct DaemonLayerOptions {
  uint32_t layers = 32;    // Llama-3-8B
  uint32_t blocks = 1024;  // 2 MiB each: 2 GiB per load
  int iters = 7;
  int warmup = 2;
};

// Milliseconds from the Load's submission (a timing event on the engine's idle stream just before it) to the point
// where the engine's stream may run layer 0 / the last layer (a timing event after the CPU saw the layer, or after
// the stream waited on the layer's event); medians.
struct DaemonLayerResult {
  double progress_first_ms = 0, progress_last_ms = 0;
  double events_first_ms = 0, events_last_ms = 0;
  double load_gbps_progress = 0, load_gbps_events = 0;  // 1e9 B/s, submission to final completion
  std::string error;                                     // why it could not run (then the figures are 0)
};

// Starts its own flexkvd (pool on /dev/shm), stores `blocks` Llama-3-8B blocks from a vLLM-shaped GPU cache on
// device 0 and loads them back both ways, alternately.
DaemonLayerResult MeasureDaemonLayers(const DaemonLayerOptions& options);

}  // namespace flexkv::bench::transfer
