// PrefixIndex: a slot-indexed node array, a key → slot hash set over it, and two intrusive lists threaded
// through the nodes (free slots; evictable leaves in LRU order). See prefix_index.h for the contract.
#include "daemon/cache/prefix_index.h"

#include <absl/container/flat_hash_set.h>
#include <absl/hash/hash.h>
#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <utility>

// Broken internal invariants crash loudly (CONVENTIONS: untrusted input is answered, invariants assert).
#define PREFIX_INDEX_CHECK(cond, what)                                                                  \
  do {                                                                                                 \
    if (!(cond)) {                                                                                     \
      std::fprintf(stderr, "%s:%d: PrefixIndex invariant violated: %s [%s]\n", __FILE__, __LINE__,     \
                   std::string(what).c_str(), #cond);                                                   \
      std::abort();                                                                                    \
    }                                                                                                  \
  } while (0)

namespace flexkv {
namespace {

constexpr SlotId kNil = std::numeric_limits<SlotId>::max();  // end of a list; "no parent" (root level)

enum class State : uint8_t {
  kFree,
  kPending,
  kCommitted,
  kAborting,  // only inside Abort(): pending, queued for removal
};

// 40 bytes. `prev`/`next` link the free list while free and the eviction list while evictable.
struct Node {
  BlockKey key;
  SlotId parent = kNil;
  uint32_t children = 0;  // pending or committed nodes whose parent is this one
  uint32_t pins = 0;
  SlotId prev = kNil;
  SlotId next = kNil;
  State state = State::kFree;
};
static_assert(sizeof(Node) <= 40, "PrefixIndex nodes should stay small; one per pool slot");

// The hash set stores slot ids only (4 bytes + 1 control byte per bucket); hashing and equality look the
// key up in the node array, and lookups by BlockKey go through heterogeneous (transparent) overloads.
struct SlotKeyHash {
  using is_transparent = void;
  const std::vector<Node>* nodes;
  size_t operator()(const BlockKey& k) const { return absl::HashOf(k.lo, k.hi); }
  size_t operator()(SlotId s) const { return (*this)((*nodes)[s].key); }
};
struct SlotKeyEq {
  using is_transparent = void;
  const std::vector<Node>* nodes;
  const BlockKey& Key(SlotId s) const { return (*nodes)[s].key; }
  bool operator()(SlotId a, SlotId b) const { return Key(a) == Key(b); }
  bool operator()(SlotId a, const BlockKey& b) const { return Key(a) == b; }
  bool operator()(const BlockKey& a, SlotId b) const { return a == Key(b); }
};

struct List {
  SlotId head = kNil;  // eviction list: least recently used end
  SlotId tail = kNil;  // eviction list: most recently used end
  uint32_t size = 0;
};

}  // namespace

struct PrefixIndex::Impl {
  explicit Impl(uint32_t cap)
      : nodes_(cap), by_key_(0, SlotKeyHash{&nodes_}, SlotKeyEq{&nodes_}) {
    by_key_.reserve(cap);  // never rehashes afterwards
    for (SlotId s = 0; s < cap; ++s) PushBack(free_, s);  // slot 0 is taken first
  }
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  std::vector<Node> nodes_;
  absl::flat_hash_set<SlotId, SlotKeyHash, SlotKeyEq> by_key_;  // pending and committed nodes
  List free_;
  List lru_;  // exactly the evictable nodes: committed, unpinned, childless
  std::function<void(SlotId, const BlockKey&)> listener_;
  uint32_t used_ = 0;
  uint32_t pinned_ = 0;
  uint32_t committed_ = 0;
  uint64_t evicted_ = 0;

  // --- intrusive lists ---
  void PushBack(List& l, SlotId s) {
    Node& n = nodes_[s];
    n.prev = l.tail;
    n.next = kNil;
    if (l.tail != kNil) nodes_[l.tail].next = s; else l.head = s;
    l.tail = s;
    ++l.size;
  }
  void PushFront(List& l, SlotId s) {
    Node& n = nodes_[s];
    n.prev = kNil;
    n.next = l.head;
    if (l.head != kNil) nodes_[l.head].prev = s; else l.tail = s;
    l.head = s;
    ++l.size;
  }
  void Unlink(List& l, SlotId s) {
    Node& n = nodes_[s];
    if (n.prev != kNil) nodes_[n.prev].next = n.next; else l.head = n.next;
    if (n.next != kNil) nodes_[n.next].prev = n.prev; else l.tail = n.prev;
    n.prev = n.next = kNil;
    --l.size;
  }

  static bool Evictable(const Node& n) {
    return n.state == State::kCommitted && n.pins == 0 && n.children == 0;
  }

  SlotId Find(const BlockKey& key) const {
    auto it = by_key_.find(key);
    return it == by_key_.end() ? kNil : *it;
  }

  // Walks the committed chain of `keys`: stops at the first key that is missing, not committed, or
  // whose node hangs under a different parent than the previous key (a chain the client did not build
  // by chaining). Calls visit(slot) for each matched node; returns the count.
  template <typename Visit>
  size_t WalkCommitted(std::span<const BlockKey> keys, Visit&& visit) {
    SlotId parent = kNil;
    size_t i = 0;
    for (; i < keys.size(); ++i) {
      SlotId s = Find(keys[i]);
      if (s == kNil) break;
      const Node& n = nodes_[s];
      if (n.state != State::kCommitted || n.parent != parent) break;
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
      if (n.children == 0) Unlink(lru_, s);  // was evictable
    }
  }
  void UnpinOne(SlotId s) {
    PREFIX_INDEX_CHECK(s < nodes_.size(), fmt::format("unpin of slot {} out of range", s));
    Node& n = nodes_[s];
    PREFIX_INDEX_CHECK(n.state == State::kCommitted && n.pins > 0,
                       fmt::format("unpin of slot {} that is not pinned", s));
    if (--n.pins == 0) {
      --pinned_;
      if (Evictable(n)) PushBack(lru_, s);
    }
  }

  // A node gains a child (pending or restored): it is no longer a leaf.
  void AddChild(SlotId parent) {
    if (parent == kNil) return;
    Node& p = nodes_[parent];
    if (Evictable(p)) Unlink(lru_, parent);
    ++p.children;
  }
  // A node loses a child. A parent uncovered by eviction goes to the LRU end (it was used no later than the
  // child that just aged out); one uncovered by an abort goes to the MRU end (the store was a recent use).
  void DropChild(SlotId parent, bool lru_end) {
    if (parent == kNil) return;
    Node& p = nodes_[parent];
    PREFIX_INDEX_CHECK(p.children > 0, fmt::format("slot {} loses a child it does not have", parent));
    if (--p.children == 0 && Evictable(p)) {
      if (lru_end) PushFront(lru_, parent); else PushBack(lru_, parent);
    }
  }

  // Evicts the least recently used evictable node and returns its slot (not on the free list), or kNil.
  SlotId EvictOne() {
    SlotId s = lru_.head;
    if (s == kNil) return kNil;
    Node& n = nodes_[s];
    PREFIX_INDEX_CHECK(Evictable(n), fmt::format("slot {} on the eviction list is not evictable", s));
    Unlink(lru_, s);
    by_key_.erase(s);
    DropChild(n.parent, /*lru_end=*/true);
    --committed_;
    --used_;
    ++evicted_;
    if (listener_) listener_(s, n.key);
    n = Node{};
    return s;
  }

  // A free slot, else an evicted one; kNil when neither exists. The slot is unlinked and counted as used.
  SlotId TakeSlot() {
    SlotId s = free_.head;
    if (s != kNil) {
      Unlink(free_, s);
    } else {
      s = EvictOne();
      if (s == kNil) return kNil;
    }
    ++used_;
    return s;
  }

  // Inserts a node into a taken slot (used_ already counted).
  void Insert(SlotId s, const BlockKey& key, SlotId parent, State state) {
    Node& n = nodes_[s];
    n = Node{};
    n.key = key;
    n.parent = parent;
    n.state = state;
    by_key_.insert(s);
    AddChild(parent);
  }

  // Removes a pending (aborting) node and returns its slot to the free list.
  void RemoveAborted(SlotId s) {
    Node& n = nodes_[s];
    by_key_.erase(s);
    SlotId parent = n.parent;
    n = Node{};
    --used_;
    PushFront(free_, s);
    DropChild(parent, /*lru_end=*/false);
  }
};

PrefixIndex::PrefixIndex(uint32_t capacity) : impl_(std::make_unique<Impl>(capacity)) {}
PrefixIndex::~PrefixIndex() = default;

void PrefixIndex::SetEvictionListener(std::function<void(SlotId, const BlockKey&)> listener) {
  impl_->listener_ = std::move(listener);
}

size_t PrefixIndex::Match(std::span<const BlockKey> keys, bool pin, std::vector<SlotId>* slots) {
  PREFIX_INDEX_CHECK(!pin || slots != nullptr, "Match with pin needs somewhere to put the pinned slots");
  Impl& m = *impl_;
  SlotId last = kNil;
  size_t matched = m.WalkCommitted(keys, [&](SlotId s) {
    if (pin) m.Pin(s);
    if (slots) slots->push_back(s);
    last = s;
  });
  // Only the deepest matched node can be a leaf; every other one has the next as a child.
  if (last != kNil && Impl::Evictable(m.nodes_[last])) {
    m.Unlink(m.lru_, last);
    m.PushBack(m.lru_, last);
  }
  return matched;
}

void PrefixIndex::Unpin(std::span<const SlotId> slots) {
  for (SlotId s : slots) impl_->UnpinOne(s);
}

PrefixIndex::Reservation PrefixIndex::Reserve(std::span<const BlockKey> keys) {
  Impl& m = *impl_;
  Reservation r;
  // Pin the committed prefix for the duration so that taking slots cannot evict this chain's own nodes.
  std::vector<SlotId> prefix;
  r.cached = m.WalkCommitted(keys, [&](SlotId s) {
    m.Pin(s);
    prefix.push_back(s);
  });
  SlotId parent = prefix.empty() ? kNil : prefix.back();
  for (size_t i = r.cached; i < keys.size(); ++i) {
    if (m.Find(keys[i]) != kNil) {
      // Pending in another store. (A committed node here would mean `keys` is not a chain: the walk
      // stopped at keys[i], yet it exists under another parent. Equally unreservable.)
      r.shortfall = StatusCode::kAborted;
      break;
    }
    SlotId s = m.TakeSlot();
    if (s == kNil) {
      r.shortfall = StatusCode::kResourceExhausted;
      break;
    }
    m.Insert(s, keys[i], parent, State::kPending);
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
    PREFIX_INDEX_CHECK(n.state == State::kPending, fmt::format("commit of slot {} that is not pending", s));
    PREFIX_INDEX_CHECK(n.parent == kNil || m.nodes_[n.parent].state == State::kCommitted,
                       fmt::format("commit of slot {} before its parent slot {}", s, n.parent));
    n.state = State::kCommitted;
    ++m.committed_;
    if (Impl::Evictable(n)) m.PushBack(m.lru_, s);
  }
}

void PrefixIndex::Abort(std::span<const SlotId> slots) {
  Impl& m = *impl_;
  for (SlotId s : slots) {
    PREFIX_INDEX_CHECK(s < m.nodes_.size(), fmt::format("abort of slot {} out of range", s));
    Node& n = m.nodes_[s];
    PREFIX_INDEX_CHECK(n.state == State::kPending,
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
  Impl& m = *impl_;
  if (slot >= m.nodes_.size()) {
    return Status::OutOfRange(fmt::format("restore: slot {} is out of range; expected < {}", slot, m.nodes_.size()));
  }
  if (key == BlockKey{}) {
    return Status::InvalidArgument(fmt::format("restore: slot {} has the zero key, which names the root", slot));
  }
  if (m.nodes_[slot].state != State::kFree) {
    return Status::FailedPrecondition(fmt::format("restore: slot {} is already taken", slot));
  }
  if (m.Find(key) != kNil) {
    return Status::FailedPrecondition(fmt::format("restore: key {} (slot {}) is already present", key.ToHex(), slot));
  }
  SlotId parent_slot = kNil;
  if (parent != BlockKey{}) {
    parent_slot = m.Find(parent);
    if (parent_slot == kNil || m.nodes_[parent_slot].state != State::kCommitted) {
      return Status::FailedPrecondition(fmt::format("restore: key {} (slot {}) has parent {}, which is not present",
                                                    key.ToHex(), slot, parent.ToHex()));
    }
  }
  m.Unlink(m.free_, slot);
  ++m.used_;
  m.Insert(slot, key, parent_slot, State::kCommitted);
  ++m.committed_;
  m.PushBack(m.lru_, slot);  // a new node is a leaf
  return Status::Ok();
}

uint32_t PrefixIndex::capacity() const { return static_cast<uint32_t>(impl_->nodes_.size()); }
uint32_t PrefixIndex::used_slots() const { return impl_->used_; }
uint32_t PrefixIndex::pinned_slots() const { return impl_->pinned_; }
uint32_t PrefixIndex::committed_blocks() const { return impl_->committed_; }
uint64_t PrefixIndex::evicted_blocks() const { return impl_->evicted_; }

std::vector<SlotId> PrefixIndex::EvictionOrder() const {
  std::vector<SlotId> out;
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
  uint32_t used = 0, pinned = 0, committed = 0, evictable = 0;
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
    if (Impl::Evictable(n)) ++evictable;
    PREFIX_INDEX_CHECK(n.state == State::kCommitted || n.pins == 0, fmt::format("pending slot {} is pinned", s));
    PREFIX_INDEX_CHECK(m.Find(n.key) == s, fmt::format("slot {} is not found by its key", s));
    if (n.parent != kNil) {
      PREFIX_INDEX_CHECK(n.parent < cap && m.nodes_[n.parent].state != State::kFree,
                         fmt::format("slot {} has a free parent slot {}", s, n.parent));
      PREFIX_INDEX_CHECK(n.state == State::kPending || m.nodes_[n.parent].state == State::kCommitted,
                         fmt::format("committed slot {} has an uncommitted parent slot {}", s, n.parent));
      ++children[n.parent];
    }
  }
  for (SlotId s = 0; s < cap; ++s) {
    PREFIX_INDEX_CHECK(children[s] == m.nodes_[s].children, fmt::format("slot {} child count is wrong", s));
  }
  PREFIX_INDEX_CHECK(used == m.used_ && pinned == m.pinned_ && committed == m.committed_, "counters drifted");
  PREFIX_INDEX_CHECK(m.by_key_.size() == used, "hash set size differs from used slots");
  PREFIX_INDEX_CHECK(m.free_.size + used == cap, "free list size + used != capacity");
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
  walk(m.free_, [](const Node& n) { return n.state == State::kFree; });
  walk(m.lru_, [](const Node& n) { return Impl::Evictable(n); });
  PREFIX_INDEX_CHECK(m.lru_.size == evictable, "an evictable node is missing from the eviction list");
}

}  // namespace flexkv
