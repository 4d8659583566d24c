// Metrics end to end: a flexkvd with --metrics-listen, scraped with curl and checked with promtool while a
// test client stores and loads; flexkvctl metrics prints the same families over the control socket.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "flexkv/v1/control.grpc.pb.h"
#include "tests/support/process.h"

using namespace std::chrono_literals;
using flexkv::testing::ChildProcess;
using flexkv::testing::DaemonUnderTest;
using flexkv::testing::FlexkvctlPath;
using flexkv::testing::FlexkvdPath;
using flexkv::testing::NowMs;
using flexkv::testing::RunCommand;
using flexkv::testing::TestClientPath;

namespace {

// `name` on $PATH, or "" when it is not installed.
std::string FindTool(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path != nullptr ? path : "/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    const std::string candidate = dir + "/" + name;
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

// The metrics port the daemon logged ("metrics on http://127.0.0.1:PORT/metrics"), or 0.
int MetricsPort(DaemonUnderTest& d) {
  const std::regex logged(R"(metrics on http://127\.0\.0\.1:(\d+)/metrics)");
  const int64_t deadline = NowMs() + 10000;
  while (NowMs() < deadline) {
    std::smatch m;
    const std::string err = d.process().Stderr();
    if (std::regex_search(err, m, logged)) return std::stoi(m[1]);
    std::this_thread::sleep_for(10ms);
  }
  return 0;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Value of the sample whose line starts with `series` (name and labels exactly as exposed); -1 if absent.
double Sample(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.size() > series.size() && line.compare(0, series.size(), series) == 0 && line[series.size()] == ' ') {
      return std::stod(line.substr(series.size() + 1));
    }
  }
  return -1;
}

// Metric family names declared by `# TYPE` lines.
std::set<std::string> Families(const std::string& text) {
  std::set<std::string> names;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("# TYPE ", 0) == 0) names.insert(line.substr(7, line.find(' ', 7) - 7));
  }
  return names;
}

struct Tools {
  std::string curl, promtool;
};

// Both tools, or a clear skip message (CI installs them through scripts/deps.sh).
std::optional<Tools> NeedTools() {
  Tools t{FindTool("curl"), FindTool("promtool")};
  if (t.curl.empty() || t.promtool.empty()) {
    WARN("SKIP: " << (t.curl.empty() ? "curl " : "") << (t.promtool.empty() ? "promtool " : "")
                  << "not installed (Debian packages curl, prometheus; scripts/deps.sh installs them)");
    return std::nullopt;
  }
  return t;
}

// Scrapes http://127.0.0.1:port/metrics into `file` with curl, checks it with promtool; returns the text.
std::string ScrapeAndCheck(const Tools& tools, int port, const std::string& file) {
  auto scraped = RunCommand({tools.curl, "-sSf", "-o", file, "http://127.0.0.1:" + std::to_string(port) + "/metrics"});
  INFO(scraped.output);
  REQUIRE(scraped.exit_code == 0);
  auto checked = RunCommand({"/bin/sh", "-c", "\"$0\" check metrics < \"$1\"", tools.promtool, file});
  INFO("promtool check metrics: " << checked.output);
  CHECK(checked.exit_code == 0);
  return ReadFile(file);
}

}  // namespace

TEST_CASE("metrics endpoint passes promtool and its histograms move when traffic flows", "[integration]") {
  auto tools = NeedTools();
  if (!tools) return;
  DaemonUnderTest d({"--pool-size", "64MiB", "--metrics-listen", "127.0.0.1:0"});
  REQUIRE(d.WaitReady());
  const int port = MetricsPort(d);
  INFO(d.process().Stderr());
  REQUIRE(port > 0);

  const std::string before = ScrapeAndCheck(*tools, port, d.dir() + "/before.prom");
  CHECK(Sample(before, R"(flexkv_state{state="serving"})") == 1);

  auto traffic = RunCommand({TestClientPath(), "--socket", d.socket(), "--layers", "2", "--kv-blocks", "16", "--do",
                             "store:7:8", "--do", "load:7:8"});
  INFO(traffic.output);
  REQUIRE(traffic.exit_code == 0);
  REQUIRE_THAT(traffic.output, Catch::Contains("STORED 0 8 OK") && Catch::Contains("LOADED 8 8 1 OK"));
  {
    // A control-plane error: the daemon refuses a Detach of session 0.
    auto stub =
        flexkv::v1::Control::NewStub(grpc::CreateChannel("unix:" + d.socket(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    flexkv::v1::DetachResponse resp;
    CHECK(stub->Detach(&ctx, flexkv::v1::DetachRequest(), &resp).error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  }

  const std::string after = ScrapeAndCheck(*tools, port, d.dir() + "/after.prom");
  INFO(after);
  // Every request kind the client ran moved its end-to-end histogram; loads and stores their wait and
  // transfer histograms too.
  for (const char* op : {"match", "load", "store", "release"}) {
    const std::string labels = std::string("{op=\"") + op + "\"}";
    INFO(op);
    CHECK(Sample(before, "flexkv_request_end_to_end_seconds_count" + labels) == 0);
    CHECK(Sample(after, "flexkv_request_end_to_end_seconds_count" + labels) >= 1);
    CHECK(Sample(after, "flexkv_request_end_to_end_seconds_sum" + labels) > 0);
    CHECK(Sample(after, "flexkv_requests_total" + labels) >= 1);
  }
  for (const char* op : {"load", "store"}) {
    const std::string labels = std::string("{op=\"") + op + "\"}";
    INFO(op);
    for (const char* h : {"flexkv_request_wait_seconds", "flexkv_request_transfer_seconds"}) {
      CHECK(Sample(before, h + std::string("_count") + labels) == 0);
      CHECK(Sample(after, h + std::string("_count") + labels) == 1);
      CHECK(Sample(after, h + std::string("_bucket{op=\"") + op + "\",le=\"+Inf\"}") == 1);
    }
  }
  CHECK(Sample(after, R"(flexkv_store_blocks_total{namespace="test-model"})") == 8);
  CHECK(Sample(after, R"(flexkv_load_blocks_total{namespace="test-model"})") == 8);
  CHECK(Sample(after, R"(flexkv_hit_blocks_total{namespace="test-model"})") == 8);
  CHECK(Sample(after, R"(flexkv_store_bytes_total{namespace="test-model"})") > 0);
  CHECK(Sample(after, R"(flexkv_pool_used_blocks{namespace="test-model"})") == 8);
  CHECK(Sample(after, R"(flexkv_pool_capacity_blocks{namespace="test-model"})") > 0);
  CHECK(Sample(after, R"(flexkv_control_errors_total{code="INVALID_ARGUMENT"})") == 1);

  // flexkvctl metrics: the same families over the control socket (without the HTTP server's own exposer_*).
  auto ctl = RunCommand({FlexkvctlPath(), "--socket", d.socket(), "metrics"});
  REQUIRE(ctl.exit_code == 0);
  std::set<std::string> http_families;
  for (const auto& name : Families(after)) {
    if (name.rfind("exposer_", 0) != 0) http_families.insert(name);
  }
  CHECK(Families(ctl.output) == http_families);
  CHECK(http_families.count("flexkv_request_end_to_end_seconds") == 1);
  CHECK(Sample(ctl.output, R"(flexkv_request_end_to_end_seconds_count{op="store"})") ==
        Sample(after, R"(flexkv_request_end_to_end_seconds_count{op="store"})"));
  {
    std::ofstream(d.dir() + "/ctl.prom") << ctl.output;
    auto checked =
        RunCommand({"/bin/sh", "-c", "\"$0\" check metrics < \"$1\"", tools->promtool, d.dir() + "/ctl.prom"});
    INFO("promtool on flexkvctl metrics: " << checked.output);
    CHECK(checked.exit_code == 0);
  }

  // Only /metrics is served.
  auto other = RunCommand({tools->curl, "-s", "-o", "/dev/null", "-w", "%{http_code}\n",
                           "http://127.0.0.1:" + std::to_string(port) + "/other"});
  CHECK(other.output == "404\n");
}

TEST_CASE("metrics endpoint is off by default, and refuses a non-loopback address unless allowed", "[integration]") {
  {
    DaemonUnderTest d({"--pool-size", "64MiB"});
    REQUIRE(d.WaitReady());
    CHECK_THAT(d.process().Stderr(), !Catch::Contains("metrics on"));
    auto ctl = RunCommand({FlexkvctlPath(), "--socket", d.socket(), "metrics"});
    CHECK(ctl.exit_code == 0);  // the control socket serves metrics without the endpoint
    CHECK_THAT(ctl.output, Catch::Contains("# TYPE flexkv_requests_total counter"));
  }
  auto refused =
      RunCommand({FlexkvdPath(), "--socket", "/tmp/flexkvd-metrics-unused.sock", "--metrics-listen", "0.0.0.0:9400"});
  CHECK(refused.exit_code == 2);
  CHECK_THAT(refused.output, Catch::Contains("not a loopback address") && Catch::Contains("--metrics-allow-remote"));
  auto malformed =
      RunCommand({FlexkvdPath(), "--socket", "/tmp/flexkvd-metrics-unused.sock", "--metrics-listen", "9400"});
  CHECK(malformed.exit_code == 2);
  CHECK_THAT(malformed.output, Catch::Contains("expected HOST:PORT"));
}

TEST_CASE("a metrics port in use stops the daemon at start, naming the cause", "[integration]") {
  // Hold a port.
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  REQUIRE(listen(fd, 1) == 0);
  socklen_t len = sizeof(a);
  REQUIRE(getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  const std::string address = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));

  DaemonUnderTest d({"--pool-size", "64MiB", "--metrics-listen", address});
  auto status = d.process().Wait(20s);
  close(fd);
  REQUIRE(status.has_value());
  CHECK(WEXITSTATUS(*status) == 1);
  CHECK_THAT(d.process().Stderr(),
             Catch::Contains("cannot serve metrics on " + address) && Catch::Contains("Address already in use"));
}
