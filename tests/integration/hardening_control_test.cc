// Control-plane hardening against a real flexkvd: odd names and namespaces, the all-zero key, ListSessions for
// non-admins, malformed requests, and a second daemon on a pool whose .lock was removed.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <csignal>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <mutex>
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

std::unique_ptr<flexkv::v1::Control::Stub> Stub(const std::string& socket) {
  return flexkv::v1::Control::NewStub(grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
}

flexkv::Geometry SmallGeometry() {
  flexkv::Geometry g = flexkv::Llama3_8B();
  g.num_layers = 2;
  return g;
}

// An Attach as a client that does not use libflexkv would send it: any bytes in the names.
grpc::Status RawAttach(const std::string& socket, const std::string& client_name, const std::string& model_namespace,
                       const flexkv::Geometry& g) {
  return flexkv::testing::TryRawAttach(*Stub(socket), client_name, model_namespace, g);
}

std::unique_ptr<flexkv::Client> Connect(const DaemonUnderTest& d) {
  auto c = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
  REQUIRE(c.ok());
  return std::move(*c);
}

// Stores the first block of a short prompt under `ns` from host KV block 0, and waits for it.
void StoreOneBlock(flexkv::Client& c, const std::string& ns) {
  auto kv = c.CreateHostKv(flexkv::KvLayout::kBlockFirst, 4);
  REQUIRE(kv.ok());
  const std::vector<int32_t> tokens(SmallGeometry().tokens_per_block, 7);
  const std::vector<flexkv::BlockKey> keys = flexkv::ComputeBlockKeys(ns, tokens, SmallGeometry().tokens_per_block);
  REQUIRE(keys.size() == 1);
  const std::vector<uint32_t> ids = {0};
  auto ticket = c.Store(flexkv::BlockKeyChain(keys), ids);
  REQUIRE(ticket.ok());
  auto stored = c.Wait(*ticket, std::chrono::seconds(10));
  REQUIRE(stored.ok());
  INFO(stored->status.ToString());
  REQUIRE(stored->status.ok());
  REQUIRE(stored->done_blocks == 1);
}

}  // namespace

TEST_CASE("an Attach with a NUL in its namespace and a made-up geometry does not lock the engines out",
          "[integration][security][regression]") {
  // Before the fix the daemon accepted this Attach, and its namespace and geometry became the node's only
  // cache domain: every real engine after it got FAILED_PRECONDITION until a restart with --discard-pool.
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  flexkv::Geometry odd = SmallGeometry();
  odd.head_dim = 64;
  odd.num_layers = 3;
  const grpc::Status attacker = RawAttach(d.socket(), "x", std::string("llama\0-owned", 12), odd);
  INFO(attacker.error_message());
  CHECK(attacker.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(attacker.error_message(), Catch::Contains("model_namespace has control character U+0000 at byte offset 5"));
  const grpc::Status bad_name = RawAttach(d.socket(), "vllm\x1b[2J", "llama", odd);
  CHECK(bad_name.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(bad_name.error_message(), Catch::Contains("client_name has control character U+001B at byte offset 4"));
  // protobuf refuses a proto3 string that is not UTF-8 while parsing (CacheDomain checks again, for pool files).
  const grpc::Status not_utf8 = RawAttach(d.socket(), "x", "llama\xfe", odd);
  INFO(not_utf8.error_message());
  CHECK(not_utf8.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(not_utf8.error_message(), Catch::Contains("flexkv.v1.AttachRequest") && Catch::Contains("UTF-8"));

  auto engine = Connect(d);
  auto session = engine->Attach({"engine", 0, 0, "llama", SmallGeometry()});
  INFO(session.status().ToString());
  CHECK(session.ok());
}

TEST_CASE("a namespace survives a restart whole: all 256 bytes, non-ASCII included",
          "[integration][regression]") {
  // The pool file keeps the namespace as a C string: before the fix "a\0b" was accepted and came back as "a".
  std::string ns;
  while (ns.size() + 2 <= 256) ns += "é";  // 2 bytes each: 256 bytes of UTF-8
  REQUIRE(ns.size() == 256);
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  CHECK(RawAttach(d.socket(), "x", "a" + std::string(1, '\0') + "b", SmallGeometry()).error_code() ==
        grpc::StatusCode::INVALID_ARGUMENT);
  {  // One block stored: a domain is kept across a restart for its blocks only.
    auto c = Connect(d);
    REQUIRE(c->Attach({"engine", 0, 0, ns, SmallGeometry()}).ok());
    StoreOneBlock(*c, ns);
    REQUIRE(c->Detach().ok());
  }
  d.process().Signal(SIGTERM);
  REQUIRE(d.process().Wait(10s).has_value());
  DaemonUnderTest restarted({"--pool-size", "64MiB"}, d.dir());
  REQUIRE(restarted.WaitReady());
  auto status = Connect(restarted)->GetStatus();
  REQUIRE(status.ok());
  CHECK(status->model_namespace == ns);
  CHECK(status->index_blocks == 1);
  // A domain holding blocks still decides the geometry.
  flexkv::Geometry other = SmallGeometry();
  other.num_layers = 3;
  CHECK(RawAttach(restarted.socket(), "x", ns, other).error_code() == grpc::StatusCode::FAILED_PRECONDITION);
}

TEST_CASE("a domain without blocks does not outlive its sessions across a restart", "[integration][regression]") {
  // Before the fix one Attach with a made-up geometry fixed the domain in the pool file, and after a restart
  // every real engine still got FAILED_PRECONDITION until an operator used --discard-pool.
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  flexkv::Geometry odd = SmallGeometry();
  odd.head_dim = 64;
  REQUIRE(RawAttach(d.socket(), "squatter", "made-up", odd).ok());
  d.process().Signal(SIGTERM);
  REQUIRE(d.process().Wait(10s).has_value());
  DaemonUnderTest restarted({"--pool-size", "64MiB"}, d.dir());
  REQUIRE(restarted.WaitReady());
  auto engine = Connect(restarted);
  auto session = engine->Attach({"engine", 0, 0, "llama", SmallGeometry()});
  INFO(session.status().ToString());
  CHECK(session.ok());
  CHECK_THAT(restarted.process().Stderr(), Catch::Contains("holds no blocks"));
}

TEST_CASE("the client library refuses to store the all-zero key, naming it", "[integration][regression]") {
  // A chain holding the all-zero key matched 3 blocks before a restart and 0 after (the pool records that key
  // as a root's parent). Before the fix the Store was submitted and reported its blocks done.
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  auto c = Connect(d);
  REQUIRE(c->Attach({"engine", 0, 0, "llama", SmallGeometry()}).ok());
  auto kv = c->CreateHostKv(flexkv::KvLayout::kBlockFirst, 8);
  REQUIRE(kv.ok());
  const std::vector<flexkv::BlockKey> keys = {{1, 2}, {0, 0}, {3, 4}};
  const std::vector<uint32_t> ids = {0, 1, 2};
  auto ticket = c->Store(flexkv::BlockKeyChain(keys), ids);
  REQUIRE_FALSE(ticket.ok());
  INFO(ticket.status().ToString());
  CHECK(ticket.status().code() == flexkv::StatusCode::kInvalidArgument);
  CHECK_THAT(ticket.status().message(), Catch::Contains("key 1 of the store is all zero"));
}

TEST_CASE("ListSessions shows a non-admin caller only its own sessions", "[integration][security][regression]") {
  if (geteuid() != 0) {
    WARN("not root: cannot run flexkvctl as another uid; skipped");
    return;
  }
  // Before the fix uid 65534 saw root's engine: its client name, pid and namespace.
  DaemonUnderTest d({"--pool-size", "64MiB", "--socket-group", "nogroup"});
  REQUIRE(d.WaitReady());
  auto c = Connect(d);
  REQUIRE(c->Attach({"secret-engine", 0, 0, "customer-a", SmallGeometry()}).ok());
  const auto nobody = RunCommand({"/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                  flexkv::testing::FlexkvctlPath(), "--socket", d.socket(), "sessions", "--json"});
  INFO(nobody.output);
  REQUIRE(nobody.exit_code == 0);
  CHECK(nobody.output.find("secret-engine") == std::string::npos);
  CHECK(nobody.output.find("customer-a") == std::string::npos);
  auto admin = c->ListSessions();  // root is an admin: it sees every session
  REQUIRE(admin.ok());
  REQUIRE(admin->size() == 1);
  CHECK((*admin)[0].client_name == "secret-engine");
}

TEST_CASE("a second daemon on the same pool is refused after the .lock file was removed",
          "[integration][regression]") {
  // Before the fix the lock lived only in <pool>.lock: after `rm <pool>.lock` a second daemon started on the
  // same pool file and the first then served its blocks as valid.
  DaemonUnderTest first({"--pool-size", "64MiB"});
  REQUIRE(first.WaitReady());
  auto c = Connect(first);
  REQUIRE(c->Attach({"engine", 0, 0, "llama", SmallGeometry()}).ok());  // creates the pool file
  const std::string pool = first.dir() + "/pool";
  REQUIRE(std::filesystem::exists(pool));
  REQUIRE(std::filesystem::remove(pool + ".lock"));
  const std::string other_dir = first.dir() + "/second";
  std::filesystem::create_directory(other_dir);
  const auto second = RunCommand({flexkv::testing::FlexkvdPath(), "--socket", other_dir + "/flexkvd.sock", "--pool-path",
                                  pool, "--pool-size", "64MiB"},
                                 10s);
  INFO(second.output);
  CHECK(second.exit_code == 1);  // refused at start (on the old code it served until killed)
  CHECK_THAT(second.output, Catch::Contains("pid " + std::to_string(first.process().pid())));
  CHECK_THAT(second.output, Catch::Contains(pool));
  auto status = c->GetStatus();  // the first daemon keeps serving its pool
  REQUIRE(status.ok());
  CHECK(status->pool.capacity_blocks > 0);
}

TEST_CASE("a request that is not valid protobuf gets INVALID_ARGUMENT naming the message type",
          "[integration][regression]") {
  // Before the fix gRPC answered INTERNAL with an empty message.
  DaemonUnderTest d;
  REQUIRE(d.WaitReady());
  auto channel = grpc::CreateChannel("unix:" + d.socket(), grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  const auto call = [&](const std::string& method, const std::string& bytes) {
    grpc::Slice slice(bytes);
    grpc::ByteBuffer request(&slice, 1), response;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 10s);
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    grpc::Status status;
    stub.UnaryCall(&ctx, method, grpc::StubOptions(), &request, &response, [&](grpc::Status s) {
      std::lock_guard lock(mu);
      status = std::move(s);
      done = true;
      cv.notify_one();
    });
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return done; });
    return status;
  };
  // Field 1 (client_name) as a length-delimited string 100 bytes long, with 3 bytes present: truncated.
  const grpc::Status attach = call("/flexkv.v1.Control/Attach", std::string("\x0a\x64" "abc", 5));
  INFO(attach.error_message());
  CHECK(attach.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(attach.error_message(), Catch::Contains("request could not be parsed as flexkv.v1.AttachRequest"));
  const grpc::Status match = call("/flexkv.v1.Control/Match", std::string("\xff\xff\xff", 3));
  INFO(match.error_message());
  CHECK(match.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(match.error_message(), Catch::Contains("flexkv.v1.MatchRequest"));
  // A well-formed request still works.
  flexkv::v1::GetStatusRequest empty;
  const grpc::Status ok = call("/flexkv.v1.Control/GetStatus", empty.SerializeAsString());
  CHECK(ok.ok());
}
