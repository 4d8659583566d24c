// The peer lookup: the one Call between daemons of a cluster (kPeerLookupMethod; docs/cluster.md "Peer calls").
// A puller asks the node the directory named which of its slots hold a prompt's keys; the answer gives, for each
// block from `from` on, where its bytes are (a region descriptor and an offset in it) and the content checksum the
// bytes must have. Both messages are little-endian, versioned, and parsed as untrusted input: every count and
// length is checked against the bytes there are and the limits below; a message that does not parse is
// INVALID_ARGUMENT saying what was wrong, never a crash.
//
// Versions: a full-attention domain's lookup is version 1 (unchanged since the first release, so that nodes of
// both releases pull FULL blocks from each other); a hybrid domain's (docs/hybrid.md) is version 2, whose reply
// adds the window and state entries the hit rule needs. A node of the first release refuses a version-2 request
// (FAILED_PRECONDITION naming the version) and never parses one; a reply of another version than the request's is
// refused the same way.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "flexkv/block_key.h"
#include "flexkv/geometry.h"
#include "flexkv/status.h"

namespace flexkv {

inline constexpr uint32_t kPeerLookupVersion = 1;        // a full-attention domain's lookup
inline constexpr uint32_t kPeerLookupHybridVersion = 2;  // a hybrid domain's: the reply carries component entries
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
  // A hybrid domain's lookup (version 2): the peer answers with its hybrid hit end and every entry it needs.
  bool hybrid = false;
};

struct PeerLookupReply {
  // The peer's cached prefix of the keys; a hybrid reply's: the peer's hit end e (the hit rule, docs/hybrid.md).
  uint32_t matched = 0;
  struct Block {
    uint32_t region = 0;    // index into regions
    uint64_t offset = 0;    // of the block's first byte in that region
    uint64_t checksum = 0;  // the content checksum (common/block_checksum.h) the bytes must have
  };
  // A window or state entry of a hybrid reply: component `component` (1..Geometry::kMaxComponents - 1) of the key
  // keys[position] (position < matched): a window block, or the state snapshot after that key.
  struct Entry {
    uint32_t component = 0;
    uint32_t position = 0;
    Block where;
  };
  std::vector<std::string> regions;  // descriptors (UcxTransport RegisteredRegion::descriptor)
  std::vector<Block> blocks;         // for keys [from, matched), in order; fewer when the peer stopped early
  // A hybrid reply (version 2): the entries the hit rule at `matched` needs, each component's in key order, the
  // components in order (the requester checks that they are exactly those). Empty for version 1.
  bool hybrid = false;
  std::vector<Entry> entries;
};

std::string EncodeLookupRequest(const PeerLookupRequest& request);
Result<PeerLookupRequest> DecodeLookupRequest(std::string_view bytes);
std::string EncodeLookupReply(const PeerLookupReply& reply);
// `from`, `keys` and `hybrid` are the request's: the answer must be of the request's version and must not name more
// blocks than it asked for (a hybrid reply: at most (Geometry::kMaxComponents - 1) x matched entries, each of a
// component 1.. and a position below matched).
Result<PeerLookupReply> DecodeLookupReply(std::string_view bytes, uint32_t from, size_t keys, bool hybrid = false);

// A decoded hybrid reply against the hit rule at its end e = matched (docs/hybrid.md), for a requester of geometry
// `geometry` whose own hit ends at `from`: FULL blocks for exactly [from, e), and entries for exactly each window's
// blocks [max(0, e - w), e) and each state at e (key e - 1), components in order, keys in order. NOT_FOUND when the
// peer has no hit past `from`; INVALID_ARGUMENT naming the first difference otherwise (a peer of another geometry,
// or a hostile one).
Status CheckHybridReply(const PeerLookupReply& reply, const Geometry& geometry, uint32_t from);

}  // namespace flexkv
