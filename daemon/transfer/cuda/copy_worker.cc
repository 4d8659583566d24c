// The CUDA backend's copy workers; see copy_worker.h. Empty without a CUDA toolkit (the daemon library lists every
// source; the header needs CUDA's).
#if FLEXKV_HAVE_CUDA
#include "daemon/transfer/cuda/copy_worker.h"

#include <algorithm>
#include <chrono>
#include <utility>

namespace flexkv {

CopyWorker::CopyWorker(int device, bool to_host, bool copy_engine, uint64_t staging_bytes)
    : device_(device), to_host_(to_host), copy_engine_(copy_engine), staging_bytes_(staging_bytes) {
  thread_ = std::thread([this] { Loop(); });
}

CopyWorker::~CopyWorker() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  cv_.notify_one();
  thread_.join();
}

void CopyWorker::Submit(Job job) {
  {
    MutexLock lock(&mu_);
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
}

Status CopyWorker::Run(Job& job, bool* waited) {
  *waited = true;
  FLEXKV_CUDA_TRY(cudaSetDevice(device_));
  if (stream_ == nullptr) FLEXKV_CUDA_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  const uint32_t n = static_cast<uint32_t>(job.gpu_blocks.size());
  const bool sums = to_host_ && job.term_sums != nullptr && !job.term_sums->empty();
  if (sums && job.term_sums->size() != n) {
    return Status::Internal(fmt::format("a store of {} blocks came with {} checksum sums; expected one per slot", n,
                                        job.term_sums->size()));
  }
  if (n > capacity_) {
    // Jobs enqueued before (more_follow) may still read the pair buffer: let them finish before it goes.
    FLEXKV_CUDA_TRY(cudaStreamSynchronize(stream_));
    if (pairs_dev_ != nullptr) cudaFree(pairs_dev_);
    if (sums_dev_ != nullptr) cudaFree(sums_dev_);
    if (sums_host_ != nullptr) cudaFreeHost(sums_host_);
    pairs_dev_ = nullptr;
    sums_dev_ = sums_host_ = nullptr;
    capacity_ = 0;
    uploaded_blocks_.clear();
    uploaded_slots_.clear();
    const uint32_t capacity = std::max<uint32_t>(n, 4096);
    FLEXKV_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&pairs_dev_), sizeof(uint32_t) * 2 * capacity));
    if (to_host_) {
      FLEXKV_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&sums_dev_), sizeof(uint64_t) * capacity));
      FLEXKV_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&sums_host_), sizeof(uint64_t) * capacity));
    }
    capacity_ = capacity;
  }
  // The last moment before this job's bytes move, on every path below (layer events, copy engine, staged, kernels):
  // past the load's launch deadline nothing of it is enqueued.
  if (job.launch_deadline) FLEXKV_RETURN_IF_ERROR(job.launch_deadline->Launch());
  const GpuKv& kv = *job.kv;
  const Geometry& g = kv.geometry;
  uint32_t first = 0, last = 0;  // the layers this job copies (JobLayers)
  const bool layered = !to_host_ && (job.events != nullptr || job.on_layer);
  if (!job.layers.Resolve(g.num_layers, &first, &last) || (!layered && (!job.layers.whole() || job.layers.more_follow))) {
    return Status::Internal(fmt::format(
        "a {} job of layers [{}, {}) (more_follow {}) on a registration of {} layers; expected a range inside them, "
        "and a partial range only on a load that reports layers or records events",
        to_host_ ? "store" : "load", job.layers.begin, job.layers.end, job.layers.more_follow, g.num_layers));
  }
  // The job's own sub-pool: components have sub-pools of their own slot sizes in one registered range.
  cuda::HostPoolView pool{job.pool.base, job.pool.slot_bytes, g.is_mla() ? 1u : g.tp_size,
                          g.is_mla() ? 0u : kv.description.tp_rank};
  const cuda::BlockPairs pairs{pairs_dev_, pairs_dev_ + capacity_, n, 0, g.num_layers};
  // Slot runs (kv_copy.h): whole copies of consecutive slots in one registration move as one copy where they can.
  const uint8_t* follows = job.follows.size() == n ? job.follows.data() : nullptr;
  // The kernels read the pairs from device memory: uploaded unless the last upload was the same pairs (stream
  // order makes the earlier upload land before these kernels, and no later one overwrote it).
  if ((!copy_engine_ || sums) && (job.gpu_blocks != uploaded_blocks_ || job.slots != uploaded_slots_)) {
    uploaded_blocks_.clear();
    uploaded_slots_.clear();
    FLEXKV_CUDA_TRY(cudaMemcpyAsync(pairs_dev_, job.gpu_blocks.data(), sizeof(uint32_t) * n, cudaMemcpyHostToDevice, stream_));
    FLEXKV_CUDA_TRY(cudaMemcpyAsync(pairs_dev_ + capacity_, job.slots.data(), sizeof(uint32_t) * n,
                                    cudaMemcpyHostToDevice, stream_));
    uploaded_blocks_ = job.gpu_blocks;
    uploaded_slots_ = job.slots;
  }
  if (sums) FLEXKV_CUDA_TRY(cudaMemsetAsync(sums_dev_, 0, sizeof(uint64_t) * n, stream_));
  if (job.events != nullptr && !to_host_) {
    // Layer events: each layer's copies, then the engine's event for that layer, on this stream; "launched" once
    // every record is enqueued (the engine may then make its stream wait on them); done once the stream drained.
    const size_t have = job.events->events.size();
    const uint64_t needed = uint64_t{job.layers.first_event} + (last - first);
    if (job.events->device != device_ || (job.layers.whole() ? have != g.num_layers : have < needed)) {
      return Status::FailedPrecondition(fmt::format(
          "layer events of tp rank {} are on device {} with {} layers; expected device {} and {} layers", job.events->tp_rank,
          job.events->device, have, device_, job.layers.whole() ? uint64_t{g.num_layers} : needed));
    }
    for (uint32_t l = first; l < last; ++l) {
      if (copy_engine_) {
        FLEXKV_CUDA_TRY(cuda::CopyEngineBatch(kv.layer_base_host.data(), kv.view, pool, job.gpu_blocks.data(),
                                              job.slots.data(), n, l, l + 1, false, stream_));
      } else {
        const cuda::BlockPairs layer_pairs{pairs_dev_, pairs_dev_ + capacity_, n, l, l + 1};
        FLEXKV_CUDA_TRY(cuda::LaunchScatter(kv.view, pool, layer_pairs, stream_));
      }
      FLEXKV_CUDA_TRY(cudaEventRecord(job.events->events[job.layers.first_event + (l - first)], stream_));
    }
    if (job.on_launched) job.on_launched();
    if (job.layers.more_follow) {  // the load's next job follows at once; a later wait covers this one
      *waited = false;
      return Status::Ok();
    }
    FLEXKV_CUDA_TRY(cudaStreamSynchronize(stream_));
    return Status::Ok();
  }
  if (copy_engine_) {
    // The copy engine cannot sum: a kernel sums the GPU blocks on a second stream while the engine copies.
    if (sums) {
      if (sums_stream_ == nullptr) {
        FLEXKV_CUDA_TRY(cudaStreamCreateWithFlags(&sums_stream_, cudaStreamNonBlocking));
        FLEXKV_CUDA_TRY(cudaEventCreateWithFlags(&sums_fork_, cudaEventDisableTiming));
        FLEXKV_CUDA_TRY(cudaEventCreateWithFlags(&sums_join_, cudaEventDisableTiming));
      }
      FLEXKV_CUDA_TRY(cudaEventRecord(sums_fork_, stream_));
      FLEXKV_CUDA_TRY(cudaStreamWaitEvent(sums_stream_, sums_fork_, 0));
      FLEXKV_CUDA_TRY(cuda::LaunchChecksumTerms(kv.view, pool, pairs, sums_dev_, sums_stream_));
      FLEXKV_CUDA_TRY(cudaEventRecord(sums_join_, sums_stream_));
    }
    FLEXKV_CUDA_TRY(cuda::CopyEngineBatch(kv.layer_base_host.data(), kv.view, pool, job.gpu_blocks.data(),
                                          job.slots.data(), n, first, last, to_host_, stream_, follows));
    if (sums) FLEXKV_CUDA_TRY(cudaStreamWaitEvent(stream_, sums_join_, 0));
    FLEXKV_CUDA_TRY(FinishSums(job, sums));
    if (job.on_layer) {
      for (uint32_t l = first; l < last; ++l) job.on_layer(l);
    }
    return Status::Ok();
  }
  if (!job.on_layer || to_host_) {
    if (cuda::StagingRing* ring = Staging(kv.view, pool)) {
      FLEXKV_CUDA_TRY(cuda::StagedCopy(kv.view, pool, pairs_dev_, job.slots.data(), n, to_host_, *ring, stream_,
                                       sums ? sums_dev_ : nullptr, /*copy_flags=*/0, follows));
    } else if (sums) {
      FLEXKV_CUDA_TRY(cuda::LaunchGatherChecksummed(kv.view, pool, pairs, sums_dev_, stream_));
    } else {
      FLEXKV_CUDA_TRY(to_host_ ? cuda::LaunchGather(kv.view, pool, pairs, stream_)
                               : cuda::LaunchScatter(kv.view, pool, pairs, stream_));
    }
    FLEXKV_CUDA_TRY(FinishSums(job, sums));
    return Status::Ok();
  }
  // Layer-wise load: one launch and one event per layer; report each layer as its event completes.
  if (events_.size() < g.num_layers) {
    const size_t have = events_.size();
    events_.resize(g.num_layers);
    for (size_t i = have; i < events_.size(); ++i) {
      FLEXKV_CUDA_TRY(cudaEventCreateWithFlags(&events_[i], cudaEventDisableTiming | cudaEventBlockingSync));
    }
  }
  for (uint32_t l = first; l < last; ++l) {
    const cuda::BlockPairs layer_pairs{pairs_dev_, pairs_dev_ + capacity_, n, l, l + 1};
    FLEXKV_CUDA_TRY(cuda::LaunchScatter(kv.view, pool, layer_pairs, stream_));
    FLEXKV_CUDA_TRY(cudaEventRecord(events_[l], stream_));
  }
  for (uint32_t l = first; l < last; ++l) {
    FLEXKV_CUDA_TRY(cudaEventSynchronize(events_[l]));
    job.on_layer(l);
  }
  return Status::Ok();
}

cuda::StagingRing* CopyWorker::Staging(const cuda::GpuKvView& view, const cuda::HostPoolView& pool) {
  if (staging_bytes_ == 0 || staging_failed_ || !cuda::CanStage(view, pool, 0, view.num_layers)) return nullptr;
  if (ring_ == nullptr) {
    if (cudaError_t e = cuda::StagingRing::Create(staging_bytes_, 2, &ring_); e != cudaSuccess) {
      (void)cudaGetLastError();
      staging_failed_ = true;
      log::Warning("cuda", "{} staging on device {}: cannot allocate {} MiB of GPU memory ({}); the kernels copy "
                   "alone (--copy-staging-mib sets the size, 0 turns staging off)", to_host_ ? "store" : "load",
                   device_, staging_bytes_ >> 20, cudaGetErrorString(e));
      return nullptr;
    }
    log::Info("cuda", "{} staging on device {}: {} MiB of GPU memory (--copy-staging-mib; 0 turns it off)",
              to_host_ ? "store" : "load", device_, staging_bytes_ >> 20);
  }
  return ring_->SlotsPerBuffer(cuda::StagedSlotBytes(view)) > 0 ? ring_.get() : nullptr;
}

cudaError_t CopyWorker::FinishSums(Job& job, bool sums) {
  const size_t n = job.gpu_blocks.size();
  if (sums) {
    if (cudaError_t e = cudaMemcpyAsync(sums_host_, sums_dev_, sizeof(uint64_t) * n, cudaMemcpyDeviceToHost, stream_);
        e != cudaSuccess)
      return e;
  }
  if (cudaError_t e = cudaStreamSynchronize(stream_); e != cudaSuccess) return e;
  if (sums) {
    std::vector<uint64_t>& out = *job.term_sums;
    for (size_t i = 0; i < n; ++i) out[i] += sums_host_[i];
  }
  return cudaSuccess;
}

void CopyWorker::FlushDeferred(const Status& st) {
  if (deferred_.empty()) return;
  Status result = st;
  if (cudaError_t e = cudaStreamSynchronize(stream_); e != cudaSuccess && result.ok()) {
    result = Status::Internal(fmt::format("waiting for the load's copies on device {}: {}", device_,
                                          cudaGetErrorString(e)));
  }
  std::vector<Job> jobs = std::move(deferred_);
  deferred_.clear();
  for (Job& j : jobs) j.done(result);
}

void CopyWorker::Loop() {
  // How long a more_follow job's `done` waits for the load's next job before the worker waits for the stream on its
  // own (the next job was refused before it reached this worker, or is slow to come).
  constexpr auto kFollowWait = std::chrono::milliseconds(2);
  for (;;) {
    Job job;
    {
      MutexLock lock(&mu_);
      if (!deferred_.empty() && !stopping_ && jobs_.empty()) mu_.WaitFor(&cv_, kFollowWait);
      while (!stopping_ && jobs_.empty() && deferred_.empty()) mu_.Wait(&cv_);
      if (jobs_.empty() && deferred_.empty()) break;
      if (!jobs_.empty()) {
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
    }
    if (!job.done) {  // nothing came after the deferred jobs: wait for them here
      FlushDeferred(Status::Ok());
      continue;
    }
    bool waited = true;
    Status s = Run(job, &waited);
    if (s.ok() && !waited) {
      deferred_.push_back(std::move(job));  // keeps the registration (and events) until its copies landed
      continue;
    }
    if (!s.ok()) {
      // Run may have launched work before it failed: let it finish before `job` drops what may be the last
      // reference to the registration (whose destructor unmaps the memory those kernels touch).
      if (stream_ != nullptr) cudaStreamSynchronize(stream_);
      if (sums_stream_ != nullptr) cudaStreamSynchronize(sums_stream_);
      if (s.code() == StatusCode::kDeadlineExceeded) {  // refused before anything was enqueued: not a copy failure
        log::Warning("cuda", "load on device {} refused: {}", device_, s.message());
      } else {
        log::Error("cuda", "{} copy on device {} failed: {}", to_host_ ? "store" : "load", device_, s.message());
      }
    }
    // Every earlier job's copies are done (this one waited, or failed and the stream was waited for above).
    FlushDeferred(Status::Ok());
    job.done(s);
  }
  if (pairs_dev_ != nullptr) cudaFree(pairs_dev_);
  if (sums_dev_ != nullptr) cudaFree(sums_dev_);
  if (sums_host_ != nullptr) cudaFreeHost(sums_host_);
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
  if (sums_stream_ != nullptr) {
    cudaEventDestroy(sums_fork_);
    cudaEventDestroy(sums_join_);
    cudaStreamDestroy(sums_stream_);
  }
  ring_.reset();
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

}  // namespace flexkv

#endif  // FLEXKV_HAVE_CUDA
