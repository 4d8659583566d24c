// Lifecycle: drain waits for in-flight work; resume admits again; draining refuses new work.
#include <catch2/catch.hpp>
#include <thread>
#include <vector>

#include "daemon/lifecycle.h"

using flexkv::Lifecycle;
using flexkv::ServingState;

TEST_CASE("drain with nothing in flight is drained at once", "[unit]") {
  Lifecycle l;
  CHECK(l.Drain() == ServingState::kDrained);
  CHECK_FALSE(l.TryBegin());
  CHECK(l.Resume() == ServingState::kServing);
  CHECK(l.TryBegin());
  l.Finish();
}

TEST_CASE("drain waits for the last in-flight request", "[unit]") {
  Lifecycle l;
  std::vector<ServingState> seen;
  l.SetListener([&](ServingState s) { seen.push_back(s); });
  REQUIRE(l.TryBegin());
  REQUIRE(l.TryBegin());
  CHECK(l.Drain() == ServingState::kDraining);
  CHECK_FALSE(l.TryBegin());
  l.Finish();
  CHECK(l.state() == ServingState::kDraining);
  l.Finish();
  CHECK(l.state() == ServingState::kDrained);
  CHECK(seen == std::vector<ServingState>{ServingState::kDraining, ServingState::kDrained});
}

TEST_CASE("concurrent begin/finish never leaves a drain hanging", "[unit]") {
  for (int round = 0; round < 50; ++round) {
    Lifecycle l;
    std::vector<std::thread> workers;
    for (int t = 0; t < 4; ++t) {
      workers.emplace_back([&] {
        for (int i = 0; i < 2000; ++i) {
          if (l.TryBegin()) l.Finish();
        }
      });
    }
    l.Drain();
    for (auto& w : workers) w.join();
    CHECK(l.inflight() == 0);
    CHECK(l.state() == ServingState::kDrained);
  }
}
