// WorkerPool: every submitted task runs, on the pool's threads, and the destructor runs what is still queued.
#include "daemon/transfer/host/worker_pool.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <future>
#include <mutex>
#include <set>
#include <thread>

using flexkv::WorkerPool;

TEST_CASE("a WorkerPool has the threads it was asked for and runs tasks off the caller's thread", "[unit]") {
  WorkerPool pool(3);
  CHECK(pool.size() == 3);
  std::mutex mu;
  std::set<std::thread::id> seen;
  std::vector<std::future<void>> done;
  for (int i = 0; i < 64; ++i) {
    auto p = std::make_shared<std::promise<void>>();
    done.push_back(p->get_future());
    pool.Submit([&, p] {
      {
        std::lock_guard lock(mu);
        seen.insert(std::this_thread::get_id());
      }
      p->set_value();
    });
  }
  for (auto& f : done) f.wait();
  CHECK(seen.count(std::this_thread::get_id()) == 0);
  CHECK(seen.size() <= 3);
}

TEST_CASE("destroying a WorkerPool runs every task still queued, then joins", "[unit]") {
  std::atomic<int> ran{0};
  {
    WorkerPool pool(1);
    std::promise<void> release;
    std::shared_future<void> gate = release.get_future().share();
    pool.Submit([gate] { gate.wait(); });  // holds the only thread while the rest queue up
    for (int i = 0; i < 100; ++i) pool.Submit([&] { ran.fetch_add(1); });
    release.set_value();
  }
  CHECK(ran.load() == 100);
}

TEST_CASE("one task per thread can run at the same time", "[unit]") {
  // Each task waits until all have started: this finishes only if the pool runs them concurrently.
  constexpr int kThreads = 4;
  WorkerPool pool(kThreads);
  std::atomic<int> started{0};
  std::vector<std::future<void>> done;
  for (int i = 0; i < kThreads; ++i) {
    auto p = std::make_shared<std::promise<void>>();
    done.push_back(p->get_future());
    pool.Submit([&started, p] {
      started.fetch_add(1);
      while (started.load() < kThreads) std::this_thread::yield();
      p->set_value();
    });
  }
  for (auto& f : done) f.wait();
  CHECK(started.load() == kThreads);
}
