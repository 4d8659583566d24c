// LayOutComponentIds: the client's checks of a hybrid Load's and Store's per-component ids and boundaries, and the
// id array they become (client/hybrid_request.h, common/hybrid_ids.h).
#include "client/hybrid_request.h"

#include <catch2/catch.hpp>

#include <span>
#include <vector>

using flexkv::Geometry;
using flexkv::StatusCode;

namespace {

using Spans = std::vector<std::span<const uint32_t>>;

// FULL, a 32-token window (2 blocks at 16 tokens) and a state: one component of each kind.
Geometry ThreeKinds() {
  Geometry g = flexkv::GptOss20B();
  g.components[0].window_tokens = 32;
  g.components.push_back(flexkv::JambaLike().components[0]);
  return g;
}

}  // namespace

TEST_CASE("a hybrid store lays out FULL and window ids, then the boundaries, then the state ids", "[unit]") {
  const std::vector<uint32_t> full{10, 11, 12, 13, 14}, window{23, 24}, state{31, 32};
  const std::vector<uint32_t> boundaries{2, 5};
  auto ids = flexkv::LayOutComponentIds(ThreeKinds(), true, 5, Spans{full, window, state}, boundaries);
  REQUIRE(ids.ok());
  CHECK(*ids == std::vector<uint32_t>{10, 11, 12, 13, 14, 23, 24, 2, 5, 31, 32});
}

TEST_CASE("a hybrid load lays out e FULL ids, the window's and one state id", "[unit]") {
  const std::vector<uint32_t> full{0, 1, 2}, window{1, 2}, state{7};
  auto ids = flexkv::LayOutComponentIds(ThreeKinds(), false, 3, Spans{full, window, state}, {});
  REQUIRE(ids.ok());
  CHECK(*ids == std::vector<uint32_t>{0, 1, 2, 1, 2, 7});
  // A prefix shorter than the window carries the whole prefix of the window.
  const std::vector<uint32_t> one{4}, one_window{4};
  ids = flexkv::LayOutComponentIds(ThreeKinds(), false, 1, Spans{one, one_window, state}, {});
  REQUIRE(ids.ok());
  CHECK(*ids == std::vector<uint32_t>{4, 4, 7});
}

TEST_CASE("a full-attention geometry's per-component request is its one span", "[unit]") {
  const std::vector<uint32_t> full{3, 4};
  auto ids = flexkv::LayOutComponentIds(flexkv::Llama3_8B(), true, 2, Spans{full}, {});
  REQUIRE(ids.ok());
  CHECK(*ids == full);
}

TEST_CASE("wrong span sizes name the component, its kind, the size given and expected", "[unit]") {
  const Geometry g = ThreeKinds();
  const std::vector<uint32_t> five{0, 1, 2, 3, 4}, four{0, 1, 2, 3}, two{0, 1}, three{0, 1, 2}, one{0}, none{};
  const std::vector<uint32_t> boundary{5};
  struct Case {
    const char* expect;
    bool store;
    Spans spans;
    std::vector<uint32_t> boundaries;
  };
  const Case cases[] = {
      {"component 0 (full) has 4 block ids; expected 5", true, Spans{four, two, one}, boundary},
      {"component 1 (sliding_window) has 3 block ids; expected 2", true, Spans{five, three, one}, boundary},
      {"component 1 (sliding_window) has 1 block ids; expected 2", true, Spans{five, one, one}, boundary},
      {"component 2 (state) has 2 block ids; expected 1", true, Spans{five, two, two}, boundary},
      {"component 2 (state) has 1 block ids; expected 0", true, Spans{five, two, one}, {}},
      {"component 2 (state) has 0 block ids; expected 1", false, Spans{five, two, none}, {}},
      {"2 id spans; expected one per geometry component: 3", true, Spans{five, two}, boundary},
  };
  for (const Case& c : cases) {
    auto ids = flexkv::LayOutComponentIds(g, c.store, 5, c.spans, c.boundaries);
    INFO(c.expect);
    REQUIRE_FALSE(ids.ok());
    CHECK(ids.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(ids.status().message(), Catch::Contains(c.expect));
  }
}

TEST_CASE("state boundaries must be in 1..n and strictly increasing", "[unit]") {
  const Geometry g = ThreeKinds();
  const std::vector<uint32_t> five{0, 1, 2, 3, 4}, two{0, 1}, states{7, 8};
  struct Case {
    std::vector<uint32_t> boundaries;
    const char* expect;
  };
  const Case cases[] = {
      {{0, 5}, "state boundary 0 is 0; expected 1..5"},
      {{2, 6}, "state boundary 1 is 6; expected 1..5"},
      {{3, 3}, "state boundary 1 is 3 after 3; expected strictly increasing"},
      {{4, 2}, "state boundary 1 is 2 after 4; expected strictly increasing"},
  };
  for (const Case& c : cases) {
    auto ids = flexkv::LayOutComponentIds(g, true, 5, Spans{five, two, states}, c.boundaries);
    INFO(c.expect);
    REQUIRE_FALSE(ids.ok());
    CHECK(ids.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(ids.status().message(), Catch::Contains(c.expect));
  }
  const std::vector<uint32_t> six_boundaries{1, 2, 3, 4, 5, 5};
  auto too_many = flexkv::LayOutComponentIds(g, true, 5, Spans{five, two, states}, six_boundaries);
  CHECK_THAT(too_many.status().message(), Catch::Contains("6 state boundaries for a store of 5 keys"));
  // Boundaries where nothing takes them: a geometry without a state component, and a load.
  const std::vector<uint32_t> window{3, 4}, boundary{5};
  auto no_state = flexkv::LayOutComponentIds(flexkv::GptOss20B(), true, 5, Spans{five, window}, boundary);
  CHECK_THAT(no_state.status().message(), Catch::Contains("no state component"));
  const std::vector<uint32_t> state{7};
  auto load = flexkv::LayOutComponentIds(g, false, 5, Spans{five, two, state}, boundary);
  CHECK_THAT(load.status().message(), Catch::Contains("a load takes no state boundaries"));
}

TEST_CASE("a request of no blocks is refused", "[unit]") {
  const std::vector<uint32_t> none{}, state{1};
  auto ids = flexkv::LayOutComponentIds(ThreeKinds(), false, 0, Spans{none, none, state}, {});
  REQUIRE_FALSE(ids.ok());
  CHECK_THAT(ids.status().message(), Catch::Contains("no ids; expected at least one"));
}
