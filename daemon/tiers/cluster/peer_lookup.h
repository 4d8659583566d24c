// The peer lookup: the one Call between daemons of a cluster (kPeerLookupMethod; docs/cluster.md "Peer calls").
// A puller asks the node the directory named which of its slots hold a prompt's keys; the answer gives, for each
// block from `from` on, where its bytes are (a region descriptor and an offset in it) and the content checksum the
// bytes must have. Both messages are little-endian, versioned, and parsed as untrusted input: every count and
// length is checked against the bytes there are and the limits below; a message that does not parse is
// INVALID_ARGUMENT saying what was wrong, never a crash.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "flexkv/block_key.h"
#include "flexkv/status.h"

namespace flexkv {

inline constexpr uint32_t kPeerLookupVersion = 1;
inline constexpr uint32_t kMaxLookupKeys = 65536;     // keys in one lookup (a prompt of 64K blocks)
inline constexpr uint32_t kMaxLookupRegions = 4096;   // region descriptors in one answer
inline constexpr uint32_t kMaxDescriptorBytes = 64 * 1024;

struct PeerLookupRequest {
  std::string model_namespace;  // <= 256 bytes
  // The puller's geometry (Geometry::ToString, <= 1024 bytes) and block size: a peer whose geometry for the namespace
  // differs in any field (another TP size or head split lays the same bytes out differently) answers
  // FAILED_PRECONDITION, so a block is never pulled into a pool of another layout.
  std::string layout;
  uint64_t block_bytes = 0;
  uint64_t epoch = 0;           // the owner's epoch the directory named: another epoch answers FAILED_PRECONDITION
  uint32_t from = 0;            // the first key whose block the puller wants (it holds the ones before)
  std::vector<BlockKey> keys;   // the prompt's chain from its first block (the peer matches from the root)
};

struct PeerLookupReply {
  uint32_t matched = 0;  // the peer's cached prefix of the keys
  struct Block {
    uint32_t region = 0;    // index into regions
    uint64_t offset = 0;    // of the block's first byte in that region
    uint64_t checksum = 0;  // the content checksum (common/block_checksum.h) the bytes must have
  };
  std::vector<std::string> regions;  // descriptors (UcxTransport RegisteredRegion::descriptor)
  std::vector<Block> blocks;         // for keys [from, matched), in order; fewer when the peer stopped early
};

std::string EncodeLookupRequest(const PeerLookupRequest& request);
Result<PeerLookupRequest> DecodeLookupRequest(std::string_view bytes);
std::string EncodeLookupReply(const PeerLookupReply& reply);
// `from` and `keys` are the request's: the answer must not name more blocks than it asked for.
Result<PeerLookupReply> DecodeLookupReply(std::string_view bytes, uint32_t from, size_t keys);

}  // namespace flexkv
