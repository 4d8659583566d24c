// What a node publishes to the cluster's directory, and which keys of a prompt a Prefetch asks the directory about
// (docs/cluster.md "What is published", "Lookup"). One place for both, so that the lookup asks for exactly what can
// be found, and so that `flexkv-bench trace --nodes` simulates the daemon's own policy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "flexkv/block_key.h"

namespace flexkv {

// A sampled key: one in `chunk_blocks` on average by its value, wherever it sits in a prompt (the daemon does not
// know depths). chunk_blocks <= 1: every key.
inline bool IsSampledKey(const BlockKey& key, uint32_t chunk_blocks) {
  return chunk_blocks <= 1 || key.lo % chunk_blocks == 0;
}

// Whether a node publishes a block it commits: a sampled key, or the last key of a commit (a store request's end,
// a pull's end, a restored block without children), where another node's identical prompt ends its lookup.
inline bool IsPublishedKey(const BlockKey& key, bool commit_end, uint32_t chunk_blocks) {
  return commit_end || IsSampledKey(key, chunk_blocks);
}

// The positions in [local, reach) of `keys` (a prompt's chain) that a Prefetch asks the directory about, deepest
// first; `local` blocks are cached here. A published key j names an owner of keys 0..j (chained keys, prefix-closed
// indexes), and the owner is asked for the whole chain up to `reach` (it answers with all it holds): so any
// published key of the prompt at or after a sampled key s >= local is reached through s, and need not be asked for
// itself. The lookup asks the sampled keys, and every key before the first sampled one (a commit end there, such
// as the previous turn's end of a conversation, is reached only by itself) and after the last (an owner holding
// one of them holds more than the sampled key's other owners). With no sampled key in [local, reach), every key.
std::vector<size_t> LookupCandidates(std::span<const BlockKey> keys, size_t local, size_t reach,
                                     uint32_t chunk_blocks);

// After the deepest candidate found with an owner is the sampled key at `found`: the keys between it and the next
// sampled key (deepest first; they were not asked, and every candidate deeper had no owner). A commit end among
// them names an owner holding more of the prompt than some of the sampled key's owners, which a random pick among
// those would miss; asking them (one more round trip, about chunk_blocks keys) makes the lookup find the deepest
// published key of the prompt. Empty when `found` is not a sampled key or no sampled key follows it before `reach`
// (the keys after the last sampled one are candidates already).
std::vector<size_t> LookupGapAbove(std::span<const BlockKey> keys, size_t found, size_t reach, uint32_t chunk_blocks);

}  // namespace flexkv
