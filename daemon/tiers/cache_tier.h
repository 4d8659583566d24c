// CacheTier: a place cached blocks live besides the DRAM pool - SSD (daemon/tiers/ssd/), the peers of a cluster
// (daemon/tiers/cluster/), a tier a test plugs in. DRAM is tier 0: the only tier engines copy from, so data reaches an
// engine as tier N -> DRAM -> engine. A tier declares what it does (TierCapabilities) and the daemon asks it only for
// that: the lookup path (tier_lookup.h) asks the tiers that promote on match, Prefetch the one that pulls, the KV event
// stream the ones that report their blocks; GetStatus and the metrics ask every tier for its own message and families.
// The daemon holds its tiers in a TierSet (tier_set.h), built in daemon.cc with one line per tier; docs/architecture.md
// "Adding a tier" lists what a new tier touches.
//
// Every tier keeps publish-after-transfer: a block becomes matchable in DRAM only once its bytes are there and
// verified (a promotion or a pull commits through Cache::Commit with the block's content checksum), and a tier serves
// no byte it cannot verify. The unit a tier moves is (key, component): the SSD tier moves every component of hybrid
// domains (TierCapabilities::hybrid); the cluster tier moves FULL blocks of full-attention geometries and leaves
// hybrid domains out.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "daemon/metrics/metric_families.h"
#include "flexkv/block_key.h"
#include "flexkv/status.h"

namespace flexkv {

class Cache;
namespace v1 {
class GetStatusResponse;
}

struct TierCapabilities {
  bool promotes_on_match = false;  // Promote: a match whose DRAM prefix ends early continues here (SSD)
  bool pulls_on_prefetch = false;  // Prefetch: a prefetch pulls the rest of a prompt from here (peers)
  bool takes_write_back = false;   // DRAM's blocks are written here before they are evicted (Cache::AttachNextTier)
  bool survives_restart = false;   // blocks held here are still here after the daemon restarts (kill -9, reboot)
  bool reports_blocks = false;     // SetBlockObserver/SnapshotBlocks: the KV event stream's view of this tier
  bool checks_owner = false;       // RecordedOwner: it keeps namespaces' owners with blocks that outlive the pool
  bool hybrid = false;             // it moves the windows and states of hybrid geometries too (else FULL blocks of
                                   // full-attention geometries only)
};

// What a Prefetch did (the ring completion: matched_blocks, done_blocks, bytes, message).
struct PrefetchResult {
  Status status;                 // OK unless the request itself was refused
  uint32_t local_blocks = 0;     // leading blocks cached here before the pull
  uint32_t pulled_blocks = 0;    // blocks pulled, verified and committed here (after local_blocks)
  uint64_t pulled_bytes = 0;
  std::string source;            // the node they came from, or why none were pulled (empty: no tier had them)
};

// A block that became held in a tier or left it (reports_blocks).
struct TierBlockEvent {
  enum Kind : uint8_t { kStored, kRemoved } kind = kStored;
  enum Cause : uint8_t { kWrittenBack, kRestored, kEvicted, kDropped } cause = kWrittenBack;
  BlockKey key;
  BlockKey parent;                // kStored: the block before it in its prompt (zero: a first block)
  uint64_t namespace_hash = 0;    // its domain (NamespaceHash of the model namespace)
  uint8_t component = 0;          // 0: FULL
};

class CacheTier {
 public:
  virtual ~CacheTier() = default;

  // Short and stable ("ssd", "peer"): logs, status, metrics and KV events name the tier by it.
  virtual std::string_view name() const = 0;
  virtual TierCapabilities capabilities() const = 0;

  // Starts the tier's threads; called once, after the caches re-attached their pools (RecoverPools).
  virtual void Start() {}
  // Ends every request the tier took (each answered: promotions, pulls), stops its threads. Idempotent; after it the
  // tier takes no request (Promote answers false, Prefetch answers UNAVAILABLE).
  virtual void Stop() = 0;

  // --- promotes_on_match. Called by a match whose DRAM prefix ended at `dram_hit` < keys.size(). When the tier holds
  // keys[dram_hit] of this domain under the right parent, it reserves DRAM slots for the run it holds, reads them in,
  // and returns true: `done(promoted)` then runs exactly once, after the first `promoted` of them are committed to
  // DRAM (verified; the rest given back) - on a thread of the tier (its I/O completions, its mover, or the one that
  // calls Stop), or inside this call, before it returns true, when every read ended while the reads were still being
  // issued (so the caller must not hold, around Promote, a lock that `done` takes). `promoted` may be 0 (a promotion
  // that waited, then found nothing it could do). False when there is nothing to promote or it cannot start: `done`
  // is not called and the match is answered from DRAM alone. The caller keeps the request in flight (Lifecycle) until
  // `done`.
  using PromotionDone = std::function<void(size_t promoted)>;
  virtual bool Promote(Cache& /*cache*/, std::span<const BlockKey> /*keys*/, size_t /*dram_hit*/,
                       PromotionDone /*done*/) {
    return false;
  }

  // --- pulls_on_prefetch. Pulls keys[local_blocks, ...) into `cache` (the prefix keys[0, local_blocks) is cached
  // there) and calls `done` exactly once with what it did, on a thread of the tier or inside this call. `session`
  // counts per-session bounds; `cancelled` is asked between the steps (the session ended).
  virtual void Prefetch(Cache* /*cache*/, std::vector<BlockKey> /*keys*/, uint32_t local_blocks, uint64_t /*session*/,
                        std::function<bool()> /*cancelled*/, std::function<void(PrefetchResult)> done) {
    PrefetchResult r;
    r.local_blocks = local_blocks;
    r.source = std::string(name()) + " does not pull";
    done(std::move(r));
  }

  // --- reports_blocks. `observer` is told each block the tier comes to hold or loses (and, `kRestored`, each block it
  // finds when it opens after this call), under the tier's own lock, so that SnapshotBlocks is consistent with it.
  // Set it before Start.
  using BlockObserver = std::function<void(const TierBlockEvent&)>;
  virtual void SetBlockObserver(BlockObserver /*observer*/) {}
  // `mark()` then `each` (kStored) for every block the tier holds, consistent with the observer's events.
  virtual void SnapshotBlocks(const std::function<void()>& mark,
                              const std::function<void(const TierBlockEvent&)>& /*each*/) const {
    mark();
  }

  // --- checks_owner. The uid recorded as the owner of `model_namespace` with its blocks here (after a reboot the DRAM
  // pool that recorded the namespace's creator is gone, these blocks are not, and an Attach must not make another uid
  // their owner); nullopt when none is recorded.
  virtual std::optional<uid_t> RecordedOwner(std::string_view /*model_namespace*/) const { return std::nullopt; }

  // Its own part of GetStatus: a GetStatusResponse.tiers entry named name() with its state and the counters that apply
  // (TierStatus), or a message of its own (the cluster tier: GetStatusResponse.cluster). docs/operations.md lists them.
  virtual void ReportStatus(v1::GetStatusResponse* status) const = 0;
  // Its metric families (flexkv_<name>_*), appended to `out` at each scrape. Thread-safe, quick (no I/O).
  virtual void CollectMetrics(MetricFamilies* out) const = 0;
};

}  // namespace flexkv
