// PrefixIndex: randomized runs checked step by step against a naive reference model of the same policy.
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

  size_t Match(std::span<const BlockKey> keys, bool pin, std::vector<SlotId>* slots,
               std::optional<MKey> parent = std::nullopt) {
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

  PrefixIndex::Reservation Reserve(const BlockKey& parent_key, std::span<const BlockKey> keys) {
    PrefixIndex::Reservation r;
    std::vector<SlotId> prefix;
    std::optional<MKey> parent;
    if (parent_key != flexkv::kRootParent) {
      auto it = nodes_.find(M(parent_key));
      if (it == nodes_.end() || !it->second.committed) {
        r.shortfall = it == nodes_.end() ? StatusCode::kFailedPrecondition : StatusCode::kAborted;
        r.parent_refused = true;
        return r;
      }
      parent = it->first;
      const bool was = Evictable(*parent);
      ++it->second.pins;
      Update(*parent, was, /*mru=*/true);
      prefix.push_back(it->second.slot);
    }
    r.cached = Match(keys, true, &prefix, parent);
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
  uint64_t exhausted = 0, aborted = 0, hits = 0, under_parent = 0, parent_missing = 0, parent_pending = 0;

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
    } else if (op < 85) {  // store a prompt, or a run of it under its parent: reserve, then commit, abort, or
                           // keep pending for a while
      const auto& prompt = pick_prompt();
      std::span<const BlockKey> keys(prompt);
      BlockKey parent = flexkv::kRootParent;
      if (!prompt.empty() && uniform(0, 1) == 1) {
        const auto begin = static_cast<size_t>(uniform(1, static_cast<int>(prompt.size())));
        const auto end = static_cast<size_t>(uniform(static_cast<int>(begin), static_cast<int>(prompt.size())));
        keys = keys.subspan(begin, end - begin);
        parent = prompt[begin - 1];
      }
      auto got = index.Reserve(parent, keys);
      auto expected = model.Reserve(parent, keys);
      REQUIRE(got.cached == expected.cached);
      REQUIRE(got.slots == expected.slots);
      REQUIRE(got.shortfall == expected.shortfall);
      REQUIRE(got.parent_refused == expected.parent_refused);
      REQUIRE(got.cached + got.slots.size() <= keys.size());
      if (got.parent_refused) {
        REQUIRE(got.cached + got.slots.size() == 0);
      } else {
        REQUIRE((got.shortfall == StatusCode::kOk) == (got.cached + got.slots.size() == keys.size()));
      }
      exhausted += got.shortfall == StatusCode::kResourceExhausted ? 1u : 0u;
      aborted += got.shortfall == StatusCode::kAborted ? 1u : 0u;
      under_parent += parent != flexkv::kRootParent && got.shortfall == StatusCode::kOk ? 1u : 0u;
      parent_missing += got.parent_refused && got.shortfall == StatusCode::kFailedPrecondition ? 1u : 0u;
      parent_pending += got.parent_refused && got.shortfall == StatusCode::kAborted ? 1u : 0u;
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
  CHECK(under_parent > 0);
  CHECK(parent_missing > 0);
  CHECK(parent_pending > 0);
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
