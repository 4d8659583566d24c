// CacheDomain: the one (model namespace, geometry) pair this daemon serves, fixed by the first Attach,
// and the pool size that follows from it (capacity_blocks = budget / host block bytes).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"
#include "flexkv/geometry.h"
#include "flexkv/status.h"

namespace flexkv {

// Checks a name a client chose (model_namespace, client_name): 1..max_bytes (0..max_bytes when `may_be_empty`)
// of valid UTF-8 without control characters (U+0000..U+001F, U+007F..U+009F). A name that breaks this is
// refused with INVALID_ARGUMENT naming `field`, the byte offset of the first bad byte and what is allowed:
// a NUL in a namespace would otherwise be cut off where the pool file stores it, and control characters
// would forge log lines and flexkvctl output.
Status CheckName(std::string_view field, std::string_view value, size_t max_bytes, bool may_be_empty = false);

class CacheDomain {
 public:
  explicit CacheDomain(uint64_t budget_bytes) : budget_bytes_(budget_bytes) {}

  // Validates `model_namespace` (CheckName, 1..256 bytes) and `geometry` (INVALID_ARGUMENT naming the field), then fixes the domain on first use or
  // checks it against the fixed one (FAILED_PRECONDITION naming the differing field and both values).
  // `creator_uid` (the attaching peer's uid, or the one a re-attached pool file records) becomes the domain's
  // creator when this call fixes the domain: without a config ACL, only it and admins may store (NamespaceAccess).
  Status Admit(const std::string& model_namespace, const Geometry& geometry, uid_t creator_uid = 0);

  struct View {
    std::optional<Geometry> geometry;  // unset until the first Attach
    std::string model_namespace;
    uint64_t budget_bytes = 0;
    uint64_t block_bytes = 0;
    uint64_t capacity_blocks = 0;
    std::optional<uid_t> creator_uid;  // unset until the first Attach
  };
  View Snapshot() const;

  // Forgets the domain: the next Admit fixes a new one. The Cache calls it when it drops its pool.
  void Reset();
  // The budget the next domain's pool gets (Cache::SetBudget, while no domain is set).
  void SetBudget(uint64_t budget_bytes);

 private:
  mutable Mutex mu_;
  uint64_t budget_bytes_ ABSL_GUARDED_BY(mu_);
  std::optional<Geometry> geometry_ ABSL_GUARDED_BY(mu_);
  std::string namespace_ ABSL_GUARDED_BY(mu_);
  uid_t creator_uid_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace flexkv
