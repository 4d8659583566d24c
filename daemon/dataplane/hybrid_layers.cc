#include "daemon/dataplane/hybrid_layers.h"

#include <atomic>
#include <utility>

namespace flexkv {

OrderedLayerProgress::OrderedLayerProgress(uint32_t layers, std::function<void(uint32_t index)> report)
    : landed_(layers, false), report_(std::move(report)) {}

void OrderedLayerProgress::Landed(uint32_t index) {
  MutexLock lock(&mu_);
  if (index >= landed_.size()) return;
  landed_[index] = true;
  while (next_ < landed_.size() && landed_[next_]) report_(next_++);
}

uint32_t OrderedLayerProgress::reported() const {
  MutexLock lock(&mu_);
  return next_;
}

std::vector<CopyRequest> HybridLayerCopies(const Geometry& g, std::vector<std::optional<CopyRequest>> components,
                                           const std::shared_ptr<OrderedLayerProgress>& progress,
                                           std::function<void()> launched) {
  const std::vector<LayerStep> order = g.LayerOrder();
  // index_of[c][j]: where component c's layer j is in the order.
  std::vector<std::vector<uint32_t>> index_of(g.component_count());
  for (size_t c = 0; c < index_of.size(); ++c) index_of[c].resize(g.Component(c).num_layers, 0);
  for (uint32_t i = 0; i < order.size(); ++i) index_of[order[i].component][order[i].layer] = i;

  bool by_layer = true;  // every moving component's backend copies layer ranges
  for (const std::optional<CopyRequest>& part : components) {
    if (!part) continue;
    const EngineMemoryCapabilities& caps = part->backend->capabilities();
    by_layer = by_layer && (part->layer_events.empty() ? caps.layerwise : caps.layer_events);
  }
  auto report = [progress](const std::vector<uint32_t>& indices) -> std::function<void(uint32_t)> {
    if (!progress) return nullptr;
    return [progress, indices](uint32_t layer) {
      if (layer < indices.size()) progress->Landed(indices[layer]);
    };
  };

  std::vector<CopyRequest> copies;
  if (by_layer) {
    for (const LayerStep& step : order) {
      const std::optional<CopyRequest>& whole = components[step.component];
      if (!whole) continue;
      CopyRequest copy = *whole;  // shares its block and slot vectors
      const uint32_t index = index_of[step.component][step.layer];
      copy.layers = JobLayers{step.layer, step.layer + 1, index, /*more_follow=*/true};
      copy.layer_done = report(index_of[step.component]);
      copies.push_back(std::move(copy));
    }
    // Only the load's last copy closes the chain: a rank's components share its GPU, so one chain per device. Where
    // they do not (or the last job is refused before it reaches a worker), a worker left with a more_follow job waits
    // for it after a short pause (CopyWorker: 2 ms) - later, never wrong.
    if (!copies.empty()) copies.back().layers.more_follow = false;
  } else {
    for (size_t c = 0; c < components.size(); ++c) {
      if (!components[c]) continue;
      CopyRequest copy = std::move(*components[c]);
      copy.layer_done = report(index_of[c]);
      copies.push_back(std::move(copy));
    }
  }
  for (const LayerStep& step : order) {  // what moves nothing has landed
    if (!components[step.component] && progress) progress->Landed(index_of[step.component][step.layer]);
  }
  if (launched) {
    auto left = std::make_shared<std::atomic<size_t>>(copies.size());
    auto shared = std::make_shared<std::function<void()>>(std::move(launched));
    for (CopyRequest& copy : copies) {
      if (copy.layer_events.empty()) continue;
      copy.launched = [left, shared] {
        if (left->fetch_sub(1) == 1) (*shared)();
      };
    }
  }
  return copies;
}

}  // namespace flexkv
