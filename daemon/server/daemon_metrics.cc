// flexkvd's metric families; see daemon_metrics.h.
#include "daemon/server/daemon_metrics.h"

#include <prometheus/text_serializer.h>

#include <limits>
#include <span>
#include <sstream>

#include "daemon/cache/cache.h"
#include "daemon/cache/cache_set.h"
#include "daemon/dataplane/data_plane.h"
#include "daemon/lifecycle/lifecycle.h"
#include "daemon/sessions/session_registry.h"
#include "daemon/tiers/tier_set.h"

namespace flexkv {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

constexpr OpKind kAllOps[] = {OpKind::kMatch,   OpKind::kLoad,     OpKind::kStore,
                              OpKind::kRelease, OpKind::kPrefetch, OpKind::kInvalid};
constexpr OpKind kRequestOps[] = {OpKind::kMatch, OpKind::kLoad, OpKind::kStore, OpKind::kRelease, OpKind::kPrefetch};
constexpr OpKind kCopyOps[] = {OpKind::kLoad, OpKind::kStore};

ClientMetric Sample(double value, std::vector<ClientMetric::Label> labels = {}) {
  ClientMetric m;
  m.label = std::move(labels);
  m.counter.value = value;
  m.gauge.value = value;
  return m;
}

MetricFamily Family(std::string name, std::string help, MetricType type, std::vector<ClientMetric> samples) {
  return MetricFamily{std::move(name), std::move(help), type, std::move(samples)};
}

MetricFamily One(std::string name, std::string help, MetricType type, uint64_t value) {
  return Family(std::move(name), std::move(help), type, {Sample(static_cast<double>(value))});
}

MetricFamily Histograms(std::string name, std::string help, const std::array<LatencyHistogram, kOpKinds>& by_op,
                        std::span<const OpKind> ops) {
  std::vector<ClientMetric> samples;
  for (const OpKind op : ops) samples.push_back(HistogramSample(by_op[Index(op)].Read(), {{"op", OpKindName(op)}}));
  return Family(std::move(name), std::move(help), MetricType::Histogram, std::move(samples));
}

}  // namespace

ClientMetric HistogramSample(const LatencyHistogram::Snapshot& snapshot, std::vector<ClientMetric::Label> labels) {
  ClientMetric m;
  m.label = std::move(labels);
  m.histogram.sample_count = snapshot.count;
  m.histogram.sample_sum = snapshot.sum_seconds;
  for (size_t i = 0; i < LatencyHistogram::kFiniteBuckets; ++i) {
    m.histogram.bucket.push_back(
        {snapshot.cumulative[i], static_cast<double>(LatencyHistogram::kUpperBoundsNs[i]) / 1e9});
  }
  m.histogram.bucket.push_back({snapshot.count, std::numeric_limits<double>::infinity()});
  return m;
}

std::string RenderText(const std::vector<MetricFamily>& families) {
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, families);
  return out.str();
}

std::vector<MetricFamily> DaemonMetrics::Collect() const {
  // One sample per cache domain in the pool, index, cache and component families, labelled with its namespace.
  struct DomainSample {
    std::string model_namespace;
    Cache::Stats stats;
    CounterValues counters;  // since the domain was created
  };
  std::vector<DomainSample> domains;
  for (const CacheSet::Domain& d : sources_.caches->Domains()) {
    domains.push_back(DomainSample{d.model_namespace, d.cache->GetStats(), d.counters});
  }
  // A family of one value per domain.
  const auto per_domain = [&](std::string name, std::string help, MetricType type, auto value) {
    std::vector<ClientMetric> samples;
    for (const DomainSample& d : domains) {
      samples.push_back(Sample(static_cast<double>(value(d)), {{"namespace", d.model_namespace}}));
    }
    return Family(std::move(name), std::move(help), type, std::move(samples));
  };
  const RequestMetrics& requests = sources_.data_plane->metrics();
  std::vector<MetricFamily> out;

  std::vector<ClientMetric> states;
  const ServingState now = sources_.lifecycle->state();
  for (const ServingState s : {ServingState::kServing, ServingState::kDraining, ServingState::kDrained}) {
    states.push_back(Sample(s == now ? 1 : 0, {{"state", ServingStateName(s)}}));
  }
  out.push_back(Family("flexkv_state", "Serving state: 1 for the current one (serving, draining, drained)",
                       MetricType::Gauge, std::move(states)));
  out.push_back(One("flexkv_sessions", "Attached engine sessions", MetricType::Gauge, sources_.sessions->Count()));
  out.push_back(One("flexkv_inflight_requests",
                    "Loads and stores admitted and not yet finished (what a drain waits for)", MetricType::Gauge,
                    sources_.lifecycle->inflight()));
  out.push_back(per_domain("flexkv_pool_capacity_blocks", "Slots in each cache domain's host pool", MetricType::Gauge,
                           [](const DomainSample& d) { return d.stats.capacity; }));
  out.push_back(per_domain("flexkv_pool_used_blocks", "Pool slots holding a committed block or a store in progress",
                           MetricType::Gauge, [](const DomainSample& d) { return d.stats.used; }));
  out.push_back(per_domain("flexkv_pool_pinned_blocks",
                           "Pool slots pinned by a match or a load (never evicted while pinned)", MetricType::Gauge,
                           [](const DomainSample& d) { return d.stats.pinned; }));
  out.push_back(per_domain("flexkv_index_blocks", "Blocks reachable through the prefix index", MetricType::Gauge,
                           [](const DomainSample& d) { return d.stats.blocks; }));
  out.push_back(One("flexkv_pin_lapses_total",
                    "Sessions whose pins lapsed: their process stopped renewing the pin lease (--pin-lease)",
                    MetricType::Counter, sources_.data_plane->pin_lapses()));
  out.push_back(One("flexkv_pin_lapsed_blocks_total", "Blocks unpinned because their session's pin lease lapsed",
                    MetricType::Counter, sources_.data_plane->pin_lapsed_blocks()));
  out.push_back(per_domain("flexkv_pool_unverified_blocks",
                           "Blocks restored at start whose bytes are still being verified (served once they pass)",
                           MetricType::Gauge, [](const DomainSample& d) { return d.stats.unverified; }));

  std::vector<ClientMetric> taken;
  for (const OpKind op : kAllOps) {
    taken.push_back(Sample(static_cast<double>(requests.taken[Index(op)].load(std::memory_order_relaxed)),
                           {{"op", OpKindName(op)}}));
  }
  out.push_back(Family("flexkv_requests_total", "Data-plane requests taken off the submit rings, by kind",
                       MetricType::Counter, std::move(taken)));
  out.push_back(per_domain("flexkv_match_blocks_total", "Blocks looked up by Match (rings and the unary call)",
                           MetricType::Counter, [](const DomainSample& d) { return d.counters.match_blocks; }));
  out.push_back(per_domain("flexkv_hit_blocks_total", "Blocks of Match found cached (leading blocks)",
                           MetricType::Counter, [](const DomainSample& d) { return d.counters.hit_blocks; }));
  out.push_back(per_domain("flexkv_load_blocks_total", "Blocks copied from the pool into engines' KV buffers",
                           MetricType::Counter, [](const DomainSample& d) { return d.counters.load_blocks; }));
  out.push_back(per_domain("flexkv_store_blocks_total", "Blocks copied into the pool and published",
                           MetricType::Counter, [](const DomainSample& d) { return d.counters.store_blocks; }));
  out.push_back(per_domain("flexkv_evicted_blocks_total", "Blocks evicted from the pool to make room",
                           MetricType::Counter, [](const DomainSample& d) { return d.stats.evicted; }));
  out.push_back(per_domain(
      "flexkv_data_loss_blocks_total",
      "Blocks dropped because their bytes failed their content checksum (restart check or scrub)", MetricType::Counter,
      [](const DomainSample& d) { return d.counters.data_loss_blocks; }));
  out.push_back(per_domain("flexkv_load_bytes_total", "Bytes of loaded blocks", MetricType::Counter,
                           [](const DomainSample& d) { return d.counters.bytes_loaded; }));
  out.push_back(per_domain("flexkv_store_bytes_total", "Bytes of stored blocks", MetricType::Counter,
                           [](const DomainSample& d) { return d.counters.bytes_stored; }));

  std::vector<ClientMetric> request_errors;
  for (const OpKind op : kAllOps) {
    for (size_t code = 1; code < ErrorCounts::kCodes; ++code) {
      const uint64_t n = requests.errors[Index(op)].Get(static_cast<StatusCode>(code));
      if (n == 0) continue;
      request_errors.push_back(Sample(
          static_cast<double>(n), {{"code", StatusCodeName(static_cast<StatusCode>(code))}, {"op", OpKindName(op)}}));
    }
  }
  out.push_back(Family("flexkv_request_errors_total",
                       "Data-plane requests answered with an error, by kind and status code", MetricType::Counter,
                       std::move(request_errors)));
  std::vector<ClientMetric> control_errors;
  for (size_t code = 1; code < ErrorCounts::kCodes; ++code) {
    const uint64_t n = sources_.control_errors->Get(static_cast<StatusCode>(code));
    if (n != 0) {
      control_errors.push_back(
          Sample(static_cast<double>(n), {{"code", StatusCodeName(static_cast<StatusCode>(code))}}));
    }
  }
  out.push_back(Family("flexkv_control_errors_total",
                       "Control-plane (gRPC) calls answered with an error, by status code", MetricType::Counter,
                       std::move(control_errors)));

  // Hybrid geometries (docs/hybrid.md): each component's sub-pool; families without samples for a full-attention
  // pool.
  {
    std::vector<ClientMetric> capacity, used, pinned, evicted, unanchored;
    for (const DomainSample& d : domains) {
      for (size_t c = 0; c < d.stats.components.size(); ++c) {
        const Cache::ComponentStats& cs = d.stats.components[c];
        const std::vector<ClientMetric::Label> labels{
            {"component", std::to_string(c)}, {"kind", ComponentKindName(cs.kind)}, {"namespace", d.model_namespace}};
        capacity.push_back(Sample(static_cast<double>(cs.capacity), labels));
        used.push_back(Sample(static_cast<double>(cs.used), labels));
        pinned.push_back(Sample(static_cast<double>(cs.pinned), labels));
        evicted.push_back(Sample(static_cast<double>(cs.evicted), labels));
        unanchored.push_back(Sample(static_cast<double>(cs.unanchored), labels));
      }
    }
    out.push_back(Family("flexkv_component_capacity_slots", "Slots of each component's sub-pool (hybrid geometries)",
                         MetricType::Gauge, std::move(capacity)));
    out.push_back(Family("flexkv_component_used_slots", "Used slots of each component's sub-pool", MetricType::Gauge,
                         std::move(used)));
    out.push_back(Family("flexkv_component_pinned_slots", "Pinned slots of each component's sub-pool",
                         MetricType::Gauge, std::move(pinned)));
    out.push_back(Family("flexkv_component_evicted_total", "Entries evicted from each component's sub-pool",
                         MetricType::Counter, std::move(evicted)));
    out.push_back(Family("flexkv_component_unanchored_slots",
                         "Window or state entries whose full-attention block is gone (evicted first)",
                         MetricType::Gauge, std::move(unanchored)));
  }

  if (sources_.tiers != nullptr) sources_.tiers->CollectMetrics(&out);

  out.push_back(Histograms("flexkv_request_wait_seconds",
                           "Loads and stores: from the poller taking the request to the start of its copy",
                           requests.wait, kCopyOps));
  out.push_back(Histograms("flexkv_request_transfer_seconds", "Loads and stores: the copy between KV buffers and pool",
                           requests.transfer, kCopyOps));
  out.push_back(Histograms("flexkv_request_end_to_end_seconds",
                           "From the poller taking the request to posting its completion", requests.end_to_end,
                           kRequestOps));
  return out;
}

std::string DaemonMetrics::Text() const { return RenderText(Collect()); }

}  // namespace flexkv
