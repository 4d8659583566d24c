// DataPlane: the hot path. Per session, a sealed memfd with a submit ring, a completion ring and a
// payload arena (common/ring_layout.h). One poller thread reads every active submit ring, spinning for a
// short window after activity and parking on the sessions' doorbell eventfds when idle. Match and Release
// are answered on the poller; Load and Store copies run on a worker pool. Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "common/ring_layout.h"
#include "common/unique_fd.h"
#include "daemon/cache/cache.h"
#include "daemon/lifecycle.h"
#include "daemon/metrics/request_metrics.h"
#include "daemon/transfer/cuda_backend.h"
#include "daemon/transfer/host_kv.h"
#include "daemon/transfer/worker_pool.h"
#include "flexkv/status.h"

namespace flexkv {

struct DataPlaneOptions {
  uint32_t submit_entries = 1024;
  uint32_t completion_entries = 1024;
  uint64_t arena_bytes = 8ULL << 20;
  int64_t spin_ns = 50000;      // how long the poller keeps spinning after the last request
  unsigned copy_threads = 0;    // 0: one per core, at least 2
  int poller_cpu = -1;          // >= 0: pin the ring poller to this CPU (keep engines off it for p99)
  uint32_t max_blocks_per_request = 1u << 20;
};

class DataPlane {
 public:
  // `cuda` may be null (no GPU): then only host KV registrations are accepted.
  DataPlane(Cache* cache, Lifecycle* lifecycle, CudaBackend* cuda, DataPlaneOptions options);
  ~DataPlane();
  DataPlane(const DataPlane&) = delete;
  DataPlane& operator=(const DataPlane&) = delete;

  Status Start();
  // Stops the poller; in-flight copies finish. Idempotent.
  void Stop();

  // Creates a session's rings. Returns {ring memfd (sealed), doorbell eventfd} to pass to the client.
  Result<std::vector<UniqueFd>> OpenSession(uint64_t session_id, const Geometry& geometry);
  // Registers host KV buffers for a session (once). Returns the bytes the layout needs.
  Result<uint64_t> RegisterHostKv(uint64_t session_id, UniqueFd memfd, KvLayout layout, uint32_t num_blocks);
  // Registers one TP rank's GPU KV buffers for a session (CUDA backend). Each rank once; Load/Store need
  // every rank of the session's tp_size registered.
  Status RegisterGpuKv(uint64_t session_id, const GpuKvDescription& description);
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
  const DataPlaneOptions& options() const { return options_; }

 private:
  struct Session;
  struct Request;
  void PollerLoop();
  bool PollSession(const std::shared_ptr<Session>& s);
  // `taken_ns` (monotonic): when the poller took `d` off the submit ring; the request's times count from it.
  void Process(const std::shared_ptr<Session>& s, const SubmitDescriptor& d, int64_t taken_ns);
  void StartLoad(const std::shared_ptr<Session>& s, const SubmitDescriptor& d, int64_t taken_ns,
                 std::vector<uint32_t> ids);
  void StartStore(const std::shared_ptr<Session>& s, const SubmitDescriptor& d, int64_t taken_ns,
                  std::vector<BlockKey> keys, std::vector<uint32_t> ids);
  // Copies `count` blocks between the session's KV buffers (host or every GPU rank) and pool slots on the
  // copy workers; `layer_done` (layer-wise loads) and then `done` run once. `done` gets when the copy started
  // (monotonic ns): when the first worker began it, or, on the CUDA backend, when it was handed over.
  void RunCopies(const std::shared_ptr<Session>& s, bool to_host, std::shared_ptr<std::vector<uint32_t>> kv_blocks,
                 std::shared_ptr<std::vector<SlotId>> slots, std::function<void(uint32_t)> layer_done,
                 std::function<void(Status, int64_t copy_start_ns)> done);
  // Posts `c` to the session's completion ring (common/ring/ring_consumer.h: queued while the ring is full,
  // dropped once the session ended). Any thread, with or without the session's lock.
  void Complete(Session& s, CompletionDescriptor c);
  void Fail(Session& s, const SubmitDescriptor& d, int64_t taken_ns, const Status& status);
  // Records the copy of a load or store that ends now: its wait and transfer time.
  void RecordCopy(OpKind op, int64_t taken_ns, int64_t copy_start_ns);
  // Records a request whose final completion is about to be posted: its end-to-end time, and its error.
  // Called before posting, so a client that has seen the completion also sees it counted.
  void RecordEnd(uint16_t opcode, int64_t taken_ns, int32_t status_code);
  void ReleaseHandleLocked(Session& s, uint64_t handle);

  Cache* const cache_;
  Lifecycle* const lifecycle_;
  CudaBackend* const cuda_;
  const DataPlaneOptions options_;
  std::unique_ptr<WorkerPool> workers_;

  mutable std::mutex mu_;
  std::map<uint64_t, std::shared_ptr<Session>> sessions_;  // guarded by mu_
  std::atomic<uint64_t> generation_{0};                     // bumped when sessions_ changes
  UniqueFd epoll_fd_;
  UniqueFd wake_fd_;
  std::atomic<bool> stopping_{false};
  std::thread poller_;
  RequestMetrics metrics_;
  std::atomic<int64_t> last_turn_ms_{0};
};

}  // namespace flexkv
