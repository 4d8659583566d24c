// See copy_scheduler.h.
#include "daemon/dataplane/copy_scheduler.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "common/block_checksum.h"
#include "common/clock.h"

namespace flexkv {
namespace {

// The parts of one request in flight.
struct FanIn {
  Mutex mu;
  uint32_t parts_left ABSL_GUARDED_BY(mu) = 0;
  Status first_error ABSL_GUARDED_BY(mu);
  int64_t start_ns ABSL_GUARDED_BY(mu) = std::numeric_limits<int64_t>::max();
  std::vector<uint32_t> layer_parts_left ABSL_GUARDED_BY(mu);  // per layer: parts that have not reported it
  uint32_t launch_parts_left ABSL_GUARDED_BY(mu) = 0;         // loads with layer events: parts not launched yet
  // Stores by a backend with store_checksums: each part's term sums, one per slot (written by the backend
  // before its `done`, read after the last one).
  std::vector<std::shared_ptr<std::vector<uint64_t>>> term_sums;
};

// The slots' content checksums: the parts' term sums added up, or (none) a pass over the stored bytes.
void FinishChecksums(const FanIn& fan, const PoolRegion& pool, const std::vector<SlotId>& slots,
                     std::vector<uint64_t>* checksums) {
  checksums->assign(slots.size(), 0);
  for (size_t i = 0; i < slots.size(); ++i) {
    uint64_t sum = 0;
    if (fan.term_sums.empty()) {
      sum = ChecksumTermSum(pool.SlotData(slots[i]), pool.slot_bytes, 0);
    } else {
      for (const auto& part : fan.term_sums) sum += (*part)[i];
    }
    (*checksums)[i] = FinishBlockChecksum(sum, pool.slot_bytes);
  }
}

}  // namespace

CopyScheduler::~CopyScheduler() { WaitIdle(); }

void CopyScheduler::Submit(CopyRequest request) {
  {
    MutexLock lock(&mu_);
    ++in_flight_;
  }
  auto done = [this, done = std::move(request.done)](Status st, int64_t start_ns) {
    done(std::move(st), start_ns);
    Finished();
  };
  if (request.backend == nullptr || request.targets.empty()) {
    return done(Status::FailedPrecondition("no KV buffers registered (RegisterKv)"), NowNs());
  }
  const EngineMemoryCapabilities& caps = request.backend->capabilities();
  const std::optional<PoolRegion> pool =
      request.tier != nullptr ? request.tier->region(request.component) : std::nullopt;
  Status refused;
  if (!caps.Copies(request.direction)) {
    refused = Status::FailedPrecondition(fmt::format("the {} backend does not copy {}; it did not declare it",
                                                     request.backend->name(), CopyDirectionName(request.direction)));
  } else if (!pool) {
    refused = Status::FailedPrecondition("the pool does not exist yet");
  } else if (!request.layer_events.empty() && !caps.layer_events) {
    refused = Status::FailedPrecondition(fmt::format(
        "the {} backend does not record CUDA layer events; load without an event set", request.backend->name()));
  } else if (!request.layer_events.empty() &&
             (request.layer_events.size() != request.targets.size() ||
              std::find(request.layer_events.begin(), request.layer_events.end(), nullptr) != request.layer_events.end())) {
    refused = Status::Internal(fmt::format("{} layer-event ranks for {} copy targets; expected one per target",
                                           request.layer_events.size(), request.targets.size()));
  }
  uint32_t first_layer = 0, end_layer = 0;
  if (refused.ok() && !request.layers.Resolve(request.num_layers, &first_layer, &end_layer)) {
    refused = Status::Internal(fmt::format("layers [{}, {}) of a copy of {} layers; expected a range inside them",
                                           request.layers.begin, request.layers.end, request.num_layers));
  } else if (refused.ok() && !request.layers.whole() && !caps.layerwise && !caps.layer_events) {
    refused = Status::Internal(fmt::format("a copy of layers [{}, {}) on the {} backend, which copies whole jobs only",
                                           first_layer, end_layer, request.backend->name()));
  }
  if (!refused.ok()) return done(refused, NowNs());

  const bool per_layer = request.layer_done && caps.layerwise;
  const bool sum_while_copying = request.checksums && caps.store_checksums;
  auto fan = std::make_shared<FanIn>();
  {
    MutexLock lock(&fan->mu);
    fan->parts_left = static_cast<uint32_t>(request.targets.size());
    if (per_layer) fan->layer_parts_left.assign(request.num_layers, fan->parts_left);
    fan->launch_parts_left = fan->parts_left;
  }
  if (sum_while_copying) {
    for (size_t t = 0; t < request.targets.size(); ++t) {
      fan->term_sums.push_back(std::make_shared<std::vector<uint64_t>>(request.slots->size(), 0));
    }
  }
  // Without layer-wise copies from the backend, a layer-wise load reports every layer once the bytes are in place.
  auto finish = [fan, done, layer_done = per_layer ? nullptr : request.layer_done, first_layer, end_layer,
                 checksums = request.direction == CopyDirection::kToPool ? request.checksums : nullptr,
                 slots = request.slots, region = *pool](Status st, int64_t start_ns) {
    Status result;
    int64_t start;
    {
      MutexLock lock(&fan->mu);
      if (!st.ok() && fan->first_error.ok()) fan->first_error = st;
      fan->start_ns = std::min(fan->start_ns, start_ns);
      if (--fan->parts_left != 0) return;
      result = fan->first_error;
      start = fan->start_ns;
    }
    if (result.ok() && layer_done) {
      for (uint32_t l = first_layer; l < end_layer; ++l) layer_done(l);
    }
    if (result.ok() && checksums) FinishChecksums(*fan, region, *slots, checksums.get());
    done(result, start);
  };
  for (size_t t = 0; t < request.targets.size(); ++t) {
    const std::shared_ptr<EngineKv>& target = request.targets[t];
    CopyJob job;
    job.kv = target;
    job.direction = request.direction;
    job.engine_blocks = request.engine_blocks;
    job.slots = request.slots;
    job.pool = *pool;
    job.launch_deadline = request.launch_deadline;
    job.layers = request.layers;
    if (sum_while_copying) job.term_sums = fan->term_sums[t];
    if (per_layer) {
      job.on_layer = [fan, layer_done = request.layer_done](uint32_t layer) {
        bool all;
        {
          MutexLock lock(&fan->mu);
          all = layer < fan->layer_parts_left.size() && --fan->layer_parts_left[layer] == 0;
        }
        if (all) layer_done(layer);
      };
    }
    if (!request.layer_events.empty()) {
      job.layer_events = request.layer_events[t];
      job.on_launched = [fan, launched = request.launched] {
        bool all;
        {
          MutexLock lock(&fan->mu);
          all = --fan->launch_parts_left == 0;
        }
        if (all && launched) launched();
      };
    }
    job.done = finish;
    request.backend->Copy(std::move(job));
  }
}

void CopyScheduler::Finished() {
  MutexLock lock(&mu_);
  if (--in_flight_ == 0) idle_.notify_all();
}

void CopyScheduler::WaitIdle() {
  MutexLock lock(&mu_);
  while (in_flight_ != 0) mu_.Wait(&idle_);
}

uint64_t CopyScheduler::in_flight() const {
  MutexLock lock(&mu_);
  return in_flight_;
}

}  // namespace flexkv
