// CopyScheduler: runs one request's block copies between engine memory and DRAM-pool slots (tier 0 of the
// request's cache domain). It fans
// the copy out over the session's registrations (one, or one per TP rank) on their backend, gathers the parts
// into one `done` with the first error, reports layer progress for layer-wise loads (per layer once every part
// has it; all layers at the end on a backend that did not declare layer-wise copies), and says when the copy
// began, for the wait/transfer metrics. For stores it also gives each slot's content checksum
// (common/block_checksum.h): the sum of the term sums the parts' backend added while copying, or, from a
// backend that did not declare store_checksums, a second pass over the stored slots. Thread-safe.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"
#include "daemon/tiers/dram/dram_tier.h"
#include "daemon/transfer/engine_memory.h"

namespace flexkv {

struct CopyRequest {
  const DramTier* tier = nullptr;                // the session's domain's DRAM pool (tier 0); outlives the copy
  EngineMemoryBackend* backend = nullptr;        // opened every target
  std::vector<std::shared_ptr<EngineKv>> targets;  // each gets every block (TP ranks copy their shards)
  CopyDirection direction = CopyDirection::kToPool;
  std::shared_ptr<const std::vector<uint32_t>> engine_blocks;
  std::shared_ptr<const std::vector<SlotId>> slots;  // same length as engine_blocks; local to the component's sub-pool
  uint32_t component = 0;  // the geometry component copied (hybrid geometries): which sub-pool the slots are in
  uint32_t num_layers = 0;
  // Loads on a backend that declared `layerwise` or `layer_events`: the layers copied (CopyJob::layers; default
  // all). layer_done then reports only these.
  JobLayers layers;
  // Optional (layer-wise loads): once per layer, in any order, before `done`, only for layers every target copied.
  std::function<void(uint32_t layer)> layer_done;
  // Optional (loads naming a CUDA layer-event set): one entry per target, the events of that target's TP rank; the
  // backend records event[layer] after each layer's copies (it must have declared layer_events, else the copy is
  // refused). `launched` runs once, before `done`, when every target enqueued all its copies and records; never
  // when a target failed to.
  std::vector<std::shared_ptr<LayerEvents>> layer_events;
  std::function<void()> launched;
  // Loads with a launch deadline (optional): handed to every target's job, each of which starts only before it.
  std::shared_ptr<LaunchDeadline> launch_deadline;
  // Stores (optional): set to one content checksum per slot (BlockChecksum of the slot's bytes) before `done`
  // runs with OK.
  std::shared_ptr<std::vector<uint64_t>> checksums;
  // Once, after every target finished: OK or the first error, and when the earliest part began (monotonic ns).
  std::function<void(Status, int64_t copy_start_ns)> done;
};

class CopyScheduler {
 public:
  CopyScheduler() = default;
  // Waits for the copies in flight (WaitIdle).
  ~CopyScheduler();
  CopyScheduler(const CopyScheduler&) = delete;
  CopyScheduler& operator=(const CopyScheduler&) = delete;

  // Starts `request`, copying from or to its tier's pool. Refused through `done` at once (FAILED_PRECONDITION) when
  // the backend did not declare the direction, there are no targets, or the pool does not exist (or no tier).
  void Submit(CopyRequest request);
  // Returns once every submitted copy has called its `done`.
  void WaitIdle();
  uint64_t in_flight() const;

 private:
  void Finished();

  mutable Mutex mu_;
  uint64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  std::condition_variable idle_;  // notified when in_flight_ drops to 0
};

}  // namespace flexkv
