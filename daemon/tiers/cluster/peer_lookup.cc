// See peer_lookup.h.
#include "daemon/tiers/cluster/peer_lookup.h"

#include <fmt/format.h>

#include <cstring>

#include "common/hybrid_ids.h"

namespace flexkv {
namespace {

class Writer {
 public:
  void U32(uint32_t v) { Put(v, 4); }
  void U64(uint64_t v) { Put(v, 8); }
  void Bytes(std::string_view b) {
    U32(static_cast<uint32_t>(b.size()));
    out_.append(b);
  }
  std::string Take() { return std::move(out_); }

 private:
  void Put(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  std::string out_;
};

class Reader {
 public:
  Reader(std::string_view in, const char* what) : in_(in), what_(what) {}
  Status U32(uint32_t* v, const char* field) {
    uint64_t x = 0;
    FLEXKV_RETURN_IF_ERROR(Get(&x, 4, field));
    *v = static_cast<uint32_t>(x);
    return Status::Ok();
  }
  Status U64(uint64_t* v, const char* field) { return Get(v, 8, field); }
  Status Bytes(std::string* out, uint32_t max, const char* field) {
    uint32_t n = 0;
    FLEXKV_RETURN_IF_ERROR(U32(&n, field));
    if (n > max) {
      return Status::InvalidArgument(fmt::format("{}: {} is {} bytes; expected at most {}", what_, field, n, max));
    }
    FLEXKV_RETURN_IF_ERROR(Need(n, field));
    out->assign(in_.substr(pos_, n));
    pos_ += n;
    return Status::Ok();
  }
  // That `count` items of `bytes_each` are there (before anything is allocated for them).
  Status NeedItems(uint64_t count, uint64_t bytes_each, const char* field) {
    if (count > (in_.size() - pos_) / bytes_each) {
      return Status::InvalidArgument(fmt::format("{}: {} says {} entries of {} bytes but {} bytes are left", what_,
                                                 field, count, bytes_each, in_.size() - pos_));
    }
    return Status::Ok();
  }
  Status End() const {
    if (pos_ != in_.size()) {
      return Status::InvalidArgument(
          fmt::format("{}: {} bytes follow the end of the message; expected none", what_, in_.size() - pos_));
    }
    return Status::Ok();
  }

 private:
  Status Need(uint64_t n, const char* field) const {
    if (n > in_.size() - pos_) {
      return Status::InvalidArgument(fmt::format("{}: truncated at {} (offset {} of {} bytes)", what_, field, pos_,
                                                 in_.size()));
    }
    return Status::Ok();
  }
  Status Get(uint64_t* v, int n, const char* field) {
    FLEXKV_RETURN_IF_ERROR(Need(static_cast<uint64_t>(n), field));
    uint64_t x = 0;
    for (int i = 0; i < n; ++i) x |= uint64_t{static_cast<uint8_t>(in_[pos_ + i])} << (8 * i);
    pos_ += static_cast<size_t>(n);
    *v = x;
    return Status::Ok();
  }
  std::string_view in_;
  const char* what_;
  size_t pos_ = 0;
};

// A hybrid reply's entries (after its blocks): each of a component 1.., a position below `matched`, a region it
// carries; at most (kMaxComponents - 1) x matched of them.
Status DecodeEntries(Reader& r, uint32_t regions, PeerLookupReply* a) {
  uint32_t count = 0;
  FLEXKV_RETURN_IF_ERROR(r.U32(&count, "entry count"));
  const uint64_t most = uint64_t{a->matched} * (Geometry::kMaxComponents - 1);
  if (count > most) {
    return Status::InvalidArgument(fmt::format(
        "peer lookup reply: {} component entries for a match of {}; expected at most {}", count, a->matched, most));
  }
  FLEXKV_RETURN_IF_ERROR(r.NeedItems(count, 28, "entry count"));
  a->entries.resize(count);
  for (PeerLookupReply::Entry& e : a->entries) {
    FLEXKV_RETURN_IF_ERROR(r.U32(&e.component, "entry component"));
    if (e.component == 0 || e.component >= Geometry::kMaxComponents) {
      return Status::InvalidArgument(fmt::format(
          "peer lookup reply: an entry of component {}; expected 1..{}", e.component, Geometry::kMaxComponents - 1));
    }
    FLEXKV_RETURN_IF_ERROR(r.U32(&e.position, "entry position"));
    if (e.position >= a->matched) {
      return Status::InvalidArgument(fmt::format(
          "peer lookup reply: an entry at key {} of a match of {}; expected below it", e.position, a->matched));
    }
    FLEXKV_RETURN_IF_ERROR(r.U32(&e.where.region, "entry region"));
    if (e.where.region >= regions) {
      return Status::InvalidArgument(fmt::format("peer lookup reply: entry region {} of {} regions; expected below it",
                                                 e.where.region, regions));
    }
    FLEXKV_RETURN_IF_ERROR(r.U64(&e.where.offset, "entry offset"));
    FLEXKV_RETURN_IF_ERROR(r.U64(&e.where.checksum, "entry checksum"));
  }
  return Status::Ok();
}

}  // namespace

std::string EncodeLookupRequest(const PeerLookupRequest& request) {
  Writer w;
  w.U32(request.hybrid ? kPeerLookupHybridVersion : kPeerLookupVersion);
  w.Bytes(request.model_namespace);
  w.Bytes(request.layout);
  w.U64(request.block_bytes);
  w.U64(request.epoch);
  w.U32(request.from);
  w.U32(static_cast<uint32_t>(request.keys.size()));
  for (const BlockKey& k : request.keys) {
    w.U64(k.lo);
    w.U64(k.hi);
  }
  return w.Take();
}

Result<PeerLookupRequest> DecodeLookupRequest(std::string_view bytes) {
  Reader r(bytes, "peer lookup request");
  PeerLookupRequest q;
  uint32_t version = 0, count = 0;
  FLEXKV_RETURN_IF_ERROR(r.U32(&version, "version"));
  if (version != kPeerLookupVersion && version != kPeerLookupHybridVersion) {
    return Status::FailedPrecondition(fmt::format(
        "peer lookup version {}; this daemon speaks versions {} and {} (run one flexkvd version across the cluster)",
        version, kPeerLookupVersion, kPeerLookupHybridVersion));
  }
  q.hybrid = version == kPeerLookupHybridVersion;
  FLEXKV_RETURN_IF_ERROR(r.Bytes(&q.model_namespace, 256, "model namespace"));
  FLEXKV_RETURN_IF_ERROR(r.Bytes(&q.layout, 1024, "geometry"));
  FLEXKV_RETURN_IF_ERROR(r.U64(&q.block_bytes, "block bytes"));
  FLEXKV_RETURN_IF_ERROR(r.U64(&q.epoch, "epoch"));
  FLEXKV_RETURN_IF_ERROR(r.U32(&q.from, "from"));
  FLEXKV_RETURN_IF_ERROR(r.U32(&count, "key count"));
  if (count == 0 || count > kMaxLookupKeys) {
    return Status::InvalidArgument(
        fmt::format("peer lookup request: {} keys; expected 1..{}", count, kMaxLookupKeys));
  }
  if (q.from >= count) {
    return Status::InvalidArgument(
        fmt::format("peer lookup request: from {} is not below the {} keys; expected 0..{}", q.from, count, count - 1));
  }
  FLEXKV_RETURN_IF_ERROR(r.NeedItems(count, 16, "key count"));
  q.keys.resize(count);
  for (BlockKey& k : q.keys) {
    FLEXKV_RETURN_IF_ERROR(r.U64(&k.lo, "key"));
    FLEXKV_RETURN_IF_ERROR(r.U64(&k.hi, "key"));
  }
  FLEXKV_RETURN_IF_ERROR(r.End());
  return q;
}

std::string EncodeLookupReply(const PeerLookupReply& reply) {
  Writer w;
  w.U32(reply.hybrid ? kPeerLookupHybridVersion : kPeerLookupVersion);
  w.U32(reply.matched);
  w.U32(static_cast<uint32_t>(reply.regions.size()));
  for (const std::string& d : reply.regions) w.Bytes(d);
  w.U32(static_cast<uint32_t>(reply.blocks.size()));
  for (const PeerLookupReply::Block& b : reply.blocks) {
    w.U32(b.region);
    w.U64(b.offset);
    w.U64(b.checksum);
  }
  if (reply.hybrid) {
    w.U32(static_cast<uint32_t>(reply.entries.size()));
    for (const PeerLookupReply::Entry& e : reply.entries) {
      w.U32(e.component);
      w.U32(e.position);
      w.U32(e.where.region);
      w.U64(e.where.offset);
      w.U64(e.where.checksum);
    }
  }
  return w.Take();
}

Result<PeerLookupReply> DecodeLookupReply(std::string_view bytes, uint32_t from, size_t keys, bool hybrid) {
  Reader r(bytes, "peer lookup reply");
  PeerLookupReply a;
  uint32_t version = 0, regions = 0, blocks = 0;
  FLEXKV_RETURN_IF_ERROR(r.U32(&version, "version"));
  const uint32_t expected = hybrid ? kPeerLookupHybridVersion : kPeerLookupVersion;
  if (version != expected) {
    return Status::FailedPrecondition(fmt::format("peer lookup reply version {}; expected {} (the request's)", version,
                                                  expected));
  }
  a.hybrid = hybrid;
  FLEXKV_RETURN_IF_ERROR(r.U32(&a.matched, "matched"));
  if (a.matched > keys) {
    return Status::InvalidArgument(
        fmt::format("peer lookup reply: matched {} of {} keys asked; expected at most {}", a.matched, keys, keys));
  }
  FLEXKV_RETURN_IF_ERROR(r.U32(&regions, "region count"));
  if (regions > kMaxLookupRegions) {
    return Status::InvalidArgument(
        fmt::format("peer lookup reply: {} regions; expected at most {}", regions, kMaxLookupRegions));
  }
  FLEXKV_RETURN_IF_ERROR(r.NeedItems(regions, 4, "region count"));
  a.regions.resize(regions);
  for (std::string& d : a.regions) FLEXKV_RETURN_IF_ERROR(r.Bytes(&d, kMaxDescriptorBytes, "region descriptor"));
  FLEXKV_RETURN_IF_ERROR(r.U32(&blocks, "block count"));
  const uint64_t most = a.matched > from ? a.matched - from : 0;
  if (blocks > most) {
    return Status::InvalidArgument(fmt::format(
        "peer lookup reply: {} blocks for a match of {} from {}; expected at most {}", blocks, a.matched, from, most));
  }
  FLEXKV_RETURN_IF_ERROR(r.NeedItems(blocks, 20, "block count"));
  a.blocks.resize(blocks);
  for (PeerLookupReply::Block& b : a.blocks) {
    FLEXKV_RETURN_IF_ERROR(r.U32(&b.region, "block region"));
    if (b.region >= regions) {
      return Status::InvalidArgument(
          fmt::format("peer lookup reply: block region {} of {} regions; expected below it", b.region, regions));
    }
    FLEXKV_RETURN_IF_ERROR(r.U64(&b.offset, "block offset"));
    FLEXKV_RETURN_IF_ERROR(r.U64(&b.checksum, "block checksum"));
  }
  if (hybrid) FLEXKV_RETURN_IF_ERROR(DecodeEntries(r, regions, &a));
  FLEXKV_RETURN_IF_ERROR(r.End());
  return a;
}

Status CheckHybridReply(const PeerLookupReply& reply, const Geometry& geometry, uint32_t from) {
  const uint32_t e = reply.matched;
  if (e <= from || reply.blocks.empty()) {
    return Status::NotFound(fmt::format(
        "holds no hybrid hit past block {} (its hit ends at {}; a hit needs the window and state at its end too)", from,
        e));
  }
  if (reply.blocks.size() != e - from) {
    return Status::InvalidArgument(fmt::format("offered {} FULL blocks for its hit end {} from block {}; expected {}",
                                               reply.blocks.size(), e, from, e - from));
  }
  size_t at = 0;
  for (size_t c = 1; c < geometry.component_count(); ++c) {
    const uint64_t n = ComponentIdCount(geometry, c, /*store=*/false, e);
    for (uint64_t i = 0; i < n; ++i, ++at) {
      const uint64_t position = e - n + i;
      if (at >= reply.entries.size()) {
        return Status::InvalidArgument(fmt::format(
            "offered {} entries for its hit end {}; the hit rule needs component {} of key {} too",
            reply.entries.size(), e, c, position));
      }
      const PeerLookupReply::Entry& got = reply.entries[at];
      if (got.component != c || got.position != position) {
        return Status::InvalidArgument(fmt::format(
            "entry {} is component {} of key {}; the hit rule at {} needs component {} of key {} there", at,
            got.component, got.position, e, c, position));
      }
    }
  }
  if (at != reply.entries.size()) {
    return Status::InvalidArgument(fmt::format("offered {} entries for its hit end {}; the hit rule needs {}",
                                               reply.entries.size(), e, at));
  }
  return Status::Ok();
}

}  // namespace flexkv
