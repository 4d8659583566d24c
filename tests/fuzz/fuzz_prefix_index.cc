// Fuzz target: random operation sequences on the prefix index (match with/without pin, unpin, reserve +
// commit/abort, interleaved stores, stores of a chain's second half under its parent), with the index's own
// invariant check after every step and a simple model of what must hold: matched prefixes are committed chains,
// pins never go negative, slots add up. Beside it, a sliding-window component of a hybrid geometry kept as the
// cache keeps one (ComponentIndex: each store also reserves its run's trailing window, all or none; FULL
// evictions unanchor, FULL commits anchor; a match takes the hit rule's end and pins its window; drops, restores),
// with its own invariant check. The prefix index sees the same calls for an input as without the component.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "daemon/cache/component_index.h"
#include "daemon/cache/prefix_index.h"

namespace {

flexkv::BlockKey Key(uint32_t chain, uint32_t i) {
  // A small tree of prefixes: chains share their first blocks when their ids share high bits.
  return flexkv::BlockKey{(uint64_t{chain >> (i < 2 ? 2 : 0)} << 16) | (i + 1), 0x9E3779B97F4A7C15ULL ^ i};
}

std::vector<flexkv::BlockKey> Chain(uint32_t chain, uint32_t len) {
  std::vector<flexkv::BlockKey> keys;
  for (uint32_t i = 0; i < len; ++i) keys.push_back(Key(chain, i));
  return keys;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  flexkv::PrefixIndex index(1 + data[0] % 32);
  constexpr uint32_t kWindow = 2;
  const flexkv::ComponentRule rules[] = {{false, kWindow}};
  flexkv::ComponentIndex window(1 + data[0] / 32 * 2);
  index.SetEvictionListener([&](flexkv::SlotId, const flexkv::BlockKey& key) { window.Unanchor(key); });
  std::vector<std::vector<flexkv::SlotId>> pins;
  std::vector<std::vector<flexkv::SlotId>> window_pins;
  struct Pending {
    std::vector<flexkv::BlockKey> keys;
    flexkv::PrefixIndex::Reservation r;
    std::vector<flexkv::SlotId> window_slots;  // pending in the window component
  };
  // A store of `run` also stores its trailing window, all or none; the slots it reserved.
  auto reserve_window = [&](const std::vector<flexkv::BlockKey>& run) {
    const size_t w = std::min<size_t>(kWindow, run.size());
    const std::vector<flexkv::BlockKey> tail(run.end() - static_cast<std::ptrdiff_t>(w), run.end());
    const auto r = window.Reserve(tail);
    if ((r.shortfall == flexkv::StatusCode::kOk) != (r.slots.size() == tail.size())) __builtin_trap();
    std::vector<flexkv::SlotId> slots;
    for (flexkv::SlotId s : r.slots) {
      if (s != flexkv::ComponentIndex::kNoSlot) slots.push_back(s);
    }
    return slots;
  };
  auto commit = [&](const Pending& s) {
    index.Commit(s.r.slots);
    window.Commit(s.window_slots);
    for (const auto& key : s.keys) window.Anchor(key);
  };
  std::vector<Pending> pending;
  for (size_t p = 1; p + 2 < size; p += 3) {
    const uint8_t op = data[p] % 6;
    const uint32_t chain = data[p + 1] % 16;
    const uint32_t len = 1 + data[p + 2] % 12;
    const auto keys = Chain(chain, len);
    switch (op) {
      case 0:
      case 1: {
        std::vector<flexkv::SlotId> slots;
        const size_t hit = index.Match(keys, op == 1, op == 1 ? &slots : nullptr);
        if (hit > keys.size()) __builtin_trap();
        if (op == 1 && hit > 0) pins.push_back(std::move(slots));
        const size_t end = flexkv::LongestUsableEnd(hit, rules, [&](size_t c, size_t j) {
          if (c != 1 || j >= hit) __builtin_trap();
          return window.Find(keys[j]).has_value();
        });
        if (end > hit) __builtin_trap();
        std::vector<flexkv::SlotId> window_slots;
        for (size_t j = end - std::min<size_t>(end, kWindow); j < end; ++j) {
          const auto found = window.Find(keys[j]);
          if (!found) __builtin_trap();
          window_slots.push_back(*found);
        }
        if (op == 1 && !window_slots.empty()) {
          for (flexkv::SlotId s : window_slots) window.Pin(s);
          window_pins.push_back(std::move(window_slots));
        }
        // Restart paths, on bits a match does not use: restore the chain's last key unverified, verify it.
        const uint32_t extra = data[p] / 6;
        if (op == 0 && (extra & 1) != 0) {
          const auto slot = static_cast<flexkv::SlotId>(data[p + 1] % window.capacity());
          (void)window.RestoreUnverified(slot, keys.back());
          if ((extra & 2) != 0) window.MarkVerified(slot);
        }
        break;
      }
      case 2:
        if (!pins.empty()) {
          index.Unpin(pins.back());
          pins.pop_back();
        }
        if (!window_pins.empty()) {
          window.Unpin(window_pins.back());
          window_pins.pop_back();
        }
        if ((data[p + 2] & 0x80) != 0) {  // a failed check drops a window entry (any state, or none)
          const auto slot = static_cast<flexkv::SlotId>(data[p + 1] % (window.capacity() + 1));
          window.Drop(std::span<const flexkv::SlotId>(&slot, 1));
        }
        break;
      case 3:
      case 4: {
        // Some stores are the second half of a chain, under the key before it (refused when that is not
        // committed).
        const bool under_parent = (data[p] / 6) % 2 == 1 && keys.size() >= 2;
        const size_t begin = under_parent ? keys.size() / 2 : 0;
        const std::vector<flexkv::BlockKey> run(keys.begin() + static_cast<std::ptrdiff_t>(begin), keys.end());
        Pending s{run, index.Reserve(under_parent ? keys[begin - 1] : flexkv::kRootParent, run), {}};
        if (s.r.cached + s.r.slots.size() > run.size()) __builtin_trap();
        if (s.r.parent_refused && (!under_parent || !s.r.slots.empty() || s.r.cached != 0)) __builtin_trap();
        s.window_slots = reserve_window(run);
        if (op == 3) {
          commit(s);
        } else {
          pending.push_back(std::move(s));
        }
        break;
      }
      case 5:
        if (!pending.empty()) {
          if ((data[p + 1] & 1) != 0) {
            commit(pending.back());
          } else {
            index.Abort(pending.back().r.slots);
            window.Abort(pending.back().window_slots);
          }
          pending.pop_back();
        }
        break;
    }
    index.CheckInvariants();
    if (index.used_slots() > index.capacity() || index.pinned_slots() > index.used_slots()) __builtin_trap();
    window.CheckInvariants();
    if (window.used_slots() > window.capacity() || window.pinned_slots() > window.used_slots()) __builtin_trap();
  }
  for (auto& s : pending) {
    index.Abort(s.r.slots);
    window.Abort(s.window_slots);
  }
  for (auto& s : pins) index.Unpin(s);
  for (auto& s : window_pins) window.Unpin(s);
  index.CheckInvariants();
  if (index.pinned_slots() != 0 || index.used_slots() != index.committed_blocks()) __builtin_trap();
  window.CheckInvariants();
  if (window.pinned_slots() != 0 ||
      window.used_slots() != window.committed_entries() + window.unverified_entries()) {
    __builtin_trap();
  }
  return 0;
}
