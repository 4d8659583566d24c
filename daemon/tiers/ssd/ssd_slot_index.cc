// See ssd_slot_index.h.
#include "daemon/tiers/ssd/ssd_slot_index.h"

#include <absl/hash/hash.h>

#include <algorithm>

#include "daemon/tiers/ssd/ssd_check.h"

namespace flexkv {

size_t SsdSlotIndex::IdHash::operator()(const SsdBlockId& id) const {
  return absl::HashOf(id.key.lo, id.key.hi, id.domain.namespace_hash, id.domain.geometry_hash, id.component);
}

SsdSlotIndex::SsdSlotIndex(uint32_t drives, uint64_t per_drive_slots)
    : per_drive_slots_(per_drive_slots), slots_(per_drive_slots * drives), free_slots_(drives) {
  SSD_CHECK(per_drive_slots > 0 && slots_.size() < kNoSlot, "slot numbers fit below kNoSlot");
}

// --- LRU lists and parents ---

// `s` must be on its list (committed, unpinned).
void SsdSlotIndex::LruUnlink(uint32_t s) {
  SlotEntry& e = slots_[s];
  LruList& l = ListOf(s);
  if (e.prev != kNil) slots_[e.prev].next = e.next; else l.head = e.next;
  if (e.next != kNil) slots_[e.next].prev = e.prev; else l.tail = e.prev;
  e.prev = e.next = kNil;
}

// Lists `s` (committed, unpinned, not listed) on the leaves' or the interior list, whichever it belongs to now:
// at the most recently used end, or with `lru_end` at the least recently used one.
void SsdSlotIndex::LruPush(uint32_t s, bool lru_end) {
  SlotEntry& e = slots_[s];
  e.interior = HasChildren(e.e.id);
  LruList& l = ListOf(s);
  if (lru_end) {
    e.prev = kNil;
    e.next = l.head;
    if (l.head != kNil) slots_[l.head].prev = s; else l.tail = s;
    l.head = s;
  } else {
    e.prev = l.tail;
    e.next = kNil;
    if (l.tail != kNil) slots_[l.tail].next = s; else l.head = s;
    l.tail = s;
  }
}

bool SsdSlotIndex::HasChildren(const SsdBlockId& id) const {
  auto it = children_.find(id);
  return it != children_.end() && it->second > 0;
}

// The id of the block `e` hangs under; none at a prompt's start (or for a block naming itself, which only a
// damaged or forged header does).
std::optional<SsdBlockId> SsdSlotIndex::ParentId(const SsdEntry& e) {
  if (e.parent == kRootParent || e.parent == e.id.key) return std::nullopt;
  return SsdBlockId{e.parent, e.id.domain, e.id.component};
}

// The committed block `e` counts as a child of its parent: a listed parent moves to the interior list.
void SsdSlotIndex::AddChild(const SsdEntry& e) {
  const std::optional<SsdBlockId> pid = ParentId(e);
  if (!pid || ++children_[*pid] != 1) return;
  auto it = map_.find(*pid);
  if (it == map_.end()) return;
  const uint32_t p = it->second;
  if (Listed(slots_[p]) && !slots_[p].interior) {
    LruUnlink(p);
    LruPush(p);
  }
}

// The committed block `e` left (overwritten, dropped, erased): a parent it leaves childless becomes a leaf, at
// the least recently used end (it was used no later than the child that just went, as in DRAM).
void SsdSlotIndex::RemoveChild(const SsdEntry& e) {
  const std::optional<SsdBlockId> pid = ParentId(e);
  if (!pid) return;
  auto c = children_.find(*pid);
  if (c == children_.end()) return;
  if (--c->second != 0) return;
  children_.erase(c);
  auto it = map_.find(*pid);
  if (it == map_.end()) return;
  const uint32_t p = it->second;
  if (Listed(slots_[p]) && slots_[p].interior) {
    LruUnlink(p);
    LruPush(p, /*lru_end=*/true);
  }
}

void SsdSlotIndex::FreeSlot(uint32_t s) {
  slots_[s] = SlotEntry{};
  free_slots_[drive_of(s)].push_back(s);
}

SsdEntry SsdSlotIndex::Unindex(uint32_t s) {
  const SsdEntry e = slots_[s].e;
  map_.erase(e.id);
  RemoveChild(e);
  --blocks_;
  return e;
}

// --- rebuild ---

std::optional<uint32_t> SsdSlotIndex::Restore(uint32_t slot, const SsdEntry& entry, uint64_t payload_xxh3) {
  SSD_CHECK(!rebuilt_ && slots_[slot].state == SlotState::kFree, "a slot is restored once, before FinishRebuild");
  SSD_CHECK(entry.generation > 0, "a restored block has a generation");
  std::optional<uint32_t> clear;
  auto [it, inserted] = map_.try_emplace(entry.id, slot);
  if (!inserted) {
    SlotEntry& other = slots_[it->second];
    if (other.e.generation > entry.generation) return slot;
    clear = it->second;
    other = SlotEntry{};
    it->second = slot;
  }
  SlotEntry& e = slots_[slot];
  e.e = entry;
  e.payload_xxh3 = payload_xxh3;
  e.state = SlotState::kCommitted;
  return clear;
}

std::vector<uint32_t> SsdSlotIndex::FinishRebuild(std::vector<uint32_t> to_clear) {
  SSD_CHECK(!rebuilt_, "the index is rebuilt once");
  rebuilt_ = true;
  uint64_t max_generation = 0;
  // LRU order: oldest generation least recently used.
  std::vector<uint32_t> committed;
  committed.reserve(map_.size());
  for (const auto& [id, s] : map_) committed.push_back(s);
  std::sort(committed.begin(), committed.end(),
            [this](uint32_t a, uint32_t b) { return slots_[a].e.generation < slots_[b].e.generation; });
  for (uint32_t s : committed) {
    if (const std::optional<SsdBlockId> pid = ParentId(slots_[s].e)) ++children_[*pid];
    max_generation = std::max(max_generation, slots_[s].e.generation);
  }
  for (uint32_t s : committed) LruPushMru(s);
  next_generation_ = max_generation + 1;
  blocks_ = committed.size();
  std::sort(to_clear.begin(), to_clear.end());
  to_clear.erase(std::unique(to_clear.begin(), to_clear.end()), to_clear.end());
  for (uint32_t s : to_clear) slots_[s].state = SlotState::kInvalidating;
  for (uint32_t di = 0; di < free_slots_.size(); ++di) {
    for (uint64_t s = per_drive_slots_; s-- > 0;) {
      const uint32_t g = slot_of(di, s);
      if (slots_[g].state == SlotState::kFree) free_slots_[di].push_back(g);  // lowest slot on top
    }
  }
  return to_clear;
}

// --- writes ---

bool SsdSlotIndex::Contains(const SsdBlockId& id) const { return map_.contains(id); }

SsdSlotIndex::Reservation SsdSlotIndex::ReserveForWrite(const SsdEntry& entry, uint64_t payload_xxh3,
                                                        absl::FunctionRef<bool(uint32_t drive)> has_room) {
  Reservation r;
  // A free slot on a drive with queue room, round robin; else the least recently used block's slot.
  const auto n = static_cast<uint32_t>(free_slots_.size());
  for (uint32_t k = 0; k < n && r.slot == kNil; ++k) {
    const uint32_t di = (next_drive_ + k) % n;
    if (free_slots_[di].empty()) continue;
    if (!has_room(di)) {
      r.queue_full = true;
      continue;
    }
    r.slot = free_slots_[di].back();
    free_slots_[di].pop_back();
    next_drive_ = (di + 1) % n;
  }
  if (r.slot == kNil && Victim() != kNil) {
    const uint32_t victim = Victim();
    if (!has_room(drive_of(victim))) {
      r.queue_full = true;
    } else {
      r.slot = victim;
      LruUnlink(victim);
      r.evicted = Unindex(victim);
      slots_[victim] = SlotEntry{};
    }
  }
  if (r.slot == kNil) return r;
  SlotEntry& e = slots_[r.slot];
  e.state = SlotState::kWriting;
  e.e = entry;
  e.e.generation = next_generation_++;
  e.payload_xxh3 = payload_xxh3;
  map_.emplace(entry.id, r.slot);
  return r;
}

const SsdEntry& SsdSlotIndex::CommitWrite(uint32_t slot) {
  SlotEntry& e = slots_[slot];
  SSD_CHECK(e.state == SlotState::kWriting, "a write completes on the slot it reserved");
  e.state = SlotState::kCommitted;
  AddChild(e.e);
  LruPushMru(slot);
  ++blocks_;
  return e.e;
}

void SsdSlotIndex::AbortWrite(uint32_t slot) {
  SlotEntry& e = slots_[slot];
  SSD_CHECK(e.state == SlotState::kWriting, "a write completes on the slot it reserved");
  map_.erase(e.e.id);
  FreeSlot(slot);
}

// --- reads, drops ---

uint32_t SsdSlotIndex::Find(const SsdBlockId& id) const {
  auto it = map_.find(id);
  return it == map_.end() ? kNoSlot : it->second;
}

const SsdEntry& SsdSlotIndex::entry(uint32_t slot) const { return slots_[slot].e; }
uint64_t SsdSlotIndex::payload_xxh3(uint32_t slot) const { return slots_[slot].payload_xxh3; }
bool SsdSlotIndex::committed(uint32_t slot) const { return slots_[slot].state == SlotState::kCommitted; }

void SsdSlotIndex::Pin(uint32_t slot) {
  SlotEntry& e = slots_[slot];
  SSD_CHECK(e.state == SlotState::kCommitted, "only a committed block is read");
  if (e.pins++ == 0) LruUnlink(slot);
}

SsdSlotIndex::Removal SsdSlotIndex::EndRead(uint32_t slot, bool verified) {
  Removal out;
  out.slot = slot;
  SlotEntry& e = slots_[slot];
  SSD_CHECK(e.pins > 0, "a read holds a pin on its slot");
  --e.pins;
  if (verified) {
    if (e.state == SlotState::kCommitted && e.pins == 0) LruPushMru(slot);
  } else if (e.state == SlotState::kCommitted) {
    out.dropped = Unindex(slot);
    e.state = SlotState::kDropped;
  }
  if (e.pins == 0 && e.state == SlotState::kDropped) {
    e.state = SlotState::kInvalidating;
    out.clear = true;
  }
  return out;
}

SsdSlotIndex::Removal SsdSlotIndex::Erase(const SsdBlockId& id) {
  Removal out;
  auto it = map_.find(id);
  if (it == map_.end() || slots_[it->second].state != SlotState::kCommitted) return out;
  const uint32_t s = it->second;
  out.slot = s;
  out.dropped = Unindex(s);
  SlotEntry& e = slots_[s];
  if (e.pins > 0) {
    e.state = SlotState::kDropped;  // cleared when its last read ends
  } else {
    LruUnlink(s);
    e.state = SlotState::kInvalidating;
    out.clear = true;
  }
  return out;
}

void SsdSlotIndex::FinishClear(uint32_t slot) {
  SSD_CHECK(slots_[slot].state == SlotState::kInvalidating, "only an invalidating slot's header is cleared");
  FreeSlot(slot);
}

// --- views ---

std::optional<SsdEntry> SsdSlotIndex::Lookup(const SsdBlockId& id) const {
  auto it = map_.find(id);
  if (it == map_.end() || slots_[it->second].state != SlotState::kCommitted) return std::nullopt;
  return slots_[it->second].e;
}

void SsdSlotIndex::Touch(std::span<const SsdBlockId> ids) {
  for (const SsdBlockId& id : ids) {
    auto it = map_.find(id);
    if (it == map_.end() || !Listed(slots_[it->second])) continue;
    LruUnlink(it->second);
    LruPushMru(it->second);
  }
}

std::vector<SsdEntry> SsdSlotIndex::Entries() const {
  std::vector<SsdEntry> out;
  out.reserve(map_.size());
  for (uint32_t s = leaves_.head; s != kNil; s = slots_[s].next) out.push_back(slots_[s].e);
  for (uint32_t s = interior_.head; s != kNil; s = slots_[s].next) out.push_back(slots_[s].e);
  for (const auto& [id, s] : map_) {  // pinned ones (reads in flight) are off the list
    if (slots_[s].state == SlotState::kCommitted && slots_[s].pins > 0) out.push_back(slots_[s].e);
  }
  return out;
}

void SsdSlotIndex::ForEachCommitted(const std::function<void(const SsdEntry&)>& each) const {
  for (const auto& [id, s] : map_) {
    if (slots_[s].state == SlotState::kCommitted) each(slots_[s].e);
  }
}

// --- checks ---

void SsdSlotIndex::CheckInvariants() const {
  SSD_CHECK(rebuilt_, "CheckInvariants runs after FinishRebuild");
  const auto cap = static_cast<uint32_t>(slots_.size());
  // The LRU lists: well linked, each slot on the list its `interior` flag names, and only listable slots.
  std::vector<uint8_t> listed(cap, 0);
  uint64_t listed_count = 0;
  for (const LruList* l : {&leaves_, &interior_}) {
    uint32_t prev = kNil;
    for (uint32_t s = l->head; s != kNil; prev = s, s = slots_[s].next) {
      SSD_CHECK(s < cap && listed[s] == 0, "an LRU list holds a slot once, and no loop");
      listed[s] = 1;
      ++listed_count;
      const SlotEntry& e = slots_[s];
      SSD_CHECK(e.prev == prev, "LRU list back link");
      SSD_CHECK(Listed(e), "only committed, unpinned blocks are listed");
      SSD_CHECK(e.interior == (l == &interior_), "a slot is on the list its interior flag names");
      SSD_CHECK(e.interior == HasChildren(e.e.id), "interior exactly when a committed block hangs under it");
    }
    SSD_CHECK(l->tail == prev, "LRU list tail");
  }
  // The free lists: each free slot once, on its own drive's.
  std::vector<uint8_t> on_free(cap, 0);
  for (uint32_t di = 0; di < free_slots_.size(); ++di) {
    for (uint32_t s : free_slots_[di]) {
      SSD_CHECK(s < cap && drive_of(s) == di && on_free[s] == 0, "a free list holds its drive's slots once");
      on_free[s] = 1;
    }
  }
  absl::flat_hash_map<SsdBlockId, uint32_t, IdHash> children;
  uint64_t committed = 0, indexed = 0, unlisted_committed = 0;
  for (uint32_t s = 0; s < cap; ++s) {
    const SlotEntry& e = slots_[s];
    SSD_CHECK((e.state == SlotState::kFree) == (on_free[s] != 0), "a slot is free exactly when on a free list");
    if (e.state != SlotState::kCommitted && e.state != SlotState::kDropped) {
      SSD_CHECK(e.pins == 0, "only committed or dropped slots are pinned");
    }
    if (e.state == SlotState::kWriting || e.state == SlotState::kCommitted) {
      ++indexed;
      SSD_CHECK(Find(e.e.id) == s, "an indexed slot is found by its id");
      SSD_CHECK(e.e.generation > 0 && e.e.generation < next_generation_, "generations are given once, in order");
    } else {
      SSD_CHECK(listed[s] == 0, "a slot not committed is not listed");
    }
    if (e.state == SlotState::kCommitted) {
      ++committed;
      if (e.pins > 0) ++unlisted_committed;
      if (const std::optional<SsdBlockId> pid = ParentId(e.e)) ++children[*pid];
    }
    if (e.state == SlotState::kDropped) SSD_CHECK(e.pins > 0, "a dropped slot is cleared once no read pins it");
  }
  SSD_CHECK(indexed == map_.size(), "the key map holds exactly the writing and committed slots");
  SSD_CHECK(committed == blocks_, "blocks counts the committed slots");
  SSD_CHECK(listed_count + unlisted_committed == committed, "every unpinned committed block is listed");
  SSD_CHECK(children == children_, "child counts are those of the committed blocks");
}

}  // namespace flexkv
