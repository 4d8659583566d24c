// LeaseRenewer: the client library's pin-lease heartbeat thread beats at once and then on its interval, and
// after Stop (or destruction) never again.
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <thread>

#include "client/session_rings.h"

using flexkv::LeaseRenewer;

namespace {

// Waits (generously: no assertion on the speed) until `beats` reaches `n`.
bool WaitForBeats(const std::atomic<int>& beats, int n) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (beats.load() < n) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

}  // namespace

TEST_CASE("lease renewer: beats at once and then again and again until stopped", "[unit][client]") {
  std::atomic<int> beats{0};
  LeaseRenewer renewer(std::chrono::milliseconds(2), [&] { beats++; });
  CHECK(WaitForBeats(beats, 3));
  renewer.Stop();
  const int after_stop = beats.load();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(beats.load() == after_stop);  // Stop joined the thread: no beat after it returned
  renewer.Stop();                     // idempotent
}

TEST_CASE("lease renewer: a long interval does not delay Stop or destruction", "[unit][client]") {
  std::atomic<int> beats{0};
  {
    LeaseRenewer renewer(std::chrono::hours(1), [&] { beats++; });
    CHECK(WaitForBeats(beats, 1));  // the first beat comes at once
  }  // the destructor wakes the thread and joins it (a hang here would fail the test by its timeout)
  CHECK(beats.load() == 1);
}
