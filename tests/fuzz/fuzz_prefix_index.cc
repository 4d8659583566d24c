// Fuzz target: random operation sequences on the prefix index (match with/without pin, unpin, reserve +
// commit/abort, interleaved stores, stores of a chain's second half under its parent), with the index's own
// invariant check after every step and a simple model of what must hold: matched prefixes are committed chains,
// pins never go negative, slots add up.
#include <cstddef>
#include <cstdint>
#include <vector>

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
  std::vector<std::vector<flexkv::SlotId>> pins;
  struct Pending {
    std::vector<flexkv::BlockKey> keys;
    flexkv::PrefixIndex::Reservation r;
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
        break;
      }
      case 2:
        if (!pins.empty()) {
          index.Unpin(pins.back());
          pins.pop_back();
        }
        break;
      case 3:
      case 4: {
        // Some stores are the second half of a chain, under the key before it (refused when that is not
        // committed).
        const bool under_parent = (data[p] / 6) % 2 == 1 && keys.size() >= 2;
        const size_t begin = under_parent ? keys.size() / 2 : 0;
        const std::vector<flexkv::BlockKey> run(keys.begin() + static_cast<std::ptrdiff_t>(begin), keys.end());
        Pending s{run, index.Reserve(under_parent ? keys[begin - 1] : flexkv::kRootParent, run)};
        if (s.r.cached + s.r.slots.size() > run.size()) __builtin_trap();
        if (s.r.parent_refused && (!under_parent || !s.r.slots.empty() || s.r.cached != 0)) __builtin_trap();
        if (op == 3) {
          index.Commit(s.r.slots);
        } else {
          pending.push_back(std::move(s));
        }
        break;
      }
      case 5:
        if (!pending.empty()) {
          if ((data[p + 1] & 1) != 0) {
            index.Commit(pending.back().r.slots);
          } else {
            index.Abort(pending.back().r.slots);
          }
          pending.pop_back();
        }
        break;
    }
    index.CheckInvariants();
    if (index.used_slots() > index.capacity() || index.pinned_slots() > index.used_slots()) __builtin_trap();
  }
  for (auto& s : pending) index.Abort(s.r.slots);
  for (auto& s : pins) index.Unpin(s);
  index.CheckInvariants();
  if (index.pinned_slots() != 0 || index.used_slots() != index.committed_blocks()) __builtin_trap();
  return 0;
}
