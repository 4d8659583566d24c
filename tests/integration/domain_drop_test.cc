// The cache domain while the daemon runs: a domain nobody uses and that holds no block gives way to the next
// Attach's, and an admin drops one that holds blocks (flexkvctl drop-domain), against a real flexkvd.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
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
  CHECK(Connect(d)->DropDomain().status().code() == flexkv::StatusCode::kFailedPrecondition);  // "other" is attached
  REQUIRE(other->Detach().ok());
  const auto again = RunCommand({flexkv::testing::FlexkvctlPath(), "--socket", d.socket(), "drop-domain"});
  CHECK(again.exit_code == 0);
  const auto none = RunCommand({flexkv::testing::FlexkvctlPath(), "--socket", d.socket(), "drop-domain"});
  CHECK(none.exit_code == 1);
  CHECK_THAT(none.output, Catch::Contains("no cache domain is set"));
}
