// The C++ Client with a hybrid geometry against a real flexkvd: per-component session info and status (flexkvctl
// included), per-component host buffers, and the requests refused before anything is sent.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "flexkv/client.h"
#include "tests/support/daemon_checks.h"
#include "tests/support/process.h"

using namespace std::chrono_literals;
using flexkv::ComponentKind;
using flexkv::StatusCode;
using flexkv::testing::DaemonUnderTest;
using flexkv::testing::SmallHybrid;
using flexkv::testing::FlexkvctlPath;
using flexkv::testing::RunCommand;

namespace {


std::unique_ptr<flexkv::Client> Attached(const DaemonUnderTest& d, const flexkv::Geometry& g,
                                         flexkv::SessionInfo* info) {
  auto c = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
  REQUIRE(c.ok());
  flexkv::AttachOptions o;
  o.client_name = "hybrid";
  o.model_namespace = "gpt-oss";
  o.geometry = g;
  auto attached = (*c)->Attach(o);
  REQUIRE(attached.ok());
  *info = *attached;
  return std::move(*c);
}

}  // namespace

TEST_CASE("a hybrid session reports each component's sub-pool, in SessionInfo, GetStatus and flexkvctl",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  flexkv::SessionInfo info;
  auto c = Attached(d, SmallHybrid(), &info);
  CHECK(info.component_slot_bytes == std::vector<uint64_t>{65536, 65536, 512});
  REQUIRE(info.component_capacity.size() == 3);
  for (uint64_t slots : info.component_capacity) CHECK(slots > 0);

  auto st = c->GetStatus();
  REQUIRE(st.ok());
  REQUIRE(st->pool.components.size() == 3);
  const ComponentKind kinds[] = {ComponentKind::kFull, ComponentKind::kSlidingWindow, ComponentKind::kState};
  for (size_t i = 0; i < 3; ++i) {
    CHECK(st->pool.components[i].kind == kinds[i]);
    CHECK(st->pool.components[i].slot_bytes == info.component_slot_bytes[i]);
    CHECK(st->pool.components[i].capacity == info.component_capacity[i]);
  }
  auto human = RunCommand({FlexkvctlPath(), "--socket", d.socket(), "status"});
  REQUIRE(human.exit_code == 0);
  CHECK_THAT(human.output, Catch::Contains("1 sliding_window") && Catch::Contains("2 state") &&
                               Catch::Contains("slots of 512 bytes"));
  auto json = RunCommand({FlexkvctlPath(), "--socket", d.socket(), "status", "--json"});
  REQUIRE(json.exit_code == 0);
  CHECK_THAT(json.output, Catch::Contains("\"components\"") && Catch::Contains("\"kind\": \"state\"") &&
                              Catch::Contains("\"unanchored\""));
}

TEST_CASE("a full-attention session's per-component info is its one pool", "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  flexkv::Geometry g = flexkv::Llama3_8B();
  g.num_layers = 2;
  flexkv::SessionInfo info;
  auto c = Attached(d, g, &info);
  CHECK(info.component_slot_bytes == std::vector<uint64_t>{info.block_bytes});
  CHECK(info.component_capacity == std::vector<uint64_t>{info.capacity_blocks});
  // The per-component overload works for component 0 alone; nothing else does.
  auto kv = c->CreateHostKv(0, flexkv::KvLayout::kBlockFirst, 4);
  REQUIRE(kv.ok());
  CHECK(kv->bytes == 4 * info.block_bytes);
  auto again = c->CreateHostKv(flexkv::KvLayout::kBlockFirst, 4);
  CHECK(again.status().code() == StatusCode::kAlreadyExists);
  CHECK(c->CreateHostKv(1, flexkv::KvLayout::kBlockFirst, 4).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("hybrid buffers are sized from each component's copy geometry, once per component", "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  flexkv::SessionInfo info;
  auto c = Attached(d, SmallHybrid(), &info);
  const uint64_t block_bytes[] = {65536, 65536, 512};
  for (uint32_t i = 0; i < 3; ++i) {
    auto kv = c->CreateHostKv(i, flexkv::KvLayout::kLayerFirst, 8);
    REQUIRE(kv.ok());
    CHECK(kv->bytes == 8 * block_bytes[i]);
    CHECK(kv->num_blocks == 8);
  }
  auto twice = c->CreateHostKv(1, flexkv::KvLayout::kLayerFirst, 8);
  CHECK(twice.status().code() == StatusCode::kAlreadyExists);
  CHECK_THAT(twice.status().message(), Catch::Contains("component 1 (sliding_window)"));
  flexkv::GpuKvRegistration reg;
  reg.component = 3;
  const flexkv::Status gpu = c->RegisterGpuKv(reg);
  CHECK(gpu.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(gpu.message(), Catch::Contains("component 3 is not in this session's geometry; expected 0..2"));
}

TEST_CASE("the single-span Load and Store refuse a hybrid session, the per-component ones check every span",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  flexkv::SessionInfo info;
  auto c = Attached(d, SmallHybrid(), &info);
  for (uint32_t i = 0; i < 3; ++i) REQUIRE(c->CreateHostKv(i, flexkv::KvLayout::kBlockFirst, 8).ok());
  std::vector<int32_t> tokens(64);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i * 31);
  const std::vector<flexkv::BlockKey> keys = flexkv::ComputeBlockKeys("gpt-oss", tokens, 16);
  REQUIRE(keys.size() == 4);
  const flexkv::BlockKeyChain chain(flexkv::kRootParent, keys);
  const std::vector<uint32_t> full{0, 1, 2, 3}, window{2, 3}, state{1}, three{1, 2, 3};

  auto first = c->Match(keys);
  REQUIRE(first.ok());
  REQUIRE(c->Wait(*first, 10s).ok());

  auto single = c->Store(chain, full);
  CHECK(single.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(single.status().message(), Catch::Contains("per-component overload"));
  auto single_load = c->Load(1, full);
  CHECK(single_load.status().code() == StatusCode::kInvalidArgument);

  using Spans = std::vector<std::span<const uint32_t>>;
  const std::vector<uint32_t> boundary{4};
  auto wide = c->Store(chain, Spans{full, three, state}, boundary);
  CHECK(wide.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(wide.status().message(), Catch::Contains("component 1 (sliding_window) has 3 block ids; expected 2"));
  const std::vector<uint32_t> backwards{3, 2};
  const std::vector<uint32_t> two_states{1, 2};
  auto bad_bounds = c->Store(chain, Spans{full, window, two_states}, backwards);
  CHECK_THAT(bad_bounds.status().message(), Catch::Contains("strictly increasing"));
  auto load = c->Load(1, Spans{full, window});
  CHECK_THAT(load.status().message(), Catch::Contains("2 id spans; expected one per geometry component: 3"));

  // Nothing reached the rings: the next ticket follows the first, and nothing is cached.
  auto next = c->Match(keys);
  REQUIRE(next.ok());
  CHECK(next->id == first->id + 1);
  auto r = c->Wait(*next, 10s);
  REQUIRE(r.ok());
  CHECK(r->matched_blocks == 0);

  // The same request with the right spans is stored and matched whole.
  auto stored = c->Store(chain, Spans{full, window, state}, boundary);
  REQUIRE(stored.ok());
  auto done = c->Wait(*stored, 10s);
  REQUIRE(done.ok());
  CHECK(done->status.ok());
  CHECK(done->done_blocks == 4);
  auto hit = c->Match(keys);
  REQUIRE(hit.ok());
  CHECK(c->Wait(*hit, 10s)->matched_blocks == 4);
}
