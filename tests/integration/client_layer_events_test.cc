// Layer events (issue 19) against a real flexkvd, without a GPU: every untrusted field of RegisterLayerEvents is
// checked against the session's geometry before any backend is asked (a rank missing or twice, a layer count, a
// handle of the wrong size), a daemon without the cuda backend refuses the set with the reason and the alternative,
// a Load naming an unknown set ends NOT_FOUND naming the sets there are, and nothing is held afterwards (the pinned
// blocks stay loadable). The GPU half - the engine's stream waiting on the events - is
// tests/integration/gpu_layer_events_test.cc.
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "flexkv/client.h"
#include "tests/support/process.h"

using namespace std::chrono_literals;
using flexkv::LayerEventHandles;
using flexkv::StatusCode;
using flexkv::testing::DaemonUnderTest;

namespace {

flexkv::AttachOptions Tp2Attach() {
  flexkv::AttachOptions o;
  o.client_name = "events";
  o.model_namespace = "llama3-8b";
  o.geometry = flexkv::Llama3_8B();
  o.geometry.num_layers = 4;
  o.geometry.tp_size = 2;
  o.geometry.kv_heads_per_rank = 4;
  return o;
}

LayerEventHandles Rank(uint32_t tp_rank, size_t layers, size_t handle_bytes = 64) {
  LayerEventHandles r;
  r.gpu_uuid = "GPU-00000000-0000-0000-0000-000000000000";
  r.tp_rank = tp_rank;
  r.handles.assign(layers, std::string(handle_bytes, '\x5a'));
  return r;
}

void ExpectRefused(const flexkv::Result<uint32_t>& r, StatusCode code, const std::string& text) {
  INFO(r.status().ToString());
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == code);
  CHECK_THAT(r.status().message(), Catch::Contains(text));
}

// Whether the daemon runs the cuda backend (a GPU visible to it): then the set's fake handles reach the driver.
bool DaemonHasCuda(flexkv::Client& client) {
  auto st = client.GetStatus();
  REQUIRE(st.ok());
  for (const auto& b : st->backends) {
    if (b.name == "cuda") return true;
  }
  return false;
}

}  // namespace

TEST_CASE("RegisterLayerEvents checks ranks, layer counts and handle sizes against the geometry", "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  auto c = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
  REQUIRE(c.ok());
  REQUIRE((*c)->Attach(Tp2Attach()).ok());
  flexkv::Client& client = **c;

  const std::vector<LayerEventHandles> one_rank = {Rank(0, 4)};
  ExpectRefused(client.RegisterLayerEvents(one_rank), StatusCode::kInvalidArgument,
                "1 ranks of layer events; expected one per TP rank of the geometry: 2");
  const std::vector<LayerEventHandles> twice = {Rank(0, 4), Rank(0, 4)};
  ExpectRefused(client.RegisterLayerEvents(twice), StatusCode::kInvalidArgument,
                "ranks[1].tp_rank is 0; expected each rank 0..1 exactly once");
  const std::vector<LayerEventHandles> past = {Rank(0, 4), Rank(2, 4)};
  ExpectRefused(client.RegisterLayerEvents(past), StatusCode::kInvalidArgument, "ranks[1].tp_rank is 2");
  const std::vector<LayerEventHandles> layers = {Rank(0, 4), Rank(1, 3)};
  ExpectRefused(client.RegisterLayerEvents(layers), StatusCode::kInvalidArgument,
                "ranks[1] (tp rank 1) has 3 event handles; expected one per layer of the geometry: 4");
  const std::vector<LayerEventHandles> short_handle = {Rank(0, 4), Rank(1, 4, 63)};
  ExpectRefused(client.RegisterLayerEvents(short_handle), StatusCode::kInvalidArgument,
                "handle of layer 0 has 63 bytes; expected a cudaIpcEventHandle_t (64 bytes)");
  if (!DaemonHasCuda(client)) {
    // Counts right: the host-only daemon says what it lacks and what to use instead.
    const std::vector<LayerEventHandles> good = {Rank(1, 4), Rank(0, 4)};
    ExpectRefused(client.RegisterLayerEvents(good), StatusCode::kFailedPrecondition,
                  "no backend of this flexkvd records CUDA layer events (backends: host)");
  }
  const flexkv::Status release = client.ReleaseLayerEvents(7);
  CHECK(release.code() == StatusCode::kNotFound);
  CHECK_THAT(release.message(), Catch::Contains("layer-event set 7 is not registered") && Catch::Contains("none"));
}

TEST_CASE("a Load naming an unknown event set ends NOT_FOUND, and its pinned blocks stay loadable", "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  auto c = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
  REQUIRE(c.ok());
  flexkv::AttachOptions o = Tp2Attach();
  o.geometry.tp_size = 1;
  o.geometry.kv_heads_per_rank = 8;
  flexkv::Client& client = **c;
  REQUIRE(client.Attach(o).ok());
  REQUIRE(client.CreateHostKv(flexkv::KvLayout::kBlockFirst, 8).ok());
  std::vector<int32_t> tokens(4 * 16);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i) + 7;
  const auto keys = flexkv::ComputeBlockKeys("llama3-8b", tokens, 16);
  const std::vector<uint32_t> ids = {0, 1, 2, 3};
  auto stored = client.Store(flexkv::BlockKeyChain(keys), ids);
  REQUIRE(stored.ok());
  auto st = client.Wait(*stored, 10s);
  REQUIRE(st.ok());
  REQUIRE(st->status.ok());
  auto match = client.Match(keys, true);
  REQUIRE(match.ok());
  auto m = client.Wait(*match, 10s);
  REQUIRE(m.ok());
  REQUIRE(m->matched_blocks == 4);

  auto load = client.LoadWithEvents(m->match_handle, ids, 9);
  REQUIRE(load.ok());
  const flexkv::Status launched = client.WaitLaunched(*load, 10s);  // the load's own error: nothing to wait on
  CHECK(launched.code() == StatusCode::kNotFound);
  CHECK_THAT(launched.message(), Catch::Contains("event_set 9 is not registered in this session (registered: none)"));
  auto r = client.Wait(*load, 10s);
  REQUIRE(r.ok());
  CHECK(r->status.code() == StatusCode::kNotFound);
  CHECK(r->done_blocks == 0);
  CHECK(client.LoadWithEvents(m->match_handle, ids, 0).status().code() == StatusCode::kInvalidArgument);
  // Nothing was taken by the refused load: the handle still loads (progress completions, as before).
  auto again = client.Load(m->match_handle, ids, /*layerwise=*/true);
  REQUIRE(again.ok());
  auto layers = client.WaitLayers(*again, 4, 10s);
  REQUIRE(layers.ok());
  CHECK(*layers == 4);
  auto ok = client.Wait(*again, 10s);
  REQUIRE(ok.ok());
  CHECK(ok->status.ok());
  CHECK(ok->done_blocks == 4);
}
