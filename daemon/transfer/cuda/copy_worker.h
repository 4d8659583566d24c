// The CUDA backend's copy workers (CUDA builds only; internal to daemon/transfer/cuda).
#pragma once

#include <cuda_runtime_api.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "daemon/cache/pool_region.h"
#include "daemon/transfer/cuda/cuda_kv.h"
#include "daemon/transfer/cuda/kv_copy.h"
#include "daemon/transfer/job_layers.h"
#include "daemon/transfer/launch_deadline.h"
#include "flexkv/status.h"

namespace flexkv {

// One copy worker per (GPU, direction): a thread and a stream of its own, so loads and stores overlap. Jobs run one
// after another in submission order; each ends with `done` (Ok, or the error with what failed), run on the worker's
// thread. Kernels (gather/scatter), the copy-engine batch, or - for whole-slot copies of one rank's chunks - the
// kernels staging slots through a GPU ring for the copy engine (kv_copy.h StagedCopy).
class CopyWorker {
 public:
  struct Job {
    std::shared_ptr<GpuKv> kv;
    PoolRegion pool;  // the sub-pool the slots index, checked against the registered range by Copy
    std::vector<uint32_t> gpu_blocks, slots;
    // Per entry: 1 where its slot lies right after the previous entry's in memory, in the same DMA registration
    // (kv_copy.h "slot runs"; CudaBackend's check computes it); empty: none does.
    std::vector<uint8_t> follows;
    std::shared_ptr<std::vector<uint64_t>> term_sums;  // stores: added to before done; null or empty: none
    std::function<void(uint32_t)> on_layer;
    std::function<void(Status)> done;
    std::shared_ptr<GpuLayerEvents> events;  // loads recording a layer-event set; null: none
    std::function<void()> on_launched;
    // Loads with a launch deadline (null: none): Run asks it before anything of the job is enqueued on the device.
    std::shared_ptr<LaunchDeadline> launch_deadline;
    // Loads with on_layer or events: the layers copied (default all). more_follow (loads with events only): Run
    // returns once this job is enqueued, its `done` waits in deferred_ until a later wait on the stream covered it.
    JobLayers layers;
  };

  // `copy_engine`: the copy-engine batch instead of the kernels; `staging_bytes`: the staging ring's size (0: none).
  // Starts the worker's thread; the device's stream and buffers are created by its first job.
  CopyWorker(int device, bool to_host, bool copy_engine, uint64_t staging_bytes);
  // Finishes the queued jobs, then frees the worker's device memory, streams and events.
  ~CopyWorker();
  CopyWorker(const CopyWorker&) = delete;
  CopyWorker& operator=(const CopyWorker&) = delete;
  void Submit(Job job);

 private:
  // Copies `job`; sets *waited when it waited for the stream to drain (every earlier job's copies landed), false
  // only for a more_follow job enqueued and left running.
  Status Run(Job& job, bool* waited);
  // Waits for the stream and runs the deferred jobs' `done` (with the wait's result where it failed).
  void FlushDeferred(const Status& st);
  // The staging ring for a whole-slot copy of `view` into or out of `pool`, allocated at the first such copy;
  // null when the copy cannot be staged (kv_copy.h CanStage, slots larger than a ring buffer) or staging is off or
  // could not be allocated (then the kernels copy alone: slower when loads and stores run at once, never wrong).
  cuda::StagingRing* Staging(const cuda::GpuKvView& view, const cuda::HostPoolView& pool);
  // Waits for the job's copies on stream_; with `sums`, fetches the device sums and adds them into the job's.
  cudaError_t FinishSums(Job& job, bool sums);
  void Loop();

  const int device_;
  const bool to_host_;
  const bool copy_engine_;
  const uint64_t staging_bytes_;
  std::unique_ptr<cuda::StagingRing> ring_;  // whole-slot copies through GPU memory (Staging)
  bool staging_failed_ = false;
  cudaStream_t stream_ = nullptr;
  uint32_t* pairs_dev_ = nullptr;
  uint32_t capacity_ = 0;  // pairs (and, stores, sums) the buffers hold
  // What pairs_dev_ holds once stream_ reaches the last upload (host copies): a job with the same pairs (the
  // per-layer jobs of a hybrid layer-wise load) uploads nothing. Cleared when the buffers go.
  std::vector<uint32_t> uploaded_blocks_, uploaded_slots_;
  // Stores: per-pair checksum term sums on the device and their pinned copy; copy-engine stores sum on a
  // second stream, forked from and joined to stream_ by the two events.
  uint64_t* sums_dev_ = nullptr;
  uint64_t* sums_host_ = nullptr;
  cudaStream_t sums_stream_ = nullptr;
  cudaEvent_t sums_fork_ = nullptr, sums_join_ = nullptr;
  std::vector<cudaEvent_t> events_;
  // more_follow jobs enqueued whose copies no wait covered yet, in order, holding their registrations and events
  // until then (worker thread only).
  std::vector<Job> deferred_;
  Mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace flexkv
