// WorkerPool: a fixed set of threads running copy tasks FIFO. Tasks must not block on each other.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"

namespace flexkv {

class WorkerPool {
 public:
  explicit WorkerPool(unsigned threads);
  // Runs every queued task, then joins.
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  void Submit(std::function<void()> task);
  unsigned size() const { return static_cast<unsigned>(threads_.size()); }

 private:
  void Run();

  Mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace flexkv
