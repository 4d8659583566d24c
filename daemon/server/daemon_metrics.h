// DaemonMetrics: flexkvd's Prometheus metrics, read from the daemon's parts at each scrape — the data
// plane's request counters and latency histograms, the cache counters and pool gauges (one sample per cache domain,
// labelled with its namespace), session gauges, and the control plane's errors. The HTTP endpoint (MetricsServer)
// and the GetMetrics call serve the same families; docs/operations.md ("Metrics") lists every one.
#pragma once

#include <string>
#include <vector>

#include <prometheus/client_metric.h>
#include <prometheus/collectable.h>
#include <prometheus/metric_family.h>

#include "daemon/metrics/latency_histogram.h"
#include "daemon/metrics/request_metrics.h"

namespace flexkv {

class TierSet;
class CacheSet;
class DataPlane;
class Lifecycle;
class SessionRegistry;

// The parts metrics are read from. All outlive the DaemonMetrics.
struct MetricsSources {
  const CacheSet* caches;  // the cache domains: pool, index, cache and component families have a sample per domain
  const DataPlane* data_plane;
  const SessionRegistry* sessions;
  const Lifecycle* lifecycle;
  const ErrorCounts* control_errors;  // the control plane's answers with an error, by code
  const TierSet* tiers = nullptr;  // the tiers below DRAM: each adds its own families (flexkv_ssd_*, flexkv_cluster_*)
};

class DaemonMetrics final : public prometheus::Collectable {
 public:
  explicit DaemonMetrics(MetricsSources sources) : sources_(sources) {}

  // Thread-safe; reads atomics and takes the cache's lock briefly (as GetStatus does), never a data-plane lock.
  std::vector<prometheus::MetricFamily> Collect() const override;
  // Collect() in the text exposition format 0.0.4.
  std::string Text() const;

 private:
  MetricsSources sources_;
};

// One histogram sample (buckets in seconds, cumulative, ending with +Inf) with the given labels.
prometheus::ClientMetric HistogramSample(const LatencyHistogram::Snapshot& snapshot,
                                         std::vector<prometheus::ClientMetric::Label> labels);
// Families in the text exposition format 0.0.4 (HELP and TYPE lines, then the samples).
std::string RenderText(const std::vector<prometheus::MetricFamily>& families);

}  // namespace flexkv
