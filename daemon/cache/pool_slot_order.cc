// Pool's rewrite of blocks an older release wrote in the layer-major slot order (see pool.h, RewriteInSlotOrder;
// common/slot_order.h), apart from pool.cc's file format.
#include <optional>
#include <vector>

#include "common/block_checksum.h"
#include "common/checksum_copy.h"
#include "common/slot_order.h"
#include "daemon/cache/pool.h"

namespace flexkv {

std::optional<uint64_t> Pool::Rewrite(SlotId slot, uint64_t layer_major_checksum, const Committed* entry) {
  const Geometry g = geometry_.Component(ComponentOf(slot));
  const uint64_t bytes = SlotBytes(slot);
  uint8_t* data = SlotData(slot);
  // Checked in the copy the rewrite reads from, in one pass: what is rewritten is exactly what was checked.
  thread_local std::vector<uint8_t> scratch;
  struct Trim {  // a huge state slot's scratch is not kept by the thread, whatever the outcome
    ~Trim() {
      if (scratch.capacity() > (64ull << 20)) std::vector<uint8_t>().swap(scratch);
    }
  } trim;
  scratch.resize(bytes);
  if (FinishBlockChecksum(CopyRunWithChecksum(scratch.data(), data, bytes, 0), bytes) != layer_major_checksum) {
    return std::nullopt;  // the bytes and the entry as they were: the caller drops the block
  }
  if (entry != nullptr) MarkFree(slot);
  const uint64_t content_checksum = FinishBlockChecksum(LayerMajorToSlotOrder(g, scratch.data(), data), bytes);
  if (entry != nullptr) MarkCommitted(slot, entry->key, entry->parent, content_checksum);
  return content_checksum;
}

std::optional<uint64_t> Pool::RewriteBytesInSlotOrder(SlotId slot, uint64_t layer_major_checksum) {
  return Rewrite(slot, layer_major_checksum, nullptr);
}

std::optional<uint64_t> Pool::RewriteInSlotOrder(const Committed& c) { return Rewrite(c.slot, c.content_checksum, &c); }

}  // namespace flexkv
