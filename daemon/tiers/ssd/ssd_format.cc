// See ssd_format.h. Fields are little-endian at fixed offsets (docs/ssd.md has the table); every header ends with
// the XXH3-64 of the bytes before it. The magic, the version, the header length and the trailing checksum keep
// their places in every version, so a header of another version is recognised as such rather than as corrupt.
#include "daemon/tiers/ssd/ssd_format.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <cstring>
#include <string>

#include "common/slot_order.h"

namespace flexkv {
namespace {

// The eight ASCII bytes as they appear on disk, read as a little-endian u64.
constexpr uint64_t Magic(const char (&s)[9]) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(s[i]);
  return v;
}
constexpr uint64_t kFileMagic = Magic("FKVSSDF1");  // the file header
constexpr uint64_t kSlotMagic = Magic("FKVSSDB1");  // a slot header
constexpr uint32_t kFileHeaderBytes = 64;
constexpr uint32_t kSlotHeaderBytes = 128;

template <typename T>
void Put(uint8_t* p, size_t off, T v) {
  std::memcpy(p + off, &v, sizeof(T));
}
template <typename T>
T Get(const uint8_t* p, size_t off) {
  T v;
  std::memcpy(&v, p + off, sizeof(T));
  return v;
}

void Seal(uint8_t* p, uint32_t header_bytes) {
  Put<uint64_t>(p, header_bytes - 8, XXH3_64bits(p, header_bytes - 8));
}

// The kind of the header in `p` with magic `magic`; *version set when it has a good checksum.
SsdSectorKind Check(const uint8_t* p, uint64_t magic, uint32_t expected_bytes, uint32_t* version) {
  if (Get<uint64_t>(p, 0) != magic) return SsdSectorKind::kEmpty;
  const uint32_t hb = Get<uint32_t>(p, 12);
  if (hb < 24 || hb > kSsdHeaderSector || hb % 8 != 0) return SsdSectorKind::kCorrupt;
  if (Get<uint64_t>(p, hb - 8) != XXH3_64bits(p, hb - 8)) return SsdSectorKind::kCorrupt;
  *version = Get<uint32_t>(p, 8);
  if (*version != kSsdFormatVersion) return SsdSectorKind::kOtherVersion;
  if (hb != expected_bytes) return SsdSectorKind::kCorrupt;  // this version's length is fixed
  return SsdSectorKind::kValid;
}

}  // namespace

SsdDomain SsdDomain::Of(const std::string& model_namespace, const Geometry& geometry) {
  const std::string g = geometry.ToString();
  return SsdDomain{XXH3_64bits(model_namespace.data(), model_namespace.size()), XXH3_64bits(g.data(), g.size())};
}

std::optional<SsdDomain> SsdDomain::OfLayerMajor(const std::string& model_namespace, const Geometry& geometry) {
  if (!HasShardedSlots(geometry)) return std::nullopt;
  std::string g = geometry.ToString();
  const std::string tag = kRankMajorSlotsTag;
  const size_t at = g.rfind(tag);
  if (at == std::string::npos) return std::nullopt;
  g.erase(at, tag.size());
  return SsdDomain{XXH3_64bits(model_namespace.data(), model_namespace.size()), XXH3_64bits(g.data(), g.size())};
}

std::string SsdDomain::ToString() const {
  return fmt::format("ns {:016x} geometry {:016x}", namespace_hash, geometry_hash);
}

std::string SsdBlockId::ToString() const {
  return fmt::format("key {} component {} ({})", key.ToHex(), component, domain.ToString());
}

void EncodeFileHeader(const SsdFileHeader& h, std::span<uint8_t, kSsdHeaderSector> sector) {
  uint8_t* p = sector.data();
  std::memset(p, 0, kSsdHeaderSector);
  Put<uint64_t>(p, 0, kFileMagic);
  Put<uint32_t>(p, 8, h.format_version);
  Put<uint32_t>(p, 12, kFileHeaderBytes);
  Put<uint64_t>(p, 16, h.file_id);
  Put<uint64_t>(p, 24, h.payload_capacity);
  Put<uint64_t>(p, 32, h.slot_stride);
  Put<uint64_t>(p, 40, h.slot_count);
  Seal(p, kFileHeaderBytes);
}

void EncodeSlotHeader(const SsdSlotHeader& h, std::span<uint8_t, kSsdHeaderSector> sector) {
  uint8_t* p = sector.data();
  std::memset(p, 0, kSlotHeaderBytes);  // the rest of the sector is never read
  Put<uint64_t>(p, 0, kSlotMagic);
  Put<uint32_t>(p, 8, h.format_version);
  Put<uint32_t>(p, 12, kSlotHeaderBytes);
  Put<uint64_t>(p, 16, h.file_id);
  Put<uint64_t>(p, 24, h.slot);
  Put<uint64_t>(p, 32, h.generation);
  Put<uint64_t>(p, 40, h.id.key.lo);
  Put<uint64_t>(p, 48, h.id.key.hi);
  Put<uint64_t>(p, 56, h.parent.lo);
  Put<uint64_t>(p, 64, h.parent.hi);
  Put<uint64_t>(p, 72, h.id.domain.namespace_hash);
  Put<uint64_t>(p, 80, h.id.domain.geometry_hash);
  Put<uint32_t>(p, 88, h.id.component);
  Put<uint64_t>(p, 96, h.payload_bytes);
  Put<uint64_t>(p, 104, h.payload_xxh3);
  Put<uint64_t>(p, 112, h.content_checksum);
  Seal(p, kSlotHeaderBytes);
}

SsdDecodedFile DecodeFileHeader(std::span<const uint8_t, kSsdHeaderSector> sector) {
  const uint8_t* p = sector.data();
  SsdDecodedFile d;
  d.kind = Check(p, kFileMagic, kFileHeaderBytes, &d.version);
  if (d.kind != SsdSectorKind::kValid) return d;
  d.header.format_version = d.version;
  d.header.file_id = Get<uint64_t>(p, 16);
  d.header.payload_capacity = Get<uint64_t>(p, 24);
  d.header.slot_stride = Get<uint64_t>(p, 32);
  d.header.slot_count = Get<uint64_t>(p, 40);
  return d;
}

SsdDecodedSlot DecodeSlotHeader(std::span<const uint8_t, kSsdHeaderSector> sector) {
  const uint8_t* p = sector.data();
  SsdDecodedSlot d;
  d.kind = Check(p, kSlotMagic, kSlotHeaderBytes, &d.version);
  if (d.kind != SsdSectorKind::kValid) return d;
  SsdSlotHeader& h = d.header;
  h.format_version = d.version;
  h.file_id = Get<uint64_t>(p, 16);
  h.slot = Get<uint64_t>(p, 24);
  h.generation = Get<uint64_t>(p, 32);
  h.id.key = BlockKey{Get<uint64_t>(p, 40), Get<uint64_t>(p, 48)};
  h.parent = BlockKey{Get<uint64_t>(p, 56), Get<uint64_t>(p, 64)};
  h.id.domain = SsdDomain{Get<uint64_t>(p, 72), Get<uint64_t>(p, 80)};
  h.id.component = Get<uint32_t>(p, 88);
  h.payload_bytes = Get<uint64_t>(p, 96);
  h.payload_xxh3 = Get<uint64_t>(p, 104);
  h.content_checksum = Get<uint64_t>(p, 112);
  return d;
}

uint64_t SsdPayloadChecksum(std::span<const uint8_t> payload) { return XXH3_64bits(payload.data(), payload.size()); }

}  // namespace flexkv
