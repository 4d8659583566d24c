// Building Prometheus metric families: one sample, no labels - what a tier or another part reports about itself
// (CacheTier::CollectMetrics). DaemonMetrics renders them with the daemon's own families.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <prometheus/client_metric.h>
#include <prometheus/metric_family.h>

namespace flexkv {

using MetricFamilies = std::vector<prometheus::MetricFamily>;

inline void AddGauge(MetricFamilies* out, std::string name, std::string help, double value) {
  prometheus::ClientMetric sample;
  sample.gauge.value = value;
  out->push_back(prometheus::MetricFamily{std::move(name), std::move(help), prometheus::MetricType::Gauge, {sample}});
}

inline void AddCounter(MetricFamilies* out, std::string name, std::string help, uint64_t value) {
  prometheus::ClientMetric sample;
  sample.counter.value = static_cast<double>(value);
  out->push_back(
      prometheus::MetricFamily{std::move(name), std::move(help), prometheus::MetricType::Counter, {sample}});
}

}  // namespace flexkv
