// Helpers shared by the PrefixIndex tests (prefix_index_test.cc: focused cases; prefix_index_model_test.cc:
// randomized runs against a reference model): chained keys independent of ComputeBlockKeys, store, closure checks.
#pragma once

#include <catch2/catch.hpp>
#include <cstdint>
#include <set>
#include <utility>
#include <vector>

#include "daemon/cache/prefix_index.h"

namespace flexkv::testing::index {

using flexkv::BlockKey;
using flexkv::PrefixIndex;
using flexkv::SlotId;
using flexkv::StatusCode;

inline uint64_t Mix(uint64_t x) {  // splitmix64 finalizer
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// Chained keys, one block per token: keys[i] names tokens[0..i] (like ComputeBlockKeys, independent of it).
inline std::vector<BlockKey> Chain(const std::vector<int32_t>& tokens) {
  std::vector<BlockKey> keys;
  BlockKey prev;
  for (int32_t t : tokens) {
    const uint64_t lo = Mix(prev.lo ^ Mix(static_cast<uint64_t>(static_cast<uint32_t>(t)) + 1));
    const uint64_t hi = Mix(prev.hi + lo);
    prev = BlockKey{lo, hi};
    keys.push_back(prev);
  }
  return keys;
}

inline std::vector<BlockKey> Prefix(const std::vector<BlockKey>& keys, size_t n) {
  return {keys.begin(), keys.begin() + static_cast<std::ptrdiff_t>(n)};
}

// Reserves and commits `keys`; returns all slots of the chain, cached prefix included (via a Match, which
// also marks the chain used).
inline std::vector<SlotId> Store(PrefixIndex& index, const std::vector<BlockKey>& keys) {
  auto r = index.Reserve(flexkv::kRootParent, keys);
  REQUIRE(r.shortfall == StatusCode::kOk);
  index.Commit(r.slots);
  std::vector<SlotId> slots;
  REQUIRE(index.Match(keys, false, &slots) == keys.size());
  return slots;
}

using MKey = std::pair<uint64_t, uint64_t>;  // an ordered stand-in for BlockKey
inline MKey M(const BlockKey& k) { return {k.lo, k.hi}; }

inline std::set<MKey> CommittedKeys(const PrefixIndex& index) {
  std::set<MKey> keys;
  index.ForEachCommitted([&](SlotId, const BlockKey& key, const BlockKey&) { keys.insert(M(key)); });
  return keys;
}

// Every committed node's parent is committed (or it is at root level).
inline bool PrefixClosed(const PrefixIndex& index) {
  auto committed = CommittedKeys(index);
  bool closed = true;
  index.ForEachCommitted([&](SlotId, const BlockKey&, const BlockKey& parent) {
    if (parent != BlockKey{} && committed.count(M(parent)) == 0) closed = false;
  });
  return closed;
}

}  // namespace flexkv::testing::index
