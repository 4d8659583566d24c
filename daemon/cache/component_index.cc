// ComponentIndex: a slot-indexed entry array, a key -> slot hash map over it, and four intrusive lists threaded
// through the entries (free slots; evictable unanchored entries; evictable anchored entries the next tier holds, and
// the other evictable anchored entries, each in LRU order). See component_index.h for the contract. Also the hit rule,
// LongestUsableEnd.
#include "daemon/cache/component_index.h"

#include <absl/container/flat_hash_map.h>
#include <absl/container/flat_hash_set.h>
#include <absl/hash/hash.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <utility>

#include "common/invariant.h"
#include "daemon/cache/large_array.h"
#include "daemon/cache/slot_list.h"

#define COMPONENT_INDEX_CHECK(cond, what) FLEXKV_INVARIANT(cond, "ComponentIndex", what)

namespace flexkv {
namespace {

constexpr SlotId kNil = kNilSlot;  // end of a list

enum class State : uint8_t {
  kFree,
  kPending,         // reserved by a store: in the key map, on no list
  kCommitted,       // findable; on an eviction list while unpinned
  kUnverified,      // restored at start, bytes not checked yet: in the key map, on no list
  kDropped,         // taken out while pinned: out of the key map, freed with its last Unpin
  kPendingDropped,  // taken out while pending: out of the key map, freed by its store's Commit or Abort
};

// 32 bytes. `prev`/`next` link the free list while free and an eviction list while evictable.
struct Entry {
  BlockKey key;
  SlotId prev = kNil;
  SlotId next = kNil;
  uint32_t pins = 0;
  State state = State::kFree;
  // Whether the FULL block of `key` is cached. Kept in every live state, so that an entry whose FULL block left
  // while it was pending or unverified is unanchored once it becomes committed.
  bool anchored = true;
  // Whether the next tier holds the entry too (SetClean): evicting it loses nothing. Committed entries only.
  bool clean = false;
};
static_assert(sizeof(Entry) <= 32, "ComponentIndex entries should stay small; one per sub-pool slot");

// Seeded per process (absl), so a client cannot choose keys that pile up in one place of the map.
struct KeyHash {
  size_t operator()(const BlockKey& k) const { return absl::HashOf(k.lo, k.hi); }
};

using List = SlotList;

}  // namespace

struct ComponentIndex::Impl {
  Impl(uint32_t cap, uint32_t active) : entries_(cap), limit_(active), active_(active) {
    COMPONENT_INDEX_CHECK(cap != kNil, "capacity must leave kNil free to end lists");
    COMPONENT_INDEX_CHECK(active <= cap, fmt::format("active capacity {} above the capacity {}", active, cap));
    by_key_.reserve(cap);  // never rehashes
    for (SlotId s = 0; s < active; ++s) PushBack(free_, s);  // slot 0 is taken first
  }
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  LargeArray<Entry> entries_;
  absl::flat_hash_map<BlockKey, SlotId, KeyHash> by_key_;  // pending, committed and unverified entries
  List free_;
  List unanchored_;  // evictable (committed, unpinned) and unanchored, in the order they became so
  List clean_;       // evictable, anchored and clean (on the next tier), least recently used first
  List lru_;         // evictable, anchored and dirty, least recently used first
  std::function<void(SlotId, const BlockKey&)> listener_;
  uint32_t used_ = 0;
  uint32_t pinned_ = 0;
  uint32_t committed_ = 0;
  uint32_t unverified_ = 0;
  uint32_t unanchored_committed_ = 0;
  uint64_t evicted_ = 0;
  // Slots below limit_ may be handed out (the free ones are on free_); slots at or above it are being given back
  // (a shrink in progress: free ones stay off free_, evictable ones are counted in doomed_evictable_ and taking
  // them frees no slot for a store). Slots at or above active_ are all free. limit_ <= active_.
  uint32_t limit_ = 0;
  uint32_t active_ = 0;
  uint32_t doomed_evictable_ = 0;

  // --- intrusive lists ---
  void PushBack(List& l, SlotId s) { l.PushBack(entries_, s); }
  void PushFront(List& l, SlotId s) { l.PushFront(entries_, s); }
  void Unlink(List& l, SlotId s) { l.Unlink(entries_, s); }

  static bool Evictable(const Entry& e) { return e.state == State::kCommitted && e.pins == 0; }
  List& EvictionList(const Entry& e) { return !e.anchored ? unanchored_ : e.clean ? clean_ : lru_; }
  // An entry joins / leaves its eviction list (becomes evictable / stops being so); `cold`: at the end evicted first.
  void ListEvictable(SlotId s, bool cold = false) {
    if (cold) {
      PushFront(EvictionList(entries_[s]), s);
    } else {
      PushBack(EvictionList(entries_[s]), s);
    }
    if (s >= limit_) ++doomed_evictable_;
  }
  void UnlistEvictable(SlotId s) {
    Unlink(EvictionList(entries_[s]), s);
    if (s >= limit_) --doomed_evictable_;
  }

  SlotId Find(const BlockKey& key) const {
    auto it = by_key_.find(key);
    return it == by_key_.end() ? kNil : it->second;
  }

  void Pin(SlotId s) {
    COMPONENT_INDEX_CHECK(s < entries_.size(), fmt::format("pin of slot {} out of range", s));
    Entry& e = entries_[s];
    COMPONENT_INDEX_CHECK(e.state == State::kCommitted, fmt::format("pin of slot {} that is not committed", s));
    if (e.pins++ == 0) {
      ++pinned_;
      UnlistEvictable(s);  // was evictable
    }
  }
  void UnpinOne(SlotId s, bool cold = false) {
    COMPONENT_INDEX_CHECK(s < entries_.size(), fmt::format("unpin of slot {} out of range", s));
    Entry& e = entries_[s];
    COMPONENT_INDEX_CHECK((e.state == State::kCommitted || e.state == State::kDropped) && e.pins > 0,
                          fmt::format("unpin of slot {} that is not pinned", s));
    if (--e.pins > 0) return;
    --pinned_;
    if (e.state == State::kDropped) {
      Free(s);
    } else {
      ListEvictable(s, cold);  // used just now (or, `cold`, pinned only to be written to the next tier)
    }
  }

  // Returns a slot that no key names any more (free of pins, on no list) to the free list.
  void Free(SlotId s) {
    entries_[s] = Entry{};
    --used_;
    if (s < limit_) PushFront(free_, s);  // else a shrink is giving it back
  }

  // Takes a committed entry out of the key map and the counters (and its eviction list, when on one), and tells
  // the listener. The caller frees the slot or keeps it as dropped.
  void Remove(SlotId s) {
    Entry& e = entries_[s];
    if (Evictable(e)) UnlistEvictable(s);
    by_key_.erase(e.key);
    --committed_;
    if (!e.anchored) --unanchored_committed_;
    if (listener_) listener_(s, e.key);
  }

  // Evicts the first unanchored entry, else the least recently used clean one, else the least recently used dirty
  // one, and returns its slot (on no list, still counted as used), or kNil when nothing is evictable.
  SlotId EvictOne() {
    SlotId s = unanchored_.head != kNil ? unanchored_.head : clean_.head != kNil ? clean_.head : lru_.head;
    if (s == kNil) return kNil;
    COMPONENT_INDEX_CHECK(Evictable(entries_[s]), fmt::format("slot {} on an eviction list is not evictable", s));
    Remove(s);
    ++evicted_;
    entries_[s] = Entry{};
    return s;
  }

  // A free slot, else an evicted one; kNil when neither exists. The slot is unlinked and counted as used. Never
  // a slot at or above limit_ (one evicted there is freed for the shrink).
  SlotId TakeSlot() {
    SlotId s = free_.head;
    if (s != kNil) {
      Unlink(free_, s);
      ++used_;
      return s;
    }
    for (;;) {
      s = EvictOne();
      if (s == kNil || s < limit_) return s;
      Free(s);
    }
  }

  // Moves limit_: free slots below the new limit are on the free list, those at or above it are not; evictable
  // entries at or above it are counted as doomed.
  void SetLimit(uint32_t limit) {
    for (SlotId s = limit; s < limit_; ++s) {
      if (entries_[s].state == State::kFree) Unlink(free_, s);
      if (Evictable(entries_[s])) ++doomed_evictable_;
    }
    for (SlotId s = limit_; s < limit; ++s) {
      if (entries_[s].state == State::kFree) PushBack(free_, s);
      if (Evictable(entries_[s])) --doomed_evictable_;
    }
    limit_ = limit;
  }

  // A live entry (pending, unverified or committed) became committed: counted, and evictable unless pinned.
  void BecomeCommitted(SlotId s, bool cold = false) {
    Entry& e = entries_[s];
    e.state = State::kCommitted;
    ++committed_;
    if (!e.anchored) ++unanchored_committed_;
    ListEvictable(s, cold);
  }

  // Moves a live entry between anchored and unanchored, and an evictable one between the eviction lists (to
  // the tail: the FULL block just left, or a store just committed it again).
  void SetAnchored(const BlockKey& key, bool anchored) {
    const SlotId s = Find(key);
    if (s == kNil) return;
    Entry& e = entries_[s];
    if (e.anchored == anchored) return;
    const bool evictable = Evictable(e);
    if (evictable) UnlistEvictable(s);
    e.anchored = anchored;
    if (evictable) ListEvictable(s);
    if (e.state == State::kCommitted) {
      if (anchored) --unanchored_committed_; else ++unanchored_committed_;
    }
  }
};

ComponentIndex::ComponentIndex(uint32_t capacity) : ComponentIndex(capacity, capacity) {}
ComponentIndex::ComponentIndex(uint32_t capacity, uint32_t active) : impl_(std::make_unique<Impl>(capacity, active)) {}
ComponentIndex::~ComponentIndex() = default;

void ComponentIndex::SetEvictionListener(std::function<void(SlotId, const BlockKey&)> listener) {
  impl_->listener_ = std::move(listener);
}

std::optional<SlotId> ComponentIndex::Find(const BlockKey& key) const {
  const SlotId s = impl_->Find(key);
  if (s == kNil || impl_->entries_[s].state != State::kCommitted) return std::nullopt;
  return s;
}

void ComponentIndex::Pin(SlotId slot) { impl_->Pin(slot); }

void ComponentIndex::Unpin(std::span<const SlotId> slots, bool cold) {
  for (SlotId s : slots) impl_->UnpinOne(s, cold);
}

void ComponentIndex::SetClean(SlotId slot, bool clean) {
  Impl& m = *impl_;
  if (slot >= m.entries_.size() || m.entries_[slot].state != State::kCommitted || m.entries_[slot].clean == clean) {
    return;
  }
  const bool listed = Impl::Evictable(m.entries_[slot]);
  if (listed) m.UnlistEvictable(slot);
  m.entries_[slot].clean = clean;
  // As PrefixIndex::SetClean: one found written was used no later than before; one found gone from the next tier
  // was at the cold end, where the write-back walk found it, and stays there.
  if (listed) m.ListEvictable(slot, /*cold=*/!clean);
}

uint32_t ComponentIndex::clean_entries() const { return impl_->clean_.size; }

void ComponentIndex::ForEachCold(size_t n, const std::function<bool(SlotId)>& visit) const {
  const Impl& m = *impl_;
  size_t i = 0;
  for (const List* l : {&m.unanchored_, &m.clean_, &m.lru_}) {
    for (SlotId s = l->head; i < n && s != kNil; ++i) {
      const SlotId next = m.entries_[s].next;
      if (!visit(s)) return;
      s = next;
    }
  }
}

StatusCode ComponentIndex::Feasible(std::span<const BlockKey> keys, std::vector<SlotId>* found) const {
  const Impl& m = *impl_;
  // The keys that need a slot, and the committed entries of `keys` that are evictable now (they must not be taken
  // for this store's own keys, so they do not count as available).
  size_t need = 0;
  size_t own_evictable = 0;
  if (found != nullptr) found->assign(keys.size(), kNil);
  for (size_t i = 0; i < keys.size(); ++i) {
    const SlotId s = m.Find(keys[i]);
    if (found != nullptr) (*found)[i] = s;
    if (s == kNil) {
      ++need;
      continue;
    }
    const Entry& e = m.entries_[s];
    if (e.state != State::kCommitted) return StatusCode::kAborted;  // pending in another store, or unverified
    if (Impl::Evictable(e) && s < m.limit_) ++own_evictable;
  }
  // A key listed twice is counted in `need` or `own_evictable` twice: the count errs on refusing. Evicting an
  // entry a shrink is giving back frees no slot for the store.
  const size_t available =
      size_t{m.free_.size} + m.unanchored_.size + m.clean_.size + m.lru_.size - m.doomed_evictable_;
  if (need > available - std::min(available, own_evictable)) return StatusCode::kResourceExhausted;
  return StatusCode::kOk;
}

bool ComponentIndex::MayHaveDirtyEvictable() const { return impl_->lru_.size > 0 || impl_->unanchored_.size > 0; }

bool ComponentIndex::FitsWithoutDirty(std::span<const BlockKey> keys) const {
  const Impl& m = *impl_;
  // The evictions Reserve(keys) would make: after the free slots, the eviction order from its head (the store's own
  // entries are pinned then, so passed by; an entry at or above the limit is evicted but frees no slot).
  size_t need = 0;
  for (const BlockKey& key : keys) need += m.Find(key) == kNil ? 1 : 0;
  if (need <= m.free_.size) return true;
  size_t evictions = need - m.free_.size;
  const absl::flat_hash_set<BlockKey, KeyHash> own(keys.begin(), keys.end());
  for (const List* l : {&m.unanchored_, &m.clean_, &m.lru_}) {
    for (SlotId s = l->head; s != kNil; s = m.entries_[s].next) {
      const Entry& e = m.entries_[s];
      if (own.contains(e.key)) continue;
      if (!e.clean) return false;  // it would be evicted before the next tier holds it
      if (s >= m.limit_) continue;
      if (--evictions == 0) return true;
    }
  }
  return false;  // not enough to evict at all (Feasible says RESOURCE_EXHAUSTED)
}

ComponentIndex::Reservation ComponentIndex::Reserve(std::span<const BlockKey> keys) {
  Impl& m = *impl_;
  Reservation r;
  // Count first, changing nothing.
  std::vector<SlotId> found;
  r.shortfall = Feasible(keys, &found);
  if (r.shortfall != StatusCode::kOk) return r;
  // Pin the committed entries of `keys` while slots are taken, so that eviction passes them by; their Unpin
  // marks them used (the store found them cached).
  for (SlotId s : found) {
    if (s != kNil) m.Pin(s);
  }
  r.slots.reserve(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    if (found[i] != kNil) {
      r.slots.push_back(kNoSlot);
      continue;
    }
    const SlotId t = m.TakeSlot();  // before the insert: an eviction erases from the map
    COMPONENT_INDEX_CHECK(t != kNil, "reserve ran out of slots after counting enough");
    if (!m.by_key_.try_emplace(keys[i], t).second) {
      // Pending from earlier in this loop: `keys` repeats a key (the contract forbids it; a client may still
      // send it). Undo this call's reservations: the store cannot be done as asked.
      m.Free(t);
      for (SlotId u : r.slots) {
        if (u == kNoSlot) continue;
        m.by_key_.erase(m.entries_[u].key);
        m.Free(u);
      }
      r.slots.clear();
      r.shortfall = StatusCode::kAborted;
      break;
    }
    Entry& e = m.entries_[t];
    e.key = keys[i];
    e.state = State::kPending;
    r.slots.push_back(t);
  }
  for (SlotId s : found) {
    if (s != kNil) m.UnpinOne(s);
  }
  return r;
}

void ComponentIndex::Commit(std::span<const SlotId> slots, size_t cold) {
  Impl& m = *impl_;
  auto commit = [&m](SlotId s, bool at_cold_end) {
    COMPONENT_INDEX_CHECK(s < m.entries_.size(), fmt::format("commit of slot {} out of range", s));
    Entry& e = m.entries_[s];
    if (e.state == State::kPendingDropped) {  // dropped while its store copied
      m.Free(s);
      return;
    }
    COMPONENT_INDEX_CHECK(e.state == State::kPending, fmt::format("commit of slot {} that is not pending", s));
    m.BecomeCommitted(s, at_cold_end);
  };
  cold = std::min(cold, slots.size());
  for (size_t i = cold; i < slots.size(); ++i) commit(slots[i], false);
  // Each to the head of the eviction order, the last first: slots[0] ends up evicted first.
  for (size_t i = cold; i-- > 0;) commit(slots[i], true);
}

void ComponentIndex::Abort(std::span<const SlotId> slots) {
  Impl& m = *impl_;
  for (SlotId s : slots) {
    COMPONENT_INDEX_CHECK(s < m.entries_.size(), fmt::format("abort of slot {} out of range", s));
    Entry& e = m.entries_[s];
    COMPONENT_INDEX_CHECK(e.state == State::kPending || e.state == State::kPendingDropped,
                          fmt::format("abort of slot {} that is not pending (or listed twice)", s));
    if (e.state == State::kPending) m.by_key_.erase(e.key);
    m.Free(s);
  }
}

void ComponentIndex::Unanchor(const BlockKey& key) { impl_->SetAnchored(key, false); }
void ComponentIndex::Anchor(const BlockKey& key) { impl_->SetAnchored(key, true); }

Status ComponentIndex::RestoreUnverified(SlotId slot, const BlockKey& key) {
  Impl& m = *impl_;
  if (slot >= m.limit_) {
    return Status::FailedPrecondition(
        fmt::format("restore: slot {} is out of range; expected < {} (the active capacity)", slot, m.limit_));
  }
  if (m.entries_[slot].state != State::kFree) {
    return Status::FailedPrecondition(fmt::format("restore: slot {} is already taken", slot));
  }
  if (m.Find(key) != kNil) {
    return Status::FailedPrecondition(fmt::format("restore: key {} (slot {}) is already present", key.ToHex(), slot));
  }
  m.Unlink(m.free_, slot);
  ++m.used_;
  ++m.unverified_;
  Entry& e = m.entries_[slot];
  e.key = key;
  e.state = State::kUnverified;
  m.by_key_.emplace(key, slot);
  return Status::Ok();
}

bool ComponentIndex::MarkVerified(SlotId slot) {
  Impl& m = *impl_;
  if (slot >= m.entries_.size() || m.entries_[slot].state != State::kUnverified) return false;
  --m.unverified_;
  m.BecomeCommitted(slot);
  return true;
}

bool ComponentIndex::PinSlot(SlotId slot) {
  Impl& m = *impl_;
  if (slot >= m.entries_.size() || m.entries_[slot].state != State::kCommitted) return false;
  m.Pin(slot);
  return true;
}

size_t ComponentIndex::Drop(std::span<const SlotId> slots) {
  Impl& m = *impl_;
  size_t dropped = 0;
  for (SlotId s : slots) {
    if (s >= m.entries_.size()) continue;
    Entry& e = m.entries_[s];
    switch (e.state) {
      case State::kCommitted:
        m.Remove(s);
        if (e.pins > 0) {
          e.state = State::kDropped;
        } else {
          m.Free(s);
        }
        ++dropped;
        break;
      case State::kUnverified:
        m.by_key_.erase(e.key);
        --m.unverified_;
        if (m.listener_) m.listener_(s, e.key);
        m.Free(s);
        ++dropped;
        break;
      case State::kPending:
        m.by_key_.erase(e.key);
        e.state = State::kPendingDropped;
        break;
      default:
        break;
    }
  }
  return dropped;
}

void ComponentIndex::Grow(uint32_t active) {
  Impl& m = *impl_;
  COMPONENT_INDEX_CHECK(active >= m.active_ && active <= m.entries_.size(),
                        fmt::format("grow to {} slots from {} (capacity {})", active, m.active_, m.entries_.size()));
  m.active_ = active;
  m.SetLimit(active);
}

PrefixIndex::Shrunk ComponentIndex::Shrink(uint32_t target) {
  Impl& m = *impl_;
  COMPONENT_INDEX_CHECK(target <= m.active_, fmt::format("shrink to {} slots from {}", target, m.active_));
  m.SetLimit(target);
  PrefixIndex::Shrunk out;
  for (SlotId s = target; s < m.active_; ++s) {
    if (!Impl::Evictable(m.entries_[s])) continue;
    m.Remove(s);  // tells the listener
    m.Free(s);
    ++m.evicted_;
    ++out.evicted;
  }
  while (m.active_ > target && m.entries_[m.active_ - 1].state == State::kFree) --m.active_;
  out.active = m.active_;
  return out;
}

uint32_t ComponentIndex::active() const { return impl_->active_; }
uint32_t ComponentIndex::limit() const { return impl_->limit_; }

void ComponentIndex::LimitTo(uint32_t limit) {
  Impl& m = *impl_;
  COMPONENT_INDEX_CHECK(limit <= m.active_, fmt::format("limit {} above the {} active slots", limit, m.active_));
  m.SetLimit(limit);
}

bool ComponentIndex::IsCommitted(SlotId slot) const {
  return slot < impl_->entries_.size() && impl_->entries_[slot].state == State::kCommitted;
}

bool ComponentIndex::IsUnverified(SlotId slot) const {
  return slot < impl_->entries_.size() && impl_->entries_[slot].state == State::kUnverified;
}

uint32_t ComponentIndex::capacity() const { return static_cast<uint32_t>(impl_->entries_.size()); }
uint32_t ComponentIndex::used_slots() const { return impl_->used_; }
uint32_t ComponentIndex::pinned_slots() const { return impl_->pinned_; }
uint32_t ComponentIndex::committed_entries() const { return impl_->committed_; }
uint32_t ComponentIndex::unverified_entries() const { return impl_->unverified_; }
uint32_t ComponentIndex::unanchored_entries() const { return impl_->unanchored_committed_; }
uint64_t ComponentIndex::evicted_entries() const { return impl_->evicted_; }

std::vector<SlotId> ComponentIndex::EvictionOrder() const {
  const Impl& m = *impl_;
  std::vector<SlotId> out;
  for (const List* l : {&m.unanchored_, &m.clean_, &m.lru_}) {
    for (SlotId s = l->head; s != kNil; s = m.entries_[s].next) out.push_back(s);
  }
  return out;
}

void ComponentIndex::ForEachCommitted(const std::function<void(SlotId, const BlockKey&)>& fn) const {
  const auto& entries = impl_->entries_;
  for (SlotId s = 0; s < entries.size(); ++s) {
    if (entries[s].state == State::kCommitted) fn(s, entries[s].key);
  }
}

void ComponentIndex::CheckInvariants() const {
  const Impl& m = *impl_;
  const auto cap = static_cast<uint32_t>(m.entries_.size());
  uint32_t used = 0, pinned = 0, committed = 0, unverified = 0, unanchored = 0, keyed = 0;
  uint32_t evictable_anchored = 0, evictable_unanchored = 0, evictable_clean = 0;
  for (SlotId s = 0; s < cap; ++s) {
    const Entry& e = m.entries_[s];
    COMPONENT_INDEX_CHECK(!e.clean || e.state == State::kCommitted || e.state == State::kDropped,
                          fmt::format("slot {} is marked clean but holds no committed entry", s));
    if (e.state == State::kFree) {
      COMPONENT_INDEX_CHECK(e.pins == 0, fmt::format("free slot {} is pinned", s));
      continue;
    }
    ++used;
    if (e.pins > 0) ++pinned;
    COMPONENT_INDEX_CHECK(e.pins == 0 || e.state == State::kCommitted || e.state == State::kDropped,
                          fmt::format("slot {} is pinned but neither committed nor dropped", s));
    switch (e.state) {
      case State::kCommitted:
        ++committed;
        if (!e.anchored) ++unanchored;
        if (Impl::Evictable(e)) ++(!e.anchored ? evictable_unanchored : e.clean ? evictable_clean : evictable_anchored);
        [[fallthrough]];
      case State::kPending:
      case State::kUnverified:
        ++keyed;
        if (e.state == State::kUnverified) ++unverified;
        COMPONENT_INDEX_CHECK(m.Find(e.key) == s, fmt::format("slot {} is not found by its key", s));
        break;
      case State::kDropped:
        COMPONENT_INDEX_CHECK(e.pins > 0, fmt::format("dropped slot {} should have been freed", s));
        [[fallthrough]];
      default:
        COMPONENT_INDEX_CHECK(m.Find(e.key) != s, fmt::format("dropped slot {} is still found by its key", s));
        break;
    }
  }
  COMPONENT_INDEX_CHECK(used == m.used_ && pinned == m.pinned_ && committed == m.committed_ &&
                            unverified == m.unverified_ && unanchored == m.unanchored_committed_,
                        "counters drifted");
  COMPONENT_INDEX_CHECK(m.by_key_.size() == keyed, "key map size differs from the keyed (live) entries");
  COMPONENT_INDEX_CHECK(m.limit_ <= m.active_ && m.active_ <= cap, "limit or active capacity out of order");
  uint32_t free_below_limit = 0, doomed = 0;
  for (SlotId s = 0; s < cap; ++s) {
    const Entry& e = m.entries_[s];
    COMPONENT_INDEX_CHECK(s < m.active_ || e.state == State::kFree,
                          fmt::format("slot {} beyond the active capacity is used", s));
    if (s < m.limit_ && e.state == State::kFree) ++free_below_limit;
    if (s >= m.limit_ && Impl::Evictable(e)) ++doomed;
  }
  COMPONENT_INDEX_CHECK(m.free_.size == free_below_limit, "free list size != free slots below the limit");
  COMPONENT_INDEX_CHECK(m.doomed_evictable_ == doomed, "evictable entries at or above the limit miscounted");
  for (SlotId s = m.free_.head; s != kNil; s = m.entries_[s].next) {
    COMPONENT_INDEX_CHECK(s < m.limit_, fmt::format("free slot {} at or above the limit is on the free list", s));
  }
  auto walk = [&](const List& l, auto&& want) {
    uint32_t count = 0;
    SlotId prev = kNil;
    for (SlotId s = l.head; s != kNil; s = m.entries_[s].next) {
      COMPONENT_INDEX_CHECK(++count <= cap && m.entries_[s].prev == prev && want(m.entries_[s]),
                            fmt::format("list broken at slot {}", s));
      prev = s;
    }
    COMPONENT_INDEX_CHECK(l.tail == prev && count == l.size, "list tail or size is wrong");
  };
  walk(m.free_, [](const Entry& e) { return e.state == State::kFree; });
  walk(m.lru_, [](const Entry& e) { return Impl::Evictable(e) && e.anchored && !e.clean; });
  walk(m.clean_, [](const Entry& e) { return Impl::Evictable(e) && e.anchored && e.clean; });
  walk(m.unanchored_, [](const Entry& e) { return Impl::Evictable(e) && !e.anchored; });
  COMPONENT_INDEX_CHECK(m.lru_.size == evictable_anchored && m.unanchored_.size == evictable_unanchored &&
                            m.clean_.size == evictable_clean,
                        "an evictable entry is missing from its eviction list");
}

size_t LongestUsableEnd(size_t full_prefix, std::span<const ComponentRule> rules,
                        const std::function<bool(size_t component, size_t j)>& has) {
  // Candidate ends are tried from the longest down; a component that is not usable at e names the next
  // candidate worth trying (a state: e - 1; a window with block m missing: m, the longest end whose window
  // leaves m out). Per window, `present_from` is how far down from the candidate its blocks are known present;
  // it only moves down, so has(c, j) is asked at most once per (c, j), and with everything cached a window
  // costs w calls and a state one, whatever the prefix length.
  std::vector<size_t> present_from(rules.size(), full_prefix);
  size_t e = full_prefix;
  while (e > 0) {
    size_t next = e;
    for (size_t c = 0; c < rules.size() && next == e; ++c) {
      const ComponentRule& rule = rules[c];
      if (rule.state) {
        if (!has(c + 1, e - 1)) next = e - 1;
        continue;
      }
      size_t& from = present_from[c];
      from = std::min(from, e);
      const size_t need_from = e - std::min<size_t>(e, rule.window_blocks);
      while (from > need_from) {
        if (!has(c + 1, from - 1)) {
          next = from - 1;  // every end in (from - 1, from - 1 + w] has that block in its window
          from = next;
          break;
        }
        --from;
      }
    }
    if (next == e) return e;
    e = next;
  }
  return 0;
}

}  // namespace flexkv
