// ComponentIndex and the hit rule: randomized runs checked step by step against naive reference models of the
// same policy (the index: maps and std::lists; the hit rule: every end tried, every block of every window asked).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <list>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "daemon/cache/component_index.h"
#include "tests/unit/daemon/cache/prefix_index_test_util.h"

namespace {

using flexkv::BlockKey;
using flexkv::ComponentIndex;
using flexkv::ComponentRule;
using flexkv::SlotId;
using flexkv::StatusCode;
using flexkv::testing::index::M;
using flexkv::testing::index::MKey;
using flexkv::testing::index::Mix;

constexpr SlotId kNoSlot = ComponentIndex::kNoSlot;

// ---------------------------------------------------------------------------------------------------------
// Reference model of the index. Entries by slot, keys in a std::map, the free slots as a LIFO std::list
// starting 0, 1, 2, ..., the two eviction lists as explicit std::lists with the documented rules.

enum class St { kFree, kPending, kCommitted, kUnverified, kDropped, kPendingDropped };

class Model {
 public:
  explicit Model(uint32_t capacity) : slots_(capacity) {
    for (SlotId s = 0; s < capacity; ++s) free_.push_back(s);
  }

  struct Entry {
    St state = St::kFree;
    MKey key{};
    int pins = 0;
    bool anchored = true;
  };

  std::vector<std::pair<SlotId, MKey>> heard;  // the listener's calls, in order

  std::optional<SlotId> Find(const BlockKey& k) const {
    auto it = by_key_.find(M(k));
    if (it == by_key_.end() || slots_[it->second].state != St::kCommitted) return std::nullopt;
    return it->second;
  }

  void Pin(SlotId s) {
    Entry& e = slots_.at(s);
    REQUIRE(e.state == St::kCommitted);
    if (e.pins++ == 0) ListOf(e).remove(s);
  }
  void UnpinOne(SlotId s) {
    Entry& e = slots_.at(s);
    REQUIRE(e.pins > 0);
    if (--e.pins > 0) return;
    if (e.state == St::kDropped) {
      Free(s);
    } else {
      ListOf(e).push_back(s);
    }
  }

  ComponentIndex::Reservation Reserve(const std::vector<BlockKey>& keys) {
    ComponentIndex::Reservation r;
    std::set<SlotId> own;
    size_t need = 0;
    for (const BlockKey& k : keys) {
      auto it = by_key_.find(M(k));
      if (it == by_key_.end()) {
        ++need;
      } else if (slots_[it->second].state != St::kCommitted) {
        r.shortfall = StatusCode::kAborted;
        return r;
      } else {
        own.insert(it->second);
      }
    }
    std::vector<SlotId> victims;  // the eviction order without the store's own entries
    for (const auto* l : {&unanchored_, &lru_}) {
      for (SlotId s : *l) {
        if (own.count(s) == 0) victims.push_back(s);
      }
    }
    if (need > free_.size() + victims.size()) {
      r.shortfall = StatusCode::kResourceExhausted;
      return r;
    }
    size_t next_victim = 0;
    std::vector<SlotId> own_in_order;
    for (const BlockKey& k : keys) {
      auto it = by_key_.find(M(k));
      if (it != by_key_.end()) {
        r.slots.push_back(kNoSlot);
        own_in_order.push_back(it->second);
        continue;
      }
      SlotId s;
      if (!free_.empty()) {
        s = free_.front();
        free_.pop_front();
      } else {
        s = victims.at(next_victim++);
        Entry& v = slots_[s];
        ListOf(v).remove(s);
        by_key_.erase(v.key);
        heard.emplace_back(s, v.key);
        ++evicted_;
      }
      slots_[s] = Entry{St::kPending, M(k), 0, true};
      by_key_[M(k)] = s;
      r.slots.push_back(s);
    }
    // The store found these cached: used just now, in the order of `keys`.
    for (SlotId s : own_in_order) {
      Entry& e = slots_[s];
      if (e.pins == 0) {
        ListOf(e).remove(s);
        ListOf(e).push_back(s);
      }
    }
    return r;
  }

  void Commit(const std::vector<SlotId>& slots) {
    for (SlotId s : slots) {
      Entry& e = slots_.at(s);
      if (e.state == St::kPendingDropped) {
        Free(s);
        continue;
      }
      REQUIRE(e.state == St::kPending);
      e.state = St::kCommitted;
      ListOf(e).push_back(s);
    }
  }

  void Abort(const std::vector<SlotId>& slots) {
    for (SlotId s : slots) {
      Entry& e = slots_.at(s);
      REQUIRE((e.state == St::kPending || e.state == St::kPendingDropped));
      if (e.state == St::kPending) by_key_.erase(e.key);
      Free(s);
    }
  }

  void SetAnchored(const BlockKey& k, bool anchored) {
    auto it = by_key_.find(M(k));
    if (it == by_key_.end()) return;
    const SlotId s = it->second;
    Entry& e = slots_[s];
    if (e.anchored == anchored) return;
    const bool listed = Evictable(e);
    if (listed) ListOf(e).remove(s);
    e.anchored = anchored;
    if (listed) ListOf(e).push_back(s);
  }

  StatusCode RestoreUnverified(SlotId s, const BlockKey& k) {
    if (s >= slots_.size() || slots_[s].state != St::kFree || by_key_.count(M(k)) != 0) {
      return StatusCode::kFailedPrecondition;
    }
    free_.remove(s);
    slots_[s] = Entry{St::kUnverified, M(k), 0, true};
    by_key_[M(k)] = s;
    return StatusCode::kOk;
  }

  bool MarkVerified(SlotId s) {
    if (s >= slots_.size() || slots_[s].state != St::kUnverified) return false;
    slots_[s].state = St::kCommitted;
    ListOf(slots_[s]).push_back(s);
    return true;
  }

  bool PinSlot(SlotId s) {
    if (s >= slots_.size() || slots_[s].state != St::kCommitted) return false;
    Pin(s);
    return true;
  }

  size_t Drop(const std::vector<SlotId>& slots) {
    size_t dropped = 0;
    for (SlotId s : slots) {
      if (s >= slots_.size()) continue;
      Entry& e = slots_[s];
      if (e.state == St::kCommitted || e.state == St::kUnverified) {
        if (Evictable(e)) ListOf(e).remove(s);
        by_key_.erase(e.key);
        heard.emplace_back(s, e.key);
        ++dropped;
        if (e.pins > 0) {
          e.state = St::kDropped;
        } else {
          Free(s);
        }
      } else if (e.state == St::kPending) {
        by_key_.erase(e.key);
        e.state = St::kPendingDropped;
      }
    }
    return dropped;
  }

  // Compares everything observable.
  void CheckAgainst(const ComponentIndex& index, const std::vector<BlockKey>& universe) const {
    index.CheckInvariants();
    uint32_t used = 0, pinned = 0, committed = 0, unverified = 0, unanchored = 0;
    std::vector<std::pair<SlotId, MKey>> committed_entries;
    for (SlotId s = 0; s < slots_.size(); ++s) {
      const Entry& e = slots_[s];
      used += e.state != St::kFree ? 1u : 0u;
      pinned += e.pins > 0 ? 1u : 0u;
      unverified += e.state == St::kUnverified ? 1u : 0u;
      if (e.state == St::kCommitted) {
        ++committed;
        unanchored += e.anchored ? 0u : 1u;
        committed_entries.emplace_back(s, e.key);
      }
      REQUIRE(index.IsCommitted(s) == (e.state == St::kCommitted));
      REQUIRE(index.IsUnverified(s) == (e.state == St::kUnverified));
    }
    REQUIRE(index.used_slots() == used);
    REQUIRE(used + free_.size() == slots_.size());
    REQUIRE(index.pinned_slots() == pinned);
    REQUIRE(index.committed_entries() == committed);
    REQUIRE(index.unverified_entries() == unverified);
    REQUIRE(index.unanchored_entries() == unanchored);
    REQUIRE(index.evicted_entries() == evicted_);
    std::vector<SlotId> order(unanchored_.begin(), unanchored_.end());
    order.insert(order.end(), lru_.begin(), lru_.end());
    REQUIRE(index.EvictionOrder() == order);
    std::vector<std::pair<SlotId, MKey>> theirs;
    index.ForEachCommitted([&](SlotId s, const BlockKey& k) { theirs.emplace_back(s, M(k)); });
    REQUIRE(theirs == committed_entries);
    for (const BlockKey& k : universe) REQUIRE(index.Find(k) == Find(k));
  }

 private:
  static bool Evictable(const Entry& e) { return e.state == St::kCommitted && e.pins == 0; }
  std::list<SlotId>& ListOf(const Entry& e) { return e.anchored ? lru_ : unanchored_; }
  void Free(SlotId s) {
    slots_[s] = Entry{};
    free_.push_front(s);
  }

  std::vector<Entry> slots_;
  std::map<MKey, SlotId> by_key_;  // pending, committed, unverified
  std::list<SlotId> free_;
  std::list<SlotId> unanchored_;
  std::list<SlotId> lru_;
  uint64_t evicted_ = 0;
};

TEST_CASE("component index: random operations agree with the reference model", "[unit][cache][component]") {
  const uint32_t seed = GENERATE(1u, 2u, 3u, 4u, 5u, 6u, 7u, 8u);
  std::mt19937 rng(seed);
  auto pick = [&](size_t n) { return static_cast<size_t>(std::uniform_int_distribution<size_t>(0, n - 1)(rng)); };
  const uint32_t capacity = 1 + static_cast<uint32_t>(pick(12));
  std::vector<BlockKey> universe;
  for (uint64_t i = 0; i < 3 * capacity + 4; ++i) universe.push_back(BlockKey{Mix(seed * 1000 + i), Mix(i)});

  ComponentIndex index(capacity);
  Model model(capacity);
  std::vector<std::pair<SlotId, MKey>> heard;
  index.SetEvictionListener([&](SlotId s, const BlockKey& k) { heard.emplace_back(s, M(k)); });
  std::vector<std::vector<SlotId>> stores;  // pending slots of reservations not yet committed or aborted
  std::vector<SlotId> pins;                 // one element per pin held
  auto random_slot = [&] { return static_cast<SlotId>(pick(capacity + 2)); };  // sometimes out of range

  for (int step = 0; step < 3000; ++step) {
    INFO("seed " << seed << " step " << step);
    switch (pick(12)) {
      case 0:
      case 1: {  // a store of 1..4 distinct keys
        std::vector<BlockKey> keys;
        const size_t n = 1 + pick(4);
        while (keys.size() < n) {
          const BlockKey k = universe[pick(universe.size())];
          if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
        }
        const auto want = model.Reserve(keys);
        const auto got = index.Reserve(keys);
        REQUIRE(got.shortfall == want.shortfall);
        REQUIRE(got.slots == want.slots);
        std::vector<SlotId> pending;
        for (SlotId s : got.slots) {
          if (s != kNoSlot) pending.push_back(s);
        }
        if (!pending.empty()) stores.push_back(pending);
        break;
      }
      case 2:
      case 3: {  // a store ends
        if (stores.empty()) break;
        const size_t i = pick(stores.size());
        if (pick(4) != 0) {
          model.Commit(stores[i]);
          index.Commit(stores[i]);
        } else {
          model.Abort(stores[i]);
          index.Abort(stores[i]);
        }
        stores.erase(stores.begin() + static_cast<std::ptrdiff_t>(i));
        break;
      }
      case 4: {  // a match pins an entry
        const BlockKey& k = universe[pick(universe.size())];
        const auto found = index.Find(k);
        REQUIRE(found == model.Find(k));
        if (found) {
          model.Pin(*found);
          index.Pin(*found);
          pins.push_back(*found);
        }
        break;
      }
      case 5: {  // a load ends
        if (pins.empty()) break;
        const size_t i = pick(pins.size());
        model.UnpinOne(pins[i]);
        index.Unpin(std::vector<SlotId>{pins[i]});
        pins.erase(pins.begin() + static_cast<std::ptrdiff_t>(i));
        break;
      }
      case 6:
      case 7: {  // a FULL block leaves or comes back
        const BlockKey& k = universe[pick(universe.size())];
        const bool anchored = pick(2) == 0;
        model.SetAnchored(k, anchored);
        if (anchored) index.Anchor(k); else index.Unanchor(k);
        break;
      }
      case 8: {  // a failed check drops entries (any state; sometimes out of range or listed twice)
        std::vector<SlotId> slots;
        for (size_t n = 1 + pick(3); n > 0; --n) slots.push_back(random_slot());
        REQUIRE(index.Drop(slots) == model.Drop(slots));
        break;
      }
      case 9: {  // restart: an entry of the pool file, unverified
        const SlotId s = random_slot();
        const BlockKey& k = universe[pick(universe.size())];
        REQUIRE(index.RestoreUnverified(s, k).code() == model.RestoreUnverified(s, k));
        break;
      }
      case 10: {  // the verifier passes an entry
        const SlotId s = random_slot();
        REQUIRE(index.MarkVerified(s) == model.MarkVerified(s));
        break;
      }
      case 11: {  // the verifier reads an entry
        const SlotId s = random_slot();
        const bool pinned = index.PinSlot(s);
        REQUIRE(pinned == model.PinSlot(s));
        if (pinned) pins.push_back(s);
        break;
      }
      default:
        break;
    }
    REQUIRE(heard == model.heard);
    model.CheckAgainst(index, universe);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Reference model of the hit rule: every end from the longest down, every block of every window.

size_t NaiveUsableEnd(size_t full_prefix, const std::vector<ComponentRule>& rules,
                      const std::vector<std::vector<bool>>& present) {
  for (size_t e = full_prefix; e > 0; --e) {
    bool usable = true;
    for (size_t c = 0; c < rules.size() && usable; ++c) {
      if (rules[c].state) {
        usable = present[c][e - 1];
        continue;
      }
      const size_t from = e > rules[c].window_blocks ? e - rules[c].window_blocks : 0;
      for (size_t j = from; j < e && usable; ++j) usable = present[c][j];
    }
    if (usable) return e;
  }
  return 0;
}

TEST_CASE("hit rule: random prefixes agree with trying every end", "[unit][cache][component]") {
  std::mt19937 rng(42);
  auto pick = [&](size_t n) { return static_cast<size_t>(std::uniform_int_distribution<size_t>(0, n - 1)(rng)); };
  for (int round = 0; round < 5000; ++round) {
    INFO("round " << round);
    const size_t full_prefix = pick(40);
    std::vector<ComponentRule> rules(pick(4));
    std::vector<std::vector<bool>> present(rules.size(), std::vector<bool>(full_prefix));
    for (size_t c = 0; c < rules.size(); ++c) {
      rules[c].state = pick(3) == 0;
      rules[c].window_blocks = rules[c].state ? 0 : static_cast<uint32_t>(pick(12));
      const size_t miss_per_64 = pick(24);  // from always present to often missing
      for (size_t j = 0; j < full_prefix; ++j) present[c][j] = pick(64) >= miss_per_64;
    }
    std::set<std::pair<size_t, size_t>> asked;
    bool asked_twice = false;
    const size_t e = flexkv::LongestUsableEnd(full_prefix, rules, [&](size_t c, size_t j) {
      REQUIRE(c >= 1);
      REQUIRE(c <= rules.size());
      REQUIRE(j < full_prefix);
      asked_twice = asked_twice || !asked.emplace(c, j).second;
      return static_cast<bool>(present[c - 1][j]);
    });
    REQUIRE(e == NaiveUsableEnd(full_prefix, rules, present));
    REQUIRE_FALSE(asked_twice);  // so at most full_prefix x components lookups
  }
}

}  // namespace
