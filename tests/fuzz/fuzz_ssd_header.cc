// Fuzz target: the SSD tier's on-disk headers (daemon/tiers/ssd/ssd_format.h), which a restarted daemon reads from
// files that may be torn, corrupted or foreign. Input byte 0 picks the mode: even = the input is a sector as read
// from disk (decoded as a file header and as a slot header); odd = header fields taken from the input are encoded,
// then bytes of the sector are flipped as the rest of the input says, and decoded. Whatever the bytes: no crash; a
// header decoded as valid re-encodes to one that decodes to the same fields; an encoded header without flips
// decodes to exactly its fields.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "daemon/tiers/ssd/ssd_format.h"

namespace {

using flexkv::kSsdHeaderSector;

[[noreturn]] void Violated(const char* what) {
  std::fprintf(stderr, "invariant violated: %s\n", what);
  std::abort();
}

bool Same(const flexkv::SsdSlotHeader& a, const flexkv::SsdSlotHeader& b) {
  return a.format_version == b.format_version && a.file_id == b.file_id && a.slot == b.slot &&
         a.generation == b.generation && a.id == b.id && a.parent == b.parent && a.payload_bytes == b.payload_bytes &&
         a.payload_xxh3 == b.payload_xxh3 && a.content_checksum == b.content_checksum;
}

bool Same(const flexkv::SsdFileHeader& a, const flexkv::SsdFileHeader& b) {
  return a.format_version == b.format_version && a.file_id == b.file_id && a.payload_capacity == b.payload_capacity &&
         a.slot_stride == b.slot_stride && a.slot_count == b.slot_count;
}

// Reads the next 8 bytes of the input as a number (zero past its end).
struct Reader {
  const uint8_t* data;
  size_t size;
  uint64_t U64() {
    uint64_t v = 0;
    const size_t n = size < 8 ? size : 8;
    std::memcpy(&v, data, n);
    data += n;
    size -= n;
    return v;
  }
};

void CheckValidRoundTrips(const uint8_t* sector) {
  const std::span<const uint8_t, kSsdHeaderSector> in(sector, kSsdHeaderSector);
  const flexkv::SsdDecodedFile file = flexkv::DecodeFileHeader(in);
  if (file.kind == flexkv::SsdSectorKind::kValid) {
    static uint8_t again[kSsdHeaderSector];
    std::memset(again, 0, sizeof(again));
    flexkv::EncodeFileHeader(file.header, std::span<uint8_t, kSsdHeaderSector>(again, kSsdHeaderSector));
    const flexkv::SsdDecodedFile back =
        flexkv::DecodeFileHeader(std::span<const uint8_t, kSsdHeaderSector>(again, kSsdHeaderSector));
    if (back.kind != flexkv::SsdSectorKind::kValid || !Same(back.header, file.header)) {
      Violated("file header round trip");
    }
  }
  const flexkv::SsdDecodedSlot slot = flexkv::DecodeSlotHeader(in);
  if (slot.kind == flexkv::SsdSectorKind::kValid) {
    static uint8_t again[kSsdHeaderSector];
    std::memset(again, 0, sizeof(again));
    flexkv::EncodeSlotHeader(slot.header, std::span<uint8_t, kSsdHeaderSector>(again, kSsdHeaderSector));
    const flexkv::SsdDecodedSlot back =
        flexkv::DecodeSlotHeader(std::span<const uint8_t, kSsdHeaderSector>(again, kSsdHeaderSector));
    if (back.kind != flexkv::SsdSectorKind::kValid || !Same(back.header, slot.header)) {
      Violated("slot header round trip");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  static uint8_t sector[kSsdHeaderSector];
  std::memset(sector, 0, sizeof(sector));
  const bool encode = (data[0] & 1) != 0;
  ++data;
  --size;
  if (!encode) {
    std::memcpy(sector, data, size < kSsdHeaderSector ? size : kSsdHeaderSector);
    CheckValidRoundTrips(sector);
    return 0;
  }
  Reader r{data, size};
  const bool slot_header = (r.U64() & 1) != 0;
  const std::span<uint8_t, kSsdHeaderSector> out(sector, kSsdHeaderSector);
  const std::span<const uint8_t, kSsdHeaderSector> in(sector, kSsdHeaderSector);
  if (slot_header) {
    flexkv::SsdSlotHeader h;
    h.file_id = r.U64();
    h.slot = r.U64();
    h.generation = r.U64();
    h.id.key = flexkv::BlockKey{r.U64(), r.U64()};
    h.id.domain = flexkv::SsdDomain{r.U64(), r.U64()};
    h.id.component = static_cast<uint32_t>(r.U64());
    h.parent = flexkv::BlockKey{r.U64(), r.U64()};
    h.payload_bytes = r.U64();
    h.payload_xxh3 = r.U64();
    h.content_checksum = r.U64();
    flexkv::EncodeSlotHeader(h, out);
    const flexkv::SsdDecodedSlot d = flexkv::DecodeSlotHeader(in);
    if (d.kind != flexkv::SsdSectorKind::kValid || !Same(d.header, h)) {
      Violated("an encoded slot header decodes to it");
    }
  } else {
    flexkv::SsdFileHeader h;
    h.file_id = r.U64();
    h.payload_capacity = r.U64();
    h.slot_stride = r.U64();
    h.slot_count = r.U64();
    flexkv::EncodeFileHeader(h, out);
    const flexkv::SsdDecodedFile d = flexkv::DecodeFileHeader(in);
    if (d.kind != flexkv::SsdSectorKind::kValid || !Same(d.header, h)) {
      Violated("an encoded file header decodes to it");
    }
  }
  // The rest: byte flips (2 bytes of offset, 1 of xor each), as a torn or damaged sector.
  while (r.size >= 3) {
    const uint16_t offset = static_cast<uint16_t>(r.data[0] | (r.data[1] << 8));
    sector[offset % kSsdHeaderSector] ^= r.data[2];
    r.data += 3;
    r.size -= 3;
  }
  CheckValidRoundTrips(sector);
  return 0;
}
