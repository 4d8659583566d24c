// The C ABI (flexkv/c.h) as a binding sees it: its version and struct sizes, what flexkv_wait / flexkv_try_wait
// answer for tickets that have no result coming, hybrid geometries (components, per-component Load/Store), and
// flexkv_prefetch with flexkv_op_result's bytes and source (ABI 5).
#include <signal.h>

#include <catch2/catch.hpp>
#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

#include "common/version.h"
#include "flexkv/c.h"
#include "tests/support/process.h"

using flexkv::testing::DaemonUnderTest;

namespace {

flexkv_geometry SmallGeometry() {
  // Llama-3-8B per-rank shape with 2 layers (128 KiB blocks).
  return flexkv_geometry{16, 2, 2, 8, 128, 2, 1};
}

flexkv_block_key OneKey(int32_t seed) {
  int32_t tokens[16];
  for (int i = 0; i < 16; ++i) tokens[i] = seed * 1000 + i;
  flexkv_block_key key{};
  size_t count = 0;
  REQUIRE(flexkv_compute_block_keys("llama3-8b", 9, tokens, 16, 16, &key, 1, &count) == FLEXKV_OK);
  REQUIRE(count == 1);
  return key;
}

}  // namespace

TEST_CASE("the C ABI reports its version, its structs' sizes and the release version", "[integration]") {
  CHECK(flexkv_abi_version() == FLEXKV_ABI_VERSION);
  CHECK(flexkv_struct_size("flexkv_geometry") == sizeof(flexkv_geometry));
  CHECK(flexkv_struct_size("flexkv_daemon_status") == sizeof(flexkv_daemon_status));
  CHECK(flexkv_struct_size("flexkv_block_key") == sizeof(flexkv_block_key));
  CHECK(flexkv_struct_size("flexkv_op_result") == sizeof(flexkv_op_result));
  CHECK(flexkv_struct_size("flexkv_ticket") == sizeof(flexkv_ticket));
  CHECK(flexkv_struct_size("flexkv_nonsense") == 0);
  CHECK(flexkv_struct_size(nullptr) == 0);
  CHECK(std::string(flexkv_version()) == flexkv::kVersion);
  CHECK(std::string(flexkv_version()) == FLEXKV_RELEASE_VERSION);
}

TEST_CASE("C ABI: an old session's ticket is FAILED_PRECONDITION, a taken one NOT_FOUND, not yet DEADLINE_EXCEEDED",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  flexkv_client* c = nullptr;
  REQUIRE(flexkv_connect(d.socket().c_str(), 5000, &c, nullptr, 0) == FLEXKV_OK);
  const flexkv_geometry g = SmallGeometry();
  uint64_t sid = 0;
  REQUIRE(flexkv_attach(c, "c-abi", "llama3-8b", 0, 0, &g, &sid) == FLEXKV_OK);
  const flexkv_block_key key = OneKey(1);

  flexkv_ticket first{};
  REQUIRE(flexkv_match(c, &key, 1, 0, &first) == FLEXKV_OK);
  CHECK(first.id == 1);
  CHECK(first.generation != 0);
  flexkv_op_result out{};
  REQUIRE(flexkv_wait(c, first, 10000000, &out) == FLEXKV_OK);
  CHECK(out.status_code == FLEXKV_OK);
  CHECK(flexkv_wait(c, first, 0, &out) == FLEXKV_NOT_FOUND);
  CHECK_THAT(flexkv_last_error(), Catch::Contains("already taken"));
  CHECK(flexkv_try_wait(c, first, &out) == FLEXKV_NOT_FOUND);

  flexkv_ticket pending{};
  d.process().Signal(SIGSTOP);  // the daemon reads nothing: the request stays in flight (or, should a poller
                                // thread still run, ends: both are answers of this session)
  REQUIRE(flexkv_match(c, &key, 1, 0, &pending) == FLEXKV_OK);
  const int early = flexkv_try_wait(c, pending, &out);
  CHECK((early == FLEXKV_DEADLINE_EXCEEDED || early == FLEXKV_OK));
  d.process().Signal(SIGCONT);
  if (early != FLEXKV_OK) REQUIRE(flexkv_wait(c, pending, 10000000, &out) == FLEXKV_OK);

  flexkv_ticket stale{};
  REQUIRE(flexkv_match(c, &key, 1, 0, &stale) == FLEXKV_OK);
  REQUIRE(flexkv_detach(c) == FLEXKV_OK);
  CHECK(flexkv_try_wait(c, stale, &out) == FLEXKV_FAILED_PRECONDITION);
  REQUIRE(flexkv_attach(c, "c-abi", "llama3-8b", 0, 0, &g, &sid) == FLEXKV_OK);
  flexkv_ticket fresh{};
  REQUIRE(flexkv_match(c, &key, 1, 0, &fresh) == FLEXKV_OK);
  CHECK(fresh.generation > stale.generation);
  CHECK(flexkv_wait(c, stale, 1000000, &out) == FLEXKV_FAILED_PRECONDITION);
  CHECK_THAT(flexkv_last_error(), Catch::Contains("generation"));
  uint32_t landed = 0;
  CHECK(flexkv_wait_layers(c, stale, 1, 0, &landed) == FLEXKV_FAILED_PRECONDITION);
  REQUIRE(flexkv_wait(c, fresh, 10000000, &out) == FLEXKV_OK);
  CHECK(out.status_code == FLEXKV_OK);
  flexkv_close(c);
}

// ---- Hybrid geometries through the C ABI (ABI 4): components, per-component buffers, Load and Store ----

namespace {

// FULL: 2 layers, K/V, 2 heads of 64, bf16 at 16 tokens: 4 KiB chunks, 16 KiB blocks. A 32-token (2-block) window
// of the same shape, and a state of 2 layers x 256 bytes (512-byte snapshots).
constexpr flexkv_component kHybridComponents[] = {
    {FLEXKV_COMPONENT_SLIDING_WINDOW, 2, 2, 2, 64, 2, 32, 0, 0},
    {FLEXKV_COMPONENT_STATE, 2, 0, 0, 0, 0, 0, 0, 256},
};
constexpr uint64_t kSlotBytes[] = {16384, 16384, 512};  // of one TP rank's block (TP 1: the host slot)
constexpr uint32_t kKvBlocks = 16;

flexkv_geometry HybridGeometry() {
  return flexkv_geometry{16, 2, 2, 2, 64, 2, 1, 2, kHybridComponents};
}

std::vector<flexkv_block_key> PromptKeys(int32_t seed, size_t blocks) {
  std::vector<int32_t> tokens(blocks * 16);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = seed * 100000 + static_cast<int32_t>(i);
  std::vector<flexkv_block_key> keys(blocks);
  size_t count = 0;
  REQUIRE(flexkv_compute_block_keys("hybrid", 6, tokens.data(), tokens.size(), 16, keys.data(), keys.size(),
                                    &count) == FLEXKV_OK);
  REQUIRE(count == blocks);
  return keys;
}

struct HybridEngine {
  flexkv_client* client = nullptr;
  uint8_t* kv[3] = {};

  explicit HybridEngine(const std::string& socket) {
    REQUIRE(flexkv_connect(socket.c_str(), 5000, &client, nullptr, 0) == FLEXKV_OK);
    const flexkv_geometry g = HybridGeometry();
    REQUIRE(flexkv_attach(client, "c-abi-hybrid", "hybrid", 0, 0, &g, nullptr) == FLEXKV_OK);
    for (uint32_t c = 0; c < 3; ++c) {
      void* data = nullptr;
      uint64_t bytes = 0;
      REQUIRE(flexkv_create_host_kv_component(client, c, FLEXKV_LAYOUT_BLOCK_FIRST, kKvBlocks, &data, &bytes) ==
              FLEXKV_OK);
      CHECK(bytes == kKvBlocks * kSlotBytes[c]);
      kv[c] = static_cast<uint8_t*>(data);
    }
  }
  ~HybridEngine() { flexkv_close(client); }
  HybridEngine(const HybridEngine&) = delete;
  HybridEngine& operator=(const HybridEngine&) = delete;

  uint8_t* Block(uint32_t component, uint32_t id) const { return kv[component] + id * kSlotBytes[component]; }
  void Fill(uint32_t component, uint32_t id, uint8_t seed) const {
    for (uint64_t i = 0; i < kSlotBytes[component]; ++i) Block(component, id)[i] = static_cast<uint8_t>(seed + i * 7);
  }
  bool Same(uint32_t component, uint32_t id, const HybridEngine& other, uint32_t other_id) const {
    return std::memcmp(Block(component, id), other.Block(component, other_id), kSlotBytes[component]) == 0;
  }
  bool Zero(uint32_t component, uint32_t id) const {
    for (uint64_t i = 0; i < kSlotBytes[component]; ++i) {
      if (Block(component, id)[i] != 0) return false;
    }
    return true;
  }
  flexkv_op_result Wait(flexkv_ticket t) const {
    flexkv_op_result out{};
    REQUIRE(flexkv_wait(client, t, 10000000, &out) == FLEXKV_OK);
    return out;
  }
};

}  // namespace

TEST_CASE("C ABI 4: flexkv_component and the grown flexkv_geometry have the library's sizes", "[integration]") {
  CHECK(FLEXKV_ABI_VERSION >= 4);
  CHECK(flexkv_struct_size("flexkv_component") == sizeof(flexkv_component));
  CHECK(sizeof(flexkv_component) == 40);
  CHECK(flexkv_struct_size("flexkv_geometry") == sizeof(flexkv_geometry));
  CHECK(sizeof(flexkv_geometry) == 40);  // 8 u32 and the components pointer
}

TEST_CASE("C ABI: a hybrid session registers each component's host buffers and reports each sub-pool",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  flexkv_client* c = nullptr;
  REQUIRE(flexkv_connect(d.socket().c_str(), 5000, &c, nullptr, 0) == FLEXKV_OK);
  uint64_t slot = 0, capacity = 0;
  CHECK(flexkv_session_component(c, 0, &slot, &capacity) == FLEXKV_FAILED_PRECONDITION);
  const flexkv_geometry g = HybridGeometry();
  REQUIRE(flexkv_attach(c, "c-abi-hybrid", "hybrid", 0, 0, &g, nullptr) == FLEXKV_OK);
  for (uint32_t i = 0; i < 3; ++i) {
    REQUIRE(flexkv_session_component(c, i, &slot, &capacity) == FLEXKV_OK);
    CHECK(slot == kSlotBytes[i]);
    CHECK(capacity > 0);
  }
  CHECK(flexkv_session_component(c, 3, &slot, &capacity) == FLEXKV_INVALID_ARGUMENT);
  CHECK_THAT(flexkv_last_error(), Catch::Contains("component 3") && Catch::Contains("0..2"));

  void* data = nullptr;
  uint64_t bytes = 0;
  CHECK(flexkv_create_host_kv_component(c, 3, FLEXKV_LAYOUT_BLOCK_FIRST, 4, &data, &bytes) == FLEXKV_INVALID_ARGUMENT);
  CHECK_THAT(flexkv_last_error(), Catch::Contains("component 3 is not in this session's geometry"));
  REQUIRE(flexkv_create_host_kv_component(c, 2, FLEXKV_LAYOUT_LAYER_FIRST, 4, &data, &bytes) == FLEXKV_OK);
  CHECK(bytes == 4 * 512);
  CHECK(flexkv_create_host_kv_component(c, 2, FLEXKV_LAYOUT_LAYER_FIRST, 4, &data, &bytes) == FLEXKV_ALREADY_EXISTS);
  CHECK_THAT(flexkv_last_error(), Catch::Contains("component 2 (state)"));
  REQUIRE(flexkv_create_host_kv(c, FLEXKV_LAYOUT_BLOCK_FIRST, 4, &data, &bytes) == FLEXKV_OK);  // component 0
  CHECK(bytes == 4 * 16384);
  flexkv_close(c);
}

TEST_CASE("C ABI: geometry components that cannot be read are refused at attach", "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  flexkv_client* c = nullptr;
  REQUIRE(flexkv_connect(d.socket().c_str(), 5000, &c, nullptr, 0) == FLEXKV_OK);
  flexkv_geometry g = HybridGeometry();
  g.components = nullptr;
  CHECK(flexkv_attach(c, "x", "hybrid", 0, 0, &g, nullptr) == FLEXKV_INVALID_ARGUMENT);
  CHECK_THAT(flexkv_last_error(), Catch::Contains("geometry.components is NULL"));
  g = HybridGeometry();
  g.n_components = 8;
  CHECK(flexkv_attach(c, "x", "hybrid", 0, 0, &g, nullptr) == FLEXKV_INVALID_ARGUMENT);
  CHECK_THAT(flexkv_last_error(), Catch::Contains("n_components is 8; expected at most 7"));
  flexkv_component bad[2] = {kHybridComponents[0], kHybridComponents[1]};
  bad[1].reserved = 1;
  g = HybridGeometry();
  g.components = bad;
  CHECK(flexkv_attach(c, "x", "hybrid", 0, 0, &g, nullptr) == FLEXKV_INVALID_ARGUMENT);
  CHECK_THAT(flexkv_last_error(), Catch::Contains("components[1].reserved"));
  bad[1].reserved = 0;
  bad[1].state_bytes_per_layer = 24;  // the daemon's own check, by name
  CHECK(flexkv_attach(c, "x", "hybrid", 0, 0, &g, nullptr) == FLEXKV_INVALID_ARGUMENT);
  CHECK_THAT(flexkv_last_error(), Catch::Contains("components[1].state_bytes_per_layer"));
  flexkv_close(c);
}

TEST_CASE("C ABI: hybrid spans of the wrong size and bad boundaries are refused before anything is sent",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  HybridEngine e(d.socket());
  const std::vector<flexkv_block_key> keys = PromptKeys(1, 4);
  flexkv_ticket t{};
  REQUIRE(flexkv_match(e.client, keys.data(), keys.size(), 0, &t) == FLEXKV_OK);
  CHECK(t.id == 1);
  e.Wait(t);

  const uint32_t full[] = {0, 1, 2, 3}, window[] = {2, 3}, state[] = {5};
  const uint32_t* ids[] = {full, window, state};
  const size_t counts[] = {4, 2, 1};
  const uint32_t boundary[] = {4};
  // The single-span calls on a hybrid session.
  CHECK(flexkv_store(e.client, nullptr, keys.data(), full, 4, &t) == FLEXKV_INVALID_ARGUMENT);
  CHECK_THAT(flexkv_last_error(), Catch::Contains("per-component"));
  CHECK(flexkv_load(e.client, 1, full, 4, 0, &t) == FLEXKV_INVALID_ARGUMENT);
  CHECK_THAT(flexkv_last_error(), Catch::Contains("per-component"));
  // A window of 1 id for a 4-key store of a 2-block window.
  const size_t short_window[] = {4, 1, 1};
  CHECK(flexkv_store_components(e.client, nullptr, keys.data(), 4, ids, short_window, 3, boundary, 1, &t) ==
        FLEXKV_INVALID_ARGUMENT);
  CHECK_THAT(flexkv_last_error(), Catch::Contains("component 1 (sliding_window) has 1 block ids; expected 2"));
  // A state id without a boundary.
  CHECK(flexkv_store_components(e.client, nullptr, keys.data(), 4, ids, counts, 3, nullptr, 0, &t) ==
        FLEXKV_INVALID_ARGUMENT);
  CHECK_THAT(flexkv_last_error(), Catch::Contains("component 2 (state) has 1 block ids; expected 0"));
  // A boundary past the keys.
  const uint32_t past[] = {5};
  CHECK(flexkv_store_components(e.client, nullptr, keys.data(), 4, ids, counts, 3, past, 1, &t) ==
        FLEXKV_INVALID_ARGUMENT);
  CHECK_THAT(flexkv_last_error(), Catch::Contains("state boundary 0 is 5; expected 1..4"));
  // Two spans for three components.
  CHECK(flexkv_store_components(e.client, nullptr, keys.data(), 4, ids, counts, 2, boundary, 1, &t) ==
        FLEXKV_INVALID_ARGUMENT);
  CHECK_THAT(flexkv_last_error(), Catch::Contains("2 id spans; expected one per geometry component: 3"));
  // A load without its state id.
  const size_t no_state[] = {4, 2, 0};
  CHECK(flexkv_load_components(e.client, 1, ids, no_state, 3, &t) == FLEXKV_INVALID_ARGUMENT);
  CHECK_THAT(flexkv_last_error(), Catch::Contains("component 2 (state) has 0 block ids; expected 1"));
  CHECK(flexkv_store_components(e.client, nullptr, keys.data(), 4, nullptr, counts, 3, boundary, 1, &t) ==
        FLEXKV_INVALID_ARGUMENT);

  // Nothing of the above reached the rings: the next request is ticket 2, and nothing was stored.
  REQUIRE(flexkv_match(e.client, keys.data(), keys.size(), 0, &t) == FLEXKV_OK);
  CHECK(t.id == 2);
  CHECK(e.Wait(t).matched_blocks == 0);
  flexkv_daemon_status st{};
  REQUIRE(flexkv_get_status(e.client, &st) == FLEXKV_OK);
  CHECK(st.index_blocks == 0);
}

TEST_CASE("C ABI: a hybrid store and load copy the FULL prefix, its trailing window and its end's state, nothing else",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  HybridEngine a(d.socket());
  HybridEngine b(d.socket());
  const std::vector<flexkv_block_key> keys = PromptKeys(2, 5);
  for (uint32_t i = 0; i < 5; ++i) a.Fill(0, i, static_cast<uint8_t>(i + 1));
  a.Fill(1, 8, 101);  // the window of keys 3 and 4
  a.Fill(1, 9, 102);
  a.Fill(2, 3, 201);  // the state after key 2 (boundary 3)
  a.Fill(2, 4, 202);  // the state after key 4 (boundary 5)
  const uint32_t full[] = {0, 1, 2, 3, 4}, window[] = {8, 9}, states[] = {3, 4};
  const uint32_t* ids[] = {full, window, states};
  const size_t counts[] = {5, 2, 2};
  const uint32_t boundaries[] = {3, 5};
  flexkv_ticket t{};
  REQUIRE(flexkv_store_components(a.client, nullptr, keys.data(), 5, ids, counts, 3, boundaries, 2, &t) == FLEXKV_OK);
  flexkv_op_result r = a.Wait(t);
  REQUIRE(r.status_code == FLEXKV_OK);
  CHECK(r.done_blocks == 5);

  REQUIRE(flexkv_match(b.client, keys.data(), keys.size(), 1, &t) == FLEXKV_OK);
  r = b.Wait(t);
  REQUIRE(r.status_code == FLEXKV_OK);
  REQUIRE(r.matched_blocks == 5);
  const uint64_t handle = r.match_handle;
  const uint32_t to_full[] = {10, 11, 12, 13, 14}, to_window[] = {6, 7}, to_state[] = {1};
  const uint32_t* load_ids[] = {to_full, to_window, to_state};
  const size_t load_counts[] = {5, 2, 1};
  REQUIRE(flexkv_load_components(b.client, handle, load_ids, load_counts, 3, &t) == FLEXKV_OK);
  r = b.Wait(t);
  REQUIRE(r.status_code == FLEXKV_OK);
  CHECK(r.done_blocks == 5);
  for (uint32_t i = 0; i < 5; ++i) CHECK(b.Same(0, 10 + i, a, i));
  CHECK(b.Same(1, 6, a, 8));
  CHECK(b.Same(1, 7, a, 9));
  CHECK(b.Same(2, 1, a, 4));  // the snapshot at e = 5
  for (uint32_t id = 0; id < kKvBlocks; ++id) {
    if (id < 10 || id > 14) CHECK(b.Zero(0, id));
    if (id != 6 && id != 7) CHECK(b.Zero(1, id));
    if (id != 1) CHECK(b.Zero(2, id));
  }
  REQUIRE(flexkv_release(b.client, handle, &t) == FLEXKV_OK);
  b.Wait(t);

  // The prefix of 3 keys ends at the other boundary: its window is keys 1 and 2, which were not stored (the store
  // kept only the last two), so it is no hit; the whole prefix is.
  REQUIRE(flexkv_match(b.client, keys.data(), 3, 0, &t) == FLEXKV_OK);
  CHECK(b.Wait(t).matched_blocks == 0);
}

TEST_CASE("C ABI: flexkv_get_status_components lists the sub-pools, at most capacity of them", "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  HybridEngine e(d.socket());
  CHECK(flexkv_struct_size("flexkv_component_status") == sizeof(flexkv_component_status));
  flexkv_component_status pools[3] = {};
  size_t count = 0;
  REQUIRE(flexkv_get_status_components(e.client, pools, 2, &count) == FLEXKV_OK);
  CHECK(count == 3);
  CHECK(pools[0].kind == FLEXKV_COMPONENT_FULL);
  CHECK(pools[1].kind == FLEXKV_COMPONENT_SLIDING_WINDOW);
  CHECK(pools[1].slot_bytes == kSlotBytes[1]);
  CHECK(pools[2].slot_bytes == 0);  // past capacity: not written
  REQUIRE(flexkv_get_status_components(e.client, pools, 3, &count) == FLEXKV_OK);
  CHECK(pools[2].kind == FLEXKV_COMPONENT_STATE);
  CHECK(pools[2].slot_bytes == 512);
  CHECK(pools[2].capacity > 0);
  CHECK(flexkv_get_status_components(e.client, nullptr, 0, &count) == FLEXKV_OK);
  CHECK(count == 3);
  CHECK(flexkv_get_status_components(e.client, nullptr, 1, &count) == FLEXKV_INVALID_ARGUMENT);
}

TEST_CASE("C ABI: flexkv_get_status_routing gives the KV event stream's state and no cluster without one, in one call",
          "[integration]") {
  // Issue 29, item 8: what a router compares (docs/kv_events.md), without shelling out to flexkvctl --json.
  CHECK(flexkv_struct_size("flexkv_kv_events_status") == sizeof(flexkv_kv_events_status));
  CHECK(flexkv_struct_size("flexkv_cluster_status") == sizeof(flexkv_cluster_status));
  CHECK(flexkv_struct_size("flexkv_cluster_member") == sizeof(flexkv_cluster_member));
  DaemonUnderTest d({"--pool-size", "64MiB", "--kv-events-buffer", "4096"});
  REQUIRE(d.WaitReady());
  flexkv_client* c = nullptr;
  REQUIRE(flexkv_connect(d.socket().c_str(), 5000, &c, nullptr, 0) == FLEXKV_OK);
  flexkv_daemon_status st{};
  flexkv_kv_events_status events{};
  flexkv_cluster_status cluster{};
  cluster.present = 7;  // overwritten
  flexkv_cluster_member members[2] = {};
  size_t count = 9;
  REQUIRE(flexkv_get_status_routing(c, &st, &events, &cluster, members, 2, &count) == FLEXKV_OK);
  CHECK(std::string(st.state) == "serving");
  CHECK(events.instance_id != 0);
  CHECK(events.buffer_events == 4096);
  CHECK(events.subscribers == 0);
  CHECK(cluster.present == 0);
  CHECK(count == 0);
  // The status is optional, the rest is not.
  CHECK(flexkv_get_status_routing(c, nullptr, &events, &cluster, nullptr, 0, &count) == FLEXKV_OK);
  CHECK(flexkv_get_status_routing(c, nullptr, nullptr, &cluster, nullptr, 0, &count) == FLEXKV_INVALID_ARGUMENT);
  CHECK(flexkv_get_status_routing(c, nullptr, &events, &cluster, nullptr, 1, &count) == FLEXKV_INVALID_ARGUMENT);
  flexkv_close(c);
}

// ---- Prefetch through the C ABI (ABI 5): flexkv_prefetch, flexkv_op_result's bytes and source ----

namespace {

std::vector<flexkv_block_key> CKeys(int32_t seed, size_t blocks) {
  std::vector<int32_t> tokens(blocks * 16);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = seed * 100000 + static_cast<int32_t>(i);
  std::vector<flexkv_block_key> keys(blocks);
  size_t count = 0;
  REQUIRE(flexkv_compute_block_keys("llama3-8b", 9, tokens.data(), tokens.size(), 16, keys.data(), keys.size(),
                                    &count) == FLEXKV_OK);
  REQUIRE(count == blocks);
  return keys;
}

}  // namespace

TEST_CASE("C ABI 5 and later: flexkv_op_result grows bytes and source at its end, the older fields where they were",
          "[integration]") {
  CHECK(FLEXKV_ABI_VERSION >= 5);
  CHECK(flexkv_struct_size("flexkv_op_result") == sizeof(flexkv_op_result));
  CHECK(sizeof(flexkv_op_result) == 384);
  CHECK(offsetof(flexkv_op_result, match_handle) == 16);
  CHECK(offsetof(flexkv_op_result, message) == 24);
  CHECK(offsetof(flexkv_op_result, bytes) == 280);
  CHECK(offsetof(flexkv_op_result, source) == 288);
  CHECK(sizeof(flexkv_op_result{}.source) == 96);
}

// Needs the daemon side of Prefetch (an older flexkvd answers opcode 5 INVALID_ARGUMENT, "opcode 5 is unknown").
TEST_CASE("C ABI: flexkv_prefetch answers the local hits with bytes 0 and an empty source, and refuses NULL keys",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  flexkv_client* c = nullptr;
  REQUIRE(flexkv_connect(d.socket().c_str(), 5000, &c, nullptr, 0) == FLEXKV_OK);
  const flexkv_geometry g{16, 2, 2, 8, 128, 2, 1};
  REQUIRE(flexkv_attach(c, "c-abi-prefetch", "llama3-8b", 0, 0, &g, nullptr) == FLEXKV_OK);
  void* data = nullptr;
  uint64_t bytes = 0;
  REQUIRE(flexkv_create_host_kv(c, FLEXKV_LAYOUT_BLOCK_FIRST, 16, &data, &bytes) == FLEXKV_OK);
  const std::vector<flexkv_block_key> keys = CKeys(5, 12);
  const uint32_t ids[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  flexkv_ticket t{};
  flexkv_op_result out{};
  REQUIRE(flexkv_store(c, nullptr, keys.data(), ids, 8, &t) == FLEXKV_OK);
  REQUIRE(flexkv_wait(c, t, 10000000, &out) == FLEXKV_OK);
  REQUIRE(out.done_blocks == 8);

  std::memset(&out, 0x5a, sizeof(out));  // every field is written
  REQUIRE(flexkv_prefetch(c, keys.data(), keys.size(), &t) == FLEXKV_OK);
  REQUIRE(flexkv_wait(c, t, 10000000, &out) == FLEXKV_OK);
  INFO(out.message);
  CHECK(out.status_code == FLEXKV_OK);
  CHECK(out.matched_blocks == 8);
  CHECK(out.done_blocks == 0);
  CHECK(out.bytes == 0);
  CHECK(std::string(out.source).empty());
  CHECK(std::string(out.message).empty());

  CHECK(flexkv_prefetch(c, nullptr, 3, &t) == FLEXKV_INVALID_ARGUMENT);
  CHECK_THAT(flexkv_last_error(), Catch::Contains("keys"));
  CHECK(flexkv_prefetch(c, keys.data(), keys.size(), nullptr) == FLEXKV_INVALID_ARGUMENT);
  CHECK(flexkv_prefetch(c, keys.data(), 0, &t) == FLEXKV_INVALID_ARGUMENT);
  flexkv_close(c);
}

// ABI 6, layer events: the refusals a host session sees (the set itself needs a GPU: tests/integration/
// gpu_layer_events_test.cc): NULL arguments, a load naming an unknown set (flexkv_wait_launched answers its error),
// and flexkv_layer_events_create where no GPU is visible.
TEST_CASE("C ABI 6: layer events - NULL arguments, an unknown set, no GPU", "[integration]") {
  CHECK(FLEXKV_ABI_VERSION == 6);
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  flexkv_client* c = nullptr;
  REQUIRE(flexkv_connect(d.socket().c_str(), 5000, &c, nullptr, 0) == FLEXKV_OK);
  const flexkv_geometry g{16, 2, 2, 8, 128, 2, 1};
  REQUIRE(flexkv_attach(c, "c-abi-events", "llama3-8b", 0, 0, &g, nullptr) == FLEXKV_OK);
  void* data = nullptr;
  uint64_t bytes = 0;
  REQUIRE(flexkv_create_host_kv(c, FLEXKV_LAYOUT_BLOCK_FIRST, 16, &data, &bytes) == FLEXKV_OK);
  const std::vector<flexkv_block_key> keys = CKeys(6, 4);
  const uint32_t ids[4] = {0, 1, 2, 3};
  flexkv_ticket t{};
  flexkv_op_result out{};
  REQUIRE(flexkv_store(c, nullptr, keys.data(), ids, 4, &t) == FLEXKV_OK);
  REQUIRE(flexkv_wait(c, t, 10000000, &out) == FLEXKV_OK);
  REQUIRE(flexkv_match(c, keys.data(), 4, 1, &t) == FLEXKV_OK);
  REQUIRE(flexkv_wait(c, t, 10000000, &out) == FLEXKV_OK);
  REQUIRE(out.matched_blocks == 4);
  const uint64_t handle = out.match_handle;

  REQUIRE(flexkv_load_with_events(c, handle, ids, 4, 3, &t) == FLEXKV_OK);
  CHECK(flexkv_wait_launched(c, t, 10000000) == FLEXKV_NOT_FOUND);
  CHECK_THAT(flexkv_last_error(), Catch::Contains("event_set 3 is not registered"));
  REQUIRE(flexkv_wait(c, t, 10000000, &out) == FLEXKV_OK);
  CHECK(out.status_code == FLEXKV_NOT_FOUND);
  CHECK(flexkv_load_with_events(c, handle, ids, 4, 0, &t) == FLEXKV_INVALID_ARGUMENT);
  CHECK(flexkv_load_with_events(c, handle, nullptr, 4, 3, &t) == FLEXKV_INVALID_ARGUMENT);
  CHECK(flexkv_load_with_events(c, handle, ids, 4, 3, nullptr) == FLEXKV_INVALID_ARGUMENT);

  uint32_t set = 0;
  CHECK(flexkv_register_layer_events(c, nullptr, 1, &set) == FLEXKV_INVALID_ARGUMENT);
  const flexkv_layer_events* none[1] = {nullptr};
  CHECK(flexkv_register_layer_events(c, none, 1, &set) == FLEXKV_INVALID_ARGUMENT);
  CHECK(flexkv_register_layer_events(c, nullptr, 0, nullptr) == FLEXKV_INVALID_ARGUMENT);
  CHECK(flexkv_register_layer_events(c, nullptr, 0, &set) == FLEXKV_INVALID_ARGUMENT);  // 0 ranks: tp_size is 1
  CHECK_THAT(flexkv_last_error(), Catch::Contains("0 ranks of layer events; expected one per TP rank"));
  CHECK(flexkv_release_layer_events(c, 5) == FLEXKV_NOT_FOUND);
  CHECK(flexkv_layer_events_stream_wait(nullptr, 0, nullptr) == FLEXKV_INVALID_ARGUMENT);
  flexkv_layer_events_free(nullptr);
  flexkv_layer_events* ev = reinterpret_cast<flexkv_layer_events*>(&set);  // overwritten in any case
  if (flexkv_layer_events_create(4, 0, &ev) == FLEXKV_OK) {  // a GPU is visible here
    CHECK(ev != nullptr);
    flexkv_layer_events_free(ev);
  } else {  // no GPU (or no CUDA in this libflexkv): the reason, and no object
    CHECK(ev == nullptr);
    CHECK(std::string(flexkv_last_error()).size() > 0);
  }
  CHECK(flexkv_layer_events_create(4, 0, nullptr) == FLEXKV_INVALID_ARGUMENT);

  REQUIRE(flexkv_load(c, handle, ids, 4, 0, &t) == FLEXKV_OK);  // the refused loads held nothing
  REQUIRE(flexkv_wait(c, t, 10000000, &out) == FLEXKV_OK);
  CHECK(out.status_code == FLEXKV_OK);
  CHECK(out.done_blocks == 4);
  flexkv_close(c);
}

// Regression (issue 20 review): flexkv_kv_next with capacity 0 answered OK with no events and never moved on, so a
// binding that passed 0 looped forever on the same batch.
TEST_CASE("C ABI: flexkv_kv_next with capacity 0 is INVALID_ARGUMENT saying capacity must be at least 1",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  flexkv_kv_subscription* sub = nullptr;
  REQUIRE(flexkv_kv_subscribe(d.socket().c_str(), 5000, 0, 0, &sub) == FLEXKV_OK);
  flexkv_kv_batch batch{};
  flexkv_kv_event events[4];
  CHECK(flexkv_kv_next(sub, &batch, nullptr, 0) == FLEXKV_INVALID_ARGUMENT);
  CHECK_THAT(std::string(flexkv_last_error()), Catch::Contains("capacity") && Catch::Contains(">= 1"));
  CHECK(flexkv_kv_next(sub, &batch, events, 0) == FLEXKV_INVALID_ARGUMENT);
  // The subscription is still usable: the (empty) snapshot comes with a capacity of 1 or more.
  REQUIRE(flexkv_kv_next(sub, &batch, events, 4) == FLEXKV_OK);
  CHECK(batch.snapshot == 1);
  CHECK(batch.snapshot_end == 1);
  flexkv_kv_close(sub);
}
