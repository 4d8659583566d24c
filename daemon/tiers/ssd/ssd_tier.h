// SsdTier: the SSD tier wired into the cache (docs/ssd.md). It owns the SsdStore and moves blocks
// between it and the DRAM pools of the cache domains:
//   write-back  a mover thread writes DRAM blocks to SSD ahead of their eviction, so that an eviction finds its
//               block on SSD already: the cold end of each domain's eviction order (the coldest
//               `writeback_window` of its blocks, in eviction order: each cold leaf, then its ancestors; the cold
//               policy, the default), and with write_all every block a store commits too, oldest first, as fast
//               as the drives take them. Writes go straight from the pool's slots (pinned
//               while written). A full SSD queue leaves the rest for the next round. DRAM evicts written (clean)
//               blocks first; an engine's store that could only evict unwritten ones waits for the write-back, up to
//               store_wait_ms (RequestHandlers::RetryWaitingStores); a block evicted unwritten all the same is
//               counted (evicted_unwritten).
//   owners      the owner of each namespace with blocks on SSD is recorded with them (SsdOwners) before its first
//               block is written, and read back at Create: RecordedOwner survives a reboot that loses the pool file.
//   uses        DRAM hits on blocks SSD holds are passed to the store as uses (Cache::TakeTouched, SsdStore::Touch),
//               and SSD overwrites leaves before the blocks others hang under, so a hot prefix keeps its SSD copy.
//   promotion   a match that ends in DRAM before its keys do continues on SSD: the consecutive blocks found there
//               (same domain, same parent chain) get pending DRAM slots, are read into them (header and XXH3
//               verified) and committed with their content checksums; the match is answered once they are
//               (Promote). A refused read (queue full) or a block that fails verification ends the promoted prefix
//               there: the match gets the blocks before it, a failed block is dropped and counted.
//   restart     the store rebuilds its index from the slot headers at open, so a restarted (or rebooted) node
//               matches its SSD blocks again; nothing else is needed.
// The unit moved is (key, component): a hybrid domain's window and state entries are written back and promoted as its
// FULL blocks are, and a promotion keeps the hit rule across the tiers (ssd_tier_hybrid.cc; docs/ssd.md, "Hybrid
// domains"). The store is opened with the largest slot of the domains (every component's): at Create when block files
// exist or a pool was re-attached, else by the mover when the first domain's pool is created.
// Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"
#include "daemon/tiers/cache_tier.h"
#include "daemon/tiers/ssd/ssd_owners.h"
#include "daemon/tiers/ssd/ssd_store.h"
#include "flexkv/block_key.h"
#include "flexkv/status.h"

namespace flexkv {

class Cache;
class CacheSet;

struct SsdTierOptions {
  SsdStoreOptions store;           // --ssd-path, --ssd-size, --ssd-queue-depth, --ssd-allow-buffered,
                                   // --ssd-sync-writes, --ssd-on-mismatch; payload_capacity is set here
  bool write_all = false;          // --ssd-write-policy all: every stored block is written to SSD; cold (default):
                                   // only the cold end (writeback_window)
  double writeback_window = 0.25;  // --ssd-writeback-window: the share of each domain's DRAM slots, coldest first,
                                   // kept written to SSD (0 < w <= 1)
  uint32_t writeback_batch = 256;  // blocks a mover round takes from one domain at most
  int mover_idle_ms = 2;           // how long the mover sleeps when a round found nothing to write (a promotion
                                   // wakes it: its reservation moved the cold end)
  int64_t store_wait_ms = 1000;    // --ssd-store-wait: how long an engine's store may wait for the write-back
                                   // before it evicts DRAM blocks SSD does not hold yet (0: never waits)
};

// What GetStatus and the metrics report (flexkv.v1.TierStatus).
struct SsdTierStatus {
  std::string state;               // "serving", "waiting for the first pool", "failed: <why>"
  uint64_t capacity_blocks = 0, used_blocks = 0, capacity_bytes = 0, block_bytes = 0;
  uint64_t promoted_blocks = 0;          // read from SSD into DRAM for a match (its SSD hits)
  uint64_t promotion_requests = 0;       // matches that went on to SSD
  uint64_t promotion_refused_blocks = 0; // SSD blocks a match could not promote: queue full or no DRAM slot
  uint64_t promotion_failed_blocks = 0;  // reads that failed or did not verify (the block is dropped)
  uint64_t promoted_layer_major_blocks = 0;  // of promoted_blocks: written by an older release in the layer-major
                                             // slot order, rewritten in today's as they were promoted
  uint64_t written_back_blocks = 0;      // written to SSD
  uint64_t writeback_refused_blocks = 0; // writes the store refused (queue full): left for a later round
  uint64_t writeback_failed_blocks = 0;  // writes that failed (I/O error, disk full): the block stays DRAM-only
  uint64_t evicted_written_blocks = 0;   // DRAM evictions of blocks SSD holds (all domains)
  uint64_t evicted_unwritten_blocks = 0; // DRAM evictions of blocks it did not hold: lost from the node
  uint64_t store_waits = 0;              // stores that waited for the write-back instead of evicting unwritten blocks
  uint64_t store_wait_expired = 0;       // of those, stores whose wait ran out: they evicted unwritten blocks
  uint64_t promotion_waits = 0;          // promotions that waited for the write-back instead of evicting unwritten
                                         // blocks (a read never costs a block the node accepted)
  uint64_t promotion_wait_expired = 0;   // of those, promotions whose wait ran out: the part that fits (FULL) or
                                         // nothing (hybrid) was promoted; nothing unwritten was evicted
  uint64_t reads_in_flight = 0, writes_in_flight = 0;
  double read_bytes_per_s = 0, write_bytes_per_s = 0;  // over the last second the mover sampled
  SsdStoreStats store;
  SsdRebuildReport rebuild;
  std::vector<SsdStore::FileInfo> files;
  std::vector<std::string> notes;        // e.g. a domain whose blocks do not fit the SSD slots
};

class SsdTier final : public CacheTier {
 public:
  // Validates the options (INVALID_ARGUMENT naming the flag) and opens the store now when a payload capacity is
  // known: the block files' (SsdFoundPayloadCapacity) or the largest block of the pools `caches` re-attached,
  // whichever is larger. Any refusal of SsdStore::Open is returned (the daemon does not start): O_DIRECT refused,
  // a file of another geometry or version under --ssd-on-mismatch=refuse, a missing path, a full drive...
  // Otherwise the store is opened when the first pool exists (its errors then show in status and the log).
  // Every domain in `caches` is attached (Cache::AttachNextTier) once the store is open.
  static Result<std::unique_ptr<SsdTier>> Create(SsdTierOptions options, CacheSet* caches);
  ~SsdTier();  // Stop()
  SsdTier(const SsdTier&) = delete;
  SsdTier& operator=(const SsdTier&) = delete;

  std::string_view name() const override { return "ssd"; }
  TierCapabilities capabilities() const override {
    TierCapabilities c;
    c.promotes_on_match = c.takes_write_back = c.survives_restart = c.reports_blocks = c.checks_owner = true;
    c.hybrid = true;
    return c;
  }

  // Starts the mover thread (write-back, the deferred open, the rate sampling).
  void Start() override;
  // Stops the mover and waits until every SSD request has ended (its callback ran: promotions answered, written
  // blocks unpinned). Idempotent. After it, Promote answers false.
  void Stop() override;

  // Called by a Match whose DRAM prefix ended at `dram_hit` < keys.size(). When the SSD holds keys[dram_hit] of this
  // domain under the right parent, reserves DRAM slots for the run of SSD blocks that follows, reads them and returns
  // true: `done(promoted)` then runs exactly once, on an SSD completion thread, after the first `promoted` of them
  // are committed to DRAM (and the rest given back). False when there is nothing to promote or it cannot start (no
  // SSD block there, the store not open, stopped, queue full, no DRAM slot): `done` is not called, and the match is
  // answered from DRAM alone. A hybrid domain's match (dram_hit: its DRAM hit) is PromoteHybrid's.
  // While the write-back serves, a promotion evicts only DRAM blocks SSD holds: one that needs more room, where the
  // write-back can make it (writes in flight, unwritten blocks evictable), waits for it - queued, true returned, retried
  // by the mover when a write completed (or every 10 ms), `done` then run on the mover's thread (or Stop's, with 0);
  // past --ssd-store-wait a FULL promotion takes what fits, a hybrid one nothing (`done(0)`).
  bool Promote(Cache& cache, std::span<const BlockKey> keys, size_t dram_hit, PromotionDone done) override;

  // The KV event stream's view of the SSD tier: `observer` is told each block the store commits (written back),
  // loses (evicted, dropped), and - kRestored - each block found on disk when the store opens after this call.
  // Runs under the store's lock (SsdStore::SetEventListener). Set it before Start.
  void SetBlockObserver(BlockObserver observer) override;
  // `mark()` then `each` for every block the store holds, consistent with the observer's events (nothing but the
  // mark while the store is not open).
  void SnapshotBlocks(const std::function<void()>& mark,
                      const std::function<void(const TierBlockEvent&)>& each) const override;

  SsdTierStatus GetStatus() const;
  bool open() const { return store_ready_.load(std::memory_order_acquire); }

  // The uid recorded as the owner of `model_namespace` with its SSD blocks (SsdOwners), read at Create: after a
  // reboot the DRAM pool that recorded the namespace's creator is gone, its blocks on SSD are not, and an Attach
  // must not make another uid their owner. nullopt when none is recorded (no block of it on SSD).
  std::optional<uid_t> RecordedOwner(std::string_view model_namespace) const override;

  // GetStatusResponse.tiers["ssd"] and the flexkv_ssd_* families (ssd_tier_report.cc).
  void ReportStatus(v1::GetStatusResponse* status) const override;
  void CollectMetrics(MetricFamilies* out) const override;

 private:
  SsdTier(SsdTierOptions options, CacheSet* caches);
  Status OpenStore(uint64_t payload_capacity);
  // The mover's round: opens the store when due, then write-back for each domain. Returns blocks written.
  size_t MoveRound();
  void SampleRates();
  // The SSD domain of `cache`'s current domain (cached per cache generation).
  SsdDomain DomainOf(const Cache& cache);
  // Whether `cache`'s blocks go to SSD: a pool whose slots (every component's) are no larger than the SSD slots.
  bool Eligible(const Cache& cache) const;
  // Promote for a hybrid domain (ssd_tier_hybrid.cc): the longest end e at which FULL [0, e), each window and the
  // state at e are each in DRAM or on SSD (Cache::ReservePromotion), when it is beyond DRAM's hit; the pieces DRAM
  // lacks are read into pending slots, verified (the store's XXH3, then the content checksum they were stored with)
  // and committed (Cache::CommitPromoted); a piece that fails is dropped from SSD and counted, and the longest end
  // that still holds is promoted next (up to `attempts` rounds in all). `done(pieces committed)` as Promote's.
  // `*wait` as StartPromotion's.
  bool PromoteHybrid(Cache& cache, std::span<const BlockKey> keys, PromotionDone done, bool* wait, int attempts = 4);
  // Promote's work once it is known to be due: true when reads are in flight (`done` runs when they end). False when
  // nothing was started (`done` is not called); `*wait` is then set when the promotion could go on only by evicting
  // DRAM blocks or entries SSD does not hold yet (nothing reserved or evicted: it waits for the write-back). With
  // `partial` a FULL promotion takes the blocks that fit without such evictions instead of waiting.
  bool StartPromotion(Cache& cache, std::span<const BlockKey> keys, size_t dram_hit, PromotionDone done, bool partial,
                      bool* wait);
  // The mover's retry of the promotions that wait for the write-back: each is started when it no longer needs an
  // unwritten eviction, answered with nothing promoted once it is not due any more (the prefix is in DRAM, the
  // domain was dropped, the tier stops), and, past its deadline (--ssd-store-wait), started with what fits (FULL) or
  // answered from DRAM (hybrid).
  void RetryWaitingPromotions();
  struct WaitingPromotion {
    Cache* cache;
    uint64_t generation;  // the domain it was asked for
    std::vector<BlockKey> keys;
    PromotionDone done;
    int64_t deadline_ms;  // MonotonicMs
  };
  // Records `cache`'s namespace owner (its creator uid) with the SSD tier before its first block is written there;
  // false when the record could not be written (its blocks then stay DRAM-only: see ssd_owners.h).
  bool RecordOwner(const Cache& cache, std::vector<std::string>* notes);
  // Forgets the recorded owners of namespaces with no block on SSD (at open).
  void PruneOwners();

  const SsdTierOptions options_;
  CacheSet* const caches_;
  std::unique_ptr<SsdStore> store_;     // set once (OpenStore), before store_ready_
  SsdOwners owners_;                    // the namespaces' owners, kept with their blocks
  std::atomic<bool> store_ready_{false};
  mutable Mutex events_mu_;             // orders the store's opening against event snapshots
  BlockObserver block_observer_ ABSL_GUARDED_BY(events_mu_);
  // The store's listener that tells block_observer_ (called with events_mu_ held).
  void ListenToStoreLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(events_mu_);
  std::atomic<bool> stopping_{false};
  std::thread mover_;

  mutable Mutex mu_;
  std::string state_ ABSL_GUARDED_BY(mu_) = "waiting for the first pool";
  // cache -> (generation, domain)
  std::map<const Cache*, std::pair<uint64_t, SsdDomain>> domains_ ABSL_GUARDED_BY(mu_);
  // cache -> the generation whose owner is recorded
  std::map<const Cache*, uint64_t> owner_recorded_ ABSL_GUARDED_BY(mu_);
  // after a failed write of the owners record, not again before this
  int64_t owner_retry_ms_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::string> notes_ ABSL_GUARDED_BY(mu_);
  double read_rate_ ABSL_GUARDED_BY(mu_) = 0, write_rate_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t last_read_bytes_ ABSL_GUARDED_BY(mu_) = 0, last_write_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t last_sample_ms_ ABSL_GUARDED_BY(mu_) = 0;
  std::condition_variable idle_cv_;  // with mu_: the mover's idle wait (IdleWait), woken by Stop and by stores
  bool stop_requested_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<WaitingPromotion> waiting_promotions_ ABSL_GUARDED_BY(mu_);
  uint64_t written_at_retry_ ABSL_GUARDED_BY(mu_) = 0;  // written_back_ at the last retry of waiting promotions
  int64_t next_retry_ms_ ABSL_GUARDED_BY(mu_) = 0;      // retried by then even if nothing was written
  // The mover waits up to `d`, or until Stop.
  void IdleWait(std::chrono::milliseconds d) ABSL_LOCKS_EXCLUDED(mu_);

  std::atomic<uint64_t> promoted_{0}, promotion_requests_{0}, promotion_refused_{0}, promotion_failed_{0};
  std::atomic<uint64_t> rewritten_promotions_{0};  // promoted from an older release's layer-major order, rewritten
  std::atomic<uint64_t> written_back_{0}, writeback_refused_{0}, writeback_failed_{0};
  std::atomic<uint64_t> reads_in_flight_{0}, writes_in_flight_{0};
  std::atomic<uint32_t> promoting_{0};  // Promote calls running (Stop waits for them)
  std::atomic<uint64_t> promotion_waits_{0}, promotion_wait_expired_{0};
  bool write_back_healthy_ = true;      // the mover's: what the caches were last told (SetWriteBackHealthy)
  uint64_t failures_seen_ = 0;          // the mover's: writeback_failed_ at the end of its last round
  uint64_t ok_seen_ = 0;                // the mover's: written_back_ likewise
};

// The largest slot of `geometry`'s components (the bytes an SSD slot must hold for its blocks); `component`
// (optional) gets the component that has it.
uint64_t LargestSlotBytes(const Geometry& geometry, size_t* component = nullptr);

// The payload capacity (largest block) the block files in `paths` were made for, when one of them holds a valid
// file header; 0 when none does (no file yet, or files that are not block files: Open decides about those).
uint64_t SsdFoundPayloadCapacity(const std::vector<std::string>& paths);

}  // namespace flexkv
