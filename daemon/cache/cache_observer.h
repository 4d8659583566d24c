// CacheObserver: the one port through which a Cache tells the parts that follow it what happens to its pool and its
// blocks - the engine-memory backends (DMA registration of each grant), the tiers (a peer's remote reads of the
// grants, a directory of the blocks), the KV event stream. A cache has any number of observers (Cache::AddObserver),
// each told the same things in the order they were added; none of them is special to the cache.
#pragma once

#include <cstdint>
#include <functional>
#include <string_view>
#include <utility>

#include "daemon/cache/pool_region.h"
#include "flexkv/block_key.h"
#include "flexkv/geometry.h"
#include "flexkv/status.h"

namespace flexkv {

// A block that became matchable in the cache's DRAM pool or left it.
struct CacheBlockEvent {
  enum Kind : uint8_t { kCommitted, kRemoved, kDomainDropped } kind = kCommitted;
  BlockKey key;
  // kCommitted: the last key of its store request (a directory publishes request ends), or a restored block with no
  // child.
  bool request_end = false;
  // The block's parent (kCommitted; zero for a first block), why, and the domain (valid only during the call).
  enum Cause : uint8_t { kStored, kPromoted, kPulled, kRestored, kEvicted, kDropped, kAdminDropped } cause = kStored;
  BlockKey parent;
  std::string_view model_namespace;
  uint32_t tokens_per_block = 0;
  // The component (0: FULL; a hybrid geometry's window or state entry: its index in the geometry, docs/hybrid.md) and
  // whether the domain is hybrid. A component entry has no parent; kDomainDropped covers every component.
  uint8_t component = 0;
  bool hybrid = false;
  const Geometry* geometry = nullptr;  // the domain's (valid only during the call)
};

class CacheObserver {
 public:
  virtual ~CacheObserver() = default;

  // A pool grant became active (a pool was created or re-attached, or a Resize grew into it): called before any of its
  // slots is handed out. Answers whether the grant could be made reachable (e.g. registered for DMA); a refusal stops
  // the observers after this one from being told. What the cache does with a refusal: Cache::AddObserver (a Resize
  // gives the grant back, telling it removed to the observers told it added, the refusing one included; a new or
  // re-attached pool keeps it). Each observer hears every region it was told added removed exactly once.
  virtual Status PoolRegionAdded(const PoolRegion& /*region*/) { return Status::Ok(); }
  // A grant stops being active: after its slots were released and before its memory is returned; observers are told in
  // the reverse order of PoolRegionAdded.
  virtual void PoolRegionRemoved(const PoolRegion& /*region*/) {}
  // kCommitted for each block a Commit publishes and each restored block that passes verification, kRemoved for each
  // committed block that leaves the index (evicted, dropped with a failed check), kDomainDropped once when DropDomain
  // drops the pool (every block at once), for FULL blocks and for the window and state entries of a hybrid geometry
  // (`component`). Runs under the cache's lock: it must be quick (queue the event) and must not call back into the
  // cache.
  virtual void BlockChanged(const CacheBlockEvent& /*event*/) {}
  // Whether BlockChanged does anything (the cache skips building events when no observer wants them).
  virtual bool wants_blocks() const { return false; }
};

// An observer made of functions (a test's, or a part that needs only one of the calls); any may be empty.
class FunctionCacheObserver final : public CacheObserver {
 public:
  FunctionCacheObserver(std::function<Status(const PoolRegion&)> added, std::function<void(const PoolRegion&)> removed,
                        std::function<void(const CacheBlockEvent&)> blocks = {})
      : added_(std::move(added)), removed_(std::move(removed)), blocks_(std::move(blocks)) {}
  Status PoolRegionAdded(const PoolRegion& region) override { return added_ ? added_(region) : Status::Ok(); }
  void PoolRegionRemoved(const PoolRegion& region) override {
    if (removed_) removed_(region);
  }
  void BlockChanged(const CacheBlockEvent& event) override {
    if (blocks_) blocks_(event);
  }
  bool wants_blocks() const override { return static_cast<bool>(blocks_); }

 private:
  std::function<Status(const PoolRegion&)> added_;
  std::function<void(const PoolRegion&)> removed_;
  std::function<void(const CacheBlockEvent&)> blocks_;
};

}  // namespace flexkv
