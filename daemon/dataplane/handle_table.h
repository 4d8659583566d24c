// HandleTable: one session's match handles. A Match with kMatchFlagPin pins the matched blocks under a handle;
// Loads copy from the handle's slots; Release (or the session's end, or its pin lease running out) lets them go -
// after the last Load still copying from them. The table decides when slots are unpinned and returns them; the
// caller unpins them in the cache (so the table is plain state, testable alone). Not thread-safe: the session's
// lock guards it.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <vector>

#include "daemon/cache/prefix_index.h"

namespace flexkv {

class HandleTable {
 public:
  // Holds `slots` (pinned by the caller) under a new handle, never 0 and never reused in this table. A hybrid
  // match (docs/hybrid.md) gives `prefix_blocks`, the prefix end its slots serve (its windows' and states' slots
  // come after the FULL ones): HeldBlocks says it, and BeginLoad hands out every slot (such a handle loads whole).
  uint64_t Add(std::vector<SlotId> slots, std::optional<size_t> prefix_blocks = std::nullopt);

  // How many prefix blocks `handle` pins (its slots, or a hybrid match's prefix end), while it is held and not
  // released; nullopt otherwise (what ValidateHandleUse takes).
  std::optional<size_t> HeldBlocks(uint64_t handle) const;

  // A Load starts copying from the first `count` slots of a held handle (HeldBlocks(handle) >= count must
  // hold; all of a hybrid match's slots): returns them and counts the load in flight.
  std::vector<SlotId> BeginLoad(uint64_t handle, uint32_t count);
  // That Load ended. Returns the slots to unpin when the handle was released meanwhile and this was its last
  // load in flight (the handle is then gone); empty otherwise.
  std::vector<SlotId> EndLoad(uint64_t handle);

  // Release: returns the slots to unpin now and forgets the handle; when loads are still copying from it, marks
  // it released (HeldBlocks says nullopt from now on), returns nothing, and the last EndLoad returns the slots.
  // An unknown handle returns nothing.
  std::vector<SlotId> Release(uint64_t handle);
  // Release of every handle (the session ended).
  std::vector<SlotId> ReleaseAll();

  // The session's pin lease ran out: every held handle is released as by ReleaseAll (slots still loading go with
  // their last EndLoad) and remembered as lapsed, so that its later use is answered as such. Returns the slots to
  // unpin now; `handles` (if not null) gets how many handles lapsed. The table remembers at most
  // kMaxLapsedHandles lapsed handles (the oldest are forgotten first: their use then reads as an unknown handle).
  std::vector<SlotId> Lapse(size_t* handles = nullptr);
  // Whether `handle` lapsed (and was not released since).
  bool Lapsed(uint64_t handle) const { return lapsed_.contains(handle); }
  // A Release of a lapsed handle: it is answered as lapsed once, then forgotten.
  void ForgetLapsed(uint64_t handle) { lapsed_.erase(handle); }
  static constexpr size_t kMaxLapsedHandles = 4096;

  // Blocks pinned by handles not yet unpinned (including released ones still loading).
  uint64_t pinned_blocks() const { return pinned_blocks_; }

 private:
  struct Handle {
    std::vector<SlotId> slots;
    size_t prefix_blocks = 0;  // what HeldBlocks says
    bool whole = false;        // a hybrid match: loads take every slot
    uint32_t loads_in_flight = 0;
    bool released = false;  // Release or session end arrived while a load was copying
  };
  std::vector<SlotId> Forget(std::map<uint64_t, Handle>::iterator it);

  std::map<uint64_t, Handle> handles_;
  std::set<uint64_t> lapsed_;  // at most kMaxLapsedHandles
  uint64_t next_handle_ = 1;
  uint64_t pinned_blocks_ = 0;
};

}  // namespace flexkv
