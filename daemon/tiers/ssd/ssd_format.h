// The SSD tier's on-disk format (docs/ssd.md, "On-disk format"): one block file per --ssd-path, a file header
// sector, then fixed-size slots, each a 4 KiB header sector followed by the block's payload padded to 4 KiB.
// Pure encode/decode/verify functions: no I/O here, so the format is tested (and fuzzable) on its own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "flexkv/block_key.h"
#include "flexkv/geometry.h"

namespace flexkv {

// Bump on any change to the layout or meaning of the file header or the slot header below; a store opened on
// files of another version refuses or discards them (SsdMismatchPolicy).
// 1: first version.
inline constexpr uint32_t kSsdFormatVersion = 1;

// Every offset and length the store hands to O_DIRECT is a multiple of this (the largest logical block size of
// the drives we run on: 4Kn NVMe namespaces), and so is every buffer address it does not copy through a bounce.
inline constexpr uint64_t kSsdAlign = 4096;
// The file header and each slot's header occupy one sector of this size.
inline constexpr uint64_t kSsdHeaderSector = 4096;
// The file's name in each --ssd-path directory.
inline constexpr const char* kSsdFileName = "flexkv-ssd.blocks";

inline constexpr uint64_t SsdRoundUp(uint64_t n) { return (n + kSsdAlign - 1) / kSsdAlign * kSsdAlign; }
// Bytes a slot occupies on disk for payloads of up to `payload_capacity` bytes.
inline constexpr uint64_t SsdSlotStride(uint64_t payload_capacity) {
  return kSsdHeaderSector + SsdRoundUp(payload_capacity);
}

// The cache domain a block belongs to: which namespace, and which geometry (another geometry's bytes must never
// be served, even for the same keys). The store compares the two hashes; it does not interpret them.
struct SsdDomain {
  uint64_t namespace_hash = 0;
  uint64_t geometry_hash = 0;
  friend bool operator==(const SsdDomain&, const SsdDomain&) = default;
  // XXH3-64 of the namespace name and of Geometry::ToString(), which names every field of the geometry.
  static SsdDomain Of(const std::string& model_namespace, const Geometry& geometry);
  // The domain a release before the rank-major slot order (common/slot_order.h) wrote a geometry with sharded slots
  // under: its geometry string lacked kRankMajorSlotsTag, and its blocks hold the layer-major order. nullopt for a
  // geometry whose slots have one shard (the same bytes and the same domain in both releases).
  static std::optional<SsdDomain> OfLayerMajor(const std::string& model_namespace, const Geometry& geometry);
  std::string ToString() const;  // "ns 0123456789abcdef geometry fedcba9876543210"
};

// What names one block on SSD: its key in its domain, and its component (0: FULL attention; hybrid geometries
// have one per sliding window or state, docs/hybrid.md).
struct SsdBlockId {
  BlockKey key;
  SsdDomain domain;
  uint32_t component = 0;
  friend bool operator==(const SsdBlockId&, const SsdBlockId&) = default;
  std::string ToString() const;  // "key <hex> component <c> (<domain>)"
};

// Decoded file header (sector 0 of a block file).
struct SsdFileHeader {
  uint32_t format_version = kSsdFormatVersion;
  uint64_t file_id = 0;            // random at creation; every slot header repeats it (a reformatted file's old
                                   // slot headers then never pass for new ones)
  uint64_t payload_capacity = 0;   // largest payload a slot holds
  uint64_t slot_stride = 0;        // SsdSlotStride(payload_capacity)
  uint64_t slot_count = 0;
  uint64_t SlotOffset(uint64_t slot) const { return kSsdHeaderSector + slot * slot_stride; }
  uint64_t FileBytes() const { return kSsdHeaderSector + slot_count * slot_stride; }
};

// Decoded slot header (the first sector of a slot).
struct SsdSlotHeader {
  uint32_t format_version = kSsdFormatVersion;
  uint64_t file_id = 0;
  uint64_t slot = 0;               // the slot's index in its file: a header copied to another slot fails
  uint64_t generation = 0;         // monotonic per store: a later write of the same key wins at rebuild
  SsdBlockId id;
  BlockKey parent;                 // the key the block hangs under (zero for a prompt's first block)
  uint64_t payload_bytes = 0;
  uint64_t payload_xxh3 = 0;       // XXH3-64 of the payload's payload_bytes bytes
  uint64_t content_checksum = 0;   // the DRAM pool's BlockChecksum of the bytes (0: none given), kept for promotion
};

void EncodeFileHeader(const SsdFileHeader& h, std::span<uint8_t, kSsdHeaderSector> sector);
void EncodeSlotHeader(const SsdSlotHeader& h, std::span<uint8_t, kSsdHeaderSector> sector);

// What a sector holds, as far as the format can tell.
enum class SsdSectorKind {
  kValid,        // magic, checksum and version good: the decoded header is filled in
  kEmpty,        // no header magic (a slot never written, zeroes, or foreign bytes)
  kCorrupt,      // header magic but the header checksum fails (torn or damaged)
  kOtherVersion, // header magic and a good checksum, but another format version: *version says which
};

struct SsdDecodedFile {
  SsdSectorKind kind = SsdSectorKind::kEmpty;
  uint32_t version = 0;
  SsdFileHeader header;
};
struct SsdDecodedSlot {
  SsdSectorKind kind = SsdSectorKind::kEmpty;
  uint32_t version = 0;
  SsdSlotHeader header;
};

SsdDecodedFile DecodeFileHeader(std::span<const uint8_t, kSsdHeaderSector> sector);
SsdDecodedSlot DecodeSlotHeader(std::span<const uint8_t, kSsdHeaderSector> sector);

// XXH3-64 of a payload.
uint64_t SsdPayloadChecksum(std::span<const uint8_t> payload);

}  // namespace flexkv
