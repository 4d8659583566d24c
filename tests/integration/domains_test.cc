// Several cache domains in one daemon (issue 14, acceptance 4): a Llama-like full-attention domain and a
// gpt-oss-like hybrid domain served at once by one flexkvd, two engine processes each (one stores, the other
// matches, loads and compares the bytes); neither sees the other's blocks; GetStatus lists both; one is dropped
// while the other's sessions keep working; both come back warm after SIGTERM and after kill -9.
#include <fmt/format.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <stdlib.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "flexkv/client.h"
#include "flexkv/v1/control.grpc.pb.h"
#include "tests/support/process.h"

using namespace std::chrono_literals;
using flexkv::testing::ChildProcess;
using flexkv::testing::DaemonUnderTest;
using flexkv::testing::TestClientPath;

namespace {

constexpr char kLlama[] = "llama";
constexpr char kGptOss[] = "gpt-oss";

// Llama's shape scaled down (2 layers, 2 KV heads x 64, bf16: 16 KiB blocks), and gpt-oss's: the same full-attention
// layers plus 2 sliding-window layers of a 64-token (4-block) window.
const std::vector<std::string> kLlamaLike = {"--layers", "2", "--heads", "2", "--head-dim", "64"};
const std::vector<std::string> kGptOssLike = {"--layers", "2", "--heads", "2", "--head-dim", "64",
                                              "--swa-layers", "2", "--window-tokens", "64"};

flexkv::Geometry LlamaLike() {
  flexkv::Geometry g = flexkv::Llama3_8B();
  g.num_layers = 2;
  g.kv_heads_per_rank = 2;
  g.head_dim = 64;
  return g;
}

flexkv::Geometry GptOssLike() {
  flexkv::Geometry g = LlamaLike();
  flexkv::ComponentSpec swa;
  swa.kind = flexkv::ComponentKind::kSlidingWindow;
  swa.num_layers = 2;
  swa.kv_planes = g.kv_planes;
  swa.kv_heads_per_rank = g.kv_heads_per_rank;
  swa.head_dim = g.head_dim;
  swa.dtype_bytes = g.dtype_bytes;
  swa.window_tokens = 64;
  g.components.push_back(swa);
  return g;
}

// An engine process (flexkv-test-client) of namespace `ns`.
ChildProcess Engine(const DaemonUnderTest& d, const std::string& ns, const std::string& name,
                    const std::vector<std::string>& steps) {
  std::vector<std::string> argv = {TestClientPath(), "--socket", d.socket(), "--name", name, "--namespace", ns,
                                   "--kv-blocks", "64"};
  const auto& geometry = ns == kLlama ? kLlamaLike : kGptOssLike;
  argv.insert(argv.end(), geometry.begin(), geometry.end());
  for (const auto& s : steps) {
    argv.push_back("--do");
    argv.push_back(s);
  }
  return ChildProcess::Spawn(argv);
}

// The engine's lines after ATTACHED, once it exits.
std::vector<std::string> Run(ChildProcess p) {
  std::vector<std::string> out;
  while (auto line = p.ReadLine(30s)) {
    if (line->rfind("ATTACHED", 0) != 0) out.push_back(*line);
  }
  return out;
}

// A Load's line when the whole prefix of n blocks hit and its bytes equal what the other process stored.
std::string Hit(const std::string& ns, int n) {
  return ns == kLlama ? fmt::format("LOADED {} {} 1 OK", n, n) : fmt::format("LOADED {} {} 1 OK 1", n, n);
}

std::unique_ptr<flexkv::v1::Control::Stub> Stub(const DaemonUnderTest& d) {
  return flexkv::v1::Control::NewStub(grpc::CreateChannel("unix:" + d.socket(), grpc::InsecureChannelCredentials()));
}

flexkv::v1::GetStatusResponse Status(const DaemonUnderTest& d) {
  grpc::ClientContext ctx;
  flexkv::v1::GetStatusResponse status;
  REQUIRE(Stub(d)->GetStatus(&ctx, flexkv::v1::GetStatusRequest(), &status).ok());
  return status;
}

// GetStatus once the blocks restored at start are verified (served from then on).
flexkv::v1::GetStatusResponse VerifiedStatus(const DaemonUnderTest& d) {
  for (int i = 0; i < 600; ++i) {
    flexkv::v1::GetStatusResponse s = Status(d);
    if (s.pool().unverified_blocks() == 0) return s;
    std::this_thread::sleep_for(50ms);
  }
  FAIL("the restored blocks were not verified within 30 s");
  return {};
}

const flexkv::v1::DomainStatus* DomainOf(const flexkv::v1::GetStatusResponse& s, const std::string& ns) {
  for (const auto& d : s.domains()) {
    if (d.model_namespace() == ns) return &d;
  }
  return nullptr;
}

grpc::Status DropDomain(const DaemonUnderTest& d, const std::string& ns, flexkv::v1::DropDomainResponse* response) {
  grpc::ClientContext ctx;
  flexkv::v1::DropDomainRequest request;
  request.set_model_namespace(ns);
  return Stub(d)->DropDomain(&ctx, request, response);
}

// The test client's tokens of SEED (tests/support/test_client.cc), for keys computed here.
std::vector<int32_t> Tokens(uint64_t seed, uint32_t blocks, uint32_t tokens_per_block) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(uint64_t{blocks} * tokens_per_block);
  for (auto& x : t) x = static_cast<int32_t>(rng() % 128000);
  return t;
}

// Blocks of `keys` a session of `ns` finds cached (the ring Match and the unary one agree).
uint32_t MatchIn(const DaemonUnderTest& d, const std::string& ns, const std::vector<flexkv::BlockKey>& keys) {
  auto c = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
  REQUIRE(c.ok());
  flexkv::AttachOptions options;
  options.client_name = "matcher";
  options.model_namespace = ns;
  options.geometry = ns == kLlama ? LlamaLike() : GptOssLike();
  auto session = (*c)->Attach(options);
  INFO(session.status().ToString());
  REQUIRE(session.ok());
  auto ticket = (*c)->Match(keys);
  REQUIRE(ticket.ok());
  auto matched = (*c)->Wait(*ticket, 10s);
  REQUIRE(matched.ok());
  REQUIRE(matched->status.ok());
  auto unary = (*c)->MatchViaControl(keys);
  REQUIRE(unary.ok());
  CHECK(*unary == matched->matched_blocks);
  REQUIRE((*c)->Detach().ok());
  return matched->matched_blocks;
}

// Both domains stored and loaded by two processes each; checks GetStatus. `llama_limit`: its pool_size (0: none).
void StoreAndLoadInBoth(const DaemonUnderTest& d, uint64_t llama_budget, uint64_t llama_limit) {
  // Domain B first misses what A stored (different domains, and so different blocks), then gets its own.
  CHECK(Run(Engine(d, kLlama, "llama-writer", {"store:7:16"})) == std::vector<std::string>{"STORED 0 16 OK"});
  CHECK(Run(Engine(d, kGptOss, "gpt-oss-reader", {"load:7:16"})) ==
        std::vector<std::string>{"LOADED 0 0 1 OK 1"});
  CHECK(Run(Engine(d, kGptOss, "gpt-oss-writer", {"store:7:16"})) == std::vector<std::string>{"STORED 0 16 OK"});
  CHECK(Run(Engine(d, kLlama, "llama-reader", {"load:7:16"})) == std::vector<std::string>{Hit(kLlama, 16)});
  CHECK(Run(Engine(d, kGptOss, "gpt-oss-reader", {"load:7:16"})) == std::vector<std::string>{Hit(kGptOss, 16)});

  // The very keys stored in the llama domain are a miss for a session of the gpt-oss domain.
  const std::vector<flexkv::BlockKey> keys = flexkv::ComputeBlockKeys(kLlama, Tokens(7, 16, 16), 16);
  CHECK(MatchIn(d, kLlama, keys) == 16);
  CHECK(MatchIn(d, kGptOss, keys) == 0);

  const flexkv::v1::GetStatusResponse s = Status(d);
  INFO(s.DebugString());
  REQUIRE(s.domains_size() == 2);
  CHECK(s.domains(0).model_namespace() == kLlama);  // in the order they were created
  CHECK(s.domains(1).model_namespace() == kGptOss);
  CHECK(s.model_namespace().empty());  // only while exactly one domain exists
  CHECK_FALSE(s.has_geometry());
  const flexkv::v1::DomainStatus* llama = DomainOf(s, kLlama);
  const flexkv::v1::DomainStatus* gpt_oss = DomainOf(s, kGptOss);
  CHECK(llama->geometry().num_layers() == 2);
  CHECK(llama->geometry().components_size() == 0);
  CHECK(gpt_oss->geometry().components_size() == 1);
  // Shares: at most what the plan gave each when it was created (whole grants, rounded down), or what the daemon's
  // rebalancing moved since by demand - never more than the domain's limit, and together within the budget.
  CHECK(llama->pool().budget_bytes() <= (llama_limit != 0 ? llama_limit : 64ULL << 20));
  CHECK(llama->pool().budget_bytes() + gpt_oss->pool().budget_bytes() <= 64ULL << 20);
  CHECK(llama->pool().budget_bytes() > 0);
  CHECK(gpt_oss->pool().budget_bytes() > 0);
  if (llama_limit != 0) CHECK(llama->pool().budget_bytes() == llama_budget);  // all it may have, and no more
  CHECK(gpt_oss->pool().budget_bytes() <= 64ULL << 20);
  CHECK(llama->limit_bytes() == llama_limit);
  CHECK(gpt_oss->limit_bytes() == 0);
  CHECK(llama->pool().capacity_blocks() == llama->pool().budget_bytes() / (16 * 1024));
  CHECK(gpt_oss->pool().components_size() == 2);
  CHECK(llama->index().blocks() == 16);
  CHECK(gpt_oss->index().blocks() == 16);
  CHECK(llama->counters().hit_blocks() == 16 + 2 * 16);  // the reader's Match, then two Matches of MatchIn
  CHECK(gpt_oss->counters().hit_blocks() == 16);
  CHECK(llama->counters().store_blocks() == 16);
  CHECK(gpt_oss->counters().store_blocks() == 16);
  CHECK(llama->sessions() == 0);
  CHECK(llama->pool().backing() == d.dir() + "/pool");
  CHECK(gpt_oss->pool().backing() == d.dir() + "/pool.1");
  CHECK(s.pool().budget_bytes() == 64ULL << 20);
  CHECK(s.index().blocks() == 32);
  CHECK(s.counters().store_blocks() == 32);
}

// A fresh directory for a daemon's socket and pool files, which the caller removes.
std::string TempDir() {
  char tmpl[] = "/tmp/flexkvd-test-XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  std::filesystem::permissions(tmpl, std::filesystem::perms(0755));
  return tmpl;
}

}  // namespace

TEST_CASE("domains: a Llama and a gpt-oss domain in one daemon - both hit, neither sees the other's blocks",
          "[integration][domains]") {
  DaemonUnderTest d({"--pool-size", "64MiB", "--max-domains", "2"});
  REQUIRE(d.WaitReady());
  StoreAndLoadInBoth(d, 32ULL << 20, 0);

  // A third namespace finds no room: both domains hold blocks.
  auto c = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
  REQUIRE(c.ok());
  flexkv::AttachOptions third;
  third.model_namespace = "qwen";
  third.geometry = LlamaLike();
  auto refused = (*c)->Attach(third);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == flexkv::StatusCode::kResourceExhausted);
  CHECK_THAT(refused.status().message(), Catch::Contains("'llama' holds") && Catch::Contains("--max-domains") &&
                                             Catch::Contains("flexkvctl drop-domain"));

  // Metrics: one sample per domain.
  auto metrics = (*c)->GetMetrics();
  REQUIRE(metrics.ok());
  CHECK_THAT(*metrics, Catch::Contains("flexkv_index_blocks{namespace=\"llama\"} 16") &&
                           Catch::Contains("flexkv_index_blocks{namespace=\"gpt-oss\"} 16"));
}

TEST_CASE("domains: a namespace's pool_size from the config bounds its share, the others share the rest",
          "[integration][domains]") {
  const std::string dir = TempDir();
  {
    std::ofstream config(dir + "/flexkvd.toml");
    config << "[namespace.\"llama\"]\npool_size = \"16MiB\"\n";
  }
  {
    DaemonUnderTest d({"--pool-size", "64MiB", "--max-domains", "2", "--config", dir + "/flexkvd.toml"}, dir);
    REQUIRE(d.WaitReady());
    StoreAndLoadInBoth(d, 16ULL << 20, 16ULL << 20);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("domains: one domain is dropped while the other's sessions keep storing and loading",
          "[integration][domains]") {
  DaemonUnderTest d({"--pool-size", "64MiB", "--max-domains", "2"});
  REQUIRE(d.WaitReady());
  CHECK(Run(Engine(d, kLlama, "llama-writer", {"store:7:16"})) == std::vector<std::string>{"STORED 0 16 OK"});
  CHECK(Run(Engine(d, kGptOss, "gpt-oss-writer", {"store:7:16"})) == std::vector<std::string>{"STORED 0 16 OK"});

  // A session of each domain stays attached.
  ChildProcess llama_engine = Engine(d, kLlama, "llama-held", {"store:9:8", "hold"});
  REQUIRE(llama_engine.WaitForLine("STORED", 20s) == std::optional<std::string>("STORED 0 8 OK"));
  ChildProcess gpt_oss_engine = Engine(d, kGptOss, "gpt-oss-held", {"hold"});
  REQUIRE(gpt_oss_engine.WaitForLine("ATTACHED", 20s).has_value());

  flexkv::v1::DropDomainResponse dropped;
  // Refused while a session of that domain is attached; an empty namespace names no domain when there are two.
  grpc::Status busy = DropDomain(d, kGptOss, &dropped);
  CHECK(busy.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(busy.error_message(), Catch::Contains("1 session(s) are attached to the domain 'gpt-oss'"));
  grpc::Status which = DropDomain(d, "", &dropped);
  CHECK(which.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(which.error_message(), Catch::Contains("'llama'") && Catch::Contains("'gpt-oss'"));
  grpc::Status control = DropDomain(d, std::string("a\x01" "b"), &dropped);
  CHECK(control.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(control.error_message(), Catch::Contains("model_namespace has control character U+0001"));
  grpc::Status unknown = DropDomain(d, "qwen", &dropped);
  CHECK(unknown.error_code() == grpc::StatusCode::NOT_FOUND);
  CHECK_THAT(unknown.error_message(), Catch::Contains("'llama'") && Catch::Contains("'gpt-oss'"));
  CHECK(Status(d).domains(1).idle_s() == 0);  // a session is attached
  {
    // Scrub one domain, or every one; an unknown namespace names the domains there are.
    grpc::ClientContext ctx;
    flexkv::v1::ScrubRequest request;
    request.set_model_namespace(kLlama);
    flexkv::v1::ScrubResponse response;
    REQUIRE(Stub(d)->Scrub(&ctx, request, &response).ok());
    CHECK(response.checked_blocks() == 24);
    CHECK(response.failed_blocks() == 0);
    grpc::ClientContext all_ctx;
    REQUIRE(Stub(d)->Scrub(&all_ctx, flexkv::v1::ScrubRequest(), &response).ok());
    CHECK(response.checked_blocks() == 24 + 16 + 4);  // gpt-oss: 16 FULL blocks and a 4-block window
    grpc::ClientContext unknown_ctx;
    request.set_model_namespace("qwen");
    grpc::Status none = Stub(d)->Scrub(&unknown_ctx, request, &response);
    CHECK(none.error_code() == grpc::StatusCode::NOT_FOUND);
    CHECK_THAT(none.error_message(), Catch::Contains("'llama'") && Catch::Contains("'gpt-oss'"));
  }
  {
    grpc::ClientContext ctx;
    flexkv::v1::DropDomainRequest request;
    request.set_model_namespace(kLlama);
    request.set_min_idle_s(3600);
    flexkv::v1::DropDomainResponse response;
    grpc::Status recent = Stub(d)->DropDomain(&ctx, request, &response);
    CHECK(recent.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  }

  // The gpt-oss engine goes; its domain is dropped while the llama session stays attached and another llama engine
  // stores and loads throughout.
  std::vector<std::string> busy_steps;
  constexpr int kBusyRounds = 200;
  for (int i = 0; i < kBusyRounds; ++i) {
    busy_steps.push_back("store:" + std::to_string(100 + i) + ":4");
    busy_steps.push_back("load:" + std::to_string(100 + i) + ":4");
  }
  ChildProcess busy_engine = Engine(d, kLlama, "llama-busy", busy_steps);
  REQUIRE(busy_engine.WaitForLine("LOADED", 20s).has_value());  // under way
  gpt_oss_engine.Signal(SIGKILL);
  REQUIRE(gpt_oss_engine.Wait(5s).has_value());
  for (int i = 0; i < 200 && DomainOf(Status(d), kGptOss)->sessions() != 0; ++i) {
    std::this_thread::sleep_for(50ms);  // the daemon ends the session when it sees the process gone
  }
  REQUIRE(DomainOf(Status(d), kGptOss)->sessions() == 0);
  {
    grpc::ClientContext ctx;
    flexkv::v1::DropDomainRequest request;
    request.set_model_namespace(kGptOss);
    request.set_min_idle_s(3600);  // it had a session just now
    flexkv::v1::DropDomainResponse response;
    grpc::Status recent = Stub(d)->DropDomain(&ctx, request, &response);
    CHECK(recent.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK_THAT(recent.error_message(), Catch::Contains("min_idle_s 3600"));
  }
  grpc::Status st;
  for (int i = 0; i < 200; ++i) {  // its pins are released just after the session ends
    st = DropDomain(d, kGptOss, &dropped);
    if (st.ok() || st.error_code() != grpc::StatusCode::FAILED_PRECONDITION) break;
    std::this_thread::sleep_for(50ms);
  }
  INFO(st.error_message());
  REQUIRE(st.ok());
  CHECK(dropped.model_namespace() == kGptOss);
  CHECK(dropped.dropped_blocks() == 16);
  CHECK_FALSE(std::filesystem::exists(d.dir() + "/pool.1"));

  // Every request of the busy engine succeeded, before, during and after the drop.
  const std::vector<std::string> busy_lines = Run(std::move(busy_engine));
  REQUIRE(busy_lines.size() == 2 * kBusyRounds - 2);  // after the STORED and LOADED WaitForLine took
  for (size_t i = 0; i < busy_lines.size(); ++i) {
    INFO(i << ": " << busy_lines[i]);
    CHECK(busy_lines[i] == (i % 2 == 0 ? std::string("STORED 0 4 OK") : Hit(kLlama, 4)));
  }
  CHECK(Run(Engine(d, kLlama, "llama-reader", {"load:7:16", "load:9:8", "store:11:4", "load:11:4"})) ==
        std::vector<std::string>{Hit(kLlama, 16), Hit(kLlama, 8), "STORED 0 4 OK", Hit(kLlama, 4)});
  const flexkv::v1::GetStatusResponse s = Status(d);
  REQUIRE(s.domains_size() == 1);
  CHECK(s.model_namespace() == kLlama);
  CHECK(s.domains(0).sessions() == 1);  // llama-held
  // The freed slot takes a new gpt-oss domain, empty.
  CHECK(Run(Engine(d, kGptOss, "gpt-oss-reader", {"load:7:16"})) == std::vector<std::string>{"LOADED 0 0 1 OK 1"});
  llama_engine.Signal(SIGKILL);
  REQUIRE(llama_engine.Wait(5s).has_value());
}

TEST_CASE("domains: SIGTERM and kill -9 - a restart re-attaches both domains with their blocks",
          "[integration][domains]") {
  const std::vector<std::string> args = {"--pool-size", "64MiB", "--max-domains", "2"};
  const std::string dir = TempDir();  // kept across the daemons (one that makes its own removes it)
  {
    DaemonUnderTest d(args, dir);
    REQUIRE(d.WaitReady());
    CHECK(Run(Engine(d, kLlama, "llama-writer", {"store:7:16"})) == std::vector<std::string>{"STORED 0 16 OK"});
    CHECK(Run(Engine(d, kGptOss, "gpt-oss-writer", {"store:7:16"})) == std::vector<std::string>{"STORED 0 16 OK"});
  }  // SIGTERM
  {
    DaemonUnderTest d(args, dir);
    REQUIRE(d.WaitReady());
    const flexkv::v1::GetStatusResponse s = VerifiedStatus(d);
    INFO(s.DebugString());
    REQUIRE(s.domains_size() == 2);
    CHECK(DomainOf(s, kLlama)->index().blocks() == 16);
    CHECK(DomainOf(s, kGptOss)->index().blocks() == 16);
    CHECK(Run(Engine(d, kLlama, "llama-reader", {"load:7:16"})) == std::vector<std::string>{Hit(kLlama, 16)});
    CHECK(Run(Engine(d, kGptOss, "gpt-oss-reader", {"load:7:16", "store:8:8"})) ==
          std::vector<std::string>{Hit(kGptOss, 16), "STORED 0 8 OK"});
    d.process().Signal(SIGKILL);
    REQUIRE(d.process().Wait(5s).has_value());
  }
  {
    DaemonUnderTest d(args, dir);
    REQUIRE(d.WaitReady());
    const flexkv::v1::GetStatusResponse s = VerifiedStatus(d);
    INFO(s.DebugString());
    REQUIRE(s.domains_size() == 2);
    CHECK(DomainOf(s, kGptOss)->index().blocks() == 24);
    CHECK(Run(Engine(d, kLlama, "llama-reader", {"load:7:16"})) == std::vector<std::string>{Hit(kLlama, 16)});
    CHECK(Run(Engine(d, kGptOss, "gpt-oss-reader", {"load:7:16", "load:8:8"})) ==
          std::vector<std::string>{Hit(kGptOss, 16), Hit(kGptOss, 8)});
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("domains: the budget follows demand - a domain that stores gets the memory of one that does not",
          "[integration][domains]") {
  DaemonUnderTest d({"--pool-size", "16MiB", "--max-domains", "2"});
  REQUIRE(d.WaitReady());
  CHECK(Run(Engine(d, kGptOss, "gpt-oss-writer", {"store:7:16"})) == std::vector<std::string>{"STORED 0 16 OK"});
  CHECK(Run(Engine(d, kLlama, "llama-writer", {"store:7:16"})) == std::vector<std::string>{"STORED 0 16 OK"});
  const flexkv::v1::GetStatusResponse before = Status(d);
  REQUIRE(before.domains_size() == 2);
  const uint64_t llama_before = DomainOf(before, kLlama)->pool().budget_bytes();
  const uint64_t gpt_oss_before = DomainOf(before, kGptOss)->pool().budget_bytes();
  CHECK(llama_before <= 8ULL << 20);  // equal shares while neither had traffic when the second came

  // Only llama stores from now on, filling its pool (512 blocks of 16 KiB) and then evicting: under that pressure
  // the daemon moves memory to it (CacheSet::Rebalance, every few seconds).
  uint64_t llama_now = llama_before, gpt_oss_now = gpt_oss_before;
  uint64_t seed = 100;
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (std::chrono::steady_clock::now() < deadline && llama_now <= llama_before) {
    CHECK(Run(Engine(d, kLlama, "llama-writer", {fmt::format("store:{}:32", seed++)})) ==
          std::vector<std::string>{"STORED 0 32 OK"});
    const flexkv::v1::GetStatusResponse s = Status(d);
    llama_now = DomainOf(s, kLlama)->pool().budget_bytes();
    gpt_oss_now = DomainOf(s, kGptOss)->pool().budget_bytes();
    CHECK(llama_now + gpt_oss_now <= 16ULL << 20);
  }
  INFO("llama " << llama_before << " -> " << llama_now << ", gpt-oss " << gpt_oss_before << " -> " << gpt_oss_now);
  CHECK(llama_now > llama_before);
  CHECK(gpt_oss_now < gpt_oss_before);
  // Regression (issue 29, item 9): gpt-oss gives up only what llama grows into, so the budget stays assigned (up to
  // the rounding of each component to whole grants). Before, gpt-oss was cut to its floor at once while llama grew
  // by an eighth of the budget: a third of the budget assigned to nobody.
  CHECK(llama_now + gpt_oss_now >= (16ULL << 20) - (2ULL << 20));
  // The gpt-oss domain keeps serving what still fits in its share, or misses - never a torn hit: its engine
  // compares every byte it loads (equal = 1) and finds its other blocks untouched (the last 1).
  const std::vector<std::string> reload = Run(Engine(d, kGptOss, "gpt-oss-reader", {"load:7:16"}));
  REQUIRE(reload.size() == 1);
  CHECK_THAT(reload[0], Catch::EndsWith(" 1 OK 1"));
}

TEST_CASE("domains: a hybrid domain's window sub-pool grows under window demand and shrinks back when demand moves",
          "[integration][domains][hybrid]") {
  // 16 MiB: each sub-pool laid out for 1024 slots of 16 KiB (grants of 16); the default split gives the window one
  // grant (16 slots: 4 windows of 4 blocks) and FULL the rest.
  DaemonUnderTest d({"--pool-size", "16MiB"});
  REQUIRE(d.WaitReady());
  CHECK(Run(Engine(d, kGptOss, "gpt-oss-writer", {"store:1:4"})) == std::vector<std::string>{"STORED 0 4 OK"});
  const auto window_slots = [&] {
    const flexkv::v1::GetStatusResponse s = Status(d);
    const flexkv::v1::DomainStatus* domain = DomainOf(s, kGptOss);
    REQUIRE(domain != nullptr);
    REQUIRE(domain->pool().components_size() == 2);
    CHECK(domain->pool().components(0).capacity() * 16384 + domain->pool().components(1).capacity() * 16384 <=
          16ULL << 20);
    return domain->pool().components(1).capacity();
  };
  const uint64_t window_before = window_slots();
  CHECK(window_before == 16);

  // Window churn: every store extends a prompt by one block, so it adds one FULL block and one window entry; the
  // window sub-pool (16 slots) is full at once while FULL has room. The daemon moves memory to it (CacheSet::Rebalance
  // every few seconds, towards half and half).
  uint64_t window_now = window_before, seed = 100;
  auto deadline = std::chrono::steady_clock::now() + 90s;
  while (std::chrono::steady_clock::now() < deadline && window_now <= window_before) {
    std::vector<std::string> steps;
    for (int n = 1; n <= 16; ++n) steps.push_back(fmt::format("store:{}:{}", seed, n));
    const std::vector<std::string> out = Run(Engine(d, kGptOss, "gpt-oss-writer", steps));
    REQUIRE(out.size() == 16);
    for (const std::string& line : out) CHECK_THAT(line, Catch::StartsWith("STORED ") && Catch::EndsWith(" OK"));
    ++seed;
    window_now = window_slots();
  }
  INFO("window sub-pool " << window_before << " -> " << window_now << " slots");
  CHECK(window_now > window_before);
  uint64_t window_peak = window_now;

  // Demand moves: long prompts stored whole (64 FULL blocks, one window of 4 each) fill FULL, and the window's share
  // of what is stored falls towards a seventeenth: memory moves back to FULL. (The smoothed demand, 60 s half-life,
  // may first keep the window growing for a step or two: it shrinks from the most it reached.)
  deadline = std::chrono::steady_clock::now() + 150s;
  while (std::chrono::steady_clock::now() < deadline && window_now >= window_peak) {
    CHECK(Run(Engine(d, kGptOss, "gpt-oss-writer", {fmt::format("store:{}:64", seed++)})) ==
          std::vector<std::string>{"STORED 0 64 OK"});
    window_now = window_slots();
    window_peak = std::max(window_peak, window_now);
  }
  INFO("window sub-pool " << window_peak << " -> " << window_now << " slots");
  CHECK(window_now < window_peak);
  CHECK(window_now >= 16);  // never below one grant
  // What is still cached is served byte for byte; what was evicted is a miss, never a torn hit. (A shrink gives back
  // the sub-pool's highest slots whatever they hold, so even the last prompt's window may have gone with one.)
  CHECK(Run(Engine(d, kGptOss, "gpt-oss-writer", {fmt::format("store:{}:64", seed)})) ==
        std::vector<std::string>{"STORED 0 64 OK"});
  const std::vector<std::string> reload = Run(Engine(d, kGptOss, "gpt-oss-reader", {fmt::format("load:{}:64", seed)}));
  REQUIRE(reload.size() == 1);
  CHECK((reload[0] == Hit(kGptOss, 64) || reload[0] == Hit(kGptOss, 0)));
}
