// What a node publishes to the directory and which keys of a prompt a Prefetch asks about
// (daemon/tiers/cluster/publish_policy.h): every key another node's commit may have published is either asked for
// or reached through a sampled key that is.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "daemon/tiers/cluster/publish_policy.h"

using flexkv::BlockKey;
using flexkv::IsPublishedKey;
using flexkv::IsSampledKey;
using flexkv::LookupCandidates;
using flexkv::LookupGapAbove;

namespace {

// A chain of n keys whose sampled positions (chunk 4) are exactly `sampled`.
std::vector<BlockKey> Chain(size_t n, const std::vector<size_t>& sampled) {
  std::vector<BlockKey> keys;
  for (size_t j = 0; j < n; ++j) {
    const bool s = std::find(sampled.begin(), sampled.end(), j) != sampled.end();
    keys.push_back(BlockKey{(j + 1) * 4 + (s ? 0 : 1), 77});
  }
  return keys;
}

}  // namespace

TEST_CASE("what is published: the sampled keys and the last key of every commit", "[unit][cluster]") {
  CHECK(IsSampledKey(BlockKey{32, 1}, 16));
  CHECK_FALSE(IsSampledKey(BlockKey{33, 1}, 16));
  CHECK(IsSampledKey(BlockKey{33, 1}, 1));
  CHECK(IsPublishedKey(BlockKey{33, 1}, /*commit_end=*/true, 16));
  CHECK_FALSE(IsPublishedKey(BlockKey{33, 1}, /*commit_end=*/false, 16));
}

TEST_CASE("regression: a Prefetch asks for the keys before the first sampled one - the previous turn's end",
          "[unit][cluster][regression]") {
  // A conversation's second turn: 20 blocks, the first turn's 9 (ending at position 8, published as a store's end)
  // stored on a peer, nothing here. The sampled keys are at 12 and 17. Before the fix only those and the last key
  // (19) were asked: the previous turn's end was never found, and the pull missed it.
  const auto keys = Chain(20, {12, 17});
  const auto asked = LookupCandidates(keys, 0, keys.size(), 4);
  CHECK(std::find(asked.begin(), asked.end(), size_t{8}) != asked.end());
  // Deepest first: the keys after the last sampled one, the sampled ones, then every key before the first.
  CHECK(asked == std::vector<size_t>{19, 18, 17, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0});
}

TEST_CASE("every published key of the prompt is asked for or reached through a sampled key that is",
          "[unit][cluster]") {
  const auto keys = Chain(40, {5, 13, 14, 30});
  for (size_t local = 0; local <= keys.size(); ++local) {
    const auto asked = LookupCandidates(keys, local, keys.size(), 4);
    for (size_t j : asked) {
      CHECK(j >= local);
      CHECK(j < keys.size());
    }
    CHECK(std::is_sorted(asked.rbegin(), asked.rend()));
    for (size_t end = local; end < keys.size(); ++end) {
      // A peer that committed keys [0, end] published `end`: the lookup finds it, or a sampled key in [local, end]
      // whose owners (this peer among them) are asked for the whole chain.
      bool found = std::find(asked.begin(), asked.end(), end) != asked.end();
      for (size_t s = local; s <= end && !found; ++s) {
        found = IsSampledKey(keys[s], 4) && std::find(asked.begin(), asked.end(), s) != asked.end();
      }
      INFO("local " << local << ", a peer's commit ending at " << end);
      CHECK(found);
    }
  }
}

TEST_CASE("a prompt without a sampled key after the local prefix asks every key, a cached one asks nothing",
          "[unit][cluster]") {
  const auto keys = Chain(6, {0});
  CHECK(LookupCandidates(keys, 1, keys.size(), 4) == std::vector<size_t>{5, 4, 3, 2, 1});
  CHECK(LookupCandidates(keys, 6, keys.size(), 4).empty());
  CHECK(LookupCandidates(keys, 0, 3, 4) == std::vector<size_t>{2, 1, 0});  // only up to reach
  CHECK(LookupCandidates(keys, 2, 2, 4).empty());
}

TEST_CASE("after a sampled key is found, the keys up to the next sampled one are asked: the deepest published key",
          "[unit][cluster]") {
  const auto keys = Chain(30, {4, 12, 20});
  // Found at 12 (nothing at or after 20): 13..19 were not asked.
  CHECK(LookupGapAbove(keys, 12, keys.size(), 4) == std::vector<size_t>{19, 18, 17, 16, 15, 14, 13});
  CHECK(LookupGapAbove(keys, 20, keys.size(), 4).empty());  // the last sampled key: what follows was asked
  CHECK(LookupGapAbove(keys, 3, keys.size(), 4).empty());   // not a sampled key (before the first)
  CHECK(LookupGapAbove(keys, 12, 16, 4).empty());           // no sampled key after it before reach
  // With both steps the deepest published key is found, wherever the ends are: a model of one lookup.
  for (size_t a = 0; a < keys.size(); ++a) {
    for (size_t b = a; b < keys.size(); ++b) {
      // Two peers: one committed [0, a], the other [0, b]; each published its sampled keys and its end.
      const auto published = [&](size_t j) { return j == a || j == b || (j <= b && IsSampledKey(keys[j], 4)); };
      size_t deepest = keys.size();
      for (size_t j : LookupCandidates(keys, 0, keys.size(), 4)) {
        if (published(j)) {
          deepest = j;
          break;
        }
      }
      REQUIRE(deepest != keys.size());
      for (size_t j : LookupGapAbove(keys, deepest, keys.size(), 4)) {
        if (published(j)) {
          deepest = j;
          break;
        }
      }
      INFO("ends at " << a << " and " << b);
      CHECK(deepest == b);
    }
  }
}
