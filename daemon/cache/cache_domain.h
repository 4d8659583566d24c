// CacheDomain: the one (model namespace, geometry) pair this daemon serves, fixed by the first Attach,
// and the pool size that follows from it (capacity_blocks = budget / host block bytes).
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>

#include "flexkv/geometry.h"
#include "flexkv/status.h"

namespace flexkv {

class CacheDomain {
 public:
  explicit CacheDomain(uint64_t budget_bytes) : budget_bytes_(budget_bytes) {}

  // Validates `geometry` (INVALID_ARGUMENT naming the field), then fixes the domain on first use or
  // checks it against the fixed one (FAILED_PRECONDITION naming the differing field and both values).
  Status Admit(const std::string& model_namespace, const Geometry& geometry);

  struct View {
    std::optional<Geometry> geometry;  // unset until the first Attach
    std::string model_namespace;
    uint64_t budget_bytes = 0;
    uint64_t block_bytes = 0;
    uint64_t capacity_blocks = 0;
  };
  View Snapshot() const;

 private:
  const uint64_t budget_bytes_;
  mutable std::mutex mu_;
  std::optional<Geometry> geometry_;  // guarded by mu_
  std::string namespace_;             // guarded by mu_
};

}  // namespace flexkv
