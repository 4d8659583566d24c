// PrefixIndex: a slot-indexed node array, a key → slot hash table over it, and two intrusive lists threaded
// through the nodes (free slots; evictable leaves in LRU order). See prefix_index.h for the contract.
// Longer than 800 lines: the hash table, the lists, every node state transition and the elastic Grow/Shrink share
// Impl's private state (a split would expose it in a header for the sake of file length).
#include "daemon/cache/prefix_index.h"

#include <absl/hash/hash.h>
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <utility>

#include "common/invariant.h"
#include "daemon/cache/large_array.h"
#include "daemon/cache/slot_list.h"

#define PREFIX_INDEX_CHECK(cond, what) FLEXKV_INVARIANT(cond, "PrefixIndex", what)

namespace flexkv {
namespace {

constexpr SlotId kNil = kNilSlot;  // end of a list; "no parent" (root level)

enum class State : uint8_t {
  kFree,
  kPending,
  kCommitted,
  kAborting,  // only inside Abort(): pending, queued for removal
  kUnverified,     // restored at start, bytes not checked yet: in the hash table, not matchable, not evictable
  kDropped,        // failed a check: out of the hash table and the lists; freed when unpinned and childless
  kPendingDropped, // pending in a store when its subtree was dropped: dropped when the store commits or aborts
};


// 40 bytes. `prev`/`next` link the free list while free and the eviction list while evictable. What a
// lookup reads (key, parent, state) comes first, in the node's first 21 bytes.
struct Node {
  BlockKey key;
  SlotId parent = kNil;
  State state = State::kFree;
  bool clean = false;     // the next tier holds the block too (SetClean): evicted before dirty nodes
  uint32_t children = 0;  // pending or committed nodes whose parent is this one
  uint32_t pins = 0;
  SlotId prev = kNil;
  SlotId next = kNil;
};
static_assert(sizeof(Node) <= 40, "PrefixIndex nodes should stay small; one per pool slot");

// Seeded per process (absl), so a client cannot choose keys that pile up in one place of the table.
uint64_t HashKey(const BlockKey& k) { return absl::HashOf(k.lo, k.hi); }

void PrefetchNode(const Node* n) {
  // A 40-byte node can straddle two cache lines.
  __builtin_prefetch(n);
  __builtin_prefetch(reinterpret_cast<const char*>(n) + sizeof(Node) - 1);
}

// Key → slot: open addressing, linear probing in Robin Hood order, backward-shift deletion (no tombstones, so
// eviction churn never degrades it). A bucket holds the slot id and 32 bits of the key's hash (the tag); the
// tag's top bits are the bucket the key hashes to (its home), so probe distances come from the table alone
// and a probe touches a node only when the whole tag matches (at 2^24 buckets a stray match is 1 in 256 per
// bucket sharing the home). 8 bytes a bucket at ≤ 7/8 load: 9.1-18.3 bytes a slot.
class SlotTable {
 public:
  struct Bucket {
    SlotId slot = kNil;  // kNil: empty
    uint32_t tag = 0;
  };

  explicit SlotTable(uint32_t capacity) {
    // Smallest power of two ≥ 8 holding `capacity` at ≤ 7/8 load, at most 2^32 buckets (the tag's bits;
    // capacity < 2^32, so at least one bucket stays empty and every probe ends).
    const uint64_t want = std::max<uint64_t>(8, uint64_t{capacity} + (uint64_t{capacity} + 6) / 7);
    const uint64_t n = std::min<uint64_t>(std::bit_ceil(want), uint64_t{1} << 32);
    shift_ = 32 - std::countr_zero(n);
    mask_ = static_cast<size_t>(n - 1);
    buckets_.assign(static_cast<size_t>(n), Bucket{});
  }

  static uint32_t Tag(uint64_t hash) { return static_cast<uint32_t>(hash >> 32); }
  size_t Home(uint32_t tag) const { return static_cast<size_t>(tag >> shift_); }
  size_t Distance(size_t pos, uint32_t tag) const { return (pos - Home(tag)) & mask_; }
  size_t size() const { return size_; }
  size_t bucket_count() const { return buckets_.size(); }
  const Bucket& bucket(size_t pos) const { return buckets_[pos]; }

  void PrefetchHome(uint64_t hash) const {
    const Bucket* b = &buckets_[Home(Tag(hash))];
    __builtin_prefetch(b);
    __builtin_prefetch(b + 1);  // the probe usually ends within two buckets; the next may start a new line
  }

  // Calls fn(slot) for each bucket on the key's probe path whose tag matches, in probe order, until fn
  // returns true (returns that slot) or the path ends (returns kNil).
  template <typename Fn>
  SlotId Probe(uint64_t hash, Fn&& fn) const {
    const uint32_t tag = Tag(hash);
    size_t pos = Home(tag);
    for (size_t dist = 0;; ++dist, pos = (pos + 1) & mask_) {
      const Bucket b = buckets_[pos];
      // Robin Hood order: a resident nearer its home than we are to ours means the key is not stored.
      if (b.slot == kNil || Distance(pos, b.tag) < dist) return kNil;
      if (b.tag == tag && fn(b.slot)) return b.slot;
    }
  }

  // Adds a slot whose key (hash) is not in the table.
  void Insert(SlotId slot, uint64_t hash) {
    Bucket cur{slot, Tag(hash)};
    size_t pos = Home(cur.tag);
    for (size_t dist = 0;; ++dist, pos = (pos + 1) & mask_) {
      Bucket& b = buckets_[pos];
      if (b.slot == kNil) {
        b = cur;
        ++size_;
        return;
      }
      const size_t d = Distance(pos, b.tag);
      if (d < dist) {  // the resident is nearer its home: it moves on, the newcomer takes its place
        std::swap(b, cur);
        dist = d;
      }
    }
  }

  // Removes `slot`, whose key hashes to `hash`. Returns false when it is not in the table.
  bool Erase(SlotId slot, uint64_t hash) {
    const uint32_t tag = Tag(hash);
    size_t pos = Home(tag);
    for (size_t dist = 0;; ++dist, pos = (pos + 1) & mask_) {
      const Bucket& b = buckets_[pos];
      if (b.slot == kNil || Distance(pos, b.tag) < dist) return false;
      if (b.slot == slot) break;
    }
    // Backward shift: pull each following bucket that is not at its home one step back.
    for (;;) {
      const size_t next = (pos + 1) & mask_;
      const Bucket& b = buckets_[next];
      if (b.slot == kNil || Distance(next, b.tag) == 0) break;
      buckets_[pos] = b;
      pos = next;
    }
    buckets_[pos] = Bucket{};
    --size_;
    return true;
  }

 private:
  LargeArray<Bucket> buckets_;
  size_t mask_ = 0;
  int shift_ = 0;  // home = tag >> shift_
  size_t size_ = 0;
};

using List = SlotList;

}  // namespace

struct PrefixIndex::Impl {
  Impl(uint32_t cap, uint32_t active) : nodes_(cap), by_key_(cap), limit_(active), active_(active) {
    PREFIX_INDEX_CHECK(active <= cap, fmt::format("active capacity {} above the capacity {}", active, cap));
    for (SlotId s = 0; s < active; ++s) PushBack(free_, s);  // slot 0 is taken first
  }
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  LargeArray<Node> nodes_;
  SlotTable by_key_;  // pending and committed nodes; sized for all slots, never rehashes
  List free_;
  // Exactly the evictable nodes (committed, unpinned, childless), on two lists by their `clean` mark: those the
  // next tier holds too are evicted first (nothing is lost with them), the others only when no clean one is left.
  List lru_;        // dirty
  List clean_lru_;  // clean
  List& Lru(SlotId s) { return nodes_[s].clean ? clean_lru_ : lru_; }
  // Slots below limit_ may be handed out (the free ones are on free_); slots at or above it are being given back
  // (a shrink in progress: free ones stay off free_). Slots at or above active_ are all free. limit_ <= active_.
  uint32_t limit_ = 0;
  uint32_t active_ = 0;
  std::function<void(SlotId, const BlockKey&)> listener_;
  uint32_t used_ = 0;
  uint32_t pinned_ = 0;
  uint32_t committed_ = 0;
  uint32_t unverified_ = 0;
  uint64_t evicted_ = 0;

  // --- intrusive lists ---
  void PushBack(List& l, SlotId s) { l.PushBack(nodes_, s); }
  void PushFront(List& l, SlotId s) { l.PushFront(nodes_, s); }
  void Unlink(List& l, SlotId s) { l.Unlink(nodes_, s); }

  static bool Evictable(const Node& n) {
    return n.state == State::kCommitted && n.pins == 0 && n.children == 0;
  }

  SlotId Find(const BlockKey& key, uint64_t hash) const {
    return by_key_.Probe(hash, [&](SlotId s) { return nodes_[s].key == key; });
  }
  SlotId Find(const BlockKey& key) const { return Find(key, HashKey(key)); }

  // Prefetches the node the key most likely names: the first tag match on its probe path (the table's
  // buckets should already be in cache, see WalkCommitted).
  void PrefetchCandidate(uint64_t hash) const {
    by_key_.Probe(hash, [&](SlotId s) {
      PrefetchNode(&nodes_[s]);
      return true;
    });
  }

  // How far ahead of the key being looked up a walk fetches: the table's buckets kBucketsAhead keys ahead,
  // then, once they have arrived, the candidate node kNodesAhead keys ahead. Each lookup is a cache miss
  // in the table and one in the node array once the index outgrows the caches; the keys of a request are
  // all known up front, so their misses can overlap instead of following one another.
  // (flexkv-bench index at 1 M and 10 M blocks measured 12/6 through 24/12 alike.)
  static constexpr size_t kBucketsAhead = 12;
  static constexpr size_t kNodesAhead = 6;
  static constexpr size_t kHashRing = 16;  // > kBucketsAhead, a power of two
  static_assert(kNodesAhead < kBucketsAhead && kBucketsAhead < kHashRing && std::has_single_bit(kHashRing));

  // Walks the committed chain of `keys` down from `parent` (kNil: the root): stops at the first key that is
  // missing, not committed, or whose node hangs under a different parent than the previous key (a chain the
  // client did not build by chaining). Calls visit(slot) for each matched node; returns the count.
  template <typename Visit>
  size_t WalkCommitted(SlotId parent, std::span<const BlockKey> keys, Visit&& visit) {
    const size_t n = keys.size();
    uint64_t hashes[kHashRing];
    const auto hash_ahead = [&](size_t j) {
      hashes[j % kHashRing] = HashKey(keys[j]);
      by_key_.PrefetchHome(hashes[j % kHashRing]);
    };
    for (size_t j = 0; j < std::min(n, kBucketsAhead); ++j) hash_ahead(j);
    for (size_t j = 0; j < std::min(n, kNodesAhead); ++j) PrefetchCandidate(hashes[j % kHashRing]);
    size_t i = 0;
    for (; i < n; ++i) {
      if (i + kBucketsAhead < n) hash_ahead(i + kBucketsAhead);
      if (i + kNodesAhead < n) PrefetchCandidate(hashes[(i + kNodesAhead) % kHashRing]);
      SlotId s = Find(keys[i], hashes[i % kHashRing]);
      if (s == kNil) break;
      const Node& node = nodes_[s];
      if (node.state != State::kCommitted || node.parent != parent) break;
      visit(s);
      parent = s;
    }
    return i;
  }

  void Pin(SlotId s) {
    Node& n = nodes_[s];
    PREFIX_INDEX_CHECK(n.state == State::kCommitted, fmt::format("pin of slot {} that is not committed", s));
    if (n.pins++ == 0) {
      ++pinned_;
      if (n.children == 0) Unlink(Lru(s), s);  // was evictable
    }
  }
  void UnpinOne(SlotId s, bool cold = false) {
    PREFIX_INDEX_CHECK(s < nodes_.size(), fmt::format("unpin of slot {} out of range", s));
    Node& n = nodes_[s];
    PREFIX_INDEX_CHECK((n.state == State::kCommitted || n.state == State::kDropped) && n.pins > 0,
                       fmt::format("unpin of slot {} that is not pinned", s));
    if (--n.pins == 0) {
      --pinned_;
      if (n.state == State::kDropped) {
        FreeDropped(s);
      } else if (Evictable(n)) {
        if (cold) PushFront(Lru(s), s); else PushBack(Lru(s), s);
      }
    }
  }

  // Frees a dropped node that is neither pinned nor a parent, then each dropped ancestor that this leaves
  // childless (iteratively: chains are long).
  void FreeDropped(SlotId s) {
    for (;;) {
      Node& n = nodes_[s];
      if (n.state != State::kDropped || n.pins != 0 || n.children != 0) return;
      const SlotId parent = n.parent;
      n = Node{};
      --used_;
      ReleaseSlot(s);
      if (parent == kNil) return;
      Node& p = nodes_[parent];
      PREFIX_INDEX_CHECK(p.children > 0, fmt::format("slot {} loses a child it does not have", parent));
      --p.children;
      if (p.state != State::kDropped) {
        if (p.children == 0 && Evictable(p)) PushFront(Lru(parent), parent);
        return;
      }
      s = parent;
    }
  }

  // A node gains a child (pending or restored): it is no longer a leaf.
  void AddChild(SlotId parent) {
    if (parent == kNil) return;
    Node& p = nodes_[parent];
    if (Evictable(p)) Unlink(Lru(parent), parent);
    ++p.children;
  }
  // A node loses a child. A parent uncovered by eviction goes to the LRU end (it was used no later than the
  // child that just aged out); one uncovered by an abort goes to the MRU end (the store was a recent use).
  void DropChild(SlotId parent, bool lru_end) {
    if (parent == kNil) return;
    Node& p = nodes_[parent];
    PREFIX_INDEX_CHECK(p.children > 0, fmt::format("slot {} loses a child it does not have", parent));
    --p.children;
    if (p.state == State::kDropped) return FreeDropped(parent);
    if (p.children == 0 && Evictable(p)) {
      if (lru_end) PushFront(Lru(parent), parent); else PushBack(Lru(parent), parent);
    }
  }

  // Evicts the least recently used evictable node and returns its slot (not on the free list), or kNil.
  // Clean nodes first; a dirty one only with `allow_dirty`.
  SlotId EvictOne(bool allow_dirty) {
    SlotId s = clean_lru_.head != kNil ? clean_lru_.head : allow_dirty ? lru_.head : kNil;
    if (s == kNil) return kNil;
    Node& n = nodes_[s];
    PREFIX_INDEX_CHECK(Evictable(n), fmt::format("slot {} on the eviction list is not evictable", s));
    Unlink(Lru(s), s);
    EraseKey(s);
    DropChild(n.parent, /*lru_end=*/true);
    --committed_;
    --used_;
    ++evicted_;
    if (listener_) listener_(s, n.key);
    n = Node{};
    return s;
  }

  // A slot that became free goes on the free list, unless a shrink is giving it back.
  void ReleaseSlot(SlotId s) {
    if (s < limit_) PushFront(free_, s);
  }

  // A free slot, else an evicted one; kNil when neither exists. The slot is unlinked and counted as used. Never
  // a slot at or above limit_ (one evicted there stays free for the shrink).
  SlotId TakeSlot(bool allow_dirty = true) {
    SlotId s = free_.head;
    if (s != kNil) {
      Unlink(free_, s);
    } else {
      do {
        s = EvictOne(allow_dirty);
        if (s == kNil) return kNil;
      } while (s >= limit_);
    }
    ++used_;
    return s;
  }

  // Completes `verdict` (one entry per slot: 1 = marked, 2 = not, 0 = not known yet): every node that is not free
  // gets the verdict of its nearest ancestor that has one (2 at the root), found by walking up once per chain.
  void SpreadVerdicts(std::vector<uint8_t>* verdict) const {
    std::vector<SlotId> path;
    for (SlotId s = 0; s < nodes_.size(); ++s) {
      if ((*verdict)[s] != 0 || nodes_[s].state == State::kFree) continue;
      path.clear();
      uint8_t v = 2;
      for (SlotId cur = s; cur != kNil; cur = nodes_[cur].parent) {
        if ((*verdict)[cur] != 0) {
          v = (*verdict)[cur];
          break;
        }
        path.push_back(cur);
      }
      for (SlotId p : path) (*verdict)[p] = v;
    }
  }

  // Moves limit_: free slots below the new limit are on the free list, those at or above it are not.
  void SetLimit(uint32_t limit) {
    for (SlotId s = limit; s < limit_; ++s) {
      if (nodes_[s].state == State::kFree) Unlink(free_, s);
    }
    for (SlotId s = limit_; s < limit; ++s) {
      if (nodes_[s].state == State::kFree) PushBack(free_, s);
    }
    limit_ = limit;
  }

  void EraseKey(SlotId s) {
    PREFIX_INDEX_CHECK(by_key_.Erase(s, HashKey(nodes_[s].key)), fmt::format("slot {} is not in the hash table", s));
  }

  // Inserts a node into a taken slot (used_ already counted). The key must not be present.
  void Insert(SlotId s, const BlockKey& key, uint64_t hash, SlotId parent, State state) {
    Node& n = nodes_[s];
    n = Node{};
    n.key = key;
    n.parent = parent;
    n.state = state;
    by_key_.Insert(s, hash);
    AddChild(parent);
  }

  // Removes a pending (aborting) node and returns its slot to the free list.
  void RemoveAborted(SlotId s) {
    Node& n = nodes_[s];
    EraseKey(s);
    SlotId parent = n.parent;
    n = Node{};
    --used_;
    ReleaseSlot(s);
    DropChild(parent, /*lru_end=*/false);
  }

  // Restore and RestoreUnverified: a node of the pool's slot table, in `state` (committed or unverified). Its
  // parent must be committed, or for an unverified node committed or unverified.
  Status RestoreNode(SlotId slot, const BlockKey& key, const BlockKey& parent, State state) {
    if (slot >= limit_) {
      return Status::OutOfRange(fmt::format("restore: slot {} is out of range; expected < {} (the active capacity)",
                                            slot, limit_));
    }
    if (key == BlockKey{}) {
      return Status::InvalidArgument(fmt::format("restore: slot {} has the zero key, which names the root", slot));
    }
    if (nodes_[slot].state != State::kFree) {
      return Status::FailedPrecondition(fmt::format("restore: slot {} is already taken", slot));
    }
    const uint64_t hash = HashKey(key);
    if (Find(key, hash) != kNil) {
      return Status::FailedPrecondition(fmt::format("restore: key {} (slot {}) is already present", key.ToHex(), slot));
    }
    SlotId parent_slot = kNil;
    if (parent != BlockKey{}) {
      parent_slot = Find(parent);
      const bool present = parent_slot != kNil && (nodes_[parent_slot].state == State::kCommitted ||
                                                   (state == State::kUnverified &&
                                                    nodes_[parent_slot].state == State::kUnverified));
      if (!present) {
        return Status::FailedPrecondition(fmt::format("restore: key {} (slot {}) has parent {}, which is not present",
                                                      key.ToHex(), slot, parent.ToHex()));
      }
    }
    Unlink(free_, slot);
    ++used_;
    Insert(slot, key, hash, parent_slot, state);
    if (state == State::kCommitted) {
      ++committed_;
      PushBack(Lru(slot), slot);  // a new node is a leaf
    } else {
      ++unverified_;
    }
    return Status::Ok();
  }
};

PrefixIndex::PrefixIndex(uint32_t capacity) : PrefixIndex(capacity, capacity) {}
PrefixIndex::PrefixIndex(uint32_t capacity, uint32_t active) : impl_(std::make_unique<Impl>(capacity, active)) {}
PrefixIndex::~PrefixIndex() = default;

void PrefixIndex::SetEvictionListener(std::function<void(SlotId, const BlockKey&)> listener) {
  impl_->listener_ = std::move(listener);
}

size_t PrefixIndex::Match(std::span<const BlockKey> keys, bool pin, std::vector<SlotId>* slots) {
  PREFIX_INDEX_CHECK(!pin || slots != nullptr, "Match with pin needs somewhere to put the pinned slots");
  Impl& m = *impl_;
  SlotId last = kNil;
  size_t matched = m.WalkCommitted(kNil, keys, [&](SlotId s) {
    if (pin) m.Pin(s);
    if (slots) slots->push_back(s);
    last = s;
  });
  // Only the deepest matched node can be a leaf; every other one has the next as a child.
  if (last != kNil && Impl::Evictable(m.nodes_[last])) {
    m.Unlink(m.Lru(last), last);
    m.PushBack(m.Lru(last), last);
  }
  return matched;
}

void PrefixIndex::Unpin(std::span<const SlotId> slots, bool cold) {
  for (SlotId s : slots) impl_->UnpinOne(s, cold);
}

SlotId PrefixIndex::ParentOf(SlotId slot) const {
  const Impl& m = *impl_;
  if (slot >= m.nodes_.size()) return kNoParent;
  const Node& n = m.nodes_[slot];
  if (n.state == State::kFree || n.parent == kNil) return kNoParent;
  return n.parent;
}

uint32_t PrefixIndex::ChildCount(SlotId slot) const {
  const Impl& m = *impl_;
  return slot < m.nodes_.size() ? m.nodes_[slot].children : 0;
}

void PrefixIndex::ForEachColdLeaf(size_t n, const std::function<bool(SlotId)>& visit) const {
  const Impl& m = *impl_;
  size_t i = 0;
  for (const List* l : {&m.clean_lru_, &m.lru_}) {
    for (SlotId s = l->head; i < n && s != kNil; ++i) {
      const SlotId next = m.nodes_[s].next;  // read first: visit may not change the list, but be safe
      if (!visit(s)) return;
      s = next;
    }
  }
}

PrefixIndex::Reservation PrefixIndex::Reserve(const BlockKey& parent_key, std::span<const BlockKey> keys,
                                              bool allow_dirty) {
  Impl& m = *impl_;
  Reservation r;
  SlotId parent = kNil;
  if (parent_key != kRootParent) {
    parent = m.Find(parent_key);
    if (parent == kNil || m.nodes_[parent].state != State::kCommitted) {
      // A pending parent is another store's, not yet committed: hanging under it would tie this store's
      // commit to that one's, and that one may still abort.
      r.shortfall = parent == kNil ? StatusCode::kFailedPrecondition : StatusCode::kAborted;
      r.parent_refused = true;
      return r;
    }
  }
  // Pin the parent and the committed prefix for the duration so that taking slots cannot evict this chain's
  // own nodes; once the first pending node hangs under them, its being a child keeps them until Commit/Abort.
  std::vector<SlotId> prefix;
  if (parent != kNil) {
    m.Pin(parent);
    prefix.push_back(parent);
  }
  r.cached = m.WalkCommitted(parent, keys, [&](SlotId s) {
    m.Pin(s);
    prefix.push_back(s);
  });
  if (r.cached > 0) parent = prefix.back();
  // The walk has fetched the buckets of the keys just after the prefix; keep fetching kAhead keys ahead.
  constexpr size_t kAhead = 4;
  for (size_t i = r.cached; i < keys.size(); ++i) {
    if (i + kAhead < keys.size()) m.by_key_.PrefetchHome(HashKey(keys[i + kAhead]));
    const uint64_t hash = HashKey(keys[i]);
    if (m.Find(keys[i], hash) != kNil) {
      // Pending in another store. (A committed node here would mean `keys` is not a chain: the walk
      // stopped at keys[i], yet it exists under another parent. Equally unreservable.)
      r.shortfall = StatusCode::kAborted;
      break;
    }
    SlotId s = m.TakeSlot(allow_dirty);
    if (s == kNil) {
      r.shortfall = StatusCode::kResourceExhausted;
      // Without dirty evictions, no slot means: only dirty leaves are left, or none is evictable at all (the write-back
      // pins the cold leaves it writes): either way the next tier's writes are what frees slots. Not a store that
      // asks for more blocks than the pool holds: no write-back makes room for it, so waiting would only delay it.
      r.dirty_only = !allow_dirty && keys.size() - r.cached <= m.limit_;
      break;
    }
    m.Insert(s, keys[i], hash, parent, State::kPending);
    r.slots.push_back(s);
    parent = s;
  }
  Unpin(prefix);
  return r;
}

void PrefixIndex::Commit(std::span<const SlotId> slots) {
  Impl& m = *impl_;
  for (SlotId s : slots) {
    PREFIX_INDEX_CHECK(s < m.nodes_.size(), fmt::format("commit of slot {} out of range", s));
    Node& n = m.nodes_[s];
    if (n.state == State::kPendingDropped) {  // its subtree was dropped while the store copied
      m.EraseKey(s);
      n.state = State::kDropped;
      m.FreeDropped(s);
      continue;
    }
    PREFIX_INDEX_CHECK(n.state == State::kPending, fmt::format("commit of slot {} that is not pending", s));
    PREFIX_INDEX_CHECK(n.parent == kNil || m.nodes_[n.parent].state == State::kCommitted,
                       fmt::format("commit of slot {} before its parent slot {}", s, n.parent));
    n.state = State::kCommitted;
    ++m.committed_;
    if (Impl::Evictable(n)) m.PushBack(m.Lru(s), s);
  }
}

void PrefixIndex::Abort(std::span<const SlotId> slots) {
  Impl& m = *impl_;
  for (SlotId s : slots) {
    PREFIX_INDEX_CHECK(s < m.nodes_.size(), fmt::format("abort of slot {} out of range", s));
    Node& n = m.nodes_[s];
    PREFIX_INDEX_CHECK(n.state == State::kPending || n.state == State::kPendingDropped,
                       fmt::format("abort of slot {} that is not pending (or listed twice)", s));
    n.state = State::kAborting;
  }
  // Remove leaves first, in the given order; removing the last child of an aborting parent removes the
  // parent too. A pending node's children are pending nodes of the same store, so all of them are listed.
  for (SlotId s : slots) {
    while (s != kNil && m.nodes_[s].state == State::kAborting && m.nodes_[s].children == 0) {
      SlotId parent = m.nodes_[s].parent;
      m.RemoveAborted(s);
      s = parent;
    }
  }
  for (SlotId s : slots) {
    PREFIX_INDEX_CHECK(m.nodes_[s].state != State::kAborting,
                       fmt::format("abort of slot {} whose pending child was not aborted with it", s));
  }
}

Status PrefixIndex::Restore(SlotId slot, const BlockKey& key, const BlockKey& parent) {
  return impl_->RestoreNode(slot, key, parent, State::kCommitted);
}

Status PrefixIndex::RestoreUnverified(SlotId slot, const BlockKey& key, const BlockKey& parent) {
  return impl_->RestoreNode(slot, key, parent, State::kUnverified);
}

bool PrefixIndex::MarkVerified(SlotId slot) {
  Impl& m = *impl_;
  if (slot >= m.nodes_.size() || m.nodes_[slot].state != State::kUnverified) return false;
  Node& n = m.nodes_[slot];
  if (n.parent != kNil && m.nodes_[n.parent].state != State::kCommitted) return false;
  n.state = State::kCommitted;
  --m.unverified_;
  ++m.committed_;
  if (Impl::Evictable(n)) m.PushBack(m.Lru(slot), slot);
  return true;
}

void PrefixIndex::SetClean(SlotId slot, bool clean) {
  Impl& m = *impl_;
  if (slot >= m.nodes_.size() || m.nodes_[slot].state != State::kCommitted || m.nodes_[slot].clean == clean) return;
  Node& n = m.nodes_[slot];
  const bool listed = Impl::Evictable(n);
  if (listed) m.Unlink(m.Lru(slot), slot);
  n.clean = clean;
  if (!listed) return;
  // A block found written (clean) was used no later than before; one found gone from the next tier (dirty) was
  // at the cold end, where the write-back walk found it: it stays there.
  if (clean) m.PushBack(m.Lru(slot), slot); else m.PushFront(m.Lru(slot), slot);
}

uint32_t PrefixIndex::clean_leaves() const { return impl_->clean_lru_.size; }

bool PrefixIndex::PinSlot(SlotId slot) {
  Impl& m = *impl_;
  if (slot >= m.nodes_.size() || m.nodes_[slot].state != State::kCommitted) return false;
  m.Pin(slot);
  return true;
}

size_t PrefixIndex::DropSubtrees(std::span<const SlotId> slots, const std::function<void(SlotId)>& on_drop) {
  Impl& m = *impl_;
  const auto cap = static_cast<uint32_t>(m.nodes_.size());
  // Per slot: 1 = in a dropped subtree, 2 = not, 0 = not known yet. A node's verdict is its nearest marked
  // ancestor's (or 2 at the root), found by walking up once per chain.
  std::vector<uint8_t> verdict(cap, 0);
  bool any = false;
  for (SlotId s : slots) {
    if (s < cap && (m.nodes_[s].state == State::kCommitted || m.nodes_[s].state == State::kUnverified)) {
      verdict[s] = 1;
      any = true;
    }
  }
  if (!any) return 0;
  m.SpreadVerdicts(&verdict);
  size_t dropped = 0;
  for (SlotId s = 0; s < cap; ++s) {
    if (verdict[s] != 1) continue;
    Node& n = m.nodes_[s];
    switch (n.state) {
      case State::kCommitted:
        if (Impl::Evictable(n)) m.Unlink(m.Lru(s), s);
        --m.committed_;
        break;
      case State::kUnverified:
        --m.unverified_;
        break;
      case State::kPending:
        n.state = State::kPendingDropped;
        continue;
      default:
        continue;
    }
    m.EraseKey(s);
    n.state = State::kDropped;
    ++dropped;
    on_drop(s);
  }
  for (SlotId s = 0; s < cap; ++s) {
    if (verdict[s] == 1) m.FreeDropped(s);
  }
  return dropped;
}

void PrefixIndex::Grow(uint32_t active) {
  Impl& m = *impl_;
  PREFIX_INDEX_CHECK(active >= m.active_ && active <= m.nodes_.size(),
                     fmt::format("grow to {} slots from {} (capacity {})", active, m.active_, m.nodes_.size()));
  m.active_ = active;
  m.SetLimit(active);
}

PrefixIndex::Shrunk PrefixIndex::Shrink(uint32_t target) {
  Impl& m = *impl_;
  PREFIX_INDEX_CHECK(target <= m.active_, fmt::format("shrink to {} slots from {}", target, m.active_));
  m.SetLimit(target);
  Shrunk out;
  bool any = false;
  for (SlotId s = target; s < m.active_ && !any; ++s) any = m.nodes_[s].state == State::kCommitted;
  if (any) {
    const auto cap = static_cast<uint32_t>(m.nodes_.size());
    // A node that is not committed and unpinned (pending, unverified, pinned, dropped) keeps itself and every
    // ancestor: evicting an ancestor would cut it off (or free a slot it needs).
    std::vector<uint8_t> kept(cap, 0);
    for (SlotId s = 0; s < cap; ++s) {
      const Node& n = m.nodes_[s];
      if (n.state == State::kFree || (n.state == State::kCommitted && n.pins == 0)) continue;
      for (SlotId cur = s; cur != kNil && kept[cur] == 0; cur = m.nodes_[cur].parent) kept[cur] = 1;
    }
    // Per slot: 1 = in the subtree of a committed tail node that is not kept (evicted), 2 = not, 0 = not known
    // yet; found by walking up once per chain, as DropSubtrees does.
    std::vector<uint8_t> verdict(cap, 0);
    for (SlotId s = target; s < m.active_; ++s) {
      if (m.nodes_[s].state == State::kCommitted && kept[s] == 0) verdict[s] = 1;
    }
    m.SpreadVerdicts(&verdict);
    // Out of the index first (every one is committed and unpinned: nothing kept is below an evicted node), then
    // the slots are freed leaves first, as for dropped nodes.
    for (SlotId s = 0; s < cap; ++s) {
      if (verdict[s] != 1) continue;
      Node& n = m.nodes_[s];
      if (Impl::Evictable(n)) m.Unlink(m.Lru(s), s);
      m.EraseKey(s);
      --m.committed_;
      ++m.evicted_;
      ++out.evicted;
      if (m.listener_) m.listener_(s, n.key);
      n.state = State::kDropped;
    }
    for (SlotId s = 0; s < cap; ++s) {
      if (verdict[s] == 1) m.FreeDropped(s);
    }
  }
  while (m.active_ > target && m.nodes_[m.active_ - 1].state == State::kFree) --m.active_;
  out.active = m.active_;
  return out;
}

uint32_t PrefixIndex::active() const { return impl_->active_; }
uint32_t PrefixIndex::limit() const { return impl_->limit_; }

void PrefixIndex::LimitTo(uint32_t limit) {
  Impl& m = *impl_;
  PREFIX_INDEX_CHECK(limit <= m.active_, fmt::format("limit {} above the {} active slots", limit, m.active_));
  m.SetLimit(limit);
}

bool PrefixIndex::IsCommitted(SlotId slot) const {
  return slot < impl_->nodes_.size() && impl_->nodes_[slot].state == State::kCommitted;
}

bool PrefixIndex::IsUnverified(SlotId slot) const {
  return slot < impl_->nodes_.size() && impl_->nodes_[slot].state == State::kUnverified;
}

uint32_t PrefixIndex::unverified_blocks() const { return impl_->unverified_; }

uint32_t PrefixIndex::capacity() const { return static_cast<uint32_t>(impl_->nodes_.size()); }
uint32_t PrefixIndex::used_slots() const { return impl_->used_; }
uint32_t PrefixIndex::pinned_slots() const { return impl_->pinned_; }
uint32_t PrefixIndex::committed_blocks() const { return impl_->committed_; }
uint64_t PrefixIndex::evicted_blocks() const { return impl_->evicted_; }
bool PrefixIndex::HasDirtyLeaf() const { return impl_->lru_.head != kNil; }

std::vector<SlotId> PrefixIndex::EvictionOrder() const {
  std::vector<SlotId> out;
  for (SlotId s = impl_->clean_lru_.head; s != kNil; s = impl_->nodes_[s].next) out.push_back(s);
  for (SlotId s = impl_->lru_.head; s != kNil; s = impl_->nodes_[s].next) out.push_back(s);
  return out;
}

void PrefixIndex::ForEachCommitted(const std::function<void(SlotId, const BlockKey&, const BlockKey&)>& fn) const {
  const auto& nodes = impl_->nodes_;
  for (SlotId s = 0; s < nodes.size(); ++s) {
    const Node& n = nodes[s];
    if (n.state != State::kCommitted) continue;
    fn(s, n.key, n.parent == kNil ? BlockKey{} : nodes[n.parent].key);
  }
}

void PrefixIndex::CheckInvariants() const {
  const Impl& m = *impl_;
  const auto cap = static_cast<uint32_t>(m.nodes_.size());
  std::vector<uint32_t> children(cap, 0);
  uint32_t used = 0, pinned = 0, committed = 0, unverified = 0, evictable = 0, dropped = 0;
  for (SlotId s = 0; s < cap; ++s) {
    const Node& n = m.nodes_[s];
    PREFIX_INDEX_CHECK(n.state != State::kAborting, fmt::format("slot {} left aborting", s));
    if (n.state == State::kFree) {
      PREFIX_INDEX_CHECK(n.pins == 0 && n.children == 0, fmt::format("free slot {} has pins or children", s));
      continue;
    }
    ++used;
    if (n.pins > 0) ++pinned;
    if (n.state == State::kCommitted) ++committed;
    if (n.state == State::kUnverified) ++unverified;
    if (Impl::Evictable(n)) ++evictable;
    PREFIX_INDEX_CHECK(n.state == State::kCommitted || n.state == State::kDropped || n.pins == 0,
                       fmt::format("slot {} is pinned but neither committed nor dropped", s));
    if (n.state == State::kDropped) {
      ++dropped;
      PREFIX_INDEX_CHECK(n.pins > 0 || n.children > 0, fmt::format("dropped slot {} should have been freed", s));
      PREFIX_INDEX_CHECK(m.Find(n.key) != s, fmt::format("dropped slot {} is still found by its key", s));
    } else {
      PREFIX_INDEX_CHECK(m.Find(n.key) == s, fmt::format("slot {} is not found by its key", s));
    }
    if (n.parent != kNil) {
      PREFIX_INDEX_CHECK(n.parent < cap && m.nodes_[n.parent].state != State::kFree,
                         fmt::format("slot {} has a free parent slot {}", s, n.parent));
      const State ps = m.nodes_[n.parent].state;
      bool parent_ok = true;
      switch (n.state) {
        case State::kCommitted: parent_ok = ps == State::kCommitted; break;
        case State::kUnverified: parent_ok = ps == State::kCommitted || ps == State::kUnverified; break;
        case State::kPending: parent_ok = ps == State::kCommitted || ps == State::kPending; break;
        case State::kPendingDropped: parent_ok = ps == State::kPendingDropped || ps == State::kDropped; break;
        default: break;
      }
      PREFIX_INDEX_CHECK(parent_ok, fmt::format("slot {} hangs under slot {}, whose state does not allow it", s, n.parent));
      ++children[n.parent];
    }
  }
  for (SlotId s = 0; s < cap; ++s) {
    PREFIX_INDEX_CHECK(children[s] == m.nodes_[s].children, fmt::format("slot {} child count is wrong", s));
  }
  PREFIX_INDEX_CHECK(used == m.used_ && pinned == m.pinned_ && committed == m.committed_ && unverified == m.unverified_,
                     "counters drifted");
  PREFIX_INDEX_CHECK(m.by_key_.size() == used - dropped, "hash table size differs from used, undropped slots");
  // Every bucket names a used slot under its key's tag, in Robin Hood order (a bucket's probe distance is at
  // most one more than the previous bucket's; empty counts as -1). Together with each used slot being found
  // by its key above and the size check, each used slot is in the table exactly once.
  const SlotTable& t = m.by_key_;
  size_t entries = 0;
  for (size_t pos = 0; pos < t.bucket_count(); ++pos) {
    const SlotTable::Bucket& b = t.bucket(pos);
    if (b.slot == kNil) continue;
    ++entries;
    PREFIX_INDEX_CHECK(b.slot < cap && m.nodes_[b.slot].state != State::kFree && m.nodes_[b.slot].state != State::kDropped,
                       fmt::format("hash table bucket {} names slot {}, which is not used", pos, b.slot));
    PREFIX_INDEX_CHECK(b.tag == SlotTable::Tag(HashKey(m.nodes_[b.slot].key)),
                       fmt::format("hash table bucket {} has the wrong tag for slot {}", pos, b.slot));
    const size_t prev = (pos + t.bucket_count() - 1) % t.bucket_count();
    const SlotTable::Bucket& p = t.bucket(prev);
    const size_t limit = p.slot == kNil ? 0 : t.Distance(prev, p.tag) + 1;
    PREFIX_INDEX_CHECK(t.Distance(pos, b.tag) <= limit,
                       fmt::format("hash table bucket {} (slot {}) is out of Robin Hood order", pos, b.slot));
  }
  PREFIX_INDEX_CHECK(entries == t.size(), "hash table entry count drifted");
  PREFIX_INDEX_CHECK(m.limit_ <= m.active_ && m.active_ <= cap, "limit or active capacity out of order");
  uint32_t free_below_limit = 0;
  for (SlotId s = 0; s < cap; ++s) {
    PREFIX_INDEX_CHECK(s < m.active_ || m.nodes_[s].state == State::kFree,
                       fmt::format("slot {} beyond the active capacity is used", s));
    if (s < m.limit_ && m.nodes_[s].state == State::kFree) ++free_below_limit;
  }
  PREFIX_INDEX_CHECK(m.free_.size == free_below_limit, "free list size != free slots below the limit");
  auto walk = [&](const List& l, auto&& want) {
    uint32_t count = 0;
    SlotId prev = kNil;
    for (SlotId s = l.head; s != kNil; s = m.nodes_[s].next) {
      PREFIX_INDEX_CHECK(++count <= cap && m.nodes_[s].prev == prev && want(m.nodes_[s]),
                         fmt::format("list broken at slot {}", s));
      prev = s;
    }
    PREFIX_INDEX_CHECK(l.tail == prev && count == l.size, "list tail or size is wrong");
  };
  SlotId listed_limit = m.limit_;
  for (SlotId s = m.free_.head; s != kNil; s = m.nodes_[s].next) {
    PREFIX_INDEX_CHECK(s < listed_limit, fmt::format("free slot {} at or above the limit is on the free list", s));
  }
  walk(m.free_, [](const Node& n) { return n.state == State::kFree; });
  walk(m.lru_, [](const Node& n) { return Impl::Evictable(n) && !n.clean; });
  walk(m.clean_lru_, [](const Node& n) { return Impl::Evictable(n) && n.clean; });
  PREFIX_INDEX_CHECK(m.lru_.size + m.clean_lru_.size == evictable, "an evictable node is missing from the eviction lists");
}

}  // namespace flexkv
