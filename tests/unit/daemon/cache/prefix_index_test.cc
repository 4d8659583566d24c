// PrefixIndex: focused cases (match, pin, eviction order, pending and aborted stores, restore, long chains,
// table churn). Randomized runs against a reference model: prefix_index_model_test.cc.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <list>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

#include "daemon/cache/prefix_index.h"
#include "tests/unit/daemon/cache/prefix_index_test_util.h"

using namespace flexkv::testing::index;  // NOLINT(google-build-using-namespace): the shared index test helpers

namespace {

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
  auto r = index.Reserve(flexkv::kRootParent, Chain({5, 6}));
  CHECK(r.shortfall == StatusCode::kOk);
  CHECK(r.slots.size() == 2);
  index.Commit(r.slots);
  CHECK(index.Match(a, false, nullptr) == 2);  // survived although least recently stored
  CHECK(index.Match(b, false, nullptr) == 0);  // evicted instead
  CHECK(index.evicted_blocks() == 2);
  index.Unpin(pinned);
  index.CheckInvariants();
}

// Issue 29 item 6: eviction takes blocks the next tier holds (clean) before the others, as a page cache does, and a
// store told not to evict dirty blocks stops where only dirty ones are left (it waits for the write-back).
TEST_CASE("prefix index: clean leaves are evicted before dirty ones, and a store may refuse to evict dirty ones",
          "[unit][index]") {
  PrefixIndex index(4);
  const auto a = Store(index, Chain({1}));  // least recently used
  const auto b = Store(index, Chain({2}));
  const auto c = Store(index, Chain({3}));
  const auto d = Store(index, Chain({4}));
  index.SetClean(c[0], true);
  CHECK(index.clean_leaves() == 1);
  CHECK(index.EvictionOrder() == std::vector<SlotId>{c[0], a[0], b[0], d[0]});
  index.CheckInvariants();
  // Not allowed to evict dirty blocks: the clean one goes, then the store stops, saying why.
  auto r = index.Reserve(flexkv::kRootParent, Chain({5, 6}), /*allow_dirty=*/false);
  CHECK(r.slots.size() == 1);
  CHECK(r.shortfall == StatusCode::kResourceExhausted);
  CHECK(r.dirty_only);
  CHECK(index.Match(Chain({3}), false, nullptr) == 0);
  CHECK(index.Match(Chain({1}), false, nullptr) == 1);
  index.Abort(r.slots);
  index.CheckInvariants();
  // Allowed: the least recently used dirty leaf goes (1 was just matched: 2 is now the oldest).
  r = index.Reserve(flexkv::kRootParent, Chain({7}));
  REQUIRE(r.slots.size() == 1);
  index.Commit(r.slots);
  r = index.Reserve(flexkv::kRootParent, Chain({8}));
  REQUIRE(r.slots.size() == 1);
  CHECK_FALSE(r.dirty_only);
  index.Commit(r.slots);
  CHECK(index.Match(Chain({2}), false, nullptr) == 0);
  // Marked dirty again (dropped from the next tier), a block goes back to the dirty list; pinned blocks keep the mark.
  const auto e = Store(index, Chain({1, 9}));
  index.SetClean(e[1], true);
  std::vector<SlotId> pinned;
  REQUIRE(index.Match(Chain({1, 9}), true, &pinned) == 2);
  index.SetClean(e[1], false);
  index.SetClean(e[1], true);
  index.Unpin(pinned);
  CHECK(index.clean_leaves() == 1);
  index.SetClean(e[1], false);
  CHECK(index.clean_leaves() == 0);
  index.CheckInvariants();
}

// A store of the part of a prompt past its cached prefix names that prefix's last key as its parent.
TEST_CASE("prefix index: a store under a parent hangs its first key there - a match from the root reaches it",
          "[unit][index]") {
  PrefixIndex index(64);
  const auto prompt = Chain({1, 2, 3, 4, 5, 6, 7, 8});
  const std::span<const BlockKey> keys(prompt);
  auto head = index.Reserve(flexkv::kRootParent, keys.first(5));
  REQUIRE(head.slots.size() == 5);
  index.Commit(head.slots);
  auto tail = index.Reserve(prompt[4], keys.subspan(5));
  CHECK_FALSE(tail.parent_refused);
  CHECK(tail.shortfall == StatusCode::kOk);
  CHECK(tail.cached == 0);
  REQUIRE(tail.slots.size() == 3);
  index.Commit(tail.slots);
  CHECK(index.Match(prompt, false, nullptr) == 8);
  CHECK(index.Match(keys.subspan(5), false, nullptr) == 0);  // not a root: only reachable through its prefix
  CHECK(PrefixClosed(index));
  std::map<MKey, MKey> parent_of;
  index.ForEachCommitted([&](SlotId, const BlockKey& k, const BlockKey& p) { parent_of[M(k)] = M(p); });
  CHECK(parent_of.at(M(prompt[5])) == M(prompt[4]));

  // Keys already cached under that parent are skipped; the rest hang under the last of them.
  const auto longer = Chain({1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  auto more = index.Reserve(longer[4], std::span<const BlockKey>(longer).subspan(5));
  CHECK(more.cached == 3);
  REQUIRE(more.slots.size() == 2);
  index.Commit(more.slots);
  CHECK(index.Match(longer, false, nullptr) == 10);
  index.CheckInvariants();
}

TEST_CASE("prefix index: a store whose parent is not cached is refused and stores nothing", "[unit][index]") {
  PrefixIndex index(4);
  const auto prompt = Chain({1, 2, 3, 4});
  const std::span<const BlockKey> keys(prompt);

  SECTION("never stored") {
    auto r = index.Reserve(prompt[1], keys.subspan(2));
    CHECK(r.parent_refused);
    CHECK(r.shortfall == StatusCode::kFailedPrecondition);
    CHECK(r.slots.empty());
    CHECK(index.used_slots() == 0);
  }
  SECTION("evicted") {
    Store(index, Prefix(prompt, 2));
    Store(index, Chain({7, 8}));  // pool full
    Store(index, Chain({9, 9}));  // evicts the prompt's two blocks, the least recently used
    REQUIRE(index.Match(prompt, false, nullptr) == 0);
    const uint32_t used = index.used_slots();
    auto r = index.Reserve(prompt[1], keys.subspan(2));
    CHECK(r.parent_refused);
    CHECK(r.shortfall == StatusCode::kFailedPrecondition);
    CHECK(r.slots.empty());
    CHECK(index.used_slots() == used);
    CHECK(index.evicted_blocks() == 2);  // nothing evicted for the refused store
  }
  SECTION("pending in a store not yet committed") {
    auto head = index.Reserve(flexkv::kRootParent, keys.first(2));
    REQUIRE(head.slots.size() == 2);
    auto r = index.Reserve(prompt[1], keys.subspan(2));
    CHECK(r.parent_refused);
    CHECK(r.shortfall == StatusCode::kAborted);
    CHECK(r.slots.empty());
    CHECK(index.used_slots() == 2);
    index.Abort(head.slots);  // the refused store left nothing under the pending parent
    CHECK(index.used_slots() == 0);
  }
  CHECK(PrefixClosed(index));
  index.CheckInvariants();
}

TEST_CASE("prefix index: a store never evicts its own parent - refused or not, nothing becomes a stray root",
          "[unit][index]") {
  PrefixIndex index(4);
  const auto prompt = Chain({1, 2, 3});
  const std::span<const BlockKey> keys(prompt);
  Store(index, Prefix(prompt, 2));
  Store(index, Chain({7, 8}));  // pool full; the prompt's blocks are the least recently used
  std::vector<SlotId> pinned;
  REQUIRE(index.Match(Chain({7, 8}), true, &pinned) == 2);
  // The only evictable block is the parent itself: the store must not take it.
  REQUIRE(index.EvictionOrder().size() == 1);
  auto r = index.Reserve(prompt[1], keys.subspan(2));
  CHECK_FALSE(r.parent_refused);
  CHECK(r.shortfall == StatusCode::kResourceExhausted);
  CHECK(r.slots.empty());
  CHECK(index.Match(prompt, false, nullptr) == 2);
  CHECK(index.evicted_blocks() == 0);
  index.Unpin(pinned);
  CHECK(PrefixClosed(index));
  index.CheckInvariants();
}

TEST_CASE("prefix index: the parent of a pending store is not evicted before its commit", "[unit][index]") {
  PrefixIndex index(3);
  const auto prompt = Chain({1, 2, 3});
  const std::span<const BlockKey> keys(prompt);
  Store(index, Prefix(prompt, 2));
  auto r = index.Reserve(prompt[1], keys.subspan(2));
  REQUIRE(r.slots.size() == 1);  // the last free slot
  // Other stores churn the pool meanwhile: nothing of the pending store's chain is evictable.
  for (int32_t t = 10; t < 20; ++t) {
    auto other = index.Reserve(flexkv::kRootParent, Chain({t}));
    CHECK(other.shortfall == StatusCode::kResourceExhausted);
    CHECK(other.slots.empty());
  }
  CHECK(index.evicted_blocks() == 0);
  index.Commit(r.slots);
  CHECK(index.Match(prompt, false, nullptr) == 3);
  CHECK(PrefixClosed(index));
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
  auto r = index.Reserve(flexkv::kRootParent, longer);
  CHECK(r.cached == 3);
  CHECK(r.slots.size() == 1);  // the one free slot
  CHECK(r.shortfall == StatusCode::kResourceExhausted);
  index.Commit(r.slots);
  CHECK(index.Match(longer, false, nullptr) == 4);
  // The new leaf is evictable, but not by a store of its own chain.
  auto r2 = index.Reserve(flexkv::kRootParent, longer);
  CHECK(r2.cached == 4);
  CHECK(r2.slots.empty());
  CHECK(r2.shortfall == StatusCode::kResourceExhausted);
  CHECK(index.Match(longer, false, nullptr) == 4);
  CHECK(index.evicted_blocks() == 0);
  // Another chain may evict that leaf, not the pinned ones.
  auto r3 = index.Reserve(flexkv::kRootParent, Chain({9, 9}));
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
  auto r = index.Reserve(flexkv::kRootParent, Chain({7, 8, 9}));  // 1 free + 2 evictions
  REQUIRE(r.slots.size() == 3);
  REQUIRE(evicted.size() == 2);
  CHECK(evicted[0] == std::make_pair(sb[2], b[2]));
  CHECK(evicted[1] == std::make_pair(sc[0], c[0]));
  CHECK(r.slots[1] == sb[2]);  // an evicted slot is reused at once
  CHECK(r.slots[2] == sc[0]);
  CHECK(PrefixClosed(index));
  index.Commit(r.slots);
  // Next: a's leaf, then its parents (uncovered leaves go to the LRU end), never cutting the chain.
  auto r2 = index.Reserve(flexkv::kRootParent, Chain({7, 8, 9, 10, 11}));
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
  auto r = index.Reserve(flexkv::kRootParent, Chain({4}));
  REQUIRE(r.slots == std::vector<SlotId>{sab[1]});
  CHECK(index.EvictionOrder() == std::vector<SlotId>{sab[0], sx[0]});
  index.Commit(r.slots);
  CHECK(index.EvictionOrder() == std::vector<SlotId>{sab[0], sx[0], sab[1]});
}

TEST_CASE("prefix index: pending blocks are neither matchable nor evictable", "[unit][index]") {
  PrefixIndex index(3);
  const auto abc = Chain({1, 2, 3});
  auto r = index.Reserve(flexkv::kRootParent, abc);
  REQUIRE(r.slots.size() == 3);
  CHECK(index.used_slots() == 3);
  CHECK(index.committed_blocks() == 0);
  CHECK(index.Match(abc, false, nullptr) == 0);
  auto other = index.Reserve(flexkv::kRootParent, Chain({4}));
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
  auto r = index.Reserve(flexkv::kRootParent, longer);
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
  auto again = index.Reserve(flexkv::kRootParent, longer);
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
  auto first = index.Reserve(flexkv::kRootParent, Prefix(abcd, 3));
  REQUIRE(first.cached == 1);
  REQUIRE(first.slots.size() == 2);
  auto second = index.Reserve(flexkv::kRootParent, abcd);
  CHECK(second.cached == 1);
  CHECK(second.slots.empty());
  CHECK(second.shortfall == StatusCode::kAborted);
  index.Commit(first.slots);
  auto third = index.Reserve(flexkv::kRootParent, abcd);
  CHECK(third.cached == 3);
  CHECK(third.slots.size() == 1);
  CHECK(third.shortfall == StatusCode::kOk);
  // A store that overlaps only past the pending point keeps its own part.
  auto fourth = index.Reserve(flexkv::kRootParent, Chain({1, 2, 3, 4, 5}));
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
  auto r = index.Reserve(flexkv::kRootParent, Chain({5, 6}));
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
    // the cached prefix, then `missing[cut]`, then keys already present
    auto r = index.Reserve(flexkv::kRootParent, missing);
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
    auto r = index.Reserve(flexkv::kRootParent, keys);
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

}  // namespace

namespace {

TEST_CASE("prefix index: unverified nodes are not matchable or evictable until verified, parents first",
          "[unit][index][checksum]") {
  PrefixIndex index(6);
  const auto abc = Chain({1, 2, 3});
  REQUIRE(index.RestoreUnverified(4, abc[0], BlockKey{}).ok());
  REQUIRE(index.RestoreUnverified(1, abc[1], abc[0]).ok());
  REQUIRE(index.RestoreUnverified(2, abc[2], abc[1]).ok());
  index.CheckInvariants();
  CHECK(index.unverified_blocks() == 3);
  CHECK(index.committed_blocks() == 0);
  CHECK(index.Match(abc, false, nullptr) == 0);
  CHECK(index.EvictionOrder().empty());
  CHECK(index.Reserve(flexkv::kRootParent, abc).shortfall == StatusCode::kAborted);  // its key is taken, as by a store in flight
  CHECK_FALSE(index.MarkVerified(1));  // its parent is not verified yet
  CHECK(index.MarkVerified(4));
  CHECK(index.MarkVerified(1));
  CHECK(index.Match(abc, false, nullptr) == 2);
  CHECK(index.EvictionOrder().empty());  // slot 1 has an unverified child
  index.CheckInvariants();
  CHECK(index.MarkVerified(2));
  CHECK_FALSE(index.MarkVerified(2));
  CHECK(index.EvictionOrder() == std::vector<SlotId>{2});
  CHECK(index.unverified_blocks() == 0);
  index.CheckInvariants();
}

TEST_CASE("prefix index: DropSubtrees takes a node and its descendants out at once - pinned slots and pending "
          "stores are freed when released",
          "[unit][index][checksum]") {
  PrefixIndex index(8);
  const auto abcd = Chain({1, 2, 3, 4});
  const auto other = Chain({9});
  Store(index, abcd);
  Store(index, other);
  std::vector<SlotId> pinned;
  REQUIRE(index.Match(Prefix(abcd, 3), true, &pinned) == 3);  // a load holds a, b, c
  const auto abcde = Chain({1, 2, 3, 4, 5});
  auto pending = index.Reserve(flexkv::kRootParent, abcde);  // a store extends the chain
  REQUIRE(pending.slots.size() == 1);
  std::vector<SlotId> seen;
  const SlotId b = pinned[1];
  CHECK(index.DropSubtrees(std::vector<SlotId>{b}, [&](SlotId s) { seen.push_back(s); }) == 3);  // b, c, d
  std::sort(seen.begin(), seen.end());
  CHECK(seen.size() == 3);
  index.CheckInvariants();
  CHECK(index.Match(abcde, false, nullptr) == 1);
  CHECK(index.Match(other, false, nullptr) == 1);
  CHECK(index.committed_blocks() == 2);
  CHECK(index.used_slots() == 6);  // a and other; b, c, d held by pins and the pending child e; e
  // Dropped nodes cannot be pinned by slot; committed ones can.
  CHECK_FALSE(index.PinSlot(b));
  CHECK(index.PinSlot(pinned[0]));
  index.Unpin(std::vector<SlotId>{pinned[0]});
  index.Unpin(pinned);
  index.CheckInvariants();
  CHECK(index.used_slots() == 6);  // b, c, d still lead to the pending e
  index.Commit(pending.slots);  // the store under the dropped chain ends: nothing is published
  CHECK_FALSE(index.IsCommitted(pending.slots[0]));
  CHECK(index.used_slots() == 2);
  CHECK(index.EvictionOrder().size() == 2);
  index.CheckInvariants();
  // The dropped keys can be stored again.
  Store(index, abcd);
  CHECK(index.Match(abcd, false, nullptr) == 4);
  index.CheckInvariants();
}

}  // namespace
