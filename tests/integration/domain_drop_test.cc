// The cache domain while the daemon runs: a domain nobody uses and that holds no block gives way to the next
// Attach's, and an admin drops one that holds blocks (flexkvctl drop-domain), against a real flexkvd.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "flexkv/block_key.h"
#include "flexkv/client.h"
#include "flexkv/v1/control.grpc.pb.h"
#include "tests/support/process.h"
#include "tests/support/raw_protocol.h"

using namespace std::chrono_literals;
using flexkv::testing::DaemonUnderTest;
using flexkv::testing::RunCommand;

namespace {

flexkv::Geometry EngineGeometry() {
  flexkv::Geometry g = flexkv::Llama3_8B();
  g.num_layers = 2;
  return g;
}

flexkv::Geometry OddGeometry() {
  flexkv::Geometry g = EngineGeometry();
  g.head_dim = 64;
  g.num_layers = 3;
  return g;
}

std::unique_ptr<flexkv::Client> Connect(const DaemonUnderTest& d) {
  auto c = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
  REQUIRE(c.ok());
  return std::move(*c);
}

// Stores one block of `ns` and waits for it; returns its key.
flexkv::BlockKey StoreOneBlock(flexkv::Client& c, const std::string& ns) {
  auto kv = c.CreateHostKv(flexkv::KvLayout::kBlockFirst, 4);
  REQUIRE(kv.ok());
  const uint32_t tpb = EngineGeometry().tokens_per_block;
  const std::vector<flexkv::BlockKey> keys = flexkv::ComputeBlockKeys(ns, std::vector<int32_t>(tpb, 5), tpb);
  const std::vector<uint32_t> ids = {0};
  auto ticket = c.Store(flexkv::BlockKeyChain(keys), ids);
  REQUIRE(ticket.ok());
  auto stored = c.Wait(*ticket, 10s);
  REQUIRE(stored.ok());
  REQUIRE(stored->status.ok());
  REQUIRE(stored->done_blocks == 1);
  return keys[0];
}

// Stores two blocks of distinct bytes from KV blocks 0-1, then matches them with pin and loads them into KV
// blocks 2-3: the bytes must come back exactly (the pool's slot size is this session's geometry's).
void StoreAndLoadBack(flexkv::Client& c, const std::string& ns, const flexkv::Geometry& g) {
  auto kv = c.CreateHostKv(flexkv::KvLayout::kBlockFirst, 4);
  REQUIRE(kv.ok());
  const uint64_t block = kv->bytes / kv->num_blocks;
  for (uint64_t i = 0; i < 2 * block; ++i) kv->data[i] = static_cast<uint8_t>(i * 7 + i / block + 1);
  const std::vector<flexkv::BlockKey> keys =
      flexkv::ComputeBlockKeys(ns, std::vector<int32_t>(2 * g.tokens_per_block, 9), g.tokens_per_block);
  REQUIRE(keys.size() == 2);
  auto stored = c.Wait(*c.Store(flexkv::BlockKeyChain(keys), std::vector<uint32_t>{0, 1}), 10s);
  REQUIRE(stored.ok());
  INFO(stored->status.ToString());
  REQUIRE(stored->status.ok());
  auto hit = c.Wait(*c.Match(keys, /*pin=*/true), 10s);
  REQUIRE(hit.ok());
  REQUIRE(hit->matched_blocks == 2);
  auto loaded = c.Wait(*c.Load(hit->match_handle, std::vector<uint32_t>{2, 3}), 10s);
  REQUIRE(loaded.ok());
  INFO(loaded->status.ToString());
  REQUIRE(loaded->status.ok());
  CHECK(std::memcmp(kv->data, kv->data + 2 * block, 2 * block) == 0);
  REQUIRE(c.Wait(*c.Release(hit->match_handle), 10s).ok());
}

}  // namespace

TEST_CASE("a domain whose sessions have all gone and that holds no block gives way to the next Attach",
          "[integration][security][regression]") {
  // Before the fix one Attach with a made-up geometry fixed the node's only domain until the daemon restarted:
  // every real engine after it got FAILED_PRECONDITION, even once the squatter had left.
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  {
    auto squatter = Connect(d);
    REQUIRE(squatter->Attach({"squatter", 0, 0, "made-up", OddGeometry()}).ok());
    // While it is attached the domain is its: a different one is refused.
    auto early = Connect(d);
    CHECK(early->Attach({"engine", 0, 0, "llama", EngineGeometry()}).status().code() ==
          flexkv::StatusCode::kFailedPrecondition);
    REQUIRE(squatter->Detach().ok());
  }
  auto engine = Connect(d);
  auto session = engine->Attach({"engine", 0, 0, "llama", EngineGeometry()});
  INFO(session.status().ToString());
  REQUIRE(session.ok());
  StoreOneBlock(*engine, "llama");
  auto status = engine->GetStatus();
  REQUIRE(status.ok());
  CHECK(status->model_namespace == "llama");
  CHECK(status->pool.block_bytes == EngineGeometry().host_block_bytes());
  CHECK_THAT(d.process().Stderr(), Catch::Contains("had no session and no block: replaced"));
}

TEST_CASE("a domain holding blocks is kept for them until an admin drops it", "[integration][regression]") {
  DaemonUnderTest d({"--pool-size", "64MiB", "--socket-group", "nogroup"});  // uid 65534 may connect
  REQUIRE(d.WaitReady());
  {
    auto first = Connect(d);
    REQUIRE(first->Attach({"first", 0, 0, "llama", EngineGeometry()}).ok());
    StoreOneBlock(*first, "llama");
    REQUIRE(first->Detach().ok());
  }
  auto other = Connect(d);
  auto refused = other->Attach({"other", 0, 0, "mistral", OddGeometry()});
  CHECK(refused.status().code() == flexkv::StatusCode::kFailedPrecondition);

  // Refused while a session is attached, naming why.
  auto holder = Connect(d);
  REQUIRE(holder->Attach({"holder", 0, 0, "llama", EngineGeometry()}).ok());
  auto busy = holder->DropDomain();
  REQUIRE_FALSE(busy.ok());
  CHECK(busy.status().code() == flexkv::StatusCode::kFailedPrecondition);
  CHECK_THAT(busy.status().message(), Catch::Contains("1 session(s) are attached"));
  REQUIRE(holder->Detach().ok());

  if (geteuid() == 0) {  // a non-admin may not drop it
    const auto nobody = RunCommand({"/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                    flexkv::testing::FlexkvctlPath(), "--socket", d.socket(), "drop-domain"});
    CHECK(nobody.exit_code == 1);
    CHECK_THAT(nobody.output, Catch::Contains("DropDomain is an admin call"));
  }
  const auto dropped = RunCommand({flexkv::testing::FlexkvctlPath(), "--socket", d.socket(), "drop-domain", "--json"});
  INFO(dropped.output);
  REQUIRE(dropped.exit_code == 0);
  CHECK_THAT(dropped.output, Catch::Contains("\"dropped_blocks\":1"));
  CHECK_THAT(d.process().Stderr(), Catch::Contains("dropped cache domain 'llama'"));

  // The next Attach fixes the new domain, on a new pool with its block size; nothing of the old one is served.
  auto session = other->Attach({"other", 0, 0, "mistral", OddGeometry()});
  INFO(session.status().ToString());
  REQUIRE(session.ok());
  auto status = other->GetStatus();
  REQUIRE(status.ok());
  CHECK(status->model_namespace == "mistral");
  CHECK(status->pool.block_bytes == OddGeometry().host_block_bytes());
  CHECK(status->index_blocks == 0);
  // Regression: the copy path kept the dropped pool's address and slot size, so this store wrote into unmapped
  // memory (the daemon died) or over the wrong bytes.
  StoreAndLoadBack(*other, "mistral", OddGeometry());
  // Slot 0 sits at the same address in both pools, so the bytes above may round-trip even through the old
  // region: the checksums (finished with the slot size the copy path believes in) and a scrub tell.
  const auto scrub = RunCommand({flexkv::testing::FlexkvctlPath(), "--socket", d.socket(), "scrub", "--json"});
  INFO(scrub.output);
  REQUIRE(scrub.exit_code == 0);
  CHECK_THAT(scrub.output, Catch::Contains("\"checked_blocks\":2") && Catch::Contains("\"failed_blocks\":0"));
  CHECK(Connect(d)->DropDomain().status().code() == flexkv::StatusCode::kFailedPrecondition);  // "other" is attached
  REQUIRE(other->Detach().ok());
  const auto again = RunCommand({flexkv::testing::FlexkvctlPath(), "--socket", d.socket(), "drop-domain"});
  CHECK(again.exit_code == 0);
  const auto none = RunCommand({flexkv::testing::FlexkvctlPath(), "--socket", d.socket(), "drop-domain"});
  CHECK(none.exit_code == 1);
  CHECK_THAT(none.output, Catch::Contains("no cache domain is set"));
}
