// CacheTier: one place cached blocks live (DRAM pool, SSD, a peer's pool), behind one small interface that
// says what the tier is (name, capacity, whether its blocks survive a daemon restart) and moves whole slots in
// and out. DRAM is tier 0: the only tier engines copy from, so data reaches an engine as tier N -> DRAM -> engine.
// Every tier keeps publish-after-transfer: the index makes a block matchable in a tier only once WriteSlot of
// its bytes returned OK. Adding a tier means adding a folder under daemon/tiers/ with its implementation.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "daemon/cache/prefix_index.h"
#include "flexkv/status.h"

namespace flexkv {

class CacheTier {
 public:
  virtual ~CacheTier() = default;

  // Short and stable ("dram", "ssd", "peer"): metrics and errors name it.
  virtual std::string_view name() const = 0;
  // Whether blocks committed here are still there after the daemon restarts (SIGTERM or kill -9).
  virtual bool survives_restart() const = 0;
  // Slots the tier holds, and the bytes of one (one block); 0 while the tier does not exist yet.
  virtual uint32_t capacity_slots() const = 0;
  virtual uint64_t slot_bytes() const = 0;

  // Copy one whole slot out of / into the tier. `bytes.size()` must be slot_bytes() and `slot` below
  // capacity_slots(): otherwise INVALID_ARGUMENT / OUT_OF_RANGE naming the value and what was expected, and
  // nothing is copied. Blocking; called from copy workers, never from the ring poller. Thread-safe for distinct
  // slots; the index makes sure no two requests write one slot at once.
  virtual Status ReadSlot(SlotId slot, std::span<uint8_t> bytes) const = 0;
  virtual Status WriteSlot(SlotId slot, std::span<const uint8_t> bytes) = 0;
};

}  // namespace flexkv
