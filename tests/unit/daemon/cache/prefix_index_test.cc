// PrefixIndex: focused cases, then randomized runs checked step by step against a naive reference model of
// the same policy.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <list>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "daemon/cache/prefix_index.h"

namespace {

using flexkv::BlockKey;
using flexkv::PrefixIndex;
using flexkv::SlotId;
using flexkv::StatusCode;

uint64_t Mix(uint64_t x) {  // splitmix64 finalizer
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// Chained keys, one block per token: keys[i] names tokens[0..i] (like ComputeBlockKeys, independent of it).
std::vector<BlockKey> Chain(const std::vector<int32_t>& tokens) {
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

std::vector<BlockKey> Prefix(const std::vector<BlockKey>& keys, size_t n) {
  return {keys.begin(), keys.begin() + static_cast<std::ptrdiff_t>(n)};
}

// Reserves and commits `keys`; returns all slots of the chain, cached prefix included (via a Match, which
// also marks the chain used).
std::vector<SlotId> Store(PrefixIndex& index, const std::vector<BlockKey>& keys) {
  auto r = index.Reserve(keys);
  REQUIRE(r.shortfall == StatusCode::kOk);
  index.Commit(r.slots);
  std::vector<SlotId> slots;
  REQUIRE(index.Match(keys, false, &slots) == keys.size());
  return slots;
}

using MKey = std::pair<uint64_t, uint64_t>;  // an ordered stand-in for BlockKey
MKey M(const BlockKey& k) { return {k.lo, k.hi}; }

std::set<MKey> CommittedKeys(const PrefixIndex& index) {
  std::set<MKey> keys;
  index.ForEachCommitted([&](SlotId, const BlockKey& key, const BlockKey&) { keys.insert(M(key)); });
  return keys;
}

// Every committed node's parent is committed (or it is at root level).
bool PrefixClosed(const PrefixIndex& index) {
  auto committed = CommittedKeys(index);
  bool closed = true;
  index.ForEachCommitted([&](SlotId, const BlockKey&, const BlockKey& parent) {
    if (parent != BlockKey{} && committed.count(M(parent)) == 0) closed = false;
  });
  return closed;
}

TEST_CASE("prefix index: match stops at the first miss", "[unit][index]") {
  PrefixIndex index(16);
  const auto abc = Chain({1, 2, 3});
  const auto abx = Chain({1, 2, 9});
  Store(index, Prefix(abc, 2));
  std::vector<SlotId> slots;
  CHECK(index.Match(abc, false, &slots) == 2);
  CHECK(slots.size() == 2);
  CHECK(index.Match(abx, false, nullptr) == 2);
  CHECK(index.Match(Chain({7, 1, 2}), false, nullptr) == 0);
  CHECK(index.Match({}, false, nullptr) == 0);
  // A key that exists but under another parent is not a continuation of this chain.
  const std::vector<BlockKey> spliced = {Chain({5})[0], abc[1]};
  Store(index, Prefix(spliced, 1));
  CHECK(index.Match(spliced, false, nullptr) == 1);
  CHECK(index.pinned_slots() == 0);
}

TEST_CASE("prefix index: match with pin pins each matched block once", "[unit][index]") {
  PrefixIndex index(8);
  const auto abc = Chain({1, 2, 3});
  const auto stored = Store(index, abc);
  std::vector<SlotId> a, b;
  REQUIRE(index.Match(abc, true, &a) == 3);
  REQUIRE(index.Match(Prefix(abc, 2), true, &b) == 2);
  CHECK(a == stored);
  CHECK(b == std::vector<SlotId>{stored[0], stored[1]});
  CHECK(index.pinned_slots() == 3);
  CHECK(index.EvictionOrder().empty());
  index.Unpin(a);
  CHECK(index.pinned_slots() == 2);
  CHECK(index.EvictionOrder() == std::vector<SlotId>{stored[2]});
  index.Unpin(b);
  CHECK(index.pinned_slots() == 0);
  index.CheckInvariants();
}

TEST_CASE("prefix index: pinned blocks are not evicted", "[unit][index]") {
  PrefixIndex index(4);
  const auto a = Chain({1, 2});
  const auto b = Chain({3, 4});
  Store(index, a);
  Store(index, b);  // pool full; a is older
  std::vector<SlotId> pinned;
  REQUIRE(index.Match(a, true, &pinned) == 2);
  auto r = index.Reserve(Chain({5, 6}));
  CHECK(r.shortfall == StatusCode::kOk);
  CHECK(r.slots.size() == 2);
  index.Commit(r.slots);
  CHECK(index.Match(a, false, nullptr) == 2);  // survived although least recently stored
  CHECK(index.Match(b, false, nullptr) == 0);  // evicted instead
  CHECK(index.evicted_blocks() == 2);
  index.Unpin(pinned);
  index.CheckInvariants();
}

TEST_CASE("prefix index: a pool of pinned blocks reserves what it can and reports RESOURCE_EXHAUSTED",
          "[unit][index]") {
  PrefixIndex index(4);
  const auto a = Chain({1, 2, 3});
  Store(index, a);
  std::vector<SlotId> pinned;
  REQUIRE(index.Match(a, true, &pinned) == 3);
  const auto longer = Chain({1, 2, 3, 4, 5, 6});
  auto r = index.Reserve(longer);
  CHECK(r.cached == 3);
  CHECK(r.slots.size() == 1);  // the one free slot
  CHECK(r.shortfall == StatusCode::kResourceExhausted);
  index.Commit(r.slots);
  CHECK(index.Match(longer, false, nullptr) == 4);
  // The new leaf is evictable, but not by a store of its own chain.
  auto r2 = index.Reserve(longer);
  CHECK(r2.cached == 4);
  CHECK(r2.slots.empty());
  CHECK(r2.shortfall == StatusCode::kResourceExhausted);
  CHECK(index.Match(longer, false, nullptr) == 4);
  CHECK(index.evicted_blocks() == 0);
  // Another chain may evict that leaf, not the pinned ones.
  auto r3 = index.Reserve(Chain({9, 9}));
  CHECK(r3.slots.size() == 1);
  CHECK(r3.shortfall == StatusCode::kResourceExhausted);
  CHECK(index.evicted_blocks() == 1);
  CHECK(index.Match(longer, false, nullptr) == 3);
  index.Abort(r3.slots);
  index.Unpin(pinned);
  CHECK(index.used_slots() == 3);
  index.CheckInvariants();
}

TEST_CASE("prefix index: eviction takes leaves only, least recently used first", "[unit][index]") {
  PrefixIndex index(6);
  const auto a = Chain({1, 2, 3});
  const auto b = Chain({1, 2, 4});  // shares two blocks with a
  const auto c = Chain({5});
  const auto sa = Store(index, a);
  const auto sb = Store(index, b);
  const auto sc = Store(index, c);
  CHECK(index.used_slots() == 5);
  CHECK(index.EvictionOrder() == std::vector<SlotId>{sa[2], sb[2], sc[0]});
  // Using a makes its leaf most recent.
  CHECK(index.Match(a, false, nullptr) == 3);
  CHECK(index.EvictionOrder() == std::vector<SlotId>{sb[2], sc[0], sa[2]});
  // Using only a prefix touches no leaf.
  CHECK(index.Match(Prefix(a, 2), false, nullptr) == 2);
  CHECK(index.EvictionOrder() == std::vector<SlotId>{sb[2], sc[0], sa[2]});

  std::vector<std::pair<SlotId, BlockKey>> evicted;
  index.SetEvictionListener([&](SlotId s, const BlockKey& k) { evicted.emplace_back(s, k); });
  auto r = index.Reserve(Chain({7, 8, 9}));  // 1 free + 2 evictions
  REQUIRE(r.slots.size() == 3);
  REQUIRE(evicted.size() == 2);
  CHECK(evicted[0] == std::make_pair(sb[2], b[2]));
  CHECK(evicted[1] == std::make_pair(sc[0], c[0]));
  CHECK(r.slots[1] == sb[2]);  // an evicted slot is reused at once
  CHECK(r.slots[2] == sc[0]);
  CHECK(PrefixClosed(index));
  index.Commit(r.slots);
  // Next: a's leaf, then its parents (uncovered leaves go to the LRU end), never cutting the chain.
  auto r2 = index.Reserve(Chain({7, 8, 9, 10, 11}));
  REQUIRE(r2.slots.size() == 2);
  REQUIRE(evicted.size() == 4);
  CHECK(evicted[2] == std::make_pair(sa[2], a[2]));
  CHECK(evicted[3] == std::make_pair(sa[1], a[1]));
  CHECK(PrefixClosed(index));
  CHECK(index.Match(a, false, nullptr) == 1);
  CHECK(index.evicted_blocks() == 4);
  index.CheckInvariants();
}

TEST_CASE("prefix index: a parent uncovered by eviction goes before older leaves", "[unit][index]") {
  PrefixIndex index(3);
  const auto ab = Chain({1, 2});
  const auto x = Chain({3});
  const auto sab = Store(index, ab);
  const auto sx = Store(index, x);
  CHECK(index.EvictionOrder() == std::vector<SlotId>{sab[1], sx[0]});
  auto r = index.Reserve(Chain({4}));
  REQUIRE(r.slots == std::vector<SlotId>{sab[1]});
  CHECK(index.EvictionOrder() == std::vector<SlotId>{sab[0], sx[0]});
  index.Commit(r.slots);
  CHECK(index.EvictionOrder() == std::vector<SlotId>{sab[0], sx[0], sab[1]});
}

TEST_CASE("prefix index: pending blocks are neither matchable nor evictable", "[unit][index]") {
  PrefixIndex index(3);
  const auto abc = Chain({1, 2, 3});
  auto r = index.Reserve(abc);
  REQUIRE(r.slots.size() == 3);
  CHECK(index.used_slots() == 3);
  CHECK(index.committed_blocks() == 0);
  CHECK(index.Match(abc, false, nullptr) == 0);
  auto other = index.Reserve(Chain({4}));
  CHECK(other.slots.empty());
  CHECK(other.shortfall == StatusCode::kResourceExhausted);
  index.Commit(std::vector<SlotId>{r.slots[0], r.slots[1]});
  CHECK(index.Match(abc, false, nullptr) == 2);
  CHECK(index.committed_blocks() == 2);
  CHECK(index.EvictionOrder().empty());  // the committed ones have a pending child
  index.Commit(std::vector<SlotId>{r.slots[2]});
  CHECK(index.Match(abc, false, nullptr) == 3);
  CHECK(index.EvictionOrder() == std::vector<SlotId>{r.slots[2]});
  index.CheckInvariants();
}

TEST_CASE("prefix index: abort frees slots in any order", "[unit][index]") {
  PrefixIndex index(8);
  const auto a = Chain({1, 2});
  const auto sa = Store(index, a);
  const auto longer = Chain({1, 2, 3, 4, 5});
  auto r = index.Reserve(longer);
  REQUIRE(r.cached == 2);
  REQUIRE(r.slots.size() == 3);
  CHECK(index.EvictionOrder().empty());
  const auto x = Chain({9});
  const auto sx = Store(index, x);
  CHECK(index.used_slots() == 6);
  std::vector<SlotId> shuffled = {r.slots[1], r.slots[0], r.slots[2]};
  index.Abort(shuffled);
  CHECK(index.used_slots() == 3);
  CHECK(index.committed_blocks() == 3);
  CHECK(index.Match(longer, false, nullptr) == 2);
  // a's leaf became evictable again, at the most recently used end.
  CHECK(index.EvictionOrder() == std::vector<SlotId>{sx[0], sa[1]});
  index.CheckInvariants();
  // The freed slots are taken again.
  auto again = index.Reserve(longer);
  CHECK(again.slots.size() == 3);
  CHECK(again.shortfall == StatusCode::kOk);
  index.Abort(again.slots);
  CHECK(index.used_slots() == 3);
  index.CheckInvariants();
}

TEST_CASE("prefix index: concurrent stores of one chain: the second stops at the pending key", "[unit][index]") {
  PrefixIndex index(16);
  const auto abcd = Chain({1, 2, 3, 4});
  Store(index, Prefix(abcd, 1));
  auto first = index.Reserve(Prefix(abcd, 3));
  REQUIRE(first.cached == 1);
  REQUIRE(first.slots.size() == 2);
  auto second = index.Reserve(abcd);
  CHECK(second.cached == 1);
  CHECK(second.slots.empty());
  CHECK(second.shortfall == StatusCode::kAborted);
  index.Commit(first.slots);
  auto third = index.Reserve(abcd);
  CHECK(third.cached == 3);
  CHECK(third.slots.size() == 1);
  CHECK(third.shortfall == StatusCode::kOk);
  // A store that overlaps only past the pending point keeps its own part.
  auto fourth = index.Reserve(Chain({1, 2, 3, 4, 5}));
  CHECK(fourth.cached == 3);
  CHECK(fourth.slots.empty());
  CHECK(fourth.shortfall == StatusCode::kAborted);
  index.Commit(third.slots);
  CHECK(index.Match(abcd, false, nullptr) == 4);
  CHECK(index.pinned_slots() == 0);
  index.CheckInvariants();
}

TEST_CASE("prefix index: restore rebuilds committed nodes and rejects orphans and duplicates", "[unit][index]") {
  PrefixIndex index(5);
  const auto abc = Chain({1, 2, 3});
  const auto x = Chain({7});
  CHECK(index.Restore(2, abc[0], BlockKey{}).ok());
  CHECK(index.Restore(0, abc[1], abc[0]).ok());
  CHECK(index.Restore(3, abc[2], x[0]).code() == StatusCode::kFailedPrecondition);  // orphan
  CHECK(index.Restore(3, abc[1], abc[0]).code() == StatusCode::kFailedPrecondition);  // duplicate key
  CHECK(index.Restore(0, abc[2], abc[1]).code() == StatusCode::kFailedPrecondition);  // slot taken
  CHECK(index.Restore(5, abc[2], abc[1]).code() == StatusCode::kOutOfRange);
  CHECK(index.Restore(1, BlockKey{}, abc[1]).code() == StatusCode::kInvalidArgument);
  CHECK(index.used_slots() == 2);
  CHECK(index.committed_blocks() == 2);
  CHECK(index.EvictionOrder() == std::vector<SlotId>{0});
  std::vector<SlotId> slots;
  CHECK(index.Match(abc, false, &slots) == 2);
  CHECK(slots == std::vector<SlotId>{2, 0});
  // Restored slots are off the free list: a reservation takes 1, then 3.
  auto r = index.Reserve(Chain({5, 6}));
  CHECK(r.slots == std::vector<SlotId>{1, 3});
  index.CheckInvariants();
  // A pending node is not a parent to restore under.
  CHECK(index.Restore(4, x[0], Chain({5})[0]).code() == StatusCode::kFailedPrecondition);
  index.Abort(r.slots);
  index.CheckInvariants();
}

TEST_CASE("prefix index: the eviction listener sees each evicted slot and key once", "[unit][index]") {
  PrefixIndex index(2);
  std::vector<std::pair<SlotId, BlockKey>> evicted;
  index.SetEvictionListener([&](SlotId s, const BlockKey& k) { evicted.emplace_back(s, k); });
  const auto a = Chain({1});
  const auto b = Chain({2});
  const auto c = Chain({3});
  const auto sa = Store(index, a);
  const auto sb = Store(index, b);
  CHECK(evicted.empty());
  Store(index, c);
  REQUIRE(evicted.size() == 1);
  CHECK(evicted[0] == std::make_pair(sa[0], a[0]));
  CHECK(index.Match(b, false, nullptr) == 1);
  Store(index, a);
  REQUIRE(evicted.size() == 2);
  CHECK(evicted[1].second == c[0]);  // b was used after c was stored
  CHECK(index.Match(b, false, nullptr) == 1);
  CHECK(sb[0] != sa[0]);
  CHECK(index.evicted_blocks() == 2);
}

TEST_CASE("prefix index: long chains match up to the first wrong key wherever it falls", "[unit][index]") {
  // The walk looks keys up ahead of the one it compares; a miss or a foreign key anywhere, inside or past that
  // look-ahead, must end the match exactly there.
  PrefixIndex index(1024);
  std::vector<int32_t> tokens(300), other(300);
  for (int32_t i = 0; i < 300; ++i) {
    tokens[static_cast<size_t>(i)] = i;
    other[static_cast<size_t>(i)] = 1000 + i;
  }
  const auto keys = Chain(tokens);
  const auto foreign = Chain(other);
  Store(index, keys);
  Store(index, Prefix(foreign, 100));
  for (size_t cut : {size_t{0}, size_t{1}, size_t{5}, size_t{6}, size_t{7}, size_t{11}, size_t{12}, size_t{13},
                     size_t{16}, size_t{17}, size_t{64}, size_t{150}, size_t{299}}) {
    INFO("cut " << cut);
    auto missing = keys;
    missing[cut] = BlockKey{cut + 1, 0xdead};  // not in the index
    std::vector<SlotId> slots;
    CHECK(index.Match(missing, false, &slots) == cut);
    CHECK(slots.size() == cut);
    auto crossed = keys;
    crossed[cut] = foreign[std::clamp<size_t>(cut, 1, 99)];  // in the index, under another parent
    CHECK(index.Match(crossed, false, nullptr) == cut);
    auto r = index.Reserve(missing);  // the cached prefix, then `missing[cut]`, then keys already present
    CHECK(r.cached == cut);
    CHECK(r.slots.size() == 1);
    CHECK(r.shortfall == (cut + 1 < keys.size() ? StatusCode::kAborted : StatusCode::kOk));
    index.Abort(r.slots);
    index.CheckInvariants();
  }
  std::vector<SlotId> all;
  CHECK(index.Match(keys, true, &all) == keys.size());
  CHECK(index.pinned_slots() == keys.size());
  index.Unpin(all);
  CHECK(index.Match(std::vector<BlockKey>(keys.begin() + 1, keys.end()), false, nullptr) == 0);  // not a root
}

TEST_CASE("prefix index: the key table stays consistent under eviction churn at its highest load",
          "[unit][index]") {
  // 7168 slots fill 8192 buckets to 7/8, the most the table allows; every store then evicts, so keys are
  // removed and inserted all over the table (backward shifts, wrap-around at its end).
  constexpr uint32_t kSlots = 7168;
  PrefixIndex index(kSlots);
  std::mt19937_64 rng(0x5eed0004);
  std::vector<std::vector<BlockKey>> stored;
  for (int32_t round = 0; round < 4000; ++round) {
    std::vector<int32_t> tokens(1 + rng() % 40);
    for (auto& t : tokens) t = static_cast<int32_t>(rng() & 0xFFFF);
    tokens[0] = round;  // distinct chains
    const auto keys = Chain(tokens);
    auto r = index.Reserve(keys);
    REQUIRE(r.shortfall == StatusCode::kOk);
    index.Commit(r.slots);
    stored.push_back(keys);
    if (round % 500 == 499) index.CheckInvariants();
  }
  CHECK(index.used_slots() == kSlots);
  CHECK(index.evicted_blocks() > 3 * kSlots);
  // Every committed block is still found; what was evicted is not: the matched lengths add up to the index.
  size_t matched = 0;
  for (const auto& keys : stored) matched += index.Match(keys, false, nullptr);
  CHECK(matched == index.committed_blocks());
  index.CheckInvariants();
}

// ---------------------------------------------------------------------------------------------------------
// Reference model: the same policy, written naively. Nodes in a std::map by key, child counts by scanning,
// the eviction order as an explicit std::list with the documented insertion rules, the free slots as a
// LIFO std::list starting 0, 1, 2, ...

class Model {
 public:
  explicit Model(uint32_t capacity) : capacity_(capacity) {
    for (SlotId s = 0; s < capacity; ++s) free_.push_back(s);
  }

  struct Node {
    SlotId slot = 0;
    std::optional<MKey> parent;
    int pins = 0;
    bool committed = false;
  };

  size_t Match(const std::vector<BlockKey>& keys, bool pin, std::vector<SlotId>* slots) {
    std::optional<MKey> parent;
    std::optional<MKey> last;
    size_t n = 0;
    for (const auto& bk : keys) {
      const MKey k = M(bk);
      auto it = nodes_.find(k);
      if (it == nodes_.end() || !it->second.committed || it->second.parent != parent) break;
      if (pin) {
        const bool was = Evictable(k);
        ++it->second.pins;
        Update(k, was, /*mru=*/true);
      }
      if (slots) slots->push_back(it->second.slot);
      parent = last = k;
      ++n;
    }
    if (last && Evictable(*last)) {
      lru_.remove(*last);
      lru_.push_back(*last);
    }
    return n;
  }

  void Unpin(const std::vector<SlotId>& slots) {
    for (SlotId s : slots) {
      const MKey k = KeyOf(s);
      Node& n = nodes_.at(k);
      REQUIRE(n.pins > 0);
      const bool was = Evictable(k);
      --n.pins;
      Update(k, was, true);
    }
  }

  PrefixIndex::Reservation Reserve(const std::vector<BlockKey>& keys) {
    PrefixIndex::Reservation r;
    std::vector<SlotId> prefix;
    r.cached = Match(keys, true, &prefix);
    std::optional<MKey> parent;
    if (r.cached > 0) parent = M(keys[r.cached - 1]);
    for (size_t i = r.cached; i < keys.size(); ++i) {
      const MKey k = M(keys[i]);
      if (nodes_.count(k) != 0) {
        r.shortfall = StatusCode::kAborted;
        break;
      }
      SlotId slot;
      if (!free_.empty()) {
        slot = free_.front();
        free_.pop_front();
      } else if (!lru_.empty()) {
        slot = EvictFront();
      } else {
        r.shortfall = StatusCode::kResourceExhausted;
        break;
      }
      const bool parent_was = parent && Evictable(*parent);
      nodes_[k] = Node{slot, parent, 0, false};
      if (parent) Update(*parent, parent_was, true);
      r.slots.push_back(slot);
      parent = k;
    }
    Unpin(prefix);
    return r;
  }

  void Commit(const std::vector<SlotId>& slots) {
    for (SlotId s : slots) {
      const MKey k = KeyOf(s);
      Node& n = nodes_.at(k);
      REQUIRE_FALSE(n.committed);
      REQUIRE((!n.parent || nodes_.at(*n.parent).committed));
      n.committed = true;
      Update(k, false, true);
    }
  }

  // Leaves first in the given order; a removed node's aborting parent follows once it has no children.
  void Abort(const std::vector<SlotId>& slots) {
    std::set<MKey> aborting;
    for (SlotId s : slots) {
      const MKey k = KeyOf(s);
      REQUIRE_FALSE(nodes_.at(k).committed);
      aborting.insert(k);
    }
    for (SlotId s : slots) {
      std::optional<MKey> cur;
      for (const auto& [k, n] : nodes_) {
        if (n.slot == s) cur = k;
      }
      while (cur && aborting.count(*cur) != 0 && Children(*cur) == 0) {
        const Node n = nodes_.at(*cur);
        const bool parent_was = n.parent && Evictable(*n.parent);
        nodes_.erase(*cur);
        aborting.erase(*cur);
        free_.push_front(n.slot);
        if (n.parent) Update(*n.parent, parent_was, true);
        cur = n.parent;
      }
    }
    REQUIRE(aborting.empty());
  }

  // Compares everything observable and the model's own invariants.
  void CheckAgainst(const PrefixIndex& index) const {
    index.CheckInvariants();
    std::vector<uint32_t> children(capacity_, 0);  // by slot
    bool sane = true;  // pins >= 0, parents present, prefix-closed, pending unpinned
    for (const auto& [k, n] : nodes_) {
      sane = sane && n.pins >= 0 && (n.committed || n.pins == 0);
      if (n.parent) {
        auto p = nodes_.find(*n.parent);
        sane = sane && p != nodes_.end() && (!n.committed || p->second.committed);
        if (p != nodes_.end()) ++children[p->second.slot];
      }
    }
    REQUIRE(sane);
    auto evictable = [&](const Node& n) { return n.committed && n.pins == 0 && children[n.slot] == 0; };
    uint32_t pinned = 0, committed = 0;
    size_t evictable_count = 0;
    for (const auto& [k, n] : nodes_) {
      pinned += n.pins > 0 ? 1u : 0u;
      committed += n.committed ? 1u : 0u;
      evictable_count += evictable(n) ? 1u : 0u;
    }
    REQUIRE(nodes_.size() + free_.size() == capacity_);
    REQUIRE(index.capacity() == capacity_);
    REQUIRE(index.used_slots() == nodes_.size());
    REQUIRE(index.pinned_slots() == pinned);
    REQUIRE(index.committed_blocks() == committed);
    REQUIRE(index.evicted_blocks() == evicted_.size());

    // Eviction list: exactly the evictable nodes, in the same order as the index's.
    std::vector<SlotId> order;
    bool listed_evictable = true;
    for (const MKey& k : lru_) {
      const Node& n = nodes_.at(k);
      listed_evictable = listed_evictable && evictable(n);
      order.push_back(n.slot);
    }
    REQUIRE(listed_evictable);
    REQUIRE(evictable_count == lru_.size());
    REQUIRE(index.EvictionOrder() == order);

    // Committed nodes: same slots, keys, parents.
    std::vector<std::tuple<SlotId, MKey, MKey>> mine, theirs;
    for (const auto& [k, n] : nodes_) {
      if (n.committed) mine.emplace_back(n.slot, k, n.parent.value_or(MKey{0, 0}));
    }
    std::sort(mine.begin(), mine.end());
    index.ForEachCommitted([&](SlotId s, const BlockKey& k, const BlockKey& p) { theirs.emplace_back(s, M(k), M(p)); });
    REQUIRE(mine == theirs);  // both in slot order
  }

  const std::vector<std::pair<SlotId, MKey>>& evicted() const { return evicted_; }

 private:
  uint32_t Children(const MKey& k) const {
    uint32_t c = 0;
    for (const auto& [key, n] : nodes_) c += (n.parent == k) ? 1u : 0u;
    return c;
  }
  bool Evictable(const MKey& k) const {
    const Node& n = nodes_.at(k);
    return n.committed && n.pins == 0 && Children(k) == 0;
  }
  MKey KeyOf(SlotId s) const {
    for (const auto& [k, n] : nodes_) {
      if (n.slot == s) return k;
    }
    FAIL("slot " << s << " is not in use");
    return {};
  }
  // Applies the list rules after a change to k: a node that stopped being evictable leaves the list; one
  // that became evictable joins at the MRU end (use, unpin, commit, abort) or LRU end (child evicted).
  void Update(const MKey& k, bool was, bool mru) {
    const bool now = Evictable(k);
    if (was && !now) lru_.remove(k);
    if (!was && now) {
      if (mru) lru_.push_back(k); else lru_.push_front(k);
    }
  }
  SlotId EvictFront() {
    const MKey k = lru_.front();
    REQUIRE(Evictable(k));
    const Node n = nodes_.at(k);
    const bool parent_was = n.parent && Evictable(*n.parent);
    lru_.pop_front();
    nodes_.erase(k);
    if (n.parent) Update(*n.parent, parent_was, /*mru=*/false);
    evicted_.emplace_back(n.slot, k);
    return n.slot;
  }

  uint32_t capacity_;
  std::map<MKey, Node> nodes_;
  std::list<MKey> lru_;  // front: least recently used
  std::list<SlotId> free_;
  std::vector<std::pair<SlotId, MKey>> evicted_;
};

// Token sequences that share prefixes: each new prompt extends a random prefix of an earlier one with
// tokens from a small alphabet, so chains branch, overlap and sometimes coincide.
std::vector<std::vector<BlockKey>> MakePrompts(std::mt19937_64& rng, int count, int max_len) {
  std::vector<std::vector<int32_t>> prompts;
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int i = 0; i < count; ++i) {
    std::vector<int32_t> p;
    if (!prompts.empty() && uniform(0, 9) < 7) {
      const auto& base = prompts[static_cast<size_t>(uniform(0, static_cast<int>(prompts.size()) - 1))];
      p.assign(base.begin(), base.begin() + uniform(0, static_cast<int>(base.size())));
    }
    const int len = uniform(1, max_len);
    while (static_cast<int>(p.size()) < len) p.push_back(uniform(0, 3));
    prompts.push_back(p);
  }
  std::vector<std::vector<BlockKey>> keys;
  for (const auto& p : prompts) keys.push_back(Chain(p));
  keys.emplace_back();  // the empty request
  return keys;
}

struct PendingStore {
  std::vector<SlotId> slots;
};

struct Session {
  std::vector<std::vector<SlotId>> pins;  // each entry: the slots of one pinned match
  std::vector<PendingStore> pending;
};

void RunRandomized(uint32_t capacity, int prompt_count, int steps, uint64_t seed, int max_prompt_len = 12) {
  std::mt19937_64 rng(seed);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const auto prompts = MakePrompts(rng, prompt_count, max_prompt_len);
  auto pick_prompt = [&]() -> const std::vector<BlockKey>& {
    return prompts[static_cast<size_t>(uniform(0, static_cast<int>(prompts.size()) - 1))];
  };

  PrefixIndex index(capacity);
  Model model(capacity);
  std::vector<std::pair<SlotId, MKey>> evicted;
  index.SetEvictionListener([&](SlotId s, const BlockKey& k) { evicted.emplace_back(s, M(k)); });
  std::vector<Session> sessions(4);
  uint64_t exhausted = 0, aborted = 0, hits = 0;

  auto finish = [&](const std::vector<SlotId>& slots, int how) {
    // how: 0 commit all, 1 abort all (shuffled), 2 commit a prefix and abort the rest
    if (how == 0) {
      index.Commit(slots);
      model.Commit(slots);
    } else if (how == 1) {
      auto shuffled = slots;
      std::shuffle(shuffled.begin(), shuffled.end(), rng);
      index.Abort(shuffled);
      model.Abort(shuffled);
    } else {
      const auto k = static_cast<size_t>(uniform(0, static_cast<int>(slots.size())));
      const std::vector<SlotId> head(slots.begin(), slots.begin() + static_cast<std::ptrdiff_t>(k));
      const std::vector<SlotId> tail(slots.begin() + static_cast<std::ptrdiff_t>(k), slots.end());
      index.Commit(head);
      model.Commit(head);
      index.Abort(tail);
      model.Abort(tail);
    }
  };

  for (int step = 0; step < steps; ++step) {
    INFO("step " << step);
    Session& session = sessions[static_cast<size_t>(uniform(0, 3))];
    const int op = uniform(0, 99);
    if (op < 20) {  // match without pin
      const auto& keys = pick_prompt();
      const bool want_slots = uniform(0, 1) == 1;
      std::vector<SlotId> got, expected;
      const size_t n = index.Match(keys, false, want_slots ? &got : nullptr);
      REQUIRE(n == model.Match(keys, false, want_slots ? &expected : nullptr));
      REQUIRE(got == expected);
      hits += n;
    } else if (op < 40) {  // match with pin (or release the oldest pins when holding many)
      if (session.pins.size() >= 3) {
        index.Unpin(session.pins.front());
        model.Unpin(session.pins.front());
        session.pins.erase(session.pins.begin());
      } else {
        const auto& keys = pick_prompt();
        std::vector<SlotId> got, expected;
        const size_t n = index.Match(keys, true, &got);
        REQUIRE(n == model.Match(keys, true, &expected));
        REQUIRE(got == expected);
        if (n > 0) session.pins.push_back(got);
        hits += n;
      }
    } else if (op < 55) {  // unpin a random held match, in random order
      if (!session.pins.empty()) {
        const auto i = static_cast<size_t>(uniform(0, static_cast<int>(session.pins.size()) - 1));
        auto slots = session.pins[i];
        std::shuffle(slots.begin(), slots.end(), rng);
        index.Unpin(slots);
        model.Unpin(slots);
        session.pins.erase(session.pins.begin() + static_cast<std::ptrdiff_t>(i));
      }
    } else if (op < 85) {  // store: reserve, then commit, abort, or keep pending for a while
      const auto& keys = pick_prompt();
      auto got = index.Reserve(keys);
      auto expected = model.Reserve(keys);
      REQUIRE(got.cached == expected.cached);
      REQUIRE(got.slots == expected.slots);
      REQUIRE(got.shortfall == expected.shortfall);
      REQUIRE(got.cached + got.slots.size() <= keys.size());
      REQUIRE((got.shortfall == StatusCode::kOk) == (got.cached + got.slots.size() == keys.size()));
      exhausted += got.shortfall == StatusCode::kResourceExhausted ? 1u : 0u;
      aborted += got.shortfall == StatusCode::kAborted ? 1u : 0u;
      const int how = uniform(0, 99);
      if (how < 45 || session.pending.size() >= 2) {
        finish(got.slots, how < 30 ? 0 : (how < 38 ? 1 : 2));
      } else if (!got.slots.empty()) {
        session.pending.push_back({got.slots});
      }
    } else {  // finish a delayed store
      if (!session.pending.empty()) {
        const auto i = static_cast<size_t>(uniform(0, static_cast<int>(session.pending.size()) - 1));
        const auto slots = session.pending[i].slots;
        session.pending.erase(session.pending.begin() + static_cast<std::ptrdiff_t>(i));
        finish(slots, uniform(0, 2));
      }
    }
    model.CheckAgainst(index);
    REQUIRE(evicted == model.evicted());
  }
  // The run exercised what it is meant to.
  CHECK(hits > 0);
  CHECK(aborted > 0);
  if (capacity <= 64) {
    CHECK(exhausted > 0);
    CHECK(index.evicted_blocks() > static_cast<uint64_t>(steps) / 10);
  }

  // Release everything; then the pool is all evictable leaves and committed chains.
  for (auto& s : sessions) {
    for (auto& p : s.pins) {
      index.Unpin(p);
      model.Unpin(p);
    }
    for (auto& p : s.pending) {
      index.Abort(p.slots);
      model.Abort(p.slots);
    }
  }
  model.CheckAgainst(index);
  CHECK(index.pinned_slots() == 0);
  CHECK(index.used_slots() == index.committed_blocks());

  // Restart rebuild: restoring every committed node, parents first, reproduces the committed set.
  std::vector<std::tuple<SlotId, BlockKey, BlockKey>> nodes;
  index.ForEachCommitted([&](SlotId s, const BlockKey& k, const BlockKey& p) { nodes.emplace_back(s, k, p); });
  PrefixIndex rebuilt(capacity);
  auto committed_keys = CommittedKeys(index);
  std::set<MKey> restored = {M(BlockKey{})};
  while (!nodes.empty()) {
    const size_t before = nodes.size();
    for (auto it = nodes.begin(); it != nodes.end();) {
      const auto& [s, k, p] = *it;
      if (restored.count(M(p)) != 0) {
        REQUIRE(rebuilt.Restore(s, k, p).ok());
        restored.insert(M(k));
        it = nodes.erase(it);
      } else {
        ++it;
      }
    }
    REQUIRE(nodes.size() < before);
  }
  rebuilt.CheckInvariants();
  CHECK(CommittedKeys(rebuilt) == committed_keys);
  CHECK(rebuilt.used_slots() == index.used_slots());
  for (const auto& keys : prompts) {
    std::vector<SlotId> a, b;
    CHECK(rebuilt.Match(keys, false, &a) == index.Match(keys, false, &b));
    CHECK(a == b);
  }
}

TEST_CASE("prefix index agrees with a reference model: small pool, constant eviction", "[unit][index]") {
  RunRandomized(/*capacity=*/64, /*prompt_count=*/40, /*steps=*/6000, /*seed=*/0x5eed0001);
}

TEST_CASE("prefix index agrees with a reference model: larger pool", "[unit][index]") {
  RunRandomized(/*capacity=*/512, /*prompt_count=*/400, /*steps=*/5000, /*seed=*/0x5eed0002);
}

// Requests longer than the walk's prefetch window (a dozen keys), so lookups run with the look-ahead in
// flight and chains end, branch and get evicted beyond it.
TEST_CASE("prefix index agrees with a reference model: long chains", "[unit][index]") {
  RunRandomized(/*capacity=*/700, /*prompt_count=*/120, /*steps=*/2500, /*seed=*/0x5eed0003, /*max_prompt_len=*/90);
}

}  // namespace
