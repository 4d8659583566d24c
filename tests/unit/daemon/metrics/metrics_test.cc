// Metrics: histogram buckets, error counts, the text exposition, --metrics-listen parsing, and that
// docs/operations.md lists exactly the metrics the daemon exports.
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/ring_layout.h"
#include "daemon/cache/cache.h"
#include "daemon/cache/cache_set.h"
#include "daemon/dataplane/data_plane.h"
#include "daemon/lifecycle/lifecycle.h"
#include "daemon/server/daemon_metrics.h"
#include "daemon/metrics/latency_histogram.h"
#include "daemon/metrics/listen_address.h"
#include "daemon/metrics/request_metrics.h"
#include "daemon/sessions/session_registry.h"
#include "daemon/tiers/cluster/cluster_tier.h"
#include "daemon/tiers/ssd/ssd_tier.h"
#include "daemon/tiers/tier_set.h"

using flexkv::ErrorCounts;
using flexkv::LatencyHistogram;
using flexkv::StatusCode;

namespace {

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

bool HasLine(const std::string& text, const std::string& line) {
  for (const auto& l : Lines(text)) {
    if (l == line) return true;
  }
  return false;
}

std::string TypeName(prometheus::MetricType type) {
  switch (type) {
    case prometheus::MetricType::Counter: return "counter";
    case prometheus::MetricType::Gauge: return "gauge";
    case prometheus::MetricType::Histogram: return "histogram";
    case prometheus::MetricType::Summary: return "summary";
    default: return "untyped";
  }
}

}  // namespace

TEST_CASE("histogram: an observation equal to a bound counts in that bound's bucket", "[unit]") {
  LatencyHistogram h;
  h.Observe(1'000);  // exactly le="1e-06"
  h.Observe(1'001);  // just above: the next bucket (2.5 µs)
  h.Observe(0);
  h.Observe(-5);  // a clock read out of order counts as 0
  const auto s = h.Read();
  CHECK(s.cumulative[0] == 3);
  CHECK(s.cumulative[1] == 4);
  CHECK(s.count == 4);
  CHECK(s.cumulative.back() == 4);
  CHECK(s.sum_seconds == Approx(2'001e-9));
}

TEST_CASE("histogram: beyond the last bound only the +Inf bucket counts", "[unit]") {
  LatencyHistogram h;
  h.Observe(LatencyHistogram::kUpperBoundsNs.back());
  h.Observe(LatencyHistogram::kUpperBoundsNs.back() + 1);
  h.Observe(int64_t{3600} * 1'000'000'000);
  const auto s = h.Read();
  CHECK(s.cumulative[LatencyHistogram::kFiniteBuckets - 2] == 0);
  CHECK(s.cumulative[LatencyHistogram::kFiniteBuckets - 1] == 1);
  CHECK(s.cumulative[LatencyHistogram::kFiniteBuckets] == 3);
  CHECK(s.count == 3);
}

TEST_CASE("histogram: bounds ascend strictly and cumulative counts never decrease", "[unit]") {
  for (size_t i = 1; i < LatencyHistogram::kFiniteBuckets; ++i) {
    CHECK(LatencyHistogram::kUpperBoundsNs[i] > LatencyHistogram::kUpperBoundsNs[i - 1]);
  }
  LatencyHistogram h;
  for (int64_t ns = 1; ns < 20'000'000'000; ns = ns * 3 + 7) h.Observe(ns);
  const auto s = h.Read();
  for (size_t i = 1; i < s.cumulative.size(); ++i) CHECK(s.cumulative[i] >= s.cumulative[i - 1]);
}

TEST_CASE("histogram: concurrent observers lose no observation", "[unit]") {
  LatencyHistogram h;
  constexpr int kThreads = 4;
  constexpr int kEach = 100'000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&h, t] {
      for (int i = 0; i < kEach; ++i) h.Observe(int64_t{1'000} * (t + 1));
    });
  }
  for (auto& t : threads) t.join();
  const auto s = h.Read();
  CHECK(s.count == uint64_t{kThreads} * kEach);
  CHECK(s.sum_seconds == Approx(1e-6 * (1 + 2 + 3 + 4) * kEach));
}

TEST_CASE("error counts: by code, OK is no error, an unknown code counts as UNKNOWN", "[unit]") {
  ErrorCounts e;
  e.Add(StatusCode::kOk);
  e.Add(StatusCode::kNotFound);
  e.Add(StatusCode::kNotFound);
  e.Add(StatusCode::kUnauthenticated);
  e.Add(static_cast<StatusCode>(99));
  CHECK(e.Get(StatusCode::kOk) == 0);
  CHECK(e.Get(StatusCode::kNotFound) == 2);
  CHECK(e.Get(StatusCode::kUnauthenticated) == 1);
  CHECK(e.Get(StatusCode::kUnknown) == 1);
  CHECK(e.Total() == 4);
}

TEST_CASE("op kinds follow the ring opcodes", "[unit]") {
  using flexkv::OpKind;
  using flexkv::RingOp;
  CHECK(flexkv::OpKindOf(static_cast<uint16_t>(RingOp::kMatch)) == OpKind::kMatch);
  CHECK(flexkv::OpKindOf(static_cast<uint16_t>(RingOp::kLoad)) == OpKind::kLoad);
  CHECK(flexkv::OpKindOf(static_cast<uint16_t>(RingOp::kStore)) == OpKind::kStore);
  CHECK(flexkv::OpKindOf(static_cast<uint16_t>(RingOp::kRelease)) == OpKind::kRelease);
  CHECK(flexkv::OpKindOf(0) == OpKind::kInvalid);
  CHECK(flexkv::OpKindOf(77) == OpKind::kInvalid);
  CHECK(std::string(flexkv::OpKindName(OpKind::kStore)) == "store");
}

TEST_CASE("exposition: a histogram has HELP, TYPE, cumulative buckets in seconds, +Inf, _sum and _count", "[unit]") {
  LatencyHistogram h;
  h.Observe(800);             // 0.8 µs
  h.Observe(2'000'000);       // 2 ms
  h.Observe(30'000'000'000);  // 30 s: +Inf only
  prometheus::MetricFamily family{"test_wait_seconds", "Time waited", prometheus::MetricType::Histogram,
                                  {flexkv::HistogramSample(h.Read(), {{"op", "load"}})}};
  const std::string text = flexkv::RenderText({family});
  INFO(text);
  CHECK(HasLine(text, "# HELP test_wait_seconds Time waited"));
  CHECK(HasLine(text, "# TYPE test_wait_seconds histogram"));
  CHECK(HasLine(text, "test_wait_seconds_count{op=\"load\"} 3"));
  CHECK(HasLine(text, "test_wait_seconds_sum{op=\"load\"} 30.0020008"));
  CHECK(HasLine(text, "test_wait_seconds_bucket{op=\"load\",le=\"1e-06\"} 1"));
  CHECK(HasLine(text, "test_wait_seconds_bucket{op=\"load\",le=\"0.001\"} 1"));
  CHECK(HasLine(text, "test_wait_seconds_bucket{op=\"load\",le=\"0.0025\"} 2"));
  CHECK(HasLine(text, "test_wait_seconds_bucket{op=\"load\",le=\"10\"} 2"));
  CHECK(HasLine(text, "test_wait_seconds_bucket{op=\"load\",le=\"+Inf\"} 3"));
  // One bucket line per finite bound, plus +Inf, each once.
  size_t buckets = 0;
  for (const auto& l : Lines(text)) buckets += l.rfind("test_wait_seconds_bucket{", 0) == 0 ? 1 : 0;
  CHECK(buckets == LatencyHistogram::kFiniteBuckets + 1);
}

TEST_CASE("exposition: counters and gauges with labels", "[unit]") {
  prometheus::ClientMetric errors;
  errors.label = {{"code", "NOT_FOUND"}, {"op", "release"}};
  errors.counter.value = 2;
  prometheus::ClientMetric sessions;
  sessions.gauge.value = 3;
  const std::string text =
      flexkv::RenderText({{"test_errors_total", "Errors", prometheus::MetricType::Counter, {errors}},
                          {"test_sessions", "Sessions", prometheus::MetricType::Gauge, {sessions}}});
  INFO(text);
  CHECK(HasLine(text, "# TYPE test_errors_total counter"));
  CHECK(HasLine(text, "test_errors_total{code=\"NOT_FOUND\",op=\"release\"} 2"));
  CHECK(HasLine(text, "# TYPE test_sessions gauge"));
  CHECK(HasLine(text, "test_sessions 3"));
}

TEST_CASE("metrics listen address: numeric addresses and localhost, loopback recognised", "[unit]") {
  auto v4 = flexkv::ParseListenAddress("--metrics-listen", "127.0.0.1:9400");
  REQUIRE(v4.ok());
  CHECK(v4->host == "127.0.0.1");
  CHECK(v4->port == 9400);
  CHECK(v4->loopback);
  CHECK(v4->ToString() == "127.0.0.1:9400");

  auto local = flexkv::ParseListenAddress("--metrics-listen", "localhost:0");
  REQUIRE(local.ok());
  CHECK(local->host == "127.0.0.1");
  CHECK(local->port == 0);

  auto v6 = flexkv::ParseListenAddress("--metrics-listen", "[::1]:9400");
  REQUIRE(v6.ok());
  CHECK(v6->host == "::1");
  CHECK(v6->loopback);
  CHECK(v6->ToString() == "[::1]:9400");

  auto any = flexkv::ParseListenAddress("--metrics-listen", "0.0.0.0:9400");
  REQUIRE(any.ok());
  CHECK_FALSE(any->loopback);
  auto any6 = flexkv::ParseListenAddress("--metrics-listen", "[::]:9400");
  REQUIRE(any6.ok());
  CHECK_FALSE(any6->loopback);
  auto lan = flexkv::ParseListenAddress("--metrics-listen", "10.1.2.3:9400");
  REQUIRE(lan.ok());
  CHECK_FALSE(lan->loopback);
}

TEST_CASE("metrics listen address: a bad value names the flag, the value and the expected form", "[unit]") {
  for (const char* bad : {"9400", "127.0.0.1", "127.0.0.1:", "127.0.0.1:65536", "127.0.0.1:-1", "127.0.0.1:94x",
                          "prometheus.example:9400", ":9400", "::1:9400", "[::1:9400", "[127.0.0.1]:9400"}) {
    auto r = flexkv::ParseListenAddress("--metrics-listen", bad);
    INFO(bad);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(r.status().message(),
               Catch::Contains("--metrics-listen") && Catch::Contains(bad) && Catch::Contains("expected HOST:PORT"));
  }
}

TEST_CASE("docs/operations.md lists exactly the metrics flexkvd exports, with their types", "[unit]") {
  flexkv::CacheSet caches({.budget_bytes = 64 << 20, .pool_path = "/nonexistent/pool"});
  flexkv::Lifecycle lifecycle;
  flexkv::EngineMemoryBackends backends;
  flexkv::DataPlane data_plane(&lifecycle, &backends, {});
  flexkv::SessionRegistry sessions(1000);
  ErrorCounts control_errors;
  // An SSD tier whose store is not open yet (no pool): its families are exported all the same.
  std::string ssd_dir = "/var/tmp/flexkv-metrics-ssd-XXXXXX";
  REQUIRE(mkdtemp(ssd_dir.data()) != nullptr);
  flexkv::SsdTierOptions ssd_options;
  ssd_options.store.paths = {ssd_dir};
  ssd_options.store.size_bytes = 1 << 20;
  // Both through a TierSet, as daemon.cc builds them: each tier adds its own families.
  flexkv::TierSet tiers;
  REQUIRE(tiers.Add(flexkv::SsdTier::Create(ssd_options, &caches)).ok());
  // A cluster tier whose store is not reachable (nothing listens on 127.0.0.1:9): it keeps trying to join; its
  // families are exported all the same.
  const std::string secret = ssd_dir + "/cluster.secret";
  std::ofstream(secret) << "sixteen-or-more-bytes-of-secret\n";
  std::filesystem::permissions(secret, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  flexkv::ClusterTierOptions cluster_options;
  cluster_options.node_id = "metrics-test";
  cluster_options.etcd_endpoints = {"127.0.0.1:9"};
  cluster_options.secret_file = secret;
  cluster_options.listen_address = "127.0.0.1";
  cluster_options.transports = "tcp";
  cluster_options.max_pulls = 1;
  const flexkv::Status cluster = tiers.Add(flexkv::ClusterTier::Create(cluster_options, &caches));
  INFO(cluster.ToString());
  REQUIRE(cluster.ok());
  flexkv::DaemonMetrics metrics({&caches, &data_plane, &sessions, &lifecycle, &control_errors, &tiers});

  std::map<std::string, std::string> exported;
  for (const auto& family : metrics.Collect()) exported[family.name] = TypeName(family.type);

  std::ifstream doc(std::string(FLEXKV_SOURCE_DIR) + "/docs/operations.md");
  REQUIRE(doc.good());
  std::map<std::string, std::string> documented;
  bool in_section = false;
  const std::regex row(R"(^\| `(flexkv_[a-z_]+)` \| (counter|gauge|histogram) \|)");
  for (std::string line; std::getline(doc, line);) {
    if (line.rfind("## ", 0) == 0) in_section = line == "## Metrics";
    std::smatch m;
    if (in_section && std::regex_search(line, m, row)) documented[m[1]] = m[2];
  }
  CHECK(documented == exported);

  // A fresh daemon: histograms exist with zero counts; the error families have no samples yet.
  const std::string text = metrics.Text();
  INFO(text);
  CHECK(HasLine(text, "flexkv_request_end_to_end_seconds_count{op=\"match\"} 0"));
  CHECK(HasLine(text, "flexkv_request_wait_seconds_count{op=\"store\"} 0"));
  CHECK(HasLine(text, "flexkv_requests_total{op=\"load\"} 0"));
  CHECK(HasLine(text, "flexkv_state{state=\"serving\"} 1"));
  CHECK(HasLine(text, "# TYPE flexkv_control_errors_total counter"));
  control_errors.Add(StatusCode::kPermissionDenied);
  CHECK(HasLine(metrics.Text(), "flexkv_control_errors_total{code=\"PERMISSION_DENIED\"} 1"));
  CHECK(HasLine(text, "flexkv_ssd_up 0"));
  CHECK(HasLine(text, "flexkv_cluster_joined 0"));
  tiers.StopAll();
  std::filesystem::remove_all(ssd_dir);
}
