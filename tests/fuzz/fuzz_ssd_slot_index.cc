// Fuzz target: the SSD store's slot index (daemon/tiers/ssd/ssd_slot_index.h) against a simple reference model.
// Byte 0 picks the geometry (1-3 drives of 1-6 slots); then each slot is found empty, unusable or holding a block
// (key, parent, generation: ties and a key in two slots included) and the index is rebuilt from that; then the rest
// of the input is a sequence of operations: reserve a slot for a write (some drives' queues full), commit or abort
// a write, start and end reads (verified or not), erase, clear, touch, look up. The model keeps each slot's state,
// pins and a use stamp, and derives what the index must answer from first principles: the free slot's drive (round
// robin), the victim (the least recently used leaf, else the least recently used block), the eviction order of
// Entries, what a drop or erase leaves to clear. Any disagreement, or a broken CheckInvariants, aborts.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <vector>

#include "daemon/tiers/ssd/ssd_slot_index.h"

namespace {

using flexkv::BlockKey;
using flexkv::SsdBlockId;
using flexkv::SsdEntry;
using flexkv::SsdSlotIndex;

constexpr uint32_t kKeys = 6;        // per component; two components
constexpr uint32_t kIds = 2 * kKeys;
constexpr uint32_t kNone = SsdSlotIndex::kNoSlot;

[[noreturn]] void Violated(const char* what) {
  std::fprintf(stderr, "invariant violated: %s\n", what);
  std::abort();
}
void Expect(bool cond, const char* what) {
  if (!cond) Violated(what);
}

struct Input {
  const uint8_t* data;
  size_t size;
  size_t pos = 0;
  bool done() const { return pos >= size; }
  uint8_t Byte() { return pos < size ? data[pos++] : 0; }
};

BlockKey KeyOf(uint32_t key) { return BlockKey{0x5EED0000u + key, 0xF00D}; }
SsdBlockId IdOf(uint32_t id) { return SsdBlockId{KeyOf(id % kKeys), {7, 9}, id / kKeys}; }
// A parent for block `id`: another key of its component, none (a prompt's start), or its own key (a forged header).
BlockKey ParentOf(uint32_t id, uint8_t b) {
  const uint32_t p = b % (kKeys + 2);
  if (p < kKeys) return KeyOf(p);
  return p == kKeys ? flexkv::kRootParent : KeyOf(id % kKeys);
}

bool SameEntry(const SsdEntry& a, const SsdEntry& b) {
  return a.id == b.id && a.parent == b.parent && a.payload_bytes == b.payload_bytes &&
         a.content_checksum == b.content_checksum && a.generation == b.generation;
}

// The reference model: slots with states, pins and use stamps; lists and child counts are derived on demand.
class Model {
 public:
  enum class State { kFree, kWriting, kCommitted, kDropped, kInvalidating };
  struct Slot {
    State state = State::kFree;
    uint32_t id = 0;
    SsdEntry entry;
    uint32_t pins = 0;
    int64_t stamp = 0;  // when listed: smaller is less recently used
  };

  Model(uint32_t drives, uint32_t per_drive) : drives_(drives), per_drive_(per_drive), slots_(drives * per_drive) {}

  std::vector<Slot>& slots() { return slots_; }
  uint32_t drive_of(uint32_t s) const { return s / per_drive_; }
  uint64_t next_generation = 1;
  uint32_t next_drive = 0;

  // The slot indexed under `id` (writing or committed), or kNone.
  uint32_t Find(uint32_t id) const {
    for (uint32_t s = 0; s < slots_.size(); ++s) {
      if ((slots_[s].state == State::kWriting || slots_[s].state == State::kCommitted) && slots_[s].id == id) return s;
    }
    return kNone;
  }
  bool Listed(uint32_t s) const { return slots_[s].state == State::kCommitted && slots_[s].pins == 0; }
  // The id block `s` hangs under, or kIds when none.
  uint32_t ParentIdOf(uint32_t s) const {
    const SsdEntry& e = slots_[s].entry;
    if (e.parent == flexkv::kRootParent || e.parent == e.id.key) return kIds;
    return static_cast<uint32_t>(e.parent.lo - KeyOf(0).lo) + slots_[s].id / kKeys * kKeys;
  }
  uint32_t Children(uint32_t id) const {
    uint32_t n = 0;
    for (uint32_t s = 0; s < slots_.size(); ++s) {
      if (slots_[s].state == State::kCommitted && ParentIdOf(s) == id) ++n;
    }
    return n;
  }
  void UseNow(uint32_t s) { slots_[s].stamp = ++clock_; }
  void UseFirst(uint32_t s) { slots_[s].stamp = --low_; }

  // Committed block `s` becomes readable: a listed parent without children so far moves to the interior list's
  // most recently used end; then `s` is listed, most recently used.
  void Commit(uint32_t s) {
    const uint32_t pid = ParentIdOf(s);
    if (pid != kIds && Children(pid) == 0) {
      const uint32_t p = Find(pid);
      if (p != kNone && Listed(p)) UseNow(p);
    }
    slots_[s].state = State::kCommitted;
    UseNow(s);
  }
  // Committed block `s` leaves (its state is changed by the caller): a parent it leaves childless and listed
  // becomes the least recently used leaf.
  void Leave(uint32_t s, State next) {
    const uint32_t pid = ParentIdOf(s);
    slots_[s].state = next;
    if (pid == kIds || Children(pid) != 0) return;
    const uint32_t p = Find(pid);
    if (p != kNone && Listed(p)) UseFirst(p);
  }
  // Listed blocks in eviction order: leaves by stamp, then those with children by stamp.
  std::vector<uint32_t> EvictionOrder() const {
    std::vector<uint32_t> leaves, interior;
    for (uint32_t s = 0; s < slots_.size(); ++s) {
      if (Listed(s)) (Children(slots_[s].id) == 0 ? leaves : interior).push_back(s);
    }
    auto by_stamp = [this](uint32_t a, uint32_t b) { return slots_[a].stamp < slots_[b].stamp; };
    std::sort(leaves.begin(), leaves.end(), by_stamp);
    std::sort(interior.begin(), interior.end(), by_stamp);
    leaves.insert(leaves.end(), interior.begin(), interior.end());
    return leaves;
  }
  bool HasFree(uint32_t drive) const {
    for (uint32_t s = drive * per_drive_; s < (drive + 1) * per_drive_; ++s) {
      if (slots_[s].state == State::kFree) return true;
    }
    return false;
  }
  uint32_t drives() const { return drives_; }
  // After the rebuild: listed in generation order.
  void SetStamps(const std::vector<uint32_t>& by_generation) {
    for (uint32_t s : by_generation) UseNow(s);
  }

 private:
  uint32_t drives_;
  uint32_t per_drive_;
  std::vector<Slot> slots_;
  int64_t clock_ = 0;
  int64_t low_ = 0;
};

void CheckViews(const SsdSlotIndex& index, Model& model) {
  index.CheckInvariants();
  uint64_t committed = 0;
  std::vector<uint32_t> pinned;
  for (uint32_t s = 0; s < model.slots().size(); ++s) {
    if (model.slots()[s].state != Model::State::kCommitted) continue;
    ++committed;
    if (model.slots()[s].pins > 0) pinned.push_back(s);
  }
  Expect(index.blocks() == committed, "blocks() counts the committed blocks");
  const std::vector<SsdEntry> entries = index.Entries();
  const std::vector<uint32_t> order = model.EvictionOrder();
  Expect(entries.size() == order.size() + pinned.size(), "Entries lists every committed block once");
  for (size_t i = 0; i < order.size(); ++i) {
    Expect(SameEntry(entries[i], model.slots()[order[i]].entry), "Entries is in eviction order");
  }
  for (size_t i = order.size(); i < entries.size(); ++i) {  // the pinned ones, in no particular order
    Expect(std::any_of(pinned.begin(), pinned.end(),
                       [&](uint32_t s) { return SameEntry(entries[i], model.slots()[s].entry); }),
           "Entries ends with the pinned blocks");
  }
}

void CheckRemoval(const SsdSlotIndex::Removal& got, std::optional<uint32_t> dropped, uint32_t slot, bool clear,
                  Model& model) {
  Expect(got.dropped.has_value() == dropped.has_value(), "a removal drops a block exactly when one was committed");
  if (dropped) Expect(SameEntry(*got.dropped, model.slots()[*dropped].entry), "the dropped block is the one named");
  Expect(got.clear == clear, "a slot is cleared once no read pins its dropped block");
  if (dropped || clear) Expect(got.slot == slot, "the removal names its slot");
}

// Rebuilds index and model from what the input says each slot holds (past the input's end: empty slots).
void Rebuild(Input& in, SsdSlotIndex& index, Model& model) {
  std::vector<uint32_t> to_clear;
  std::vector<uint32_t> restored;  // model slots committed by the rebuild
  for (uint32_t s = 0; s < model.slots().size(); ++s) {
    const uint8_t what = in.Byte() % 4;
    if (what == 0) continue;  // empty
    if (what == 1) {          // unusable header: cleared
      to_clear.push_back(s);
      continue;
    }
    const uint32_t id = in.Byte() % kIds;
    // Generations tie only for one id (the later one restored wins), never across ids: the order of equal
    // generations is not the index's to keep.
    const uint64_t generation = 1 + (in.Byte() % 4) * kIds + id;
    const SsdEntry entry{IdOf(id), ParentOf(id, in.Byte()), 1 + id, id * 3u, generation};
    const std::optional<uint32_t> got = index.Restore(s, entry, generation ^ 0xABCD);
    const uint32_t other = model.Find(id);
    std::optional<uint32_t> want;
    if (other != kNone) want = model.slots()[other].entry.generation > generation ? s : other;
    Expect(got == want, "Restore keeps the newer generation of an id found twice");
    if (want) to_clear.push_back(*want);
    if (want == s) continue;
    if (want) model.slots()[other] = Model::Slot{};
    model.slots()[s] = Model::Slot{Model::State::kCommitted, id, entry, 0, 0};
  }
  std::vector<uint32_t> committed;
  for (uint32_t s = 0; s < model.slots().size(); ++s) {
    if (model.slots()[s].state == Model::State::kCommitted) committed.push_back(s);
    model.next_generation = std::max(model.next_generation, model.slots()[s].entry.generation + 1);
  }
  std::sort(committed.begin(), committed.end(), [&](uint32_t a, uint32_t b) {
    return model.slots()[a].entry.generation < model.slots()[b].entry.generation;
  });
  model.SetStamps(committed);
  std::vector<uint32_t> want_clear = to_clear;
  std::sort(want_clear.begin(), want_clear.end());
  want_clear.erase(std::unique(want_clear.begin(), want_clear.end()), want_clear.end());
  Expect(index.FinishRebuild(to_clear) == want_clear, "FinishRebuild returns the slots to clear, sorted, once each");
  for (uint32_t s : want_clear) model.slots()[s].state = Model::State::kInvalidating;
}

// A write of `id`: the slot the model expects (free on the next drive with room, round robin; else the victim's if
// its drive has room), the eviction and the refusal's reason.
void Reserve(uint32_t id, uint8_t parent, uint8_t full_mask, SsdSlotIndex& index, Model& model) {
  const bool contained = model.Find(id) != kNone;
  Expect(index.Contains(IdOf(id)) == contained, "Contains agrees");
  if (contained) return;
  auto room = [full_mask](uint32_t drive) { return (full_mask >> drive & 1) == 0; };
  const SsdEntry asked{IdOf(id), ParentOf(id, parent), 4096, 0x5EED, 0};
  const SsdSlotIndex::Reservation r = index.ReserveForWrite(asked, 0x1234, room);
  uint32_t want_drive = kNone;
  bool queue_full = false;
  for (uint32_t k = 0; k < model.drives() && want_drive == kNone; ++k) {
    const uint32_t di = (model.next_drive + k) % model.drives();
    if (!model.HasFree(di)) continue;
    if (!room(di)) {
      queue_full = true;
      continue;
    }
    want_drive = di;
  }
  if (want_drive != kNone) {
    Expect(r.slot != kNone && model.drive_of(r.slot) == want_drive, "a free slot of the next drive with room");
    Expect(model.slots()[r.slot].state == Model::State::kFree, "the slot given was free");
    Expect(!r.evicted, "no eviction while a drive with room has a free slot");
    model.next_drive = (want_drive + 1) % model.drives();
  } else {
    const std::vector<uint32_t> order = model.EvictionOrder();
    const uint32_t victim = order.empty() ? kNone : order.front();
    if (victim != kNone && room(model.drive_of(victim))) {
      Expect(r.slot == victim, "the victim is the least recently used leaf, else the least recently used block");
      Expect(r.evicted && SameEntry(*r.evicted, model.slots()[victim].entry), "the evicted block is reported");
      model.Leave(victim, Model::State::kFree);
    } else {
      if (victim != kNone) queue_full = true;
      Expect(r.slot == kNone && !r.evicted, "no slot when no drive with a slot to give has room");
      Expect(r.queue_full == queue_full, "queue_full says whether a full queue was the reason");
      return;
    }
  }
  Model::Slot& s = model.slots()[r.slot];
  s = Model::Slot{Model::State::kWriting, id, asked, 0, 0};
  s.entry.generation = model.next_generation++;
  Expect(SameEntry(index.entry(r.slot), s.entry), "the reserved slot holds the block, with the next generation");
  Expect(index.Find(IdOf(id)) == r.slot && !index.committed(r.slot), "a block being written is found, not committed");
  Expect(!index.Lookup(IdOf(id)), "a block being written is not looked up");
}

// The `n`-th slot (mod their count) in state `state`, or kNone.
uint32_t Pick(Model& model, Model::State state, uint8_t n) {
  std::vector<uint32_t> found;
  for (uint32_t s = 0; s < model.slots().size(); ++s) {
    if (model.slots()[s].state == state) found.push_back(s);
  }
  return found.empty() ? kNone : found[n % found.size()];
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in{data, size};
  const uint8_t g = in.Byte();
  const uint32_t drives = 1 + g % 3;
  const uint32_t per_drive = 1 + (g / 3) % 6;
  SsdSlotIndex index(drives, per_drive);
  Model model(drives, per_drive);
  Rebuild(in, index, model);
  CheckViews(index, model);
  std::vector<uint32_t> reads;  // slots with a read in flight, one entry per pin
  while (!in.done()) {
    const uint8_t op = in.Byte();
    const uint8_t a = in.Byte();
    const uint8_t b = in.Byte();
    const uint32_t id = a % kIds;
    switch (op % 9) {
      case 0:
      case 1:
        Reserve(id, b, op % 2 == 1 ? static_cast<uint8_t>(op >> 4) : 0, index, model);
        break;
      case 2: {  // a write completes, or fails
        const uint32_t s = Pick(model, Model::State::kWriting, a);
        if (s == kNone) break;
        if (b % 4 != 0) {
          Expect(SameEntry(index.CommitWrite(s), model.slots()[s].entry), "CommitWrite returns the block");
          model.Commit(s);
        } else {
          index.AbortWrite(s);
          model.slots()[s] = Model::Slot{};
        }
        break;
      }
      case 3: {  // a read starts
        const uint32_t s = model.Find(id);
        Expect(index.Find(IdOf(id)) == s, "Find agrees");
        if (s == kNone) break;
        Expect(index.committed(s) == (model.slots()[s].state == Model::State::kCommitted), "committed() agrees");
        if (!index.committed(s)) break;
        index.Pin(s);
        ++model.slots()[s].pins;
        reads.push_back(s);
        break;
      }
      case 4: {  // a read ends, verified or not
        if (reads.empty()) break;
        const size_t k = a % reads.size();
        const uint32_t s = reads[k];
        reads.erase(reads.begin() + static_cast<std::ptrdiff_t>(k));
        const bool verified = b % 4 != 0;
        const SsdSlotIndex::Removal got = index.EndRead(s, verified);
        Model::Slot& m = model.slots()[s];
        --m.pins;
        std::optional<uint32_t> dropped;
        if (verified) {
          if (m.state == Model::State::kCommitted && m.pins == 0) model.UseNow(s);
        } else if (m.state == Model::State::kCommitted) {
          dropped = s;
          model.Leave(s, Model::State::kDropped);
        }
        const bool clear = m.pins == 0 && m.state == Model::State::kDropped;
        if (clear) m.state = Model::State::kInvalidating;
        CheckRemoval(got, dropped, s, clear, model);
        break;
      }
      case 5: {  // erase
        const uint32_t s = model.Find(id);
        const SsdSlotIndex::Removal got = index.Erase(IdOf(id));
        if (s == kNone || model.slots()[s].state != Model::State::kCommitted) {
          CheckRemoval(got, std::nullopt, kNone, false, model);
          break;
        }
        const bool pinned = model.slots()[s].pins > 0;
        model.Leave(s, pinned ? Model::State::kDropped : Model::State::kInvalidating);
        CheckRemoval(got, s, s, !pinned, model);
        break;
      }
      case 6: {  // a header cleared on disk
        const uint32_t s = Pick(model, Model::State::kInvalidating, a);
        if (s == kNone) break;
        index.FinishClear(s);
        model.slots()[s] = Model::Slot{};
        break;
      }
      case 7: {  // uses of up to three blocks
        const uint32_t ids[] = {id, b % kIds, static_cast<uint32_t>(a ^ b) % kIds};
        const size_t n = 1 + b / 86;
        std::vector<SsdBlockId> touched;
        for (size_t k = 0; k < n; ++k) {
          touched.push_back(IdOf(ids[k]));
          const uint32_t s = model.Find(ids[k]);
          if (s != kNone && model.Listed(s)) model.UseNow(s);
        }
        index.Touch(touched);
        break;
      }
      case 8: {  // look up
        const uint32_t s = model.Find(id);
        const std::optional<SsdEntry> got = index.Lookup(IdOf(id));
        const bool committed = s != kNone && model.slots()[s].state == Model::State::kCommitted;
        Expect(got.has_value() == committed, "Lookup finds exactly the committed blocks");
        if (committed) Expect(SameEntry(*got, model.slots()[s].entry), "Lookup returns the block");
        break;
      }
    }
    CheckViews(index, model);
  }
  // Every read ends, every write completes, every slot is cleared: nothing is left pinned or half done.
  for (uint32_t s : reads) {
    (void)index.EndRead(s, true);
    --model.slots()[s].pins;
    if (model.slots()[s].state == Model::State::kCommitted && model.slots()[s].pins == 0) model.UseNow(s);
    if (model.slots()[s].state == Model::State::kDropped && model.slots()[s].pins == 0) {
      model.slots()[s].state = Model::State::kInvalidating;
    }
  }
  for (uint32_t s = kNone; (s = Pick(model, Model::State::kWriting, 0)) != kNone;) {
    (void)index.CommitWrite(s);
    model.Commit(s);
  }
  for (uint32_t s = kNone; (s = Pick(model, Model::State::kInvalidating, 0)) != kNone;) {
    index.FinishClear(s);
    model.slots()[s] = Model::Slot{};
  }
  CheckViews(index, model);
  return 0;
}
