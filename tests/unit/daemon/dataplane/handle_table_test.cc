// HandleTable: pin handles, loads in flight, and a Release (or the session's end) arriving while a load copies.
#include <catch2/catch.hpp>

#include <vector>

#include "daemon/dataplane/handle_table.h"

using flexkv::HandleTable;
using flexkv::SlotId;

TEST_CASE("handle table: handles are distinct, never 0, and count the blocks they pin", "[unit][dataplane]") {
  HandleTable t;
  const uint64_t a = t.Add({1, 2, 3});
  const uint64_t b = t.Add({4});
  CHECK(a != 0);
  CHECK(b != 0);
  CHECK(a != b);
  CHECK(t.HeldBlocks(a) == 3u);
  CHECK(t.HeldBlocks(b) == 1u);
  CHECK_FALSE(t.HeldBlocks(a + b + 1).has_value());
  CHECK(t.pinned_blocks() == 4);
}

TEST_CASE("handle table: Release without loads returns the slots at once and forgets the handle", "[unit][dataplane]") {
  HandleTable t;
  const uint64_t h = t.Add({7, 8});
  CHECK(t.Release(h) == std::vector<SlotId>{7, 8});
  CHECK_FALSE(t.HeldBlocks(h).has_value());
  CHECK(t.pinned_blocks() == 0);
  CHECK(t.Release(h).empty());  // a second Release finds nothing
  const uint64_t next = t.Add({9});
  CHECK(next != h);  // never reused
}

TEST_CASE("handle table: a Release during loads unpins after the last load ends", "[unit][dataplane]") {
  HandleTable t;
  const uint64_t h = t.Add({1, 2, 3});
  CHECK(t.BeginLoad(h, 2) == std::vector<SlotId>{1, 2});
  CHECK(t.BeginLoad(h, 3) == std::vector<SlotId>{1, 2, 3});
  CHECK(t.Release(h).empty());             // loads still copy from the slots
  CHECK_FALSE(t.HeldBlocks(h).has_value());  // a later Load or Release of it is refused
  CHECK(t.pinned_blocks() == 3);           // still pinned
  CHECK(t.EndLoad(h).empty());
  CHECK(t.EndLoad(h) == std::vector<SlotId>{1, 2, 3});
  CHECK(t.pinned_blocks() == 0);
  CHECK(t.EndLoad(h).empty());  // gone
}

TEST_CASE("handle table: a load ending on a held handle keeps it", "[unit][dataplane]") {
  HandleTable t;
  const uint64_t h = t.Add({5});
  t.BeginLoad(h, 1);
  CHECK(t.EndLoad(h).empty());
  CHECK(t.HeldBlocks(h) == 1u);
  CHECK(t.Release(h) == std::vector<SlotId>{5});
}

TEST_CASE("handle table: ReleaseAll returns idle handles' slots and leaves loading ones to their last load",
          "[unit][dataplane]") {
  HandleTable t;
  const uint64_t idle = t.Add({1, 2});
  const uint64_t loading = t.Add({3});
  t.BeginLoad(loading, 1);
  CHECK(t.ReleaseAll() == std::vector<SlotId>{1, 2});
  CHECK_FALSE(t.HeldBlocks(idle).has_value());
  CHECK_FALSE(t.HeldBlocks(loading).has_value());
  CHECK(t.pinned_blocks() == 1);
  CHECK(t.EndLoad(loading) == std::vector<SlotId>{3});
  CHECK(t.pinned_blocks() == 0);
}

TEST_CASE("handle table: a lapse releases every held handle and remembers them as lapsed", "[unit][dataplane]") {
  HandleTable t;
  const uint64_t idle = t.Add({1, 2});
  const uint64_t loading = t.Add({3});
  const uint64_t released = t.Add({4});
  t.BeginLoad(loading, 1);
  t.BeginLoad(released, 1);
  CHECK(t.Release(released).empty());  // the client let it go; its load still copies
  size_t handles = 0;
  CHECK(t.Lapse(&handles) == std::vector<SlotId>{1, 2});
  CHECK(handles == 2);
  CHECK(t.Lapsed(idle));
  CHECK(t.Lapsed(loading));
  CHECK_FALSE(t.Lapsed(released));  // released before the lapse: an ordinary unknown handle from now on
  CHECK_FALSE(t.HeldBlocks(idle).has_value());
  CHECK_FALSE(t.HeldBlocks(loading).has_value());
  CHECK(t.pinned_blocks() == 2);  // the two loads still copy: their slots go with their last EndLoad
  CHECK(t.EndLoad(loading) == std::vector<SlotId>{3});
  CHECK(t.EndLoad(released) == std::vector<SlotId>{4});
  CHECK(t.pinned_blocks() == 0);
  t.ForgetLapsed(idle);
  CHECK_FALSE(t.Lapsed(idle));
  // Pins taken after the lapse are ordinary ones.
  const uint64_t again = t.Add({5});
  CHECK(t.HeldBlocks(again) == 1u);
  CHECK_FALSE(t.Lapsed(again));
}

TEST_CASE("handle table: lapsed handles are remembered up to a bound, the oldest forgotten first", "[unit][dataplane]") {
  HandleTable t;
  const uint64_t first = t.Add({1});
  CHECK(t.Lapse().size() == 1);
  for (size_t i = 0; i < HandleTable::kMaxLapsedHandles; ++i) t.Add({static_cast<SlotId>(i)});
  CHECK(t.Lapse().size() == HandleTable::kMaxLapsedHandles);
  CHECK_FALSE(t.Lapsed(first));
  CHECK(t.Lapsed(first + 1));
}
