// SsdSlotIndex without a drive (daemon/tiers/ssd/ssd_slot_index.h): slots handed out round robin over the drives,
// a second write of an id refused, failed writes freeing their slot, the eviction order (least recently used leaf,
// then the blocks others hang under; pinned blocks never), full queues, failed reads and erases under reads, and the
// rebuild (the newer generation of an id found twice, generation order, the slots to clear). Invariants after each
// step. The random sequences are tests/fuzz/fuzz_ssd_slot_index.cc's.
#include <catch2/catch.hpp>

#include <optional>
#include <vector>

#include "daemon/tiers/ssd/ssd_slot_index.h"

using flexkv::BlockKey;
using flexkv::SsdBlockId;
using flexkv::SsdEntry;
using flexkv::SsdSlotIndex;

namespace {

SsdBlockId IndexId(uint64_t i) { return SsdBlockId{BlockKey{0x1000 + i, 0xABC}, {1, 2}, 0}; }

// Block `i` under block `parent` (nullopt: a prompt's first block).
SsdEntry IndexEntry(uint64_t i, std::optional<uint64_t> parent = std::nullopt, uint64_t generation = 0) {
  return SsdEntry{IndexId(i), parent ? IndexId(*parent).key : flexkv::kRootParent, 4096, 0, generation};
}

bool AnyRoom(uint32_t) { return true; }

// An index of `drives` x `per_drive` slots with nothing on disk.
SsdSlotIndex Fresh(uint32_t drives, uint32_t per_drive) {
  SsdSlotIndex index(drives, per_drive);
  REQUIRE(index.FinishRebuild({}).empty());
  return index;
}

// Reserves and commits block `i`; returns its slot.
uint32_t Store(SsdSlotIndex& index, uint64_t i, std::optional<uint64_t> parent = std::nullopt) {
  const SsdSlotIndex::Reservation r = index.ReserveForWrite(IndexEntry(i, parent), 0x77, AnyRoom);
  REQUIRE(r.slot != SsdSlotIndex::kNoSlot);
  index.CommitWrite(r.slot);
  index.CheckInvariants();
  return r.slot;
}

std::vector<uint64_t> Order(const SsdSlotIndex& index) {
  std::vector<uint64_t> out;
  for (const SsdEntry& e : index.Entries()) out.push_back(e.id.key.lo - 0x1000);
  return out;
}

}  // namespace

TEST_CASE("ssd slot index: writes take free slots round robin over the drives, readable once committed",
          "[unit][ssd]") {
  SsdSlotIndex index = Fresh(2, 2);
  std::vector<uint32_t> slots;
  for (uint64_t i = 0; i < 4; ++i) {
    const SsdSlotIndex::Reservation r = index.ReserveForWrite(IndexEntry(i), 0x100 + i, AnyRoom);
    REQUIRE(r.slot != SsdSlotIndex::kNoSlot);
    CHECK_FALSE(r.evicted);
    CHECK(index.entry(r.slot).generation == i + 1);
    CHECK(index.payload_xxh3(r.slot) == 0x100 + i);
    CHECK(index.Contains(IndexId(i)));
    CHECK(index.Find(IndexId(i)) == r.slot);
    CHECK_FALSE(index.committed(r.slot));
    CHECK_FALSE(index.Lookup(IndexId(i)));  // being written: not readable
    slots.push_back(r.slot);
    index.CheckInvariants();
  }
  // Drive 0, drive 1, drive 0, drive 1; each drive's lowest slot first.
  CHECK(slots == std::vector<uint32_t>{0, 2, 1, 3});
  CHECK(index.drive_of(2) == 1);
  CHECK(index.file_slot(3) == 1);
  CHECK(index.blocks() == 0);
  for (uint32_t s : slots) CHECK(index.CommitWrite(s).generation == index.entry(s).generation);
  index.CheckInvariants();
  CHECK(index.blocks() == 4);
  REQUIRE(index.Lookup(IndexId(2)));
  CHECK(index.Lookup(IndexId(2))->generation == 3);
  CHECK(Order(index) == std::vector<uint64_t>{0, 1, 2, 3});
}

TEST_CASE("ssd slot index: a failed write frees its slot and the id may be written again", "[unit][ssd]") {
  SsdSlotIndex index = Fresh(1, 1);
  const uint32_t s = index.ReserveForWrite(IndexEntry(1), 0, AnyRoom).slot;
  REQUIRE(s == 0);
  // Every slot is being written: nothing to give, and no queue was the reason.
  const SsdSlotIndex::Reservation none = index.ReserveForWrite(IndexEntry(2), 0, AnyRoom);
  CHECK(none.slot == SsdSlotIndex::kNoSlot);
  CHECK_FALSE(none.queue_full);
  index.AbortWrite(s);
  index.CheckInvariants();
  CHECK_FALSE(index.Contains(IndexId(1)));
  const SsdSlotIndex::Reservation again = index.ReserveForWrite(IndexEntry(1), 0, AnyRoom);
  CHECK(again.slot == 0);
  CHECK(index.entry(0).generation == 2);  // the failed write's generation is not given again
  index.CheckInvariants();
}

TEST_CASE("ssd slot index: when full, the least recently used leaf goes before the blocks others hang under",
          "[unit][ssd]") {
  SsdSlotIndex index = Fresh(1, 4);
  // root 0 (written first) <- 1 <- 2, and 0 <- 3.
  Store(index, 0);
  Store(index, 1, 0);
  Store(index, 2, 1);
  Store(index, 3, 0);
  CHECK(Order(index) == std::vector<uint64_t>{2, 3, 0, 1});  // leaves, then interior, least recently used first
  SsdSlotIndex::Reservation r = index.ReserveForWrite(IndexEntry(10), 0, AnyRoom);
  REQUIRE(r.evicted);
  CHECK(r.evicted->id == IndexId(2));
  index.CommitWrite(r.slot);
  index.CheckInvariants();
  // 1 lost its only child: a leaf now, at the least recently used end.
  CHECK(Order(index) == std::vector<uint64_t>{1, 3, 10, 0});
  index.Touch(std::vector<SsdBlockId>{IndexId(1), IndexId(99)});  // 99: not stored, skipped
  index.CheckInvariants();
  CHECK(Order(index) == std::vector<uint64_t>{3, 10, 1, 0});
  r = index.ReserveForWrite(IndexEntry(11), 0, AnyRoom);
  REQUIRE(r.evicted);
  CHECK(r.evicted->id == IndexId(3));
  CHECK(index.Lookup(IndexId(0)));  // the root outlives the blocks under it
}

TEST_CASE("ssd slot index: when every block has a child (a cycle in a forged file), the least recently used goes",
          "[unit][ssd]") {
  SsdSlotIndex index = Fresh(1, 2);
  Store(index, 0, 1);
  Store(index, 1, 0);
  CHECK(Order(index) == std::vector<uint64_t>{0, 1});
  const SsdSlotIndex::Reservation r = index.ReserveForWrite(IndexEntry(5), 0, AnyRoom);
  REQUIRE(r.evicted);
  CHECK(r.evicted->id == IndexId(0));
  index.CheckInvariants();
}

TEST_CASE("ssd slot index: a block being read is never overwritten, and a full queue is told apart",
          "[unit][ssd]") {
  SsdSlotIndex index = Fresh(2, 1);
  const uint32_t a = Store(index, 0);
  const uint32_t b = Store(index, 1);
  index.Pin(a);
  index.CheckInvariants();
  CHECK(Order(index) == std::vector<uint64_t>{1, 0});  // the pinned block last
  // The only victim (1) is on a drive whose queue is full.
  const auto full = [b, &index](uint32_t drive) { return drive != index.drive_of(b); };
  SsdSlotIndex::Reservation r = index.ReserveForWrite(IndexEntry(2), 0, full);
  CHECK(r.slot == SsdSlotIndex::kNoSlot);
  CHECK(r.queue_full);
  CHECK(index.Lookup(IndexId(1)));
  index.Pin(b);
  r = index.ReserveForWrite(IndexEntry(2), 0, AnyRoom);
  CHECK(r.slot == SsdSlotIndex::kNoSlot);  // every block is being read
  CHECK_FALSE(r.queue_full);
  CHECK_FALSE(index.EndRead(a, true).dropped);
  CHECK_FALSE(index.EndRead(b, true).dropped);
  index.CheckInvariants();
  CHECK(Order(index) == std::vector<uint64_t>{0, 1});  // read: most recently used
}

TEST_CASE("ssd slot index: a failed read drops the block at once and clears its slot when the last read ends",
          "[unit][ssd]") {
  SsdSlotIndex index = Fresh(1, 2);
  Store(index, 0);
  const uint32_t s = Store(index, 1, 0);
  index.Pin(s);
  index.Pin(s);
  SsdSlotIndex::Removal gone = index.EndRead(s, false);
  REQUIRE(gone.dropped);
  CHECK(gone.dropped->id == IndexId(1));
  CHECK_FALSE(gone.clear);  // another read still uses the slot
  CHECK_FALSE(index.Contains(IndexId(1)));
  CHECK(index.blocks() == 1);
  CHECK(Order(index) == std::vector<uint64_t>{0});  // 0 lost its child: a leaf again
  index.CheckInvariants();
  gone = index.EndRead(s, true);  // verified, but the block is gone already
  CHECK_FALSE(gone.dropped);
  CHECK(gone.clear);
  CHECK(gone.slot == s);
  index.CheckInvariants();
  // Invalidating: not free until its header is cleared.
  SsdSlotIndex::Reservation r = index.ReserveForWrite(IndexEntry(2), 0, AnyRoom);
  REQUIRE(r.evicted);
  CHECK(r.evicted->id == IndexId(0));
  index.AbortWrite(r.slot);
  index.FinishClear(s);
  index.CheckInvariants();
  r = index.ReserveForWrite(IndexEntry(3), 0, AnyRoom);
  CHECK(r.slot != SsdSlotIndex::kNoSlot);
  CHECK_FALSE(r.evicted);
}

TEST_CASE("ssd slot index: Erase clears an unpinned block's slot at once, a pinned one's when its read ends",
          "[unit][ssd]") {
  SsdSlotIndex index = Fresh(1, 3);
  const uint32_t a = Store(index, 0);
  const uint32_t b = Store(index, 1);
  SsdSlotIndex::Removal gone = index.Erase(IndexId(0));
  REQUIRE(gone.dropped);
  CHECK(gone.clear);
  CHECK(gone.slot == a);
  index.Pin(b);
  gone = index.Erase(IndexId(1));
  REQUIRE(gone.dropped);
  CHECK_FALSE(gone.clear);
  CHECK_FALSE(index.Erase(IndexId(1)).dropped);  // not committed any more
  const uint32_t w = index.ReserveForWrite(IndexEntry(2), 0, AnyRoom).slot;
  CHECK_FALSE(index.Erase(IndexId(2)).dropped);   // being written
  index.CheckInvariants();
  CHECK(index.EndRead(b, true).clear);
  index.FinishClear(a);
  index.FinishClear(b);
  index.AbortWrite(w);
  index.CheckInvariants();
  CHECK(index.blocks() == 0);
  CHECK(index.Entries().empty());
}

TEST_CASE("ssd slot index: rebuilt, an id found twice keeps its newer generation, and order follows generations",
          "[unit][ssd]") {
  SsdSlotIndex index(2, 3);
  CHECK_FALSE(index.Restore(0, IndexEntry(0, std::nullopt, 7), 0xA));
  CHECK_FALSE(index.Restore(1, IndexEntry(1, 0, 3), 0xB));
  CHECK(index.Restore(3, IndexEntry(1, 0, 9), 0xC) == 1u);  // newer: the older slot is to be cleared
  CHECK(index.Restore(4, IndexEntry(0, std::nullopt, 5), 0xD) == 4u);  // older than slot 0's: itself cleared
  const std::vector<uint32_t> clear = index.FinishRebuild({5, 1, 4, 5});
  CHECK(clear == std::vector<uint32_t>{1, 4, 5});
  index.CheckInvariants();
  CHECK(index.blocks() == 2);
  CHECK(index.payload_xxh3(3) == 0xC);
  CHECK(Order(index) == std::vector<uint64_t>{1, 0});  // 1 is a leaf; 0 has a child
  // Free: slot 2 of drive 0, then drive 1 has none left (3 holds a block, 4 and 5 are being cleared).
  SsdSlotIndex::Reservation r = index.ReserveForWrite(IndexEntry(2), 0, AnyRoom);
  CHECK(r.slot == 2);
  CHECK(index.entry(2).generation == 10);  // after the newest found
  r = index.ReserveForWrite(IndexEntry(3), 0, AnyRoom);
  REQUIRE(r.evicted);
  CHECK(r.evicted->id == IndexId(1));
  for (uint32_t s : clear) index.FinishClear(s);
  index.CheckInvariants();
}
