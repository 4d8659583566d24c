// Lifecycle: drain waits for in-flight work; resume admits again; draining refuses new work. An admitted request is
// an InFlight token that ends it exactly once, whoever holds it last.
#include <catch2/catch.hpp>
#include <thread>
#include <utility>
#include <vector>

#include "daemon/lifecycle/lifecycle.h"

using flexkv::InFlight;
using flexkv::Lifecycle;
using flexkv::ServingState;

TEST_CASE("drain with nothing in flight is drained at once", "[unit]") {
  Lifecycle l;
  CHECK(l.Drain() == ServingState::kDrained);
  CHECK_FALSE(l.Admit());
  CHECK(l.inflight() == 0);
  CHECK(l.Resume() == ServingState::kServing);
  InFlight admitted = l.Admit();
  CHECK(admitted);
  CHECK(l.inflight() == 1);
  admitted.End();
  CHECK(l.inflight() == 0);
}

TEST_CASE("drain waits for the last in-flight request", "[unit]") {
  Lifecycle l;
  std::vector<ServingState> seen;
  l.SetListener([&](ServingState s) { seen.push_back(s); });
  InFlight first = l.Admit();
  InFlight second = l.Admit();
  REQUIRE(first);
  REQUIRE(second);
  CHECK(l.Drain() == ServingState::kDraining);
  CHECK_FALSE(l.Admit());
  first.End();
  CHECK(l.state() == ServingState::kDraining);
  { InFlight last = std::move(second); }  // its last owner goes: the request ends
  CHECK(l.state() == ServingState::kDrained);
  CHECK(seen == std::vector<ServingState>{ServingState::kDraining, ServingState::kDrained});
}

TEST_CASE("an in-flight token ends its request exactly once: moved, ended twice, or overwritten", "[unit]") {
  Lifecycle l;
  InFlight a = l.Admit();
  InFlight b = std::move(a);
  CHECK_FALSE(a);  // NOLINT(bugprone-use-after-move): moved-from is empty by contract
  CHECK(l.inflight() == 1);
  a.End();  // empty: nothing
  CHECK(l.inflight() == 1);
  b.End();
  b.End();
  CHECK(l.inflight() == 0);
  InFlight c = l.Admit();
  InFlight d = l.Admit();
  CHECK(l.inflight() == 2);
  c = std::move(d);  // c's own request ends, d's is c's now
  CHECK(l.inflight() == 1);
  c = InFlight();
  CHECK(l.inflight() == 0);
}

TEST_CASE("concurrent begin/finish never leaves a drain hanging", "[unit]") {
  for (int round = 0; round < 50; ++round) {
    Lifecycle l;
    std::vector<std::thread> workers;
    for (int t = 0; t < 4; ++t) {
      workers.emplace_back([&] {
        for (int i = 0; i < 2000; ++i) {
          InFlight admitted = l.Admit();
        }
      });
    }
    l.Drain();
    for (auto& w : workers) w.join();
    CHECK(l.inflight() == 0);
    CHECK(l.state() == ServingState::kDrained);
  }
}
