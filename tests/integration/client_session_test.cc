// Tickets and the Client's session state against a real flexkvd: a ticket never answers for another session's
// request (Detach + Attach, a daemon restart), TryWait's outcomes, a result taken twice, Detach racing waits.
#include <signal.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "flexkv/client.h"
#include "tests/support/process.h"

using namespace std::chrono_literals;
using flexkv::StatusCode;
using flexkv::testing::DaemonUnderTest;

namespace {

flexkv::AttachOptions SmallAttach(const std::string& name) {
  flexkv::AttachOptions o;
  o.client_name = name;
  o.model_namespace = "llama3-8b";
  o.geometry = flexkv::Llama3_8B();
  o.geometry.num_layers = 2;  // 128 KiB blocks
  return o;
}

// call_timeout short enough that a Detach sent to a stopped daemon gives up quickly (the channel still closes).
std::unique_ptr<flexkv::Client> ConnectTo(const DaemonUnderTest& d, std::chrono::milliseconds call_timeout = 10s) {
  auto c = flexkv::Client::Connect({d.socket(), 5000ms, call_timeout});
  REQUIRE(c.ok());
  return std::move(*c);
}

std::vector<flexkv::BlockKey> Keys(int seed, size_t blocks) {
  std::vector<int32_t> tokens(blocks * 16);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = seed * 100000 + static_cast<int32_t>(i);
  return flexkv::ComputeBlockKeys("llama3-8b", tokens, 16);
}

// SIGSTOP, returning once every thread of the daemon is stopped: a request submitted then stays in flight.
void Freeze(DaemonUnderTest& d) {
  const pid_t pid = d.process().pid();
  d.process().Signal(SIGSTOP);
  for (int i = 0; i < 5000; ++i) {
    bool all_stopped = true;
    for (const auto& task : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task")) {
      std::ifstream stat(task.path() / "stat");
      std::string line;
      std::getline(stat, line);
      const size_t paren = line.rfind(')');
      if (paren == std::string::npos || paren + 2 >= line.size()) continue;
      const char state = line[paren + 2];
      if (state != 'T' && state != 't') all_stopped = false;
    }
    if (all_stopped) return;
    std::this_thread::sleep_for(1ms);
  }
  FAIL("flexkvd did not stop after SIGSTOP");
}

void Thaw(DaemonUnderTest& d) { d.process().Signal(SIGCONT); }

}  // namespace

TEST_CASE("a ticket in flight across Detach and Attach answers FAILED_PRECONDITION, never the new session's result",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  auto c = ConnectTo(d, 1000ms);
  REQUIRE(c->Attach(SmallAttach("first")).ok());
  Freeze(d);
  auto old_ticket = c->Match(Keys(1, 2));  // the old session's first ticket, never read by the stopped daemon
  REQUIRE(old_ticket.ok());
  flexkv::Status ignored = c->Detach();  // times out against the stopped daemon; the session ends anyway
  (void)ignored;
  Thaw(d);
  REQUIRE(c->Attach(SmallAttach("second")).ok());
  // The new session's tickets count from 1 again: its first has the old ticket's id, and ends at once.
  auto new_ticket = c->Match(Keys(1, 2));
  REQUIRE(new_ticket.ok());
  auto old_result = c->Wait(*old_ticket, 2s);
  INFO(old_result.status().ToString());
  REQUIRE_FALSE(old_result.ok());  // before generations: the new session's result, OK
  CHECK(old_result.status().code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(old_result.status().message(), Catch::Contains("has ended"));
  auto new_result = c->Wait(*new_ticket, 10s);
  REQUIRE(new_result.ok());  // its own result, still there for it
  CHECK(new_result->status.ok());
}

TEST_CASE("a ticket in flight when flexkvd is killed answers UNAVAILABLE, then FAILED_PRECONDITION after re-Attach",
          "[integration]") {
  std::optional<DaemonUnderTest> d;
  d.emplace(std::vector<std::string>{"--pool-size", "64MiB"});
  REQUIRE(d->WaitReady());
  const std::string dir = d->dir();
  auto c = ConnectTo(*d);
  REQUIRE(c->Attach(SmallAttach("phoenix")).ok());
  Freeze(*d);
  auto old_ticket = c->Match(Keys(3, 2));
  REQUIRE(old_ticket.ok());
  d->process().Signal(SIGKILL);
  REQUIRE(d->process().Wait(10s).has_value());
  auto gone = c->Wait(*old_ticket, 10s);
  REQUIRE_FALSE(gone.ok());
  CHECK(gone.status().code() == StatusCode::kUnavailable);

  DaemonUnderTest restarted({"--pool-size", "64MiB"}, dir);
  REQUIRE(restarted.WaitReady());
  REQUIRE(c->Attach(SmallAttach("phoenix")).ok());
  auto new_ticket = c->Match(Keys(3, 2));  // the new session's ticket 1, as the old one
  REQUIRE(new_ticket.ok());
  auto old_result = c->Wait(*old_ticket, 2s);
  INFO(old_result.status().ToString());
  REQUIRE_FALSE(old_result.ok());  // before generations: the new session's result, OK
  CHECK(old_result.status().code() == StatusCode::kFailedPrecondition);
  auto tried = c->TryWait(*old_ticket);
  REQUIRE_FALSE(tried.ok());
  CHECK(tried.status().code() == StatusCode::kFailedPrecondition);
  auto new_result = c->Wait(*new_ticket, 10s);
  REQUIRE(new_result.ok());
  CHECK(new_result->status.ok());
  c.reset();
  std::filesystem::remove_all(dir);
}

TEST_CASE("TryWait tells not yet, ended, taken, never issued, another session, not attached and daemon gone",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  auto c = ConnectTo(d);
  REQUIRE(c->Attach(SmallAttach("poller")).ok());

  Freeze(d);
  auto t = c->Match(Keys(5, 1));
  REQUIRE(t.ok());
  auto not_yet = c->TryWait(*t);
  REQUIRE(not_yet.ok());
  CHECK_FALSE(not_yet->has_value());  // in flight: "not yet", not an error
  Thaw(d);
  auto ended = c->Wait(*t, 10s);  // the same request ends; Wait takes its result ...
  REQUIRE(ended.ok());
  CHECK(ended->status.ok());

  SECTION("a result taken by Wait is NOT_FOUND for TryWait and a second Wait, saying so") {
    auto again = c->TryWait(*t);
    REQUIRE_FALSE(again.ok());
    CHECK(again.status().code() == StatusCode::kNotFound);
    CHECK_THAT(again.status().message(), Catch::Contains("already taken"));
    auto second = c->Wait(*t, 1s);
    REQUIRE_FALSE(second.ok());
    CHECK(second.status().code() == StatusCode::kNotFound);  // not DEADLINE_EXCEEDED "still in flight"
    CHECK_THAT(second.status().message(), Catch::Contains("already taken"));
    // Layer-wise waits only ask whether the request ended: it did.
    auto layers = c->WaitLayers(*t, 2, 1s);
    REQUIRE(layers.ok());
    CHECK(*layers == 2);
  }
  SECTION("TryWait hands out an ended request's result once") {
    auto u = c->Match(Keys(5, 1));
    REQUIRE(u.ok());
    std::optional<flexkv::OpResult> got;
    for (int i = 0; i < 100000 && !got; ++i) {
      auto polled = c->TryWait(*u);
      REQUIRE(polled.ok());
      got = *polled;
      if (!got) std::this_thread::sleep_for(100us);
    }
    REQUIRE(got.has_value());
    CHECK(got->status.ok());
    auto again = c->TryWait(*u);
    REQUIRE_FALSE(again.ok());
    CHECK(again.status().code() == StatusCode::kNotFound);
  }
  SECTION("an id this session never issued is NOT_FOUND") {
    auto r = c->TryWait(flexkv::Ticket{t->id + 1000, t->generation});
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kNotFound);
    CHECK_THAT(r.status().message(), Catch::Contains("never issued"));
    auto zero = c->Wait(flexkv::Ticket{0, t->generation}, 1s);
    REQUIRE_FALSE(zero.ok());
    CHECK(zero.status().code() == StatusCode::kNotFound);
  }
  SECTION("a generation never issued, or another Client's, is FAILED_PRECONDITION") {
    auto r = c->TryWait(flexkv::Ticket{t->id, t->generation + 1000});
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(r.status().message(), Catch::Contains("never issued"));
    auto zero = c->TryWait(flexkv::Ticket{t->id, 0});
    REQUIRE_FALSE(zero.ok());
    CHECK(zero.status().code() == StatusCode::kFailedPrecondition);

    auto other = ConnectTo(d);
    REQUIRE(other->Attach(SmallAttach("other")).ok());
    auto theirs = other->Match(Keys(5, 1));
    REQUIRE(theirs.ok());
    CHECK(theirs->id == 1);
    auto mine = c->Match(Keys(5, 1));  // this client's ticket 2
    REQUIRE(mine.ok());
    auto wrong = c->Wait(flexkv::Ticket{mine->id - 1, theirs->generation}, 1s);  // their generation, our id space
    REQUIRE_FALSE(wrong.ok());
    CHECK(wrong.status().code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(wrong.status().message(), Catch::Contains("another Client"));
    REQUIRE(other->Wait(*theirs, 10s).ok());
    REQUIRE(c->Wait(*mine, 10s).ok());
  }
  SECTION("after Detach: FAILED_PRECONDITION, not attached") {
    auto u = c->Match(Keys(5, 1));
    REQUIRE(u.ok());
    REQUIRE(c->Detach().ok());
    auto r = c->TryWait(*u);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(r.status().message(), Catch::Contains("not attached"));
  }
  SECTION("daemon gone: UNAVAILABLE") {
    Freeze(d);
    auto u = c->Match(Keys(5, 1));
    REQUIRE(u.ok());
    d.process().Signal(SIGKILL);
    REQUIRE(d.process().Wait(10s).has_value());
    auto r = c->TryWait(*u);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kUnavailable);
    CHECK_THAT(r.status().message(), Catch::Contains("Attach again"));
  }
}

TEST_CASE("Detach racing waits and submissions on other threads: each ends with its result or FAILED_PRECONDITION",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  auto c = ConnectTo(d);
  for (int round = 0; round < 20; ++round) {
    REQUIRE(c->Attach(SmallAttach("racer")).ok());
    std::atomic<bool> go{false};
    std::atomic<int> bad{0};
    std::vector<std::thread> workers;
    for (int w = 0; w < 3; ++w) {
      workers.emplace_back([&, w] {
        while (!go.load()) std::this_thread::yield();
        for (int i = 0; i < 200; ++i) {
          auto t = c->Match(Keys(100 + w, 1));
          if (!t.ok()) {
            if (t.status().code() != StatusCode::kFailedPrecondition) bad.fetch_add(1);
            return;  // detached
          }
          auto r = c->Wait(*t, 10s);
          if (!r.ok() && r.status().code() != StatusCode::kFailedPrecondition) bad.fetch_add(1);
          if (r.ok() && (!r->status.ok() || r->matched_blocks != 0)) bad.fetch_add(1);
        }
      });
    }
    go.store(true);
    std::this_thread::sleep_for(std::chrono::microseconds(200 * (round % 5)));
    REQUIRE(c->Detach().ok());
    for (auto& w : workers) w.join();
    CHECK(bad.load() == 0);
  }
}
