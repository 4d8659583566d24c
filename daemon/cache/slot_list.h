// SlotList: an intrusive doubly-linked list of pool slots, threaded through the `prev` and `next` fields of a
// slot-indexed node array (PrefixIndex's nodes, ComponentIndex's entries): free slots and eviction orders, O(1) each
// operation. Not thread-safe; the index that owns the nodes serializes calls.
#pragma once

#include <cstdint>
#include <limits>

#include "daemon/cache/prefix_index.h"

namespace flexkv {

inline constexpr SlotId kNilSlot = std::numeric_limits<SlotId>::max();  // the end of a list

struct SlotList {
  SlotId head = kNilSlot;  // eviction lists: the end evicted first
  SlotId tail = kNilSlot;  // eviction lists: the most recently used end
  uint32_t size = 0;

  // `nodes[s]` has SlotId members prev and next; s must not be on a list.
  template <class Nodes>
  void PushBack(Nodes& nodes, SlotId s) {
    auto& n = nodes[s];
    n.prev = tail;
    n.next = kNilSlot;
    if (tail != kNilSlot) nodes[tail].next = s; else head = s;
    tail = s;
    ++size;
  }
  template <class Nodes>
  void PushFront(Nodes& nodes, SlotId s) {
    auto& n = nodes[s];
    n.prev = kNilSlot;
    n.next = head;
    if (head != kNilSlot) nodes[head].prev = s; else tail = s;
    head = s;
    ++size;
  }
  // s must be on this list.
  template <class Nodes>
  void Unlink(Nodes& nodes, SlotId s) {
    auto& n = nodes[s];
    if (n.prev != kNilSlot) nodes[n.prev].next = n.next; else head = n.next;
    if (n.next != kNilSlot) nodes[n.next].prev = n.prev; else tail = n.prev;
    n.prev = n.next = kNilSlot;
    --size;
  }
};

}  // namespace flexkv
