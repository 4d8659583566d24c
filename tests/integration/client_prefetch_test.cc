// Client::Prefetch (ring op 5) against a real flexkvd without a cluster tier: the daemon answers with the local
// hits only (nothing pulled, bytes 0, source empty), pins nothing, and refuses an all-zero key; the client refuses
// empty keys before anything is sent. Needs the daemon side of Prefetch (daemon/: an older flexkvd answers opcode 5
// INVALID_ARGUMENT, "opcode 5 is unknown").
#include <catch2/catch.hpp>
#include <string>
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

std::unique_ptr<flexkv::Client> ConnectTo(const DaemonUnderTest& d) {
  auto c = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
  REQUIRE(c.ok());
  return std::move(*c);
}

std::vector<flexkv::BlockKey> Keys(int seed, size_t blocks) {
  std::vector<int32_t> tokens(blocks * 16);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = seed * 100000 + static_cast<int32_t>(i);
  return flexkv::ComputeBlockKeys("llama3-8b", tokens, 16);
}

flexkv::OpResult Run(flexkv::Client& c, flexkv::Result<flexkv::Ticket> t) {
  INFO(t.status().ToString());
  REQUIRE(t.ok());
  auto r = c.Wait(*t, 10s);
  INFO(r.status().ToString());
  REQUIRE(r.ok());
  return *r;
}

}  // namespace

TEST_CASE("Prefetch without a cluster tier answers the local hits: nothing pulled, bytes 0, no source, no pins",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  auto c = ConnectTo(d);
  REQUIRE(c->Attach(SmallAttach("prefetcher")).ok());
  REQUIRE(c->CreateHostKv(flexkv::KvLayout::kBlockFirst, 16).ok());
  const std::vector<flexkv::BlockKey> keys = Keys(1, 12);
  const std::vector<uint32_t> ids = {0, 1, 2, 3, 4, 5, 6, 7};
  const flexkv::OpResult stored =
      Run(*c, c->Store(flexkv::BlockKeyChain(std::span<const flexkv::BlockKey>(keys).first(8)), ids));
  REQUIRE(stored.status.ok());
  REQUIRE(stored.done_blocks == 8);
  CHECK(stored.bytes == 0);  // no other request reports bytes or a source
  CHECK(stored.source.empty());

  // The 8 stored keys and 4 more: the 8 are cached here, and nobody has the rest.
  const flexkv::OpResult r = Run(*c, c->Prefetch(keys));
  INFO(r.status.ToString());
  CHECK(r.status.ok());
  CHECK(r.matched_blocks == 8);
  CHECK(r.done_blocks == 0);
  CHECK(r.bytes == 0);
  CHECK(r.source.empty());
  CHECK(r.match_handle == 0);
  auto status = c->GetStatus();
  REQUIRE(status.ok());
  CHECK(status->pool.pinned_blocks == 0);  // a prefetch pins nothing

  // A Match with pin after it finds the same 8 blocks, and pins them.
  const flexkv::OpResult hit = Run(*c, c->Match(keys, true));
  CHECK(hit.matched_blocks == 8);
  CHECK(hit.match_handle != 0);
  CHECK(Run(*c, c->Release(hit.match_handle)).status.ok());
}

TEST_CASE("Prefetch of a prompt nothing of is cached answers OK with nothing matched and nothing pulled",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  auto c = ConnectTo(d);
  REQUIRE(c->Attach(SmallAttach("prefetcher")).ok());
  const flexkv::OpResult r = Run(*c, c->Prefetch(Keys(2, 6)));  // no KV buffers needed: it copies nothing of ours
  INFO(r.status.ToString());
  CHECK(r.status.ok());
  CHECK(r.matched_blocks == 0);
  CHECK(r.done_blocks == 0);
  CHECK(r.bytes == 0);
  CHECK(r.source.empty());
}

TEST_CASE("Prefetch of an all-zero key ends with INVALID_ARGUMENT, of no keys or when not attached is refused unsent",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  auto c = ConnectTo(d);
  auto unattached = c->Prefetch(Keys(3, 2));
  REQUIRE_FALSE(unattached.ok());
  CHECK(unattached.status().code() == StatusCode::kFailedPrecondition);
  REQUIRE(c->Attach(SmallAttach("prefetcher")).ok());

  auto empty = c->Prefetch({});
  REQUIRE_FALSE(empty.ok());
  CHECK(empty.status().code() == StatusCode::kInvalidArgument);

  std::vector<flexkv::BlockKey> keys = Keys(3, 4);
  keys[2] = flexkv::BlockKey{};
  const flexkv::OpResult r = Run(*c, c->Prefetch(keys));
  INFO(r.status.ToString());
  CHECK(r.status.code() == StatusCode::kInvalidArgument);
  CHECK(r.done_blocks == 0);
  CHECK(r.bytes == 0);
  CHECK(r.source.empty());  // a failed request's message is its status's, never a source

  // The session still serves.
  CHECK(Run(*c, c->Match(Keys(3, 4))).status.ok());
}
