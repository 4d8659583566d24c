// ComponentIndex and the hybrid hit rule: focused cases (the hit rule on hand-built prefixes; reserve, commit,
// eviction order, anchoring, drops, restore). Randomized runs against reference models:
// component_index_model_test.cc.
#include <catch2/catch.hpp>

#include <cstdint>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "daemon/cache/component_index.h"
#include "tests/unit/daemon/cache/prefix_index_test_util.h"

namespace {

using flexkv::BlockKey;
using flexkv::ComponentIndex;
using flexkv::ComponentRule;
using flexkv::LongestUsableEnd;
using flexkv::SlotId;
using flexkv::StatusCode;
using flexkv::testing::index::Mix;

constexpr SlotId kNoSlot = ComponentIndex::kNoSlot;

BlockKey Key(uint64_t i) { return BlockKey{Mix(i), Mix(i ^ 0xC0FFEE)}; }

// The hit rule over per-component sets of present block indices (component c = 1.. is present[c - 1]).
size_t UsableEnd(size_t full_prefix, const std::vector<ComponentRule>& rules,
                 const std::vector<std::set<size_t>>& present) {
  return LongestUsableEnd(full_prefix, rules, [&](size_t c, size_t j) {
    REQUIRE(c >= 1);
    REQUIRE(c <= present.size());
    REQUIRE(j < full_prefix);
    return present[c - 1].count(j) != 0;
  });
}

std::set<size_t> AllBut(size_t n, std::set<size_t> missing) {
  std::set<size_t> s;
  for (size_t j = 0; j < n; ++j) {
    if (missing.count(j) == 0) s.insert(j);
  }
  return s;
}

const ComponentRule kWindow3{false, 3};
const ComponentRule kState{true, 0};

TEST_CASE("hit rule: no FULL prefix is no hit, and a FULL-only geometry hits its whole prefix", "[unit][cache][component]") {
  CHECK(UsableEnd(0, {kWindow3, kState}, {{}, {}}) == 0);
  CHECK(UsableEnd(7, {}, {}) == 7);
}

TEST_CASE("hit rule: a window partly evicted makes the ends whose window holds the hole unusable", "[unit][cache][component]") {
  // 10 blocks, window 3. A hole at 8 rules out e = 10 ([7,10)) and e = 9 ([6,9)); e = 8 ([5,8)) avoids it.
  CHECK(UsableEnd(10, {kWindow3}, {AllBut(10, {8})}) == 8);
  // Holes at 1, 5 and 8: e = 8 needs 5; e = 5 ([2,5)) avoids both 1 and 5.
  CHECK(UsableEnd(10, {kWindow3}, {AllBut(10, {1, 5, 8})}) == 5);
  // Holes every other block: no window of 3 fits anywhere.
  CHECK(UsableEnd(10, {kWindow3}, {{1, 3, 5, 7, 9}}) == 0);
  // Holes at 0 and 2 with a window of 2: e = 4 needs 2, e = 2 needs 0; e = 1's window [0,1) needs 0 too.
  CHECK(UsableEnd(4, {ComponentRule{false, 2}}, {AllBut(4, {0, 2})}) == 0);
  // Only the window matters: blocks before it may all be gone.
  CHECK(UsableEnd(10, {kWindow3}, {{7, 8, 9}}) == 10);
}

TEST_CASE("hit rule: a state missing at the longest end but present at a shorter one", "[unit][cache][component]") {
  // Snapshots at e = 4 and e = 7 (stored under the keys of blocks 3 and 6).
  CHECK(UsableEnd(10, {kState}, {{3, 6}}) == 7);
  CHECK(UsableEnd(10, {kState}, {{9}}) == 10);
  CHECK(UsableEnd(10, {kState}, {{}}) == 0);
  // A snapshot past the FULL prefix does not count.
  CHECK(UsableEnd(5, {kState}, {{2}}) == 3);
}

TEST_CASE("hit rule: a window larger than the prefix needs the whole prefix", "[unit][cache][component]") {
  const ComponentRule wide{false, 8};
  CHECK(UsableEnd(3, {wide}, {{0, 1, 2}}) == 3);
  CHECK(UsableEnd(3, {wide}, {{1, 2}}) == 0);   // every end's window starts at 0
  CHECK(UsableEnd(3, {wide}, {{0, 1}}) == 2);   // e = 2 needs [0,2) only
}

TEST_CASE("hit rule: a window of 0 blocks needs nothing", "[unit][cache][component]") {
  CHECK(UsableEnd(4, {ComponentRule{false, 0}}, {{}}) == 4);
}

TEST_CASE("hit rule: a window and a state together", "[unit][cache][component]") {
  // 12 blocks; window of 4 with block 9 missing; snapshots at e = 5, 8 and 11.
  // e = 11: the state is there but [7,11) holds the hole; e = 9: no state; e = 8: [4,8) and the state at 8.
  const std::vector<ComponentRule> rules = {ComponentRule{false, 4}, kState};
  CHECK(UsableEnd(12, rules, {AllBut(12, {9}), {4, 7, 10}}) == 8);
  // Two windows and a state, each failing at a different end.
  const std::vector<ComponentRule> three = {ComponentRule{false, 2}, ComponentRule{false, 5}, kState};
  // window 2 lacks 7 (ends 8, 9 out); window 5 lacks 2 (ends 3..7 out); states at 10, 9, 2.
  CHECK(UsableEnd(10, three, {AllBut(10, {7}), AllBut(10, {2}), {9, 8, 1}}) == 10);
  CHECK(UsableEnd(9, three, {AllBut(10, {7}), AllBut(10, {2}), {8, 1}}) == 2);
}

TEST_CASE("hit rule: with everything cached a window costs w lookups and a state one", "[unit][cache][component]") {
  size_t calls = 0;
  const std::vector<ComponentRule> rules = {ComponentRule{false, 4}, kState};
  const size_t e = LongestUsableEnd(100000, rules, [&](size_t, size_t) {
    ++calls;
    return true;
  });
  CHECK(e == 100000);
  CHECK(calls == 5);
}

// ---------------------------------------------------------------------------------------------------------
// ComponentIndex

// Reserves and commits `keys`; every key must need a slot. Returns the slots.
std::vector<SlotId> Store(ComponentIndex& index, const std::vector<BlockKey>& keys) {
  auto r = index.Reserve(keys);
  REQUIRE(r.shortfall == StatusCode::kOk);
  REQUIRE(r.slots.size() == keys.size());
  index.Commit(r.slots);
  return r.slots;
}

TEST_CASE("component index: reserve, commit, find", "[unit][cache][component]") {
  ComponentIndex index(4);
  auto r = index.Reserve(std::vector<BlockKey>{Key(1), Key(2)});
  REQUIRE(r.shortfall == StatusCode::kOk);
  REQUIRE(r.slots == std::vector<SlotId>{0, 1});
  CHECK_FALSE(index.Find(Key(1)).has_value());  // pending: not findable
  CHECK_FALSE(index.IsCommitted(0));
  CHECK(index.used_slots() == 2);
  CHECK(index.EvictionOrder().empty());  // pending: not evictable
  index.Commit(r.slots);
  CHECK(index.Find(Key(1)) == std::optional<SlotId>{0});
  CHECK(index.Find(Key(2)) == std::optional<SlotId>{1});
  CHECK(index.IsCommitted(1));
  CHECK(index.committed_entries() == 2);
  // A key already committed needs no slot.
  auto again = index.Reserve(std::vector<BlockKey>{Key(1), Key(3)});
  REQUIRE(again.shortfall == StatusCode::kOk);
  CHECK(again.slots == std::vector<SlotId>{kNoSlot, 2});
  index.Abort(std::vector<SlotId>{2});
  CHECK_FALSE(index.Find(Key(3)).has_value());
  CHECK(index.used_slots() == 2);
  index.CheckInvariants();
}

TEST_CASE("component index: a reservation larger than free and evictable slots takes nothing", "[unit][cache][component]") {
  ComponentIndex index(3);
  const auto slots = Store(index, {Key(1), Key(2), Key(3)});
  index.Pin(slots[0]);
  // Two slots are evictable (keys 2 and 3), three are needed.
  auto r = index.Reserve(std::vector<BlockKey>{Key(4), Key(5), Key(6)});
  CHECK(r.shortfall == StatusCode::kResourceExhausted);
  CHECK(r.slots.empty());
  CHECK(index.evicted_entries() == 0);
  CHECK(index.used_slots() == 3);
  for (uint64_t i : {1, 2, 3}) CHECK(index.Find(Key(i)).has_value());
  // The store's own committed entry does not count as evictable: key 2 stays, so only key 3 could go.
  auto own = index.Reserve(std::vector<BlockKey>{Key(2), Key(4), Key(5)});
  CHECK(own.shortfall == StatusCode::kResourceExhausted);
  CHECK(index.evicted_entries() == 0);
  // One new key: key 2 is the least recently used, yet key 3 is evicted since key 2 is part of the store.
  auto fits = index.Reserve(std::vector<BlockKey>{Key(2), Key(4)});
  REQUIRE(fits.shortfall == StatusCode::kOk);
  CHECK(fits.slots == std::vector<SlotId>{kNoSlot, slots[2]});
  CHECK(index.Find(Key(2)) == std::optional<SlotId>{slots[1]});
  CHECK_FALSE(index.Find(Key(3)).has_value());
  CHECK(index.Find(Key(1)) == std::optional<SlotId>{slots[0]});  // pinned
  index.Commit(std::vector<SlotId>{fits.slots[1]});
  index.Unpin(std::vector<SlotId>{slots[0]});
  index.CheckInvariants();
}

TEST_CASE("component index: pinned entries are never evicted", "[unit][cache][component]") {
  ComponentIndex index(2);
  const auto slots = Store(index, {Key(1), Key(2)});
  index.Pin(slots[0]);
  index.Pin(slots[1]);
  CHECK(index.pinned_slots() == 2);
  CHECK(index.Reserve(std::vector<BlockKey>{Key(3)}).shortfall == StatusCode::kResourceExhausted);
  index.Unpin(std::vector<SlotId>{slots[1]});
  auto r = index.Reserve(std::vector<BlockKey>{Key(3)});
  REQUIRE(r.shortfall == StatusCode::kOk);
  CHECK(r.slots == std::vector<SlotId>{slots[1]});
  CHECK(index.Find(Key(1)).has_value());
  index.Commit(r.slots);
  index.Unpin(std::vector<SlotId>{slots[0]});
  CHECK(index.pinned_slots() == 0);
  index.CheckInvariants();
}

TEST_CASE("component index: pin marks an entry used", "[unit][cache][component]") {
  ComponentIndex index(3);
  const auto slots = Store(index, {Key(1), Key(2), Key(3)});
  CHECK(index.EvictionOrder() == slots);
  index.Pin(slots[0]);
  index.Unpin(std::vector<SlotId>{slots[0]});
  CHECK(index.EvictionOrder() == std::vector<SlotId>{slots[1], slots[2], slots[0]});
  // Find does not.
  CHECK(index.Find(Key(2)).has_value());
  CHECK(index.EvictionOrder() == std::vector<SlotId>{slots[1], slots[2], slots[0]});
}

TEST_CASE("component index: a store's cold entries go to the cold end, its first first, and a hit warms them",
          "[unit][cache][component]") {
  ComponentIndex index(6);
  const auto older = Store(index, {Key(1)});
  // A store of 4 window blocks whose first 3 lie before its trailing window: they go in ahead of the older entry.
  auto r = index.Reserve(std::vector<BlockKey>{Key(10), Key(11), Key(12), Key(13)});
  REQUIRE(r.shortfall == StatusCode::kOk);
  index.Commit(r.slots, 3);
  CHECK(index.EvictionOrder() == std::vector<SlotId>{r.slots[0], r.slots[1], r.slots[2], older[0], r.slots[3]});
  index.Pin(r.slots[1]);
  index.Unpin(std::vector<SlotId>{r.slots[1]});
  CHECK(index.EvictionOrder() == std::vector<SlotId>{r.slots[0], r.slots[2], older[0], r.slots[3], r.slots[1]});
  // The next store that needs room evicts the coldest first.
  std::vector<BlockKey> evicted;
  index.SetEvictionListener([&](SlotId, const BlockKey& k) { evicted.push_back(k); });
  auto more = index.Reserve(std::vector<BlockKey>{Key(20), Key(21)});
  REQUIRE(more.shortfall == StatusCode::kOk);
  index.Commit(more.slots);
  CHECK(evicted == std::vector<BlockKey>{Key(10)});  // one slot was free
  index.CheckInvariants();
}

TEST_CASE("component index: unanchored entries are evicted before anchored ones, and Anchor takes them back", "[unit][cache][component]") {
  ComponentIndex index(4);
  std::vector<std::pair<SlotId, BlockKey>> evicted;
  index.SetEvictionListener([&](SlotId s, const BlockKey& k) { evicted.emplace_back(s, k); });
  const auto slots = Store(index, {Key(1), Key(2), Key(3), Key(4)});
  index.Unanchor(Key(4));  // the most recently used
  index.Unanchor(Key(2));
  CHECK(index.unanchored_entries() == 2);
  CHECK(index.EvictionOrder() == std::vector<SlotId>{slots[3], slots[1], slots[0], slots[2]});
  index.Unanchor(Key(4));            // already unanchored: no change
  index.Unanchor(Key(99));           // no entry: no-op
  index.Anchor(Key(2));              // back among the anchored, as just used
  CHECK(index.unanchored_entries() == 1);
  CHECK(index.EvictionOrder() == std::vector<SlotId>{slots[3], slots[0], slots[2], slots[1]});
  auto r = index.Reserve(std::vector<BlockKey>{Key(5), Key(6)});
  REQUIRE(r.shortfall == StatusCode::kOk);
  CHECK(r.slots == std::vector<SlotId>{slots[3], slots[0]});
  REQUIRE(evicted.size() == 2);
  CHECK(evicted[0] == std::pair<SlotId, BlockKey>{slots[3], Key(4)});
  CHECK(evicted[1] == std::pair<SlotId, BlockKey>{slots[0], Key(1)});
  CHECK(index.unanchored_entries() == 0);
  CHECK(index.evicted_entries() == 2);
  index.Commit(r.slots);
  index.CheckInvariants();
}

TEST_CASE("component index: an entry unanchored while pending is unanchored once committed", "[unit][cache][component]") {
  ComponentIndex index(3);
  const auto old = Store(index, {Key(1)});
  auto r = index.Reserve(std::vector<BlockKey>{Key(2)});
  REQUIRE(r.shortfall == StatusCode::kOk);
  index.Unanchor(Key(2));  // its FULL block was evicted while the store copied
  CHECK(index.unanchored_entries() == 0);
  index.Commit(r.slots);
  CHECK(index.unanchored_entries() == 1);
  CHECK(index.EvictionOrder() == std::vector<SlotId>{r.slots[0], old[0]});
  index.CheckInvariants();
}

TEST_CASE("component index: a key pending in another store or unverified refuses the reservation", "[unit][cache][component]") {
  ComponentIndex index(8);
  auto first = index.Reserve(std::vector<BlockKey>{Key(1)});
  REQUIRE(first.shortfall == StatusCode::kOk);
  auto second = index.Reserve(std::vector<BlockKey>{Key(2), Key(1)});
  CHECK(second.shortfall == StatusCode::kAborted);
  CHECK(second.slots.empty());
  CHECK(index.used_slots() == 1);
  REQUIRE(index.RestoreUnverified(5, Key(3)).ok());
  CHECK(index.Reserve(std::vector<BlockKey>{Key(3)}).shortfall == StatusCode::kAborted);
  CHECK(index.used_slots() == 2);
  index.Commit(first.slots);
  index.CheckInvariants();
}

TEST_CASE("component index: a repeated key in one reservation reserves nothing", "[unit][cache][component]") {
  ComponentIndex index(8);
  auto r = index.Reserve(std::vector<BlockKey>{Key(1), Key(2), Key(1)});
  CHECK(r.shortfall == StatusCode::kAborted);
  CHECK(r.slots.empty());
  CHECK(index.used_slots() == 0);
  index.CheckInvariants();
  // Not enough room for the repeated count: refused as exhausted, equally with nothing reserved.
  ComponentIndex small(2);
  auto s = small.Reserve(std::vector<BlockKey>{Key(1), Key(2), Key(1)});
  CHECK(s.shortfall == StatusCode::kResourceExhausted);
  CHECK(small.used_slots() == 0);
  // Room only by evicting: the entries evicted on the way stay evicted (the contract says so), nothing is reserved.
  ComponentIndex full(2);
  Store(full, {Key(1), Key(2)});
  auto f = full.Reserve(std::vector<BlockKey>{Key(3), Key(3)});
  CHECK(f.shortfall == StatusCode::kAborted);
  CHECK(f.slots.empty());
  CHECK(full.used_slots() == 0);
  CHECK(full.evicted_entries() == 2);
  full.CheckInvariants();
  CHECK(Store(full, {Key(4), Key(5)}).size() == 2);
  full.CheckInvariants();
}

TEST_CASE("component index: a dropped pinned entry is gone at once and its slot is freed by the last unpin", "[unit][cache][component]") {
  ComponentIndex index(4);
  std::vector<std::pair<SlotId, BlockKey>> gone;
  index.SetEvictionListener([&](SlotId s, const BlockKey& k) { gone.emplace_back(s, k); });
  const auto slots = Store(index, {Key(1), Key(2)});
  index.Pin(slots[0]);
  index.Pin(slots[0]);
  CHECK(index.Drop(std::vector<SlotId>{slots[0], 77}) == 1);
  CHECK(gone == std::vector<std::pair<SlotId, BlockKey>>{{slots[0], Key(1)}});
  CHECK_FALSE(index.Find(Key(1)).has_value());
  CHECK_FALSE(index.IsCommitted(slots[0]));
  CHECK(index.committed_entries() == 1);
  CHECK(index.used_slots() == 2);
  index.CheckInvariants();
  // The key may be stored again, in another slot: the dropped one is still read.
  auto r = index.Reserve(std::vector<BlockKey>{Key(1)});
  REQUIRE(r.shortfall == StatusCode::kOk);
  CHECK(r.slots[0] != slots[0]);
  index.Commit(r.slots);
  index.Unpin(std::vector<SlotId>{slots[0]});
  CHECK(index.used_slots() == 3);
  index.Unpin(std::vector<SlotId>{slots[0]});
  CHECK(index.used_slots() == 2);
  CHECK(index.pinned_slots() == 0);
  CHECK(gone.size() == 1);  // the listener ran at the drop, not again at the free
  index.CheckInvariants();
}

TEST_CASE("component index: an entry dropped while pending is freed by its commit", "[unit][cache][component]") {
  ComponentIndex index(4);
  int listened = 0;
  index.SetEvictionListener([&](SlotId, const BlockKey&) { ++listened; });
  auto r = index.Reserve(std::vector<BlockKey>{Key(1), Key(2)});
  REQUIRE(r.shortfall == StatusCode::kOk);
  CHECK(index.Drop(std::vector<SlotId>{r.slots[0]}) == 0);  // not counted: never published
  CHECK(listened == 0);
  // Its key is free for another store at once.
  auto other = index.Reserve(std::vector<BlockKey>{Key(1)});
  REQUIRE(other.shortfall == StatusCode::kOk);
  index.Commit(r.slots);
  CHECK_FALSE(index.IsCommitted(r.slots[0]));
  CHECK(index.IsCommitted(r.slots[1]));
  CHECK_FALSE(index.Find(Key(1)).has_value());
  CHECK(index.used_slots() == 2);
  index.CheckInvariants();
  // And by its abort.
  CHECK(index.Drop(other.slots) == 0);
  index.Abort(other.slots);
  CHECK(index.used_slots() == 1);
  CHECK(index.committed_entries() == 1);
  index.CheckInvariants();
}

TEST_CASE("component index: restored entries wait for verification", "[unit][cache][component]") {
  ComponentIndex index(4);
  std::vector<std::pair<SlotId, BlockKey>> gone;
  index.SetEvictionListener([&](SlotId s, const BlockKey& k) { gone.emplace_back(s, k); });
  REQUIRE(index.RestoreUnverified(2, Key(1)).ok());
  REQUIRE(index.RestoreUnverified(3, Key(2)).ok());
  CHECK(index.RestoreUnverified(2, Key(3)).code() == StatusCode::kFailedPrecondition);  // slot taken
  CHECK(index.RestoreUnverified(0, Key(1)).code() == StatusCode::kFailedPrecondition);  // key present
  CHECK(index.RestoreUnverified(4, Key(3)).code() == StatusCode::kFailedPrecondition);  // out of range
  CHECK(index.unverified_entries() == 2);
  CHECK(index.IsUnverified(2));
  CHECK_FALSE(index.Find(Key(1)).has_value());
  CHECK_FALSE(index.PinSlot(2));
  CHECK(index.EvictionOrder().empty());
  index.Unanchor(Key(2));  // its FULL block failed verification first
  // New stores take the free slots around them.
  CHECK(Store(index, {Key(5), Key(6)}) == std::vector<SlotId>{0, 1});
  index.Pin(0);
  index.Pin(1);
  CHECK(index.Reserve(std::vector<BlockKey>{Key(7)}).shortfall == StatusCode::kResourceExhausted);
  index.Unpin(std::vector<SlotId>{0, 1});
  CHECK(index.MarkVerified(2));
  CHECK_FALSE(index.MarkVerified(2));
  CHECK_FALSE(index.MarkVerified(0));
  CHECK(index.Find(Key(1)) == std::optional<SlotId>{2});
  REQUIRE(index.PinSlot(2));
  CHECK(index.EvictionOrder() == std::vector<SlotId>{0, 1});
  index.Unpin(std::vector<SlotId>{2});
  CHECK(index.EvictionOrder() == std::vector<SlotId>{0, 1, 2});
  CHECK(index.MarkVerified(3));
  CHECK(index.unanchored_entries() == 1);
  CHECK(index.EvictionOrder() == std::vector<SlotId>{3, 0, 1, 2});
  // A dropped unverified entry is freed at once and reported.
  REQUIRE(index.RestoreUnverified(3, Key(8)).code() == StatusCode::kFailedPrecondition);
  CHECK(index.Drop(std::vector<SlotId>{3}) == 1);
  REQUIRE(index.RestoreUnverified(3, Key(8)).ok());
  CHECK(index.Drop(std::vector<SlotId>{3}) == 1);
  CHECK(gone == std::vector<std::pair<SlotId, BlockKey>>{{3, Key(2)}, {3, Key(8)}});
  CHECK(index.used_slots() == 3);
  CHECK(index.unverified_entries() == 0);
  index.CheckInvariants();
}

TEST_CASE("component index: the eviction listener hears the evicted key before its slot is reused", "[unit][cache][component]") {
  ComponentIndex index(2);
  const auto slots = Store(index, {Key(1), Key(2)});
  std::vector<std::pair<SlotId, BlockKey>> heard;
  index.SetEvictionListener([&](SlotId s, const BlockKey& k) {
    heard.emplace_back(s, k);
    CHECK_FALSE(index.Find(k).has_value());  // gone from the index before anyone hears of it
    CHECK_FALSE(index.Find(Key(3)).has_value());  // the new key is not there yet
  });
  auto r = index.Reserve(std::vector<BlockKey>{Key(3)});
  REQUIRE(r.shortfall == StatusCode::kOk);
  CHECK(heard == std::vector<std::pair<SlotId, BlockKey>>{{slots[0], Key(1)}});
  CHECK(r.slots == std::vector<SlotId>{slots[0]});
  index.Commit(r.slots);
  index.CheckInvariants();
}

}  // namespace

TEST_CASE("component index: entries the next tier holds (clean) are evicted after the unanchored ones and before the "
          "others, and an entry unpinned cold goes to the end evicted first",
          "[unit][cache][component]") {
  ComponentIndex index(6);
  std::vector<BlockKey> keys;
  for (uint64_t i = 0; i < 6; ++i) keys.push_back(Key(100 + i));
  ComponentIndex::Reservation r = index.Reserve(keys);
  REQUIRE(r.shortfall == StatusCode::kOk);
  index.Commit(r.slots);  // LRU order: slots 0..5
  index.SetClean(r.slots[3], true);
  index.SetClean(r.slots[1], true);
  index.Unanchor(keys[5]);
  CHECK(index.clean_entries() == 2);
  // Unanchored first, then clean (an entry found written goes to the used end of the clean ones: slot 3 was marked
  // first), then dirty, least recently used first.
  CHECK(index.EvictionOrder() == std::vector<SlotId>{r.slots[5], r.slots[3], r.slots[1], r.slots[0], r.slots[2],
                                                     r.slots[4]});
  std::vector<SlotId> cold;
  index.ForEachCold(4, [&](SlotId s) {
    cold.push_back(s);
    return true;
  });
  CHECK(cold == std::vector<SlotId>{r.slots[5], r.slots[3], r.slots[1], r.slots[0]});
  // Pinned to be written, then unpinned cold and marked clean: the coldest clean entry.
  index.Pin(r.slots[2]);
  index.SetClean(r.slots[2], true);  // pinned: only marked, listed at its unpin
  index.Unpin(std::vector<SlotId>{r.slots[2]}, /*cold=*/true);
  CHECK(index.EvictionOrder() == std::vector<SlotId>{r.slots[5], r.slots[2], r.slots[3], r.slots[1], r.slots[0],
                                                     r.slots[4]});
  // Found gone from the next tier: dirty again, at the cold end of the dirty ones.
  index.SetClean(r.slots[3], false);
  CHECK(index.EvictionOrder() == std::vector<SlotId>{r.slots[5], r.slots[2], r.slots[1], r.slots[3], r.slots[0],
                                                     r.slots[4]});
  index.CheckInvariants();
  // A store of two new keys evicts the unanchored entry and the coldest clean one; the counts see clean entries as
  // available.
  const std::vector<BlockKey> more = {Key(200), Key(201)};
  CHECK(index.Feasible(more) == StatusCode::kOk);
  ComponentIndex::Reservation m = index.Reserve(more);
  REQUIRE(m.shortfall == StatusCode::kOk);
  CHECK(std::set<SlotId>(m.slots.begin(), m.slots.end()) == std::set<SlotId>{r.slots[5], r.slots[2]});
  index.Commit(m.slots);
  CHECK_FALSE(index.Find(keys[2]).has_value());
  CHECK(index.clean_entries() == 1);  // slot 1's; a new entry starts dirty
  index.CheckInvariants();
}

TEST_CASE("component index: a reservation fits without a dirty eviction when the evictions it would make are all "
          "of clean entries, unanchored or not",
          "[unit][cache][component]") {
  ComponentIndex index(6);
  std::vector<BlockKey> keys;
  for (uint64_t i = 0; i < 4; ++i) keys.push_back(Key(300 + i));
  ComponentIndex::Reservation r = index.Reserve(keys);
  REQUIRE(r.shortfall == StatusCode::kOk);
  index.Commit(r.slots);  // 4 dirty anchored entries (LRU order 0..3), 2 free slots
  const std::vector<BlockKey> two = {Key(400), Key(401)}, three = {Key(400), Key(401), Key(402)};
  CHECK(index.FitsWithoutDirty(two));               // the free slots
  CHECK_FALSE(index.FitsWithoutDirty(three));        // a third would evict a dirty entry
  CHECK(index.Feasible(three) == StatusCode::kOk);  // which an ordinary reservation may
  index.SetClean(r.slots[0], true);
  CHECK(index.FitsWithoutDirty(three));  // the clean one goes first
  // An unanchored entry is evicted before every anchored one: dirty, it is a loss (its prefix end's hit from the
  // next tier) and blocks the store; written, it is not.
  index.Unanchor(keys[1]);
  CHECK_FALSE(index.FitsWithoutDirty(three));
  index.SetClean(r.slots[1], true);
  CHECK(index.FitsWithoutDirty(three));
  const std::vector<BlockKey> four = {Key(400), Key(401), Key(402), Key(403)};
  CHECK(index.FitsWithoutDirty(four));  // the unanchored clean one, then the anchored clean one
  // The store's own entries are never evicted for it: a clean own entry is passed by.
  const std::vector<BlockKey> own = {Key(400), Key(401), Key(402), Key(403), keys[1]};
  CHECK_FALSE(index.FitsWithoutDirty(own));
  // Pinned entries are not evictable at all.
  index.Pin(r.slots[0]);
  CHECK_FALSE(index.FitsWithoutDirty(four));
  index.Unpin(std::vector<SlotId>{r.slots[0]});
  CHECK(index.FitsWithoutDirty(four));
  // What it answers is what a reservation does: four new keys evict exactly the two clean entries.
  ComponentIndex::Reservation m = index.Reserve(four);
  REQUIRE(m.shortfall == StatusCode::kOk);
  CHECK(index.EvictionOrder() == std::vector<SlotId>{r.slots[2], r.slots[3]});
  index.Abort(m.slots);
  index.CheckInvariants();
}
