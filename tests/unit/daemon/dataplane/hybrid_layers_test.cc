// Hybrid layer-wise loads: the layer order reported in order whatever order the layers land in, and the copies a
// load becomes - one per layer in Geometry::LayerOrder where the backend copies layer ranges, whole components
// otherwise - over the fake backend.
#include <catch2/catch.hpp>

#include <memory>
#include <optional>
#include <vector>

#include "daemon/dataplane/hybrid_layers.h"
#include "tests/unit/daemon/cache/temp_cache.h"
#include "tests/unit/daemon/transfer/fake_engine_memory.h"

using flexkv::CopyRequest;
using flexkv::MemoryKind;
using flexkv::OrderedLayerProgress;
using flexkv::testing::Caps;
using flexkv::testing::FakeEngineMemory;
using flexkv::testing::FakeKv;

namespace {

// Three components of two layers each: full, sliding window, state. Layer order: (2,0) (2,1) (0,0) (1,0) (0,1) (1,1).
flexkv::Geometry ThreeByTwo() {
  flexkv::Geometry g = flexkv::testing::TinyHybrid();
  g.num_layers = 2;
  for (flexkv::ComponentSpec& c : g.components) c.num_layers = 2;
  REQUIRE(g.Validate().ok());
  return g;
}

CopyRequest Whole(FakeEngineMemory* backend, uint32_t component, bool with_events) {
  CopyRequest r;
  r.backend = backend;
  r.component = component;
  r.targets.push_back(std::make_shared<FakeKv>(16, 0));
  r.engine_blocks = std::make_shared<const std::vector<uint32_t>>(std::vector<uint32_t>{1, 2});
  r.slots = std::make_shared<const std::vector<flexkv::SlotId>>(std::vector<flexkv::SlotId>{5, 6});
  r.num_layers = 2;
  if (with_events) r.layer_events.push_back(nullptr);  // stands for the rank's set: only its presence matters here
  return r;
}

}  // namespace

TEST_CASE("hybrid layers: progress is reported in index order whatever order the layers land in", "[unit]") {
  std::vector<uint32_t> reported;
  OrderedLayerProgress p(4, [&](uint32_t i) { reported.push_back(i); });
  p.Landed(2);
  p.Landed(9);  // not a layer of the load: ignored
  CHECK(reported.empty());
  p.Landed(0);
  CHECK(reported == std::vector<uint32_t>{0});
  p.Landed(1);
  p.Landed(1);  // again: nothing more
  CHECK(reported == std::vector<uint32_t>{0, 1, 2});
  p.Landed(3);
  CHECK(reported == std::vector<uint32_t>{0, 1, 2, 3});
  CHECK(p.reported() == 4);
}

TEST_CASE("hybrid layers: a backend of layer ranges gets one copy per layer in the order, the last one closing",
          "[unit]") {
  const flexkv::Geometry g = ThreeByTwo();
  FakeEngineMemory backend("fake", Caps({MemoryKind::kHostMemfd}, /*layerwise=*/true));
  std::vector<uint32_t> reported;
  auto progress = std::make_shared<OrderedLayerProgress>(6, [&](uint32_t i) { reported.push_back(i); });
  std::vector<std::optional<CopyRequest>> components(3);
  components[0] = Whole(&backend, 0, false);
  components[2] = Whole(&backend, 2, false);  // the window (component 1) moves nothing
  std::vector<CopyRequest> copies = flexkv::HybridLayerCopies(g, std::move(components), progress, nullptr);
  REQUIRE(copies.size() == 4);
  const uint32_t want[4][4] = {{2, 0, 0, 1}, {2, 1, 1, 1}, {0, 0, 2, 1}, {0, 1, 4, 0}};  // component, layer, index, more
  for (size_t i = 0; i < copies.size(); ++i) {
    INFO("copy " << i);
    CHECK(copies[i].component == want[i][0]);
    CHECK(copies[i].layers.begin == want[i][1]);
    CHECK(copies[i].layers.end == want[i][1] + 1);
    CHECK(copies[i].layers.first_event == want[i][2]);
    CHECK(copies[i].layers.more_follow == (want[i][3] == 1));
    CHECK(*copies[i].engine_blocks == std::vector<uint32_t>{1, 2});
    REQUIRE(copies[i].layer_done);
  }
  CHECK(reported.empty());  // the window's layers (3, 5) landed at once, but layer 0 has not
  copies[0].layer_done(0);
  CHECK(reported == std::vector<uint32_t>{0});
  copies[2].layer_done(0);  // lands before the state's layer 1: held back
  CHECK(reported == std::vector<uint32_t>{0});
  copies[1].layer_done(1);
  CHECK(reported == std::vector<uint32_t>{0, 1, 2, 3});
  copies[3].layer_done(1);
  CHECK(reported == std::vector<uint32_t>{0, 1, 2, 3, 4, 5});
}

TEST_CASE("hybrid layers: a backend of whole copies gets one per component, its layers mapped into the order",
          "[unit]") {
  const flexkv::Geometry g = ThreeByTwo();
  FakeEngineMemory backend("fake", Caps({MemoryKind::kHostMemfd}));
  std::vector<uint32_t> reported;
  auto progress = std::make_shared<OrderedLayerProgress>(6, [&](uint32_t i) { reported.push_back(i); });
  std::vector<std::optional<CopyRequest>> components(3);
  for (uint32_t c = 0; c < 3; ++c) components[c] = Whole(&backend, c, false);
  std::vector<CopyRequest> copies = flexkv::HybridLayerCopies(g, std::move(components), progress, nullptr);
  REQUIRE(copies.size() == 3);
  for (const CopyRequest& c : copies) CHECK(c.layers.whole());
  copies[1].layer_done(0);  // the window's layers are 3 and 5, the full ones 2 and 4, the state's 0 and 1
  copies[1].layer_done(1);
  copies[0].layer_done(0);
  CHECK(reported.empty());
  copies[2].layer_done(0);
  CHECK(reported == std::vector<uint32_t>{0});
  copies[2].layer_done(1);
  CHECK(reported == std::vector<uint32_t>{0, 1, 2, 3});
  copies[0].layer_done(1);
  CHECK(reported == std::vector<uint32_t>{0, 1, 2, 3, 4, 5});
}

TEST_CASE("hybrid layers: with events, launched once every per-layer copy launched", "[unit]") {
  const flexkv::Geometry g = ThreeByTwo();
  flexkv::EngineMemoryCapabilities caps = Caps({MemoryKind::kHostMemfd});
  caps.layer_events = true;
  FakeEngineMemory backend("fake", caps);
  int launched = 0;
  std::vector<std::optional<CopyRequest>> components(3);
  for (uint32_t c = 0; c < 3; ++c) components[c] = Whole(&backend, c, true);
  std::vector<CopyRequest> copies = flexkv::HybridLayerCopies(g, std::move(components), nullptr, [&] { ++launched; });
  REQUIRE(copies.size() == 6);
  for (size_t i = 0; i < copies.size(); ++i) {
    CHECK(copies[i].layers.first_event == i);  // the set's event i: the order's entry i
    CHECK_FALSE(copies[i].layer_done);          // no progress asked for
    REQUIRE(copies[i].launched);
  }
  for (size_t i = 0; i + 1 < copies.size(); ++i) copies[i].launched();
  CHECK(launched == 0);
  copies.back().launched();
  CHECK(launched == 1);
}
