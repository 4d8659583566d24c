// See host_backend.h.
#include "daemon/transfer/host/host_backend.h"

#include <algorithm>
#include <atomic>
#include <thread>

#include "common/clock.h"
#include "common/mutex.h"
#include "daemon/transfer/host/host_kv.h"

namespace flexkv {
namespace {

unsigned ThreadsFor(unsigned asked) { return asked != 0 ? asked : std::max(2u, std::thread::hardware_concurrency()); }

EngineMemoryCapabilities HostCapabilities() {
  EngineMemoryCapabilities caps;
  caps.memory_kinds = {MemoryKind::kHostMemfd};
  caps.to_pool = true;
  caps.from_pool = true;
  caps.store_checksums = true;  // CopyToSlot sums while it copies, at memcpy speed (docs/performance.md)
  return caps;
}

}  // namespace

HostBackend::HostBackend(unsigned copy_threads) : capabilities_(HostCapabilities()), workers_(ThreadsFor(copy_threads)) {}

HostBackend::~HostBackend() = default;

Status HostBackend::RegisterPool(const PoolRegion& /*pool*/) { return Status::Ok(); }

Result<std::shared_ptr<EngineKv>> HostBackend::Open(KvRegistration registration, const Geometry& geometry) {
  auto* host = std::get_if<HostKvMemory>(&registration.memory);
  if (host == nullptr) return Status::Internal("the host backend was handed a registration of another memory kind");
  auto kv = HostKv::Map(std::move(host->memfd), geometry, host->layout, host->num_blocks);
  if (!kv.ok()) return kv.status();
  return std::shared_ptr<EngineKv>(std::move(*kv));
}

void HostBackend::Copy(CopyJob job) {
  // The blocks are split into one part per worker; `done` runs after the last part, with when the first began and
  // the first error (a part its launch deadline refused).
  struct Parts {
    CopyJob job;
    std::shared_ptr<const HostKv> kv;
    std::atomic<uint32_t> left{0};
    std::atomic<int64_t> start_ns{0};
    Mutex mu;
    Status error ABSL_GUARDED_BY(mu);
  };
  auto parts = std::make_shared<Parts>();
  parts->kv = std::static_pointer_cast<const HostKv>(job.kv);  // opened by Open above
  parts->job = std::move(job);
  // Both directions fault the client's pages: a read of a hole allocates it as a write does.
  if (Status populated = parts->kv->CheckPopulated(); !populated.ok()) return parts->job.done(populated, NowNs());
  const uint32_t count = static_cast<uint32_t>(parts->job.slots->size());
  const uint32_t n = std::max(1u, std::min(count, workers_.size()));
  parts->left = n;
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t begin = static_cast<uint32_t>(uint64_t{count} * i / n);
    const uint32_t end = static_cast<uint32_t>(uint64_t{count} * (i + 1) / n);
    workers_.Submit([parts, begin, end] {
      if (parts->start_ns.load(std::memory_order_relaxed) == 0) {
        int64_t unset = 0;
        parts->start_ns.compare_exchange_strong(unset, NowNs(), std::memory_order_relaxed);
      }
      const CopyJob& j = parts->job;
      // The part's last moment before its first memcpy: refused by the load's launch deadline, it copies nothing.
      const Status launched = j.launch_deadline ? j.launch_deadline->Launch() : Status::Ok();
      if (launched.ok()) {
        for (uint32_t b = begin; b < end; ++b) {
          uint8_t* slot = j.pool.SlotData((*j.slots)[b]);
          if (j.direction == CopyDirection::kToPool) {
            const uint64_t sum = parts->kv->CopyToSlot((*j.engine_blocks)[b], slot);
            if (j.term_sums) (*j.term_sums)[b] += sum;  // each part owns its own range of entries
          } else {
            parts->kv->CopyFromSlot(slot, (*j.engine_blocks)[b]);
          }
        }
      } else {
        MutexLock lock(&parts->mu);
        if (parts->error.ok()) parts->error = launched;
      }
      if (parts->left.fetch_sub(1) == 1) {
        Status result;
        {
          MutexLock lock(&parts->mu);
          result = parts->error;
        }
        parts->job.done(std::move(result), parts->start_ns.load(std::memory_order_relaxed));
      }
    });
  }
}

}  // namespace flexkv
