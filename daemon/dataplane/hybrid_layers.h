// Layer-wise loads of hybrid geometries: their layers go and are reported in Geometry::LayerOrder, one copy per
// layer, across the components (docs/hybrid.md, "Layer-wise loads").
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"
#include "daemon/dataplane/copy_scheduler.h"
#include "flexkv/geometry.h"

namespace flexkv {

// Reports the layers of a load in index order, whatever order they land in: index i once 0..i all landed (a
// client's WaitLayers counts landed layers from 0). Thread-safe; `report` runs under the object's lock, so reports
// never overtake each other.
class OrderedLayerProgress {
 public:
  OrderedLayerProgress(uint32_t layers, std::function<void(uint32_t index)> report);
  // Layer `index` landed (again: ignored). Indices at or above the count are ignored.
  void Landed(uint32_t index);
  uint32_t reported() const;

 private:
  mutable Mutex mu_;
  std::vector<bool> landed_ ABSL_GUARDED_BY(mu_);
  uint32_t next_ ABSL_GUARDED_BY(mu_) = 0;
  const std::function<void(uint32_t)> report_;
};

// The copies of a hybrid geometry's layer-wise load (progress reports, CUDA layer events, or both), made from one
// whole copy per component: `components[c]` (nullopt where component c moves nothing) filled by FillTargets, with
// its engine blocks, slots, num_layers and - with events - layer_events (one per target). Where the backend copies
// layer ranges (it declared layerwise or layer_events), one copy per layer in g.LayerOrder(), each but the last with
// more_follow; else the whole copies. `progress` (may be null): every copy reports its layers at their index in the
// order; layers of components that move nothing are reported landed at once (with events: theirs are not
// recorded, so the engine's wait on them passes - nothing of them is loaded). `launched` (may be empty): once every
// returned copy enqueued all its copies and records. The copies' `done` is the caller's to set.
std::vector<CopyRequest> HybridLayerCopies(const Geometry& g, std::vector<std::optional<CopyRequest>> components,
                                           const std::shared_ptr<OrderedLayerProgress>& progress,
                                           std::function<void()> launched);

}  // namespace flexkv
