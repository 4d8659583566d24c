// Checks shared by the integration tests against a real flexkvd: a small hybrid geometry, the SSD tier's status
// entry, and waiting until the SSD tier is idle.
#pragma once

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <thread>

#include "flexkv/client.h"

namespace flexkv::testing {

// gpt-oss's shape with 2 layers of each kind and a 32-token (2-block) window, plus a state of 2 x 256 bytes:
// FULL and window blocks of 2*2*(16*8*64*2) = 64 KiB, 512-byte snapshots.
inline Geometry SmallHybrid() {
  Geometry g = GptOss20B();
  g.num_layers = 2;
  g.components[0].num_layers = 2;
  g.components[0].window_tokens = 32;
  ComponentSpec state;
  state.kind = ComponentKind::kState;
  state.num_layers = 2;
  state.state_bytes_per_layer = 256;
  g.components.push_back(state);
  return g;
}

// The SSD tier's entry in a status, or null when the daemon has none.
inline const DaemonStatus::Tier* SsdTierOf(const DaemonStatus& st) {
  for (const auto& t : st.tiers) {
    if (t.name == "ssd") return &t;
  }
  return nullptr;
}

// Until the SSD tier is idle: nothing in flight, nothing unverified, and the same blocks written and held in two
// looks 200 ms apart (fails the test after a minute).
inline void WaitSsdIdle(Client& c) {
  uint64_t last_written = UINT64_MAX, last_used = UINT64_MAX;
  for (int i = 0; i < 300; ++i) {
    auto st = c.GetStatus();
    REQUIRE(st.ok());
    const auto* t = SsdTierOf(*st);
    REQUIRE(t != nullptr);
    const uint64_t written = t->counters.at("written_back_blocks");
    if (t->counters.at("writes_in_flight") == 0 && t->counters.at("reads_in_flight") == 0 &&
        written == last_written && t->used_blocks == last_used && st->pool.unverified_blocks == 0) {
      return;
    }
    last_written = written;
    last_used = t->used_blocks;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  FAIL("the SSD tier did not settle");
}

}  // namespace flexkv::testing
