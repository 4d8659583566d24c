// See tier_set.h.
#include "daemon/tiers/tier_set.h"

#include <fmt/format.h>

#include <utility>

#include "common/log.h"

namespace flexkv {

TierSet::~TierSet() { StopAll(); }

Status TierSet::Add(std::unique_ptr<CacheTier> tier) {
  if (!tier) return Status::InvalidArgument("TierSet::Add: no tier (a null pointer)");
  if (Find(tier->name()) != nullptr) {
    return Status::InvalidArgument(fmt::format("a second tier named '{}'; expected one tier per name", tier->name()));
  }
  if (tier->capabilities().pulls_on_prefetch) {
    if (puller_ != nullptr) {
      return Status::InvalidArgument(fmt::format("tiers '{}' and '{}' both pull on prefetch; expected one", puller_->name(),
                                                 tier->name()));
    }
    puller_ = tier.get();
  }
  tiers_.push_back(std::move(tier));
  return Status::Ok();
}

void TierSet::StartAll() {
  for (const auto& tier : tiers_) tier->Start();
}

void TierSet::StopAll() {
  if (stopped_) return;
  stopped_ = true;
  for (auto it = tiers_.rbegin(); it != tiers_.rend(); ++it) (*it)->Stop();
}

CacheTier* TierSet::Find(std::string_view name) const {
  for (const auto& tier : tiers_) {
    if (tier->name() == name) return tier.get();
  }
  return nullptr;
}

std::vector<CacheTier*> TierSet::With(bool TierCapabilities::*has) const {
  std::vector<CacheTier*> out;
  for (const auto& tier : tiers_) {
    if (tier->capabilities().*has) out.push_back(tier.get());
  }
  return out;
}

std::optional<uid_t> TierSet::RecordedOwner(std::string_view model_namespace) const {
  for (const auto& tier : tiers_) {
    if (!tier->capabilities().checks_owner) continue;
    if (std::optional<uid_t> owner = tier->RecordedOwner(model_namespace)) return owner;
  }
  return std::nullopt;
}

void TierSet::ReportStatus(v1::GetStatusResponse* status) const {
  for (const auto& tier : tiers_) tier->ReportStatus(status);
}

void TierSet::CollectMetrics(MetricFamilies* out) const {
  for (const auto& tier : tiers_) tier->CollectMetrics(out);
}

}  // namespace flexkv
