// See cache_domain.h.
#include "daemon/cache/cache_domain.h"

#include <fmt/format.h>

#include "common/units.h"

namespace flexkv {

Status CacheDomain::Admit(const std::string& model_namespace, const Geometry& geometry) {
  if (model_namespace.empty() || model_namespace.size() > 256) {
    return Status::InvalidArgument(
        fmt::format("model_namespace has {} bytes; expected 1..256", model_namespace.size()));
  }
  FLEXKV_RETURN_IF_ERROR(geometry.Validate());
  if (geometry.host_block_bytes() > budget_bytes_) {
    return Status::InvalidArgument(fmt::format(
        "geometry: one host block is {} but the pool budget (--pool-size) is {}; expected a block no larger "
        "than the pool",
        FormatByteSize(geometry.host_block_bytes()), FormatByteSize(budget_bytes_)));
  }
  std::lock_guard lock(mu_);
  if (!geometry_) {
    geometry_ = geometry;
    namespace_ = model_namespace;
    return Status::Ok();
  }
  if (model_namespace != namespace_) {
    return Status::FailedPrecondition(fmt::format(
        "model_namespace is '{}' but this daemon's cache domain is '{}'; one cache domain per daemon",
        model_namespace, namespace_));
  }
  return geometry.CheckSameHostLayout(*geometry_);
}

CacheDomain::View CacheDomain::Snapshot() const {
  std::lock_guard lock(mu_);
  View v;
  v.geometry = geometry_;
  v.model_namespace = namespace_;
  v.budget_bytes = budget_bytes_;
  if (geometry_) {
    v.block_bytes = geometry_->host_block_bytes();
    v.capacity_blocks = budget_bytes_ / v.block_bytes;
  }
  return v;
}

}  // namespace flexkv
