// DataPlane: the hot path's session table, rings and poller. Per session, a sealed memfd with a submit ring, a
// completion ring and a payload arena (common/ring_layout.h). One poller thread reads every active submit ring,
// spinning for a short window after activity and parking on the sessions' doorbell eventfds when idle, and hands
// each descriptor to the request handlers (request_handlers.h); Load and Store copies run on the engine-memory
// backends through the copy scheduler (copy_scheduler.h). Every completion is posted through Complete. Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/log.h"
#include "common/mutex.h"
#include "common/ring_layout.h"
#include "common/unique_fd.h"
#include "daemon/cache/cache.h"
#include "daemon/lifecycle/lifecycle.h"
#include "daemon/dataplane/copy_scheduler.h"
#include "daemon/dataplane/request_handlers.h"
#include "daemon/metrics/request_metrics.h"
#include "daemon/sessions/namespace_access.h"
#include "daemon/tiers/dram/dram_tier.h"
#include "daemon/transfer/engine_memory_backends.h"
#include "daemon/transfer/kv_registration.h"
#include "flexkv/status.h"

namespace flexkv {

class TierSet;

struct DataPlaneOptions {
  uint32_t submit_entries = 1024;
  uint32_t completion_entries = 1024;
  uint64_t arena_bytes = 8ULL << 20;
  int64_t spin_ns = 50000;      // how long the poller keeps spinning after the last request
  int poller_cpu = -1;          // >= 0: pin the ring poller to this CPU (keep engines off it for p99)
  uint32_t max_blocks_per_request = 1u << 20;
  PinPolicy pins;               // the per-session pin cap and the pin lease
  const TierSet* tiers = nullptr;  // the tiers below DRAM (a Match continues into those that promote on match, a
                                   // Prefetch pulls from the one that pulls); none: DRAM alone
};

class DataPlane {
 public:
  // Every pointer outlives the data plane. `backends` serve the sessions' KV registrations (RegisterKv); Loads and
  // Stores copy between them and the pool of the session's cache domain.
  DataPlane(Lifecycle* lifecycle, EngineMemoryBackends* backends, DataPlaneOptions options);
  ~DataPlane();
  DataPlane(const DataPlane&) = delete;
  DataPlane& operator=(const DataPlane&) = delete;

  Status Start();
  // Stops the poller, then waits for the copies in flight to finish (each answers its request). Idempotent.
  void Stop();

  // Creates a session's rings. Returns {ring memfd (sealed), doorbell eventfd} to pass to the client. The session
  // works on `cache` (its cache domain, which outlives the data plane) and only on it; it is refused once the
  // cache's generation changes (its domain was dropped). The session's Stores are refused with `access.store`
  // unless it is OK, its Prefetches that would pull from peers with `access.prefetch`.
  Result<std::vector<UniqueFd>> OpenSession(uint64_t session_id, Cache* cache, const Geometry& geometry,
                                            const SessionAccess& access);
  // Registers a session's KV buffers on the backend that declared the memory kinds they need: whole blocks once,
  // or each TP rank once on a backend that shards by rank (Load/Store then need every rank of tp_size). Returns
  // the bytes the layout needs on one rank. Errors: FAILED_PRECONDITION for a session without rings or memory
  // no backend serves; see SessionKv::Register for the rest.
  Result<uint64_t> RegisterKv(uint64_t session_id, KvRegistration registration);
  // Registers a set of CUDA layer events (docs/protocol.md "Layer events"): one LayerEventsRank per TP rank of the
  // session's geometry (each rank once), each with one 64-byte cudaIpcEventHandle_t per layer. The events are opened
  // on the first backend that declared layer_events (the cuda backend) and closed when the set is released or the
  // session ends. Returns the set's id for Load's event_set. INVALID_ARGUMENT for counts or sizes that do not fit
  // the geometry (naming the rank, the field, what was given and expected), for a hybrid geometry; FAILED_PRECONDITION
  // for a session without rings or a daemon with no such backend; RESOURCE_EXHAUSTED beyond the sets a session may
  // hold; the backend's errors (unknown GPU, a handle it cannot open).
  Result<uint32_t> RegisterLayerEvents(uint64_t session_id, std::vector<LayerEventsRank> ranks);
  // Forgets a set (NOT_FOUND when the session has none of that id); a load recording it finishes first.
  Status ReleaseLayerEvents(uint64_t session_id, uint32_t set_id);
  // The session is gone: its pins are released (after any load still copying from them), its stores in
  // flight are aborted when their copy ends, its rings are unmapped. Returns at once.
  void EndSession(uint64_t session_id);

  struct SessionStats {
    uint64_t pinned_blocks = 0;
    uint64_t inflight_requests = 0;
  };
  SessionStats StatsOf(uint64_t session_id) const;
  // Requests answered with an error.
  uint64_t errors() const { return metrics_.TotalErrors(); }
  // Per request kind: requests taken, errors by code, wait / transfer / end-to-end histograms.
  const RequestMetrics& metrics() const { return metrics_; }
  int64_t last_turn_ms() const { return last_turn_ms_.load(std::memory_order_relaxed); }
  // Sessions whose pins lapsed (their process stopped renewing the pin lease), and the blocks that were unpinned.
  uint64_t pin_lapses() const { return pin_lapses_.load(std::memory_order_relaxed); }
  uint64_t pin_lapsed_blocks() const { return pin_lapsed_blocks_.load(std::memory_order_relaxed); }
  const DataPlaneOptions& options() const { return options_; }

 private:
  struct Session;
  void PollerLoop();
  bool PollSession(const std::shared_ptr<Session>& s);
  // `taken_ns` (monotonic): when the poller took `d` off the submit ring; the request's times count from it.
  void Process(const std::shared_ptr<Session>& s, const SubmitDescriptor& d, int64_t taken_ns);
  // Posts `c` to the session's completion ring (common/ring/ring_consumer.h: queued while the ring is full,
  // dropped once the session ended). Any thread, with or without the session's lock. The only way completions
  // reach a ring: the request handlers post through RequestSession::Post, which calls this.
  void Complete(Session& s, CompletionDescriptor c);
  void Fail(Session& s, const SubmitDescriptor& d, int64_t taken_ns, const Status& status);
  Result<std::shared_ptr<Session>> SessionOf(uint64_t session_id) const;
  // Poller: reads each session's heartbeat and releases the pins of those whose lease ran out.
  void CheckPinLeases(const std::vector<std::shared_ptr<Session>>& active, int64_t now_ns);
  // The DRAM tier over `cache` (one per cache domain's Cache, made at its first session, kept as long as the data
  // plane).
  const DramTier* TierOf(Cache* cache);

  EngineMemoryBackends* const backends_;
  const DataPlaneOptions options_;
  RequestMetrics metrics_;
  mutable Mutex tiers_mu_;
  std::map<const Cache*, std::unique_ptr<DramTier>> tiers_ ABSL_GUARDED_BY(tiers_mu_);
  CopyScheduler copies_;  // after tiers_: waits for the copies in flight when it goes
  RequestHandlers handlers_;

  mutable Mutex mu_;
  std::map<uint64_t, std::shared_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> generation_{0};                     // bumped when sessions_ changes
  UniqueFd epoll_fd_;
  UniqueFd wake_fd_;
  std::atomic<bool> stopping_{false};
  std::thread poller_;
  std::atomic<int64_t> last_turn_ms_{0};
  std::atomic<uint64_t> pin_lapses_{0};
  std::atomic<uint64_t> pin_lapsed_blocks_{0};
  log::RateLimited lapse_log_{5000};
};

}  // namespace flexkv
