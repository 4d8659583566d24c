// See handle_table.h.
#include "daemon/dataplane/handle_table.h"

#include <cassert>

namespace flexkv {

uint64_t HandleTable::Add(std::vector<SlotId> slots, std::optional<size_t> prefix_blocks) {
  const uint64_t handle = next_handle_++;
  pinned_blocks_ += slots.size();
  Handle& h = handles_[handle];
  h.prefix_blocks = prefix_blocks.value_or(slots.size());
  h.whole = prefix_blocks.has_value();
  h.slots = std::move(slots);
  return handle;
}

std::optional<size_t> HandleTable::HeldBlocks(uint64_t handle) const {
  auto it = handles_.find(handle);
  if (it == handles_.end() || it->second.released) return std::nullopt;
  return it->second.prefix_blocks;
}

std::vector<SlotId> HandleTable::BeginLoad(uint64_t handle, uint32_t count) {
  auto it = handles_.find(handle);
  assert(it != handles_.end() && !it->second.released && count <= it->second.prefix_blocks);
  it->second.loads_in_flight++;
  if (it->second.whole) return it->second.slots;
  return {it->second.slots.begin(), it->second.slots.begin() + count};
}

std::vector<SlotId> HandleTable::EndLoad(uint64_t handle) {
  auto it = handles_.find(handle);
  if (it == handles_.end()) return {};
  assert(it->second.loads_in_flight > 0);
  if (--it->second.loads_in_flight == 0 && it->second.released) return Forget(it);
  return {};
}

std::vector<SlotId> HandleTable::Release(uint64_t handle) {
  auto it = handles_.find(handle);
  if (it == handles_.end()) return {};
  if (it->second.loads_in_flight > 0) {
    it->second.released = true;  // the last load copying from these slots unpins them
    return {};
  }
  return Forget(it);
}

std::vector<SlotId> HandleTable::ReleaseAll() {
  std::vector<SlotId> unpin;
  for (auto it = handles_.begin(); it != handles_.end();) {
    auto next = std::next(it);
    if (it->second.loads_in_flight > 0) {
      it->second.released = true;
    } else {
      std::vector<SlotId> slots = Forget(it);
      unpin.insert(unpin.end(), slots.begin(), slots.end());
    }
    it = next;
  }
  return unpin;
}

std::vector<SlotId> HandleTable::Lapse(size_t* handles) {
  size_t lapsed = 0;
  for (const auto& [id, handle] : handles_) {
    if (handle.released) continue;  // released by the client already, only a load still copies from it
    lapsed_.insert(id);
    ++lapsed;
  }
  while (lapsed_.size() > kMaxLapsedHandles) lapsed_.erase(lapsed_.begin());
  if (handles != nullptr) *handles = lapsed;
  return ReleaseAll();
}

std::vector<SlotId> HandleTable::Forget(std::map<uint64_t, Handle>::iterator it) {
  std::vector<SlotId> slots = std::move(it->second.slots);
  pinned_blocks_ -= slots.size();
  handles_.erase(it);
  return slots;
}

}  // namespace flexkv
