// See cache_domain.h.
#include "daemon/cache/cache_domain.h"

#include <fmt/format.h>

#include "common/units.h"

namespace flexkv {
namespace {

// The length of the UTF-8 sequence starting at `s[i]` and its code point, or 0 when the bytes there are not
// valid UTF-8 (bad lead byte, truncated or bad continuation, overlong form, surrogate, beyond U+10FFFF).
size_t DecodeUtf8(std::string_view s, size_t i, uint32_t* code_point) {
  const auto byte = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  const uint8_t lead = byte(i);
  size_t len;
  uint32_t cp;
  if (lead < 0x80) {
    *code_point = lead;
    return 1;
  } else if (lead >= 0xC2 && lead <= 0xDF) {
    len = 2, cp = lead & 0x1F;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    len = 3, cp = lead & 0x0F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    len = 4, cp = lead & 0x07;
  } else {
    return 0;
  }
  if (s.size() - i < len) return 0;
  for (size_t k = 1; k < len; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (byte(i + k) & 0x3F);
  }
  const uint32_t min_cp[] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < min_cp[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  *code_point = cp;
  return len;
}

}  // namespace

Status CheckName(std::string_view field, std::string_view value, size_t max_bytes, bool may_be_empty) {
  if ((value.empty() && !may_be_empty) || value.size() > max_bytes) {
    return Status::InvalidArgument(
        fmt::format("{} has {} bytes; expected {}..{}", field, value.size(), may_be_empty ? 0 : 1, max_bytes));
  }
  for (size_t i = 0; i < value.size();) {
    uint32_t cp = 0;
    const size_t len = DecodeUtf8(value, i, &cp);
    if (len == 0) {
      return Status::InvalidArgument(fmt::format(
          "{} is not valid UTF-8 at byte offset {} (byte 0x{:02x}); expected UTF-8 text", field, i,
          static_cast<uint8_t>(value[i])));
    }
    if (cp < 0x20 || (cp >= 0x7F && cp <= 0x9F)) {
      return Status::InvalidArgument(fmt::format(
          "{} has control character U+{:04X} at byte offset {}; expected printable UTF-8 text (no NUL, no "
          "U+0000..U+001F or U+007F..U+009F)",
          field, cp, i));
    }
    i += len;
  }
  return Status::Ok();
}

Status CacheDomain::Admit(const std::string& model_namespace, const Geometry& geometry, uid_t creator_uid) {
  FLEXKV_RETURN_IF_ERROR(CheckName("model_namespace", model_namespace, 256));
  FLEXKV_RETURN_IF_ERROR(geometry.Validate());
  MutexLock lock(&mu_);
  if (geometry.host_block_bytes() > budget_bytes_) {
    return Status::InvalidArgument(fmt::format(
        "geometry: one host block is {} but the pool budget (--pool-size) is {}; expected a block no larger "
        "than the pool",
        FormatByteSize(geometry.host_block_bytes()), FormatByteSize(budget_bytes_)));
  }
  if (!geometry_) {
    geometry_ = geometry;
    namespace_ = model_namespace;
    creator_uid_ = creator_uid;
    return Status::Ok();
  }
  if (model_namespace != namespace_) {
    return Status::FailedPrecondition(fmt::format(
        "model_namespace is '{}' but this daemon's cache domain is '{}'; one cache domain at a time (--max-domains 1: "
        "raise it to serve several)",
        model_namespace, namespace_));
  }
  return geometry.CheckSameHostLayout(*geometry_);
}

void CacheDomain::SetBudget(uint64_t budget_bytes) {
  MutexLock lock(&mu_);
  budget_bytes_ = budget_bytes;
}

void CacheDomain::Reset() {
  MutexLock lock(&mu_);
  geometry_.reset();
  namespace_.clear();
  creator_uid_ = 0;
}

CacheDomain::View CacheDomain::Snapshot() const {
  MutexLock lock(&mu_);
  View v;
  v.geometry = geometry_;
  v.model_namespace = namespace_;
  v.budget_bytes = budget_bytes_;
  if (geometry_) {
    v.block_bytes = geometry_->host_block_bytes();
    v.capacity_blocks = budget_bytes_ / v.block_bytes;
    v.creator_uid = creator_uid_;
  }
  return v;
}

}  // namespace flexkv
