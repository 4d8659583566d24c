// Block keys: 128-bit chained hashes that name a block of tokens together with everything before it
// (docs/protocol.md, "Block keys"). Computed in the client; the daemon only compares them.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace flexkv {

struct BlockKey {
  uint64_t lo = 0;  // XXH128_hash_t.low64
  uint64_t hi = 0;  // XXH128_hash_t.high64
  friend bool operator==(const BlockKey&, const BlockKey&) = default;
  // 32 lowercase hex digits, high half first (as XXH128 canonical form prints).
  std::string ToHex() const;
};

// The parent of a prompt's first block: the all-zero key (key[-1] below), which a store refuses as a key.
inline constexpr BlockKey kRootParent{};

// key[i] = XXH3_128(seed = XXH3_64(model_namespace), bytes = key[i-1] as 16 bytes little-endian (lo then hi)
//          ‖ tokens of block i as little-endian int32), key[-1] = 0. Only whole blocks are keyed: a trailing
// partial block is ignored. `tokens_per_block` must be > 0 (returns no keys otherwise).
std::vector<BlockKey> ComputeBlockKeys(std::string_view model_namespace, std::span<const int32_t> tokens,
                                       uint32_t tokens_per_block);

// What changes a block's KV besides its token ids (a tenant's cache salt, a LoRA adapter, the media under
// multimodal placeholders, prompt embeddings), as a 16-byte digest the engine integration computes per block; all
// zero: nothing. The same key scheme, with block i's digest appended when it is not zero:
//   key[i] = XXH3_128(seed, key[i-1] ‖ tokens of block i ‖ extras[i])
// so a block without an extra keeps its plain key, and one with an extra changes its key and, through the chain,
// every key after it. `extras` may be shorter than the blocks (the rest have none).
using BlockExtra = std::array<uint8_t, 16>;
std::vector<BlockKey> ComputeBlockKeys(std::string_view model_namespace, std::span<const int32_t> tokens,
                                       uint32_t tokens_per_block, std::span<const BlockExtra> extras);

// XXH3_64(model_namespace): the seed above, and what names a namespace where the daemon knows only the hash (a KV
// event of an SSD block whose namespace it has not seen since it started is of domain "#<16 hex digits>").
uint64_t NamespaceHash(std::string_view model_namespace);

// A run of consecutive keys of one prompt together with the key its first one hangs under (its parent):
// kRootParent when keys()[0] is the prompt's first block. What Client::Store takes, so that a store of the
// part of a prompt past its cached prefix says where that part goes. A view: the keys must outlive it.
//
//   std::vector<BlockKey> keys = ComputeBlockKeys(ns, tokens, 16);
//   BlockKeyChain prompt(keys);                // from the root
//   BlockKeyChain tail = prompt.Slice(20, 30); // keys[20..30), parent keys[19]
class BlockKeyChain {
 public:
  BlockKeyChain() = default;
  // Keys that start a prompt (parent kRootParent). Explicit: a sub-span of a prompt's keys must come from
  // Slice, or name its parent, never pass for a prompt's start.
  explicit BlockKeyChain(std::span<const BlockKey> keys) : keys_(keys) {}
  // keys()[0] hangs under `parent` (kRootParent: keys start a prompt).
  BlockKeyChain(const BlockKey& parent, std::span<const BlockKey> keys) : parent_(parent), keys_(keys) {}

  // keys()[begin, end), each clamped to size() (end also to at least begin); the parent is keys()[begin - 1],
  // or this chain's parent when begin is 0.
  BlockKeyChain Slice(size_t begin, size_t end) const {
    end = end < keys_.size() ? end : keys_.size();
    begin = begin < end ? begin : end;
    return BlockKeyChain(begin == 0 ? parent_ : keys_[begin - 1], keys_.subspan(begin, end - begin));
  }
  // keys()[begin, size()).
  BlockKeyChain Slice(size_t begin) const { return Slice(begin, keys_.size()); }

  const BlockKey& parent() const { return parent_; }
  std::span<const BlockKey> keys() const { return keys_; }
  size_t size() const { return keys_.size(); }
  bool empty() const { return keys_.empty(); }
  const BlockKey& operator[](size_t i) const { return keys_[i]; }

 private:
  BlockKey parent_{};
  std::span<const BlockKey> keys_;
};

struct BlockKeyHash {
  size_t operator()(const BlockKey& k) const { return static_cast<size_t>(k.lo ^ (k.hi * 0x9E3779B97F4A7C15ULL)); }
};

}  // namespace flexkv
