// TierSet: the daemon's cache tiers below DRAM (cache_tier.h), in the order they were added (the order matches ask
// them in, and the order they are started; they are stopped in reverse). Built once at start in daemon.cc, one line
// per tier, then shared read-only with the parts that use tiers: the data plane and the control service (the lookup
// path, Prefetch, namespace owners), GetStatus, the metrics and the KV event stream. Each asks only the tiers that
// declared the capability it needs.
#pragma once

#include <sys/types.h>

#include <functional>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "daemon/tiers/cache_tier.h"
#include "flexkv/status.h"

namespace flexkv {

class TierSet {
 public:
  TierSet() = default;
  ~TierSet();  // StopAll()
  TierSet(const TierSet&) = delete;
  TierSet& operator=(const TierSet&) = delete;

  // Adds a tier created by its Create (a failed creation is returned as is: the daemon does not start). Refused
  // (INVALID_ARGUMENT) for a second tier of the same name and for a second tier that pulls on prefetch (a prefetch has
  // one source); call before StartAll.
  template <typename Tier>
  Status Add(Result<std::unique_ptr<Tier>> tier) {
    if (!tier.ok()) return tier.status();
    return Add(std::unique_ptr<CacheTier>(std::move(*tier)));
  }
  Status Add(std::unique_ptr<CacheTier> tier);

  // Start every tier in order / stop every tier in reverse order (each Stop ends the requests that tier took).
  void StartAll();
  void StopAll();

  bool empty() const { return tiers_.empty(); }
  const std::vector<std::unique_ptr<CacheTier>>& tiers() const { return tiers_; }
  CacheTier* Find(std::string_view name) const;
  // Every tier that declared `has` (a member of TierCapabilities), in order.
  std::vector<CacheTier*> With(bool TierCapabilities::*has) const;
  // The tier a Prefetch pulls from (pulls_on_prefetch), or nullptr.
  CacheTier* puller() const { return puller_; }

  // The owner a tier with checks_owner recorded for `model_namespace` (the first that has one), else nullopt.
  std::optional<uid_t> RecordedOwner(std::string_view model_namespace) const;
  // Every tier's part of GetStatus, in order.
  void ReportStatus(v1::GetStatusResponse* status) const;
  // Every tier's metric families.
  void CollectMetrics(MetricFamilies* out) const;

 private:
  std::vector<std::unique_ptr<CacheTier>> tiers_;
  CacheTier* puller_ = nullptr;
  bool stopped_ = false;
};

}  // namespace flexkv
