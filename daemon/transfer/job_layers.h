// JobLayers: the layers one load job copies. A layer-wise load of a hybrid geometry goes as one job per layer, in
// the order Geometry::LayerOrder gives, so that its layers land (and are reported) in that order across components.
#pragma once

#include <cstdint>

namespace flexkv {

struct JobLayers {
  uint32_t begin = 0;
  uint32_t end = 0;  // one past the last layer copied; 0: every layer of the registration (begin must be 0 then)
  // Loads recording layer events: the event index of layer `begin` (layer l records event first_event + l - begin).
  uint32_t first_event = 0;
  // Loads recording layer events: more jobs of the same load follow on the same device, so the backend may go on
  // to them without waiting for this job's copies - it still runs this job's `done` only once they completed (the
  // CUDA worker: at the next job that waits, or after 2 ms without a next job). Jobs reporting progress (on_layer)
  // wait for each layer anyway and ignore it.
  bool more_follow = false;

  bool whole() const { return end == 0; }
  // The range within a registration of `num_layers` layers; false when it is not inside it.
  bool Resolve(uint32_t num_layers, uint32_t* first, uint32_t* last) const {
    *first = whole() ? 0 : begin;
    *last = whole() ? num_layers : end;
    return (whole() ? begin == 0 : begin < end) && *last <= num_layers;
  }
};

}  // namespace flexkv
