// The indexes' elastic capacity: Grow hands out more slots, Shrink evicts what it can in the slots it gives back
// (a FULL block with its descendants), never hands those slots out again, and is held up by pinned, pending and
// unverified blocks until they go.
#include <catch2/catch.hpp>

#include <cstdint>
#include <random>
#include <set>
#include <span>
#include <vector>

#include "daemon/cache/component_index.h"
#include "daemon/cache/prefix_index.h"
#include "tests/unit/daemon/cache/prefix_index_test_util.h"

using flexkv::BlockKey;
using flexkv::ComponentIndex;
using flexkv::PrefixIndex;
using flexkv::SlotId;
using flexkv::StatusCode;
using namespace flexkv::testing::index;

namespace {

std::vector<BlockKey> Keys(uint64_t chain, size_t n) {
  std::vector<BlockKey> keys(n);
  for (size_t i = 0; i < n; ++i) keys[i] = BlockKey{chain * 1000 + i + 1, chain};
  return keys;
}

}  // namespace

TEST_CASE("prefix index: slots beyond the active capacity are never handed out until Grow", "[unit][index][elastic]") {
  PrefixIndex index(16, 8);
  CHECK(index.capacity() == 16);
  CHECK(index.active() == 8);
  const std::vector<BlockKey> keys = Chain({1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  auto r = index.Reserve(flexkv::kRootParent, keys);
  CHECK(r.shortfall == StatusCode::kResourceExhausted);
  REQUIRE(r.slots.size() == 8);
  for (SlotId s : r.slots) CHECK(s < 8);
  index.Commit(r.slots);
  index.CheckInvariants();
  index.Grow(16);
  CHECK(index.active() == 16);
  auto more = index.Reserve(keys[7], std::span(keys).subspan(8));
  REQUIRE(more.slots.size() == 2);
  for (SlotId s : more.slots) CHECK(s >= 8);
  index.Commit(more.slots);
  CHECK(index.Match(keys, false, nullptr) == 10);
  index.CheckInvariants();
}

TEST_CASE("prefix index: a shrink evicts the blocks in the slots it gives back, and those slots are not reused",
          "[unit][index][elastic]") {
  PrefixIndex index(16);
  std::vector<SlotId> heard;
  index.SetEvictionListener([&](SlotId s, const BlockKey&) { heard.push_back(s); });
  const std::vector<BlockKey> keys = Chain({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12});
  REQUIRE(Store(index, keys).size() == 12);  // slots 0..11, in order
  const PrefixIndex::Shrunk shrunk = index.Shrink(8);
  CHECK(shrunk.active == 8);
  CHECK(shrunk.evicted == 4);
  CHECK(index.evicted_blocks() == 4);
  CHECK(std::set<SlotId>(heard.begin(), heard.end()) == std::set<SlotId>{8, 9, 10, 11});
  CHECK(index.Match(keys, false, nullptr) == 8);
  CHECK(PrefixClosed(index));
  index.CheckInvariants();
  // A full index evicts for a new store, and still hands out only slots below 8.
  const std::vector<BlockKey> other = Chain({50, 51, 52, 53, 54});
  auto r = index.Reserve(flexkv::kRootParent, other);
  REQUIRE(r.slots.size() == 5);
  for (SlotId s : r.slots) CHECK(s < 8);
  index.Commit(r.slots);
  index.CheckInvariants();
}

TEST_CASE("prefix index: a shrunk block's descendants go with it, wherever their slots are", "[unit][index][elastic]") {
  PrefixIndex index(16);
  const BlockKey a{1, 1}, b{2, 2}, c{3, 3}, d{4, 4}, e{5, 5};
  REQUIRE(index.Restore(12, a, BlockKey{}).ok());
  REQUIRE(index.Restore(3, b, a).ok());
  REQUIRE(index.Restore(4, c, b).ok());
  // A second chain whose tail block has a pinned child below the target: it holds the shrink.
  REQUIRE(index.Restore(13, d, BlockKey{}).ok());
  REQUIRE(index.Restore(5, e, d).ok());
  REQUIRE(index.PinSlot(5));
  std::set<SlotId> heard;
  index.SetEvictionListener([&](SlotId s, const BlockKey&) { heard.insert(s); });
  const PrefixIndex::Shrunk shrunk = index.Shrink(8);
  CHECK(heard == std::set<SlotId>{12, 3, 4});
  CHECK(shrunk.evicted == 3);
  CHECK(shrunk.active == 14);  // slot 13 (d) stays: its child is pinned
  const std::vector<BlockKey> abc{a, b, c};
  CHECK(index.Match(abc, false, nullptr) == 0);
  const std::vector<BlockKey> de{d, e};
  CHECK(index.Match(de, false, nullptr) == 2);
  CHECK(PrefixClosed(index));
  index.CheckInvariants();
  const SlotId pinned = 5;
  index.Unpin(std::span(&pinned, 1));
  const PrefixIndex::Shrunk again = index.Shrink(8);
  CHECK(again.active == 8);
  CHECK(again.evicted == 2);
  CHECK(index.committed_blocks() == 0);
  index.CheckInvariants();
}

TEST_CASE("prefix index: pinned, pending and unverified blocks in the tail hold a shrink until they go",
          "[unit][index][elastic]") {
  PrefixIndex index(16);
  const std::vector<BlockKey> x = Chain({1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  const std::vector<BlockKey> y = Chain({20, 21, 22});
  REQUIRE(Store(index, x).size() == 10);  // slots 0..9
  std::vector<SlotId> y_slots = Store(index, y);  // slots 10..12
  REQUIRE(y_slots == std::vector<SlotId>{10, 11, 12});
  std::vector<SlotId> pinned;
  REQUIRE(index.Match(std::span(y).first(1), true, &pinned) == 1);  // y[0] at slot 10 pinned
  // A store in flight at slot 13, and an unverified block at slot 14.
  const std::vector<BlockKey> z = Chain({30});
  auto pending = index.Reserve(flexkv::kRootParent, z);
  REQUIRE(pending.slots == std::vector<SlotId>{13});
  const BlockKey restored{77, 77};
  REQUIRE(index.RestoreUnverified(14, restored, BlockKey{}).ok());

  PrefixIndex::Shrunk shrunk = index.Shrink(8);
  CHECK(shrunk.evicted == 4);  // x[8], x[9], and y[1], y[2] (under the pinned y[0], but not pinned themselves)
  CHECK(shrunk.active == 15);  // the unverified block at 14 is the highest that stays
  CHECK(index.Match(x, false, nullptr) == 8);
  CHECK(index.Match(y, false, nullptr) == 1);
  index.CheckInvariants();

  // Nothing new goes to a slot from 8 up meanwhile, even when eviction must make room (it evicts x[7]).
  const std::vector<BlockKey> w = Chain({40});
  auto r = index.Reserve(flexkv::kRootParent, w);
  REQUIRE(r.slots == std::vector<SlotId>{7});
  index.Abort(r.slots);

  index.Abort(pending.slots);
  index.MarkVerified(14);
  shrunk = index.Shrink(8);
  CHECK(shrunk.active == 11);  // the pinned y[0] at slot 10 still holds it
  index.Unpin(pinned);
  shrunk = index.Shrink(8);
  CHECK(shrunk.active == 8);
  CHECK(index.Match(x, false, nullptr) == 7);  // the blocks in the kept slots are still there
  index.CheckInvariants();
  index.Grow(16);
  CHECK(index.Match(x, false, nullptr) == 7);
  REQUIRE(Store(index, Chain({60, 61, 62, 63, 64, 65, 66, 67})).size() == 8);
  index.CheckInvariants();
}

TEST_CASE("component index: a shrink evicts its tail, is held by pinned and pending entries, and never reuses the tail",
          "[unit][index][elastic]") {
  ComponentIndex index(16);
  std::set<SlotId> heard;
  index.SetEvictionListener([&](SlotId s, const BlockKey&) { heard.insert(s); });
  const std::vector<BlockKey> keys = Keys(1, 16);
  auto first = index.Reserve(std::span(keys).first(14));
  REQUIRE(first.shortfall == StatusCode::kOk);
  index.Commit(first.slots);  // slots 0..13
  auto pending = index.Reserve(std::span(keys).subspan(14, 1));  // slot 14, left pending
  REQUIRE(pending.slots == std::vector<SlotId>{14});
  auto last = index.Reserve(std::span(keys).subspan(15, 1));
  index.Commit(last.slots);  // slot 15
  index.Pin(12);

  PrefixIndex::Shrunk shrunk = index.Shrink(8);
  CHECK(heard == std::set<SlotId>{8, 9, 10, 11, 13, 15});
  CHECK(shrunk.evicted == 6);
  CHECK(shrunk.active == 15);
  CHECK(index.evicted_entries() == 6);
  index.CheckInvariants();
  index.Abort(pending.slots);
  shrunk = index.Shrink(8);
  CHECK(shrunk.active == 13);  // the pinned entry at 12
  index.CheckInvariants();

  // Unpinned, the entry at 12 is evictable, but evicting it frees no slot for a store: only the 8 below count.
  const SlotId twelve = 12;
  index.Unpin(std::span(&twelve, 1));
  index.CheckInvariants();
  const std::vector<BlockKey> fresh = Keys(2, 9);
  CHECK(index.Feasible(fresh) == StatusCode::kResourceExhausted);
  CHECK(index.Feasible(std::span(fresh).first(8)) == StatusCode::kOk);
  auto r = index.Reserve(std::span(fresh).first(8));
  REQUIRE(r.shortfall == StatusCode::kOk);
  for (SlotId s : r.slots) CHECK(s < 8);
  index.Commit(r.slots);
  index.CheckInvariants();
  shrunk = index.Shrink(8);
  CHECK(shrunk.active == 8);
  index.CheckInvariants();
  index.Grow(16);
  CHECK(index.Feasible(Keys(3, 8)) == StatusCode::kOk);
  auto grown = index.Reserve(Keys(3, 8));
  REQUIRE(grown.shortfall == StatusCode::kOk);
  for (SlotId s : grown.slots) CHECK(s >= 8);  // the free ones first: the slots grown into
  index.CheckInvariants();
}

TEST_CASE("component index: unverified entries hold a shrink, and a restore beyond the active capacity is refused",
          "[unit][index][elastic]") {
  ComponentIndex index(16, 16);
  REQUIRE(index.RestoreUnverified(14, BlockKey{1, 1}).ok());
  CHECK(index.Shrink(4).active == 15);
  CHECK(index.RestoreUnverified(6, BlockKey{2, 2}).code() == StatusCode::kFailedPrecondition);  // at or above the limit
  REQUIRE(index.MarkVerified(14));
  CHECK(index.Shrink(4).active == 4);
  index.CheckInvariants();
  ComponentIndex small(16, 4);
  CHECK(small.RestoreUnverified(4, BlockKey{3, 3}).code() == StatusCode::kFailedPrecondition);
  CHECK(small.RestoreUnverified(3, BlockKey{3, 3}).ok());
  small.CheckInvariants();
}

TEST_CASE("prefix index: random stores, pins, drops, shrinks and grows keep the index consistent and the shrunk slots unused",
          "[unit][index][elastic]") {
  constexpr uint32_t kCap = 64;
  PrefixIndex index(kCap);
  std::mt19937 rng(7);
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  std::vector<std::vector<SlotId>> pending, pins;
  std::vector<std::vector<BlockKey>> stored;
  size_t shrinks_held = 0;
  for (int step = 0; step < 4000; ++step) {
    switch (pick(8)) {
      case 7: {  // a block fails a check: dropped with its descendants
        const SlotId s = static_cast<SlotId>(pick(kCap));
        index.DropSubtrees(std::span(&s, 1), [](SlotId) {});
        break;
      }
      case 0:
      case 1: {  // a store of a chain over a small alphabet (chains share prefixes)
        std::vector<int32_t> tokens(1 + pick(8));
        for (int32_t& t : tokens) t = static_cast<int32_t>(pick(3));
        const std::vector<BlockKey> keys = Chain(tokens);
        auto r = index.Reserve(flexkv::kRootParent, keys);
        for (SlotId s : r.slots) REQUIRE(s < index.limit());
        if (r.slots.empty()) break;
        if (pick(2) == 0) {
          index.Commit(r.slots);
          stored.push_back(keys);
        } else {
          pending.push_back(r.slots);
        }
        break;
      }
      case 2:  // a store in flight ends
        if (!pending.empty()) {
          const size_t i = pick(pending.size());
          if (pick(2) == 0) index.Commit(pending[i]); else index.Abort(pending[i]);
          pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
        }
        break;
      case 3:  // a load pins what it matches, or one ends
        if (!stored.empty() && pick(2) == 0) {
          std::vector<SlotId> slots;
          index.Match(stored[pick(stored.size())], true, &slots);
          if (!slots.empty()) pins.push_back(slots);
        } else if (!pins.empty()) {
          const size_t i = pick(pins.size());
          index.Unpin(pins[i]);
          pins.erase(pins.begin() + static_cast<std::ptrdiff_t>(i));
        }
        break;
      case 4:
      case 5: {
        const uint32_t target = static_cast<uint32_t>(pick(index.active() + 1));
        const PrefixIndex::Shrunk shrunk = index.Shrink(target);
        REQUIRE(shrunk.active >= target);
        REQUIRE(shrunk.active == index.active());
        REQUIRE(index.limit() == target);
        shrinks_held += shrunk.active > target ? 1 : 0;
        break;
      }
      case 6:
        index.Grow(index.active() + static_cast<uint32_t>(pick(kCap - index.active() + 1)));
        break;
    }
    index.CheckInvariants();
    REQUIRE(PrefixClosed(index));
  }
  CHECK(shrinks_held > 0);  // the run did hold shrinks up
  for (const auto& p : pending) index.Abort(p);
  for (const auto& p : pins) index.Unpin(p);
  CHECK(index.Shrink(0).active == 0);  // with nothing held, everything goes
  CHECK(index.used_slots() == 0);
  index.Grow(kCap);
  index.CheckInvariants();
}

TEST_CASE("component index: random stores, pins, anchors, drops, shrinks and grows keep it consistent",
          "[unit][index][elastic]") {
  constexpr uint32_t kCap = 32;
  ComponentIndex index(kCap);
  std::mt19937 rng(11);
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  std::vector<std::vector<SlotId>> pending;
  std::vector<SlotId> pins;
  const std::vector<BlockKey> universe = Keys(9, 48);
  size_t shrinks_held = 0;
  for (int step = 0; step < 6000; ++step) {
    switch (pick(8)) {
      case 0:
      case 1: {  // an all-or-none store of distinct keys: Feasible foretells Reserve
        std::vector<BlockKey> keys;
        const size_t start = pick(universe.size());
        for (size_t i = 0; i < 1 + pick(4); ++i) keys.push_back(universe[(start + i * 7) % universe.size()]);
        const StatusCode feasible = index.Feasible(keys);
        auto r = index.Reserve(keys);
        REQUIRE(r.shortfall == feasible);
        std::vector<SlotId> taken;
        for (SlotId s : r.slots) {
          if (s == ComponentIndex::kNoSlot) continue;
          REQUIRE(s < index.limit());
          taken.push_back(s);
        }
        if (taken.empty()) break;
        if (pick(2) == 0) index.Commit(taken); else pending.push_back(taken);
        break;
      }
      case 2:
        if (!pending.empty()) {
          const size_t i = pick(pending.size());
          if (pick(2) == 0) index.Commit(pending[i]); else index.Abort(pending[i]);
          pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
        }
        break;
      case 3:
        if (pick(2) == 0) {
          if (const auto s = index.Find(universe[pick(universe.size())])) {
            index.Pin(*s);
            pins.push_back(*s);
          }
        } else if (!pins.empty()) {
          const size_t i = pick(pins.size());
          index.Unpin(std::span(&pins[i], 1));
          pins.erase(pins.begin() + static_cast<std::ptrdiff_t>(i));
        }
        break;
      case 4:
        if (pick(2) == 0) index.Unanchor(universe[pick(universe.size())]); else index.Anchor(universe[pick(universe.size())]);
        break;
      case 5: {
        const SlotId s = static_cast<SlotId>(pick(kCap));
        index.Drop(std::span(&s, 1));
        break;
      }
      case 6: {
        const uint32_t target = static_cast<uint32_t>(pick(index.active() + 1));
        const PrefixIndex::Shrunk shrunk = index.Shrink(target);
        REQUIRE(shrunk.active >= target);
        REQUIRE(shrunk.active == index.active());
        shrinks_held += shrunk.active > target ? 1 : 0;
        break;
      }
      case 7:
        index.Grow(index.active() + static_cast<uint32_t>(pick(kCap - index.active() + 1)));
        break;
    }
    index.CheckInvariants();
  }
  CHECK(shrinks_held > 0);
  for (const auto& p : pending) index.Abort(p);
  index.Unpin(pins);
  CHECK(index.Shrink(0).active == 0);
  CHECK(index.used_slots() == 0);
  index.Grow(kCap);
  index.CheckInvariants();
}
