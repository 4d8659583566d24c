// Cache: the cache domain, the host pool and the prefix index behind one lock, plus the request counters that
// Status reports. Thread-safe. The pool is created when the first session fixes the geometry, or re-attached
// at start when a pool file from an earlier run exists; either way it announces its active grants to the pool
// observers (cache_observer.h: the engine-memory backends register them for DMA, a cluster tier for remote reads).
// Resize moves the pool's active size.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"
#include "common/unique_fd.h"
#include "daemon/cache/budget_plan.h"
#include "daemon/cache/cache_domain.h"
#include "daemon/cache/cache_observer.h"
#include "daemon/cache/component_index.h"
#include "daemon/cache/observer_registry.h"
#include "daemon/cache/pool.h"
#include "daemon/cache/pool_lock.h"
#include "daemon/cache/pool_region.h"
#include "daemon/cache/prefix_index.h"

namespace flexkv {

struct CacheCounters {
  std::atomic<uint64_t> match_requests{0}, match_blocks{0}, hit_blocks{0}, load_blocks{0}, store_blocks{0},
      bytes_loaded{0}, bytes_stored{0};
  // Blocks whose bytes failed their content checksum (at restart or in a scrub) and were dropped; their
  // descendants, dropped with them, are not counted.
  std::atomic<uint64_t> data_loss_blocks{0};
};

class Cache {
 public:
  // A block event (CacheObserver::BlockChanged).
  using BlockEvent = CacheBlockEvent;

  // `split`: how a hybrid geometry's pool divides the budget between its components (pool.h).
  Cache(uint64_t budget_bytes, std::string pool_path, PoolSplit split = {});
  ~Cache();  // stops a running pool preparation first
  Cache(const Cache&) = delete;
  Cache& operator=(const Cache&) = delete;

  // The budget the next pool is laid out for (its max_bytes; a CacheSet gives a domain its limit, or the whole
  // budget) and the part of it that is active at first (Pool::Create's active_bytes: at most that, rounded down to
  // whole grants; default all of it). FAILED_PRECONDITION while a domain is set (its pool keeps its layout; Resize
  // moves its active part).
  Status SetBudget(uint64_t budget_bytes, uint64_t initial_active_bytes = Pool::kAllActive);
  uint64_t budget_bytes() const { return budget_bytes_.load(std::memory_order_acquire); }
  const std::string& pool_path() const { return pool_path_; }

  // Locks the pool (PoolLock: `<pool>.lock` and the pool file itself; a second daemon on the same pool is
  // refused naming the holder's pid), then
  // re-attaches the pool file of an earlier run, if any, and rebuilds the index from its slot table. The
  // restored blocks are unverified (not matchable) until FinishVerification passes them (block_verifier.h).
  // With `discard`, a pool file that cannot be used is replaced (its blocks are lost) instead of refused. A
  // pool file of an older layout (blocks without content checksums) is dropped with one log line.
  // `other_budgets`: budgets the file may have been made for besides budget_bytes() (a CacheSet's domain shares);
  // the first that fits the file becomes budget_bytes().
  Status RecoverPool(bool discard, std::span<const uint64_t> other_budgets = {});

  // Validates a session's cache domain; the first one creates the pool, recording `creator_uid` (the attaching
  // peer's uid; see CacheDomain::Admit) in the pool file so that it survives a restart. With
  // SetPrepareInBackground(true), the first Admit only checks that the pool's filesystem has room for its initial
  // active part (RESOURCE_EXHAUSTED as before) and returns at once: the pool is prepared in the background (below).
  Status Admit(const std::string& model_namespace, const Geometry& geometry, uid_t creator_uid = 0);

  // Pool preparation (issue 29 item 7: a pool of tens of GiB took 7-10 s per 16 GiB to allocate and register for
  // DMA, on the first Attach's path). In the background, a thread of this cache: creates the pool file with one grant
  // of each component active, tells the observers each grant (DMA registration) without the cache's lock, adopts
  // the pool (has_pool() turns true: matches and stores are served from here on), then grows it grant by grant up to
  // its initial active part, allocating and registering each grant without the lock and publishing it under the lock
  // (lookups never wait for a grant). A failure to create the pool is kept (preparation().error) and the next Admit
  // tries again; a grow that fails stops the growth where it is (the domain serves at that size, logged). Resize is
  // refused while a preparation runs; DropDomain and the destructor stop it (at the next grant) first. Off by
  // default (Admit creates the pool itself, as the tests of this class expect); the daemon turns it on.
  void SetPrepareInBackground(bool on);
  struct Preparation {
    bool preparing = false;     // a preparation runs (the pool may exist already and be growing)
    uint64_t ready_bytes = 0;   // active bytes so far (0 until the pool exists)
    uint64_t target_bytes = 0;  // the active part it grows to
    Status error;               // why the last preparation could not create the pool (OK otherwise)
    int64_t started_ms = 0;     // monotonic: when it began (0: none ran since the domain was set)
    int64_t served_ms = 0;      // monotonic: when the pool was adopted, its first grants served (0: not yet)
    int64_t done_ms = 0;        // monotonic: when it ended (0: not yet)
  };
  Preparation preparation() const;
  // What a request that needs the pool is answered while there is none: UNAVAILABLE with the preparation's progress
  // while it runs, the preparation's error when it failed, FAILED_PRECONDITION otherwise.
  Status PoolNotReady() const;
  // Waits up to `timeout` for a running preparation to end (at once when none runs); whether the pool exists.
  bool WaitForPreparation(std::chrono::milliseconds timeout) const;
  // The budget bytes this domain holds: its active bytes, or what a running preparation grows it to.
  uint64_t held_bytes() const;

  // Drops the cache domain and its pool (the pool file is deleted, its blocks are lost) so that the next Admit
  // fixes a new one. The caller guarantees that no session is attached and none can attach meanwhile (the
  // control service serializes Attach and this) and that no copy is in flight (Lifecycle::inflight() == 0); the
  // cache refuses with FAILED_PRECONDITION, saying what is left, while blocks are pinned or being stored (a
  // session's end still releasing them), and with `only_if_empty` while the pool holds committed blocks.
  // NOT_FOUND when no domain is set. On success `dropped_blocks` (optional) has the committed blocks lost.
  Status DropDomain(bool only_if_empty, uint64_t* dropped_blocks);
  // Changes whenever a pool is adopted: a data-plane session remembers the generation it attached under and is
  // refused once it differs (its geometry may not be the pool's any more).
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }

  bool has_pool() const;
  uint64_t block_bytes() const;
  uint8_t* SlotData(SlotId slot) const;  // has_pool() must hold
  uint64_t SlotBytes(SlotId slot) const;  // the slot's size (its component's); has_pool() must hold
  // Active slots in the pool (every component's; see Resize); 0 before it exists. No lock.
  uint32_t capacity_slots() const;
  // Slot ids are below this: every component's slots at the pool's maximum (its numbering; see Resize). 0 before
  // the pool exists.
  SlotId slot_id_end() const;
  // Active slots of component `component` (0 before the pool exists or for a component it does not have). No lock.
  uint32_t active_slots(size_t component) const;
  // Where component `component`'s active slots are (its sub-pool; slot ids in it are local, 0-based; `slots` is
  // its active capacity); nullopt before the pool exists or for a component the pool does not have.
  std::optional<PoolRegion> pool_region(size_t component = 0) const;

  // Elastic capacity. The pool is laid out for the budget (max_bytes) and holds memory for its active part only;
  // every capacity figure the cache reports (GetStats, pool_region, capacity_slots) is the active one.
  // Resize moves the active part towards `active_bytes` (per component Pool::ActiveSlotsFor: whole grants,
  // at least one, at most the layout) without moving any slot: a shrinking component evicts the committed,
  // unpinned blocks in the slots it gives back (their descendants with them; counted as evictions) and gives
  // back the grants that are then free; pinned, pending or unverified blocks hold it there (a later Resize
  // continues). A growing component's new grants are allocated, announced to the observers, then handed out.
  // Returns the active bytes reached (Σ active slots × slot bytes): more than asked when a shrink is held up.
  // FAILED_PRECONDITION without a pool; RESOURCE_EXHAUSTED (naming the file, the bytes and the filesystem) when a
  // grow cannot be allocated, the shrinks of this call kept.
  Result<uint64_t> Resize(uint64_t active_bytes);
  // Whether a Resize left a shrink held back (pinned, pending or unverified blocks above the size it asked for):
  // the indexes hand out no slot above that size meanwhile. The next Resize continues the shrink, or - asked for at
  // least the active size - lifts the hold.
  bool shrink_held() const;
  // Each component's active slots now, and Resize to exactly such a list (whole grants per component, as
  // ActiveSlots gives them; INVALID_ARGUMENT otherwise): what puts a pool back where it was, since Resize(bytes)
  // rounds each component down on its own and so need not give back the same sizes. ResizeSlots(ActiveSlots())
  // changes no size and lifts a held shrink.
  std::vector<uint32_t> ActiveSlots() const;
  Result<uint64_t> ResizeSlots(const std::vector<uint32_t>& target);
  // The pool's active bytes now, the most its active part may hold (every slot active; for a pool whose sub-pools
  // are sized by demand, layout 4, the budget it was laid out for: each sub-pool could hold all of it), and one grant
  // of each component active (the least Resize goes to); 0 without a pool.
  uint64_t active_bytes() const;
  uint64_t max_bytes() const;
  uint64_t min_bytes() const;
  // Sub-pools sized by demand (docs/hybrid.md "Pool and eviction"). The bytes stored into each component since the
  // pool was adopted (entries a hybrid store or a pull from a peer added; FULL blocks included), for a DemandMeter per
  // component; empty without a pool.
  std::vector<uint64_t> ComponentBytesStored() const;
  // Each sub-pool as PlanSubPools needs it (demand 0: the caller's meters give it), or empty when the domain's
  // split does not follow demand: no pool, one component, a layout fixed by the operator's shares or written before
  // (layout 3), a preparation running, or a held shrink not yet done.
  std::vector<SubPoolNeed> SubPoolNeeds() const;
  // The pool's components' first slot in the cache's slot numbering (what Match pins and Unpin takes), by component.
  std::vector<SlotId> component_bases() const;
  CacheDomain::View Domain() const { return domain_.Snapshot(); }

  // See PrefixIndex. Keys are the request's; slots and reservations refer to this cache's pool.
  // A hybrid geometry's Match is its hit rule (docs/hybrid.md): the longest prefix end e whose FULL blocks, windows
  // and states are all cached; with `pin` it pins all of them and appends their slots in the order of a Load's ids
  // (common/hybrid_ids.h LayoutIds(geometry, false, e)).
  size_t Match(std::span<const BlockKey> keys, bool pin, std::vector<SlotId>* pinned);
  // Unpins slots of any component (Match's, PinForCheck's).
  void Unpin(std::span<const SlotId> slots);

  // A hybrid store (all or none), as reserved: the FULL part as Reserve gives it, and per component c >= 1 the
  // keys it stores (sliding window: the request's last min(window, n) keys; state: the key before each boundary)
  // with one slot per key (cache numbering), kNoSlot where the entry is cached already.
  struct HybridReservation {
    PrefixIndex::Reservation full;
    std::vector<std::vector<BlockKey>> keys;  // [component], empty for component 0
    std::vector<std::vector<SlotId>> slots;   // [component], empty for component 0
    // OK when everything was reserved; otherwise nothing is (full.slots and slots empty) and this says why (as
    // Reservation::shortfall) with `component` the one that could not be reserved (0: FULL).
    StatusCode shortfall = StatusCode::kOk;
    size_t component = 0;
    // With `may_wait`: nothing was reserved or evicted because the store would have to evict entries the next tier
    // does not hold yet, or its sub-pools are full of entries pinned by write-backs in flight; retry after the
    // write-back (shortfall OK).
    bool wait_for_write_back = false;
  };
  // `boundaries` are the request's state boundaries (validated: 1..keys.size(), increasing). Each sliding window
  // takes entries for the last `window_keys` keys, or for its last min(window_blocks, keys.size()) when it is 0
  // (validated: 0, or at least that for every window and at most keys.size()). With `may_wait` and StoreWaitMs() > 0
  // (a next tier that takes write-backs and keeps up) a store that would lose unwritten entries of any component,
  // or that finds a sub-pool full of entries pinned by write-backs, reserves nothing and says wait_for_write_back.
  HybridReservation ReserveHybrid(const BlockKey& parent, std::span<const BlockKey> keys,
                                  std::span<const uint32_t> boundaries, uint32_t window_keys = 0,
                                  bool may_wait = false);
  // Publishes a hybrid store after every copy completed; `checksums[c]` has one content checksum per reserved slot
  // of component c (in r.full.slots / r.slots[c] order, kNoSlot entries skipped).
  void CommitHybrid(const BlockKey& parent, std::span<const BlockKey> keys, const HybridReservation& r,
                    const std::vector<std::vector<uint64_t>>& checksums);
  // Returns a hybrid store's reserved slots (a copy failed, or the session ended).
  void AbortHybrid(const HybridReservation& r);
  // A hybrid prefix pulled from a peer (the cluster tier; cache_hybrid_pull.cc). Reserves, all or none, the FULL
  // blocks `keys` under `parent` (as Reserve: the leading ones cached here are skipped; a FULL part cut short by the
  // pool or by another store of the same keys, or a parent no longer committed, refuses the whole: shortfall says
  // why, full.parent_refused the latter) and per component c >= 1 one entry per key of `entry_keys[c]` (kNoSlot where
  // it is cached). `entry_keys` has one list per component, entry_keys[0] ignored. Unlike ReserveHybrid the caller
  // names the entries: the peer's hit end decides them, and a window may reach back before `keys` (into the prefix
  // held here). Nothing is matchable until CommitPulledHybrid; AbortHybrid gives it all back. While a next tier's
  // write-back serves (StoreWaitMs() > 0) it evicts only what that tier holds: a pull that would evict anything else
  // is refused (RESOURCE_EXHAUSTED), nothing else evicted.
  HybridReservation ReservePulledHybrid(const BlockKey& parent, std::span<const BlockKey> keys,
                                        const std::vector<std::vector<BlockKey>>& entry_keys);
  // Publishes a pulled set after every byte of it verified (as CommitHybrid; its events' cause is kPulled, and every
  // entry joins its component's most recently used end). `checksums[c]` as CommitHybrid's.
  void CommitPulledHybrid(const BlockKey& parent, std::span<const BlockKey> keys, const HybridReservation& r,
                          const std::vector<std::vector<uint64_t>>& checksums);
  // A FULL store's reservation (PrefixIndex::Reserve). With `may_wait` and StoreWaitMs() > 0 it evicts only blocks
  // the next tier holds: when it would have to evict others, the answer has `dirty_only` set and the caller waits
  // (retries) for the write-back, up to StoreWaitMs(), before it reserves without `may_wait`.
  PrefixIndex::Reservation Reserve(const BlockKey& parent, std::span<const BlockKey> keys, bool may_wait = false);
  // Publishes reserved slots after their bytes are complete. `parent` and `keys` are the request's (as given
  // to Reserve) and `first` the index of reservation.slots[0] in them; `content_checksums[i]` is slots[i]'s
  // BlockChecksum.
  // `cause`: what the KV event stream reports (an engine's store, a promotion from SSD, a pull from a peer).
  void Commit(const BlockKey& parent, std::span<const BlockKey> keys, size_t first, std::span<const SlotId> slots,
              std::span<const uint64_t> content_checksums, BlockEvent::Cause cause = BlockEvent::kStored);
  void Abort(std::span<const SlotId> slots);

  // The observer port (cache_observer.h): the pool's memory, one region per active grant (a grant of component c:
  // PoolRegion{its first slot's bytes, its slots x slot bytes, c's slot bytes, its slots}), and the blocks. Each
  // observer is told PoolRegionAdded for each grant that becomes active: every active grant as soon as a pool exists
  // (created by the first Admit, or re-attached by RecoverPool; at once, in AddObserver, when it exists already), and
  // each grant a Resize grows into, after its memory is allocated and before any of its slots is handed out;
  // PoolRegionRemoved for each grant that stops being active: after its slots were released and before its memory is
  // returned (Resize), and every active grant before a dropped pool is unmapped (DropDomain); each exactly once per
  // added. Both run under the cache's lock - except a background preparation's (SetPrepareInBackground), which tells
  // its grants without it, before any of their slots is handed out - so that no session uses a grant before the
  // observers are done with it (e.g. DMA registration); they must not call back into the cache. A grant a Resize
  // grows into is given back when an observer refused it (the Resize answers that error); the grants of a new or
  // re-attached pool are kept either way (the observer keeps the error for the sessions it concerns).
  // BlockChanged: see CacheObserver. An observer may be added or removed at any time, a background preparation
  // running or not: one added is told every grant active or already announced (its own refusal of one is its to
  // keep), then each new one; `observer` is kept until RemoveObserver, which returns once no call into it runs, and
  // after which it is never called again (an announcement in flight on another thread ends first).
  void AddObserver(std::shared_ptr<CacheObserver> observer);
  void RemoveObserver(const CacheObserver* observer);

  // Checking block contents (block_verifier.h). The blocks RecoverPool restored unverified, parents first;
  // the first call takes them, later ones get none. A non-empty answer starts the restart verification, which
  // EndVerification ends: DropDomain is refused in between (the verifier reads the pool's bytes).
  std::vector<Pool::Committed> TakeUnverified();
  void EndVerification();
  // Keeps the blocks of `batch` that are still unverified: one dropped with a failed ancestor has lost its slot
  // (which a store may be reusing), so it must be neither read nor settled.
  void KeepUnverified(std::vector<Pool::Committed>* batch) const;
  // Whether the slot's bytes still have `content_checksum` (reads the whole block, without the lock: the
  // caller holds the slot, unverified or pinned). has_pool() must hold.
  bool ContentMatches(SlotId slot, uint64_t content_checksum) const;
  // Checks a block restored from a layer-major pool, which the index still holds unverified, and rewrites it in
  // today's slot order (Pool::RewriteInSlotOrder: false, nothing changed, when its bytes do not match). Only the
  // verifier calls it, for blocks KeepUnverified kept: nothing else reads or reuses their slots meanwhile.
  bool RewriteInSlotOrder(const Pool::Committed& block);
  // A re-attached pool of sharded slots written before the rank-major order (Pool::AdoptRankMajorSlots): its header
  // flagged, so that the older release refuses it from here on. CacheSet::RecoverPools calls it once every domain
  // is kept and before any block is checked, rewritten or stored (a start refused before that leaves the file to
  // the release that wrote it). OK and nothing written for any other pool, or none.
  Status AdoptRankMajorSlots();
  // A slot this caller reserved and filled with a block in the layer-major order of an older release (a promotion
  // from SSD), checked against `layer_major_checksum` and rewritten in today's order before it is committed: the
  // bytes' new content checksum, or nullopt when they do not match.
  std::optional<uint64_t> RewriteReservedInSlotOrder(SlotId slot, uint64_t layer_major_checksum);
  // The content checksum the slot entry of a committed FULL block records (nullopt: no valid entry). The caller
  // pins the slot (or holds it otherwise) so that the entry cannot change while it uses the answer.
  std::optional<uint64_t> EntryChecksum(SlotId slot) const;
  // A committed block pinned for a check, with what its slot entry says (nullopt: the entry is corrupt).
  struct CheckTarget {
    SlotId slot;
    std::optional<uint64_t> content_checksum;
  };
  // Pins the committed blocks in slots [begin, end) (clamped to the capacity) and reads their slot entries.
  std::vector<CheckTarget> PinForCheck(SlotId begin, SlotId end);
  // Ends checks: `passed` unverified blocks become matchable (parents first); `unpin` are unpinned; `failed`
  // blocks (pinned or unverified) are taken out of the index with their descendants, their slot entries cleared,
  // and counted in data_loss_blocks. Returns the blocks dropped, descendants included.
  size_t FinishChecks(std::span<const SlotId> passed, std::span<const SlotId> unpin, std::span<const SlotId> failed);

  // The next tier (the SSD tier, daemon/tiers/ssd/ssd_tier.h): which committed blocks it also holds, so that an
  // eviction loses nothing. The unit is (key, component): FULL blocks and, in a hybrid domain, window and state
  // entries alike, each by its slot. Each slot is "not on the next tier", "being written" or "on the next tier"; a
  // slot's mark is cleared when its entry leaves (evicted, dropped) or the slot is reserved again. Nothing here is
  // active until AttachNextTier.
  struct WriteBackBlock {
    SlotId slot = 0;
    BlockKey key, parent;          // parent: zero for a prompt's first block, and for window and state entries
    uint64_t content_checksum = 0; // the slot entry's BlockChecksum
    bool cold = false;             // from the cold end (not the commit queue): unpinned to the cold end
    uint32_t component = 0;        // 0: FULL; else the hybrid component whose sub-pool holds the slot
  };
  // From now on evictions are counted as written (the next tier had the block) or unwritten, and with
  // `queue_commits` every block Commit or CommitHybrid publishes is queued for TakeWriteBack (oldest first) as well,
  // and one whose write failed is queued again. Blocks the next tier holds are evicted before the others
  // (PrefixIndex::SetClean; in a hybrid domain's other sub-pools ComponentIndex::SetClean, after the unanchored
  // entries), and a store of a FULL-only domain that would have to evict a block it does not hold may wait up to
  // `store_wait_ms` for the write-back (StoreWaitMs, Reserve's `may_wait`; 0: never waits). With `hybrid` the next
  // tier takes hybrid domains (TierCapabilities::hybrid); without it a hybrid domain has no next tier (TakeWriteBack
  // hands out none of its blocks).
  void AttachNextTier(bool queue_commits, int64_t store_wait_ms = 0, bool hybrid = false);
  // Whether the next tier's writes succeed: while they fail (a full or failing drive), no store waits for them.
  void SetWriteBackHealthy(bool healthy);
  // Whether the next tier writes this domain's blocks at all: not for blocks its slots cannot hold (another model) or
  // a namespace whose owner could not be recorded; a store would wait for a write-back that never comes.
  void SetWriteBackServed(bool served);
  // How long a store may wait for the write-back before it evicts blocks the next tier does not hold (dropping
  // them from the node): 0 without a next tier, for a hybrid geometry (its stores, all or none over the sub-pools,
  // do not wait: they evict clean entries first), while write-back fails, or while the next tier does not write this
  // domain (SetWriteBackServed).
  int64_t StoreWaitMs() const;
  // Whether waiting for the write-back can make room without losing a block: a write is in flight, or a block or
  // entry the next tier does not hold yet is evictable (its write makes it clean). False when what stands in the way
  // is only pins (engines' loads): a promotion then does not wait (SsdTier).
  bool WriteBackMayMakeRoom() const;
  // Counts a store that waited for the write-back (`expired`: one whose wait ran out, so that it evicted what it
  // had to).
  void CountStoreWait(bool expired);
  // A block of the next tier's unit: its key and component.
  struct NextTierKey {
    BlockKey key;
    uint32_t component = 0;
    friend bool operator==(const NextTierKey&, const NextTierKey&) = default;
  };
  // The blocks Match hit since the last call that the next tier holds too (each once; a hybrid domain's: the pieces
  // of pinned matches): the next tier marks them used, so that a block DRAM always serves (a hot system prompt)
  // keeps a recent copy there.
  std::vector<NextTierKey> TakeTouched();
  // Pins and returns up to `max_blocks` committed blocks the next tier does not hold yet, marking them "being
  // written": first those the commit queue holds (in commit order), then the cold end of each component's eviction
  // order in the order it will be evicted - FULL: each cold leaf, then the ancestors that become cold leaves when it
  // goes (up to one with other children); windows and states: unanchored entries, then clean, then dirty, least
  // recently used first - walking at most a share of `window` blocks, written or not, proportional to the component's
  // slots (all of it for a FULL-only domain; at most 16384 per call: the walk holds the lock), and taking at most the
  // same share of `max_blocks` from each component's cold end. A FULL block on the next tier is reached there through
  // the DRAM prefix above it, which eviction (leaves first) keeps longest. The caller writes each and calls
  // EndWriteBack for each, exactly once. Empty without a pool, before AttachNextTier, and when nothing changed in the
  // index since a walk found nothing (then at most one walk every 100 ms).
  // `still_on_next` (optional) is asked, under the cache's lock, whether a cold block marked as on the next tier
  // still is (the next tier may have dropped it to make room); one that is not is taken again.
  std::vector<WriteBackBlock> TakeWriteBack(
      size_t max_blocks, size_t window,
      const std::function<bool(const BlockKey&, uint32_t component)>& still_on_next = {});
  // Ends a write of TakeWriteBack's: `stored` marks the block as on the next tier. Unpins it (a cold one goes back to
  // the cold end of the eviction order: it was not used).
  void EndWriteBack(const WriteBackBlock& block, bool stored);
  // Blocks just committed from the next tier (promoted): they are on it already. Slots of any component.
  void MarkOnNextTier(std::span<const SlotId> slots);

  // Promotion of a hybrid domain from the next tier (docs/ssd.md, "Hybrid domains"): the hit rule holds across the
  // tiers. ReservePromotion finds, under the cache's lock, the longest prefix end e of `keys` at which FULL [0, e),
  // each window [e - w, e) and each state at e are each in DRAM or on the next tier (`on_next(c, j)`: whether it holds
  // keys[j] of component c, asked under the cache's lock; for FULL it must check that the block hangs under
  // keys[j - 1]); when e is beyond DRAM's own hit, it pins the pieces of e that DRAM holds (held) and reserves pending
  // slots for the others (pieces): FULL keys [full_from, e) under the DRAM prefix, and the window and state entries.
  // All or nothing: `end` is 0 (nothing reserved or pinned) when no such e exists or a sub-pool cannot take its part
  // (`refused` then says how many pieces would have been read). The pieces are not matchable until CommitPromoted.
  // While the next tier's write-back serves (StoreWaitMs() > 0) a promotion evicts only what the next tier holds:
  // one that could go on only by evicting a block or entry it does not hold yet (or finds a sub-pool full of
  // entries pinned by write-backs in flight) reserves nothing, evicts nothing and says wait_for_write_back (the
  // caller retries once the write-back moved on, or answers from DRAM): a read never costs a block the node accepted.
  struct HybridPromotion {
    size_t end = 0;
    size_t full_from = 0;                     // FULL keys [full_from, end) are read: keys[0], slots[0]
    std::vector<std::vector<BlockKey>> keys;  // [component] the pieces read (FULL: in prefix order)
    std::vector<std::vector<size_t>> at;      // [component] each piece's index in `keys` of the request
    std::vector<std::vector<SlotId>> slots;   // [component] their pending slots (cache numbering)
    std::vector<SlotId> held;                 // DRAM's pieces of `end`, pinned until CommitPromoted
    size_t refused = 0;
    bool wait_for_write_back = false;         // end 0: it would have evicted what the next tier does not hold
    size_t pieces() const;                    // Σ slots[c].size()
  };
  HybridPromotion ReservePromotion(std::span<const BlockKey> keys,
                                   const std::function<bool(size_t component, size_t j)>& on_next);
  // Ends a ReservePromotion after the reads: `ok[c][i]` says whether piece i of component c was read and verified
  // (kPieceVerified, or kPieceRewritten: verified and rewritten from an older release's slot order, so the next tier
  // does not hold it in today's order), `checksums[c][i]` its content checksum (what it was stored with, or its new
  // one). Commits the FULL pieces up to the first that failed (the rest cannot hang under it) and every window and
  // state piece that verified, anchored where its FULL block is now in DRAM; gives back the other slots; marks what
  // it committed as on the next tier (clean), except the rewritten pieces (written back like new ones); unpins the
  // held pieces. A match then finds the longest end that holds. Returns the pieces committed.
  static constexpr uint8_t kPieceVerified = 1;
  static constexpr uint8_t kPieceRewritten = 3;
  size_t CommitPromoted(std::span<const BlockKey> keys, const HybridPromotion& promotion,
                        const std::vector<std::vector<uint8_t>>& ok,
                        const std::vector<std::vector<uint64_t>>& checksums);
  struct WriteBackStats {
    uint64_t evicted_written = 0;    // evictions of blocks the next tier holds
    uint64_t evicted_unwritten = 0;  // evictions of blocks it did not hold: lost from the node
    uint64_t writing = 0;            // blocks being written now
    uint64_t queued = 0;             // blocks in the commit queue
    uint64_t store_waits = 0;        // stores that waited for the write-back before evicting
    uint64_t store_wait_expired = 0; // of those, stores whose wait ran out (they evicted unwritten blocks)
  };
  WriteBackStats write_back_stats() const;

  // Under the cache's lock: calls `mark` (what the event stream records as the point the snapshot is consistent
  // with), then `each(key, parent, component)` for every committed (matchable) FULL block and, for a hybrid geometry,
  // every committed window and state entry (parent zero). Nothing without a pool. `geometry` (optional) gets the
  // domain's (nullopt without one).
  void SnapshotBlocks(const std::function<void()>& mark,
                      const std::function<void(const BlockKey& key, const BlockKey& parent, uint8_t component)>& each,
                      std::optional<Geometry>* geometry = nullptr, std::string* model_namespace = nullptr) const;

  // Capacities are active slots (see Resize).
  struct ComponentStats {
    ComponentKind kind = ComponentKind::kFull;
    uint64_t slot_bytes = 0, capacity = 0, used = 0, pinned = 0, evicted = 0, unanchored = 0;
  };
  struct Stats {
    uint64_t capacity = 0, used = 0, pinned = 0, blocks = 0, evicted = 0;
    uint64_t unverified = 0;  // restored blocks whose bytes are not verified yet (not matchable)
    std::string backing;
    std::vector<ComponentStats> components;  // hybrid geometries: one per component, component 0 first
  };
  Stats GetStats() const;
  CacheCounters& counters() { return counters_; }

 private:
  // RESOURCE_EXHAUSTED (naming the pool file and what to do) when the pool's filesystem cannot hold the budget.
  Status CheckPoolSpace() const;
  Status CreatePoolLocked(const std::string& model_namespace, const Geometry& geometry, uid_t creator_uid)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Installs `pool` and its index and publishes has_pool_; with `announce`, tells the listener every active grant
  // (else the caller's background thread does); with `new_generation`, sessions of an earlier pool are told apart
  // (not for a background preparation's pool: the sessions attached meanwhile are of its domain).
  void AdoptPoolLocked(std::unique_ptr<Pool> pool, std::unique_ptr<PrefixIndex> index,
                       std::vector<std::unique_ptr<ComponentIndex>> parts, bool announce = true,
                       bool new_generation = true) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A re-attached pool (RecoverPool, SetPrepareInBackground on): its indexes hand out no slot until the grant holding
  // it is registered; a thread tells the listener each active grant and lifts the limit behind it (RegisterRestored).
  void StartRegisteringLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RegisterRestored();
  // The preparation thread's body (see SetPrepareInBackground) and its stop: StopPreparation asks it to end at the
  // next grant and joins it; call it without mu_.
  void Prepare(std::string model_namespace, Geometry geometry, uid_t creator_uid, uint64_t target_bytes);
  // Grows the adopted pool grant by grant towards `target` active slots per component (the slow parts without mu_).
  void GrowInBackground(const std::vector<uint32_t>& target);
  void StopPreparation() ABSL_LOCKS_EXCLUDED(mu_);
  // RESOURCE_EXHAUSTED (as CheckPoolSpace) when the pool's filesystem has less than `bytes` free.
  Status CheckSpaceFor(uint64_t bytes) const;
  // Tells `listener` (when set) each grant of component c in its slots [from, to) (grant boundaries).
  void AnnounceGrantsLocked(const std::function<void(const PoolRegion&)>& listener, size_t c, uint32_t from,
                            uint32_t to) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells the `added` listener each grant of component c in [from, to), up to the first it refuses: that error, with
  // `*reached` the end of the grants it was told (the refused one included). AnnounceAllAddedLocked tells every one
  // whatever it answers (a pool that keeps its grants: the listener keeps its errors for the sessions concerned).
  Status AnnounceAddedLocked(size_t c, uint32_t from, uint32_t to, uint32_t* reached) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AnnounceAllAddedLocked(size_t c, uint32_t from, uint32_t to) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Resize to `target` active slots per component (whole grants, validated by the callers).
  Result<uint64_t> ResizeLocked(const std::vector<uint32_t>& target) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Publishes the pool's active capacities to the lock-free readers (capacity_slots, active_slots).
  void PublishActiveLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The component index of component c >= 1, and a slot's component and its slot there.
  ComponentIndex& Part(size_t c) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return *parts_[c - 1]; }
  size_t ComponentOfLocked(SlotId slot) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return pool_->ComponentOf(slot); }
  SlotId LocalLocked(size_t c, SlotId slot) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return slot - pool_->sub_pool(c).base;
  }
  size_t HybridMatchLocked(std::span<const BlockKey> keys, bool pin, std::vector<SlotId>* pinned)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UnpinLocked(std::span<const SlotId> slots) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A FULL block left the index (evicted or dropped): the other components' entries of its key are unanchored.
  void UnanchorLocked(const BlockKey& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::atomic<uint64_t> budget_bytes_;  // changed only while no domain is set (SetBudget)
  std::atomic<uint64_t> initial_active_bytes_{Pool::kAllActive};  // likewise
  const std::string pool_path_;
  const PoolSplit split_;
  CacheDomain domain_;
  CacheCounters counters_;
  mutable Mutex mu_;
  // Set under mu_ before has_pool_ turns true, reset (DropDomain) only while no session exists; read without
  // the lock only after has_pool() (SlotData), by sessions of the current generation.
  std::unique_ptr<Pool> pool_;
  std::unique_ptr<PrefixIndex> index_ ABSL_GUARDED_BY(mu_);  // component 0 (FULL)
  std::vector<std::unique_ptr<ComponentIndex>> parts_ ABSL_GUARDED_BY(mu_);  // components 1.. of a hybrid geometry
  std::atomic<bool> has_pool_{false};
  std::atomic<uint64_t> generation_{0};
  std::atomic<uint32_t> capacity_{0};  // the pool's active slots (capacity_slots without a lock)
  std::array<std::atomic<uint32_t>, Geometry::kMaxComponents> active_slots_{};  // per component, without a lock
  PoolLock pool_lock_;  // taken by RecoverPool (at start, before any Attach), then used under mu_
  // Every grant announcement goes through the registry (observer_registry.h), under mu_ or, in a background
  // preparation, without it: pool_listener_/pool_gone_listener_ call it and never change after construction.
  const std::shared_ptr<ObserverRegistry> registry_ = std::make_shared<ObserverRegistry>();
  std::function<Status(const PoolRegion&)> pool_listener_ ABSL_GUARDED_BY(mu_);
  std::function<void(const PoolRegion&)> pool_gone_listener_ ABSL_GUARDED_BY(mu_);
  // The observers (AddObserver), for the block events (the registry has them too, for the grants).
  std::vector<std::shared_ptr<CacheObserver>> observers_ ABSL_GUARDED_BY(mu_);
  bool block_observers_ ABSL_GUARDED_BY(mu_) = false;  // some observer wants_blocks()
  void RebuildListenersLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string event_namespace_ ABSL_GUARDED_BY(mu_);  // the domain's, for the events (set when a pool is adopted)
  uint32_t event_tokens_per_block_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<Geometry> event_geometry_ ABSL_GUARDED_BY(mu_);
  bool dropping_ ABSL_GUARDED_BY(mu_) = false;  // FinishChecks drops component entries: their removal is a drop
  // Tells the observers that want blocks.
  void ReportBlockLocked(BlockEvent::Kind kind, const BlockKey& key, bool request_end,
                         BlockEvent::Cause cause = BlockEvent::kStored, const BlockKey& parent = BlockKey{},
                         uint8_t component = 0)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The next tier's marks (see AttachNextTier), one per slot of every component: kNotOnNext, kWriting, kOnNext.
  bool next_tier_ ABSL_GUARDED_BY(mu_) = false;
  bool next_tier_hybrid_ ABSL_GUARDED_BY(mu_) = false;  // it takes hybrid domains too
  // Whether this domain has a next tier (attached, and hybrid if the domain is).
  bool NextTierLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return next_tier_ && (parts_.empty() || next_tier_hybrid_);
  }
  bool queue_commits_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<uint8_t> on_next_ ABSL_GUARDED_BY(mu_);
  std::deque<SlotId> commit_queue_ ABSL_GUARDED_BY(mu_);
  uint64_t evicted_written_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t evicted_unwritten_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t writing_ ABSL_GUARDED_BY(mu_) = 0;
  // Bumped by whatever may change what TakeWriteBack finds (a commit, an eviction, a match, a failed write);
  // idle_epoch_ is its value when a walk of the cold end last found nothing to write.
  uint64_t next_tier_epoch_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t idle_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t last_walk_ms_ ABSL_GUARDED_BY(mu_) = 0;
  // A block left its slot (evicted, dropped) or the slot was reserved again: its next-tier mark goes.
  void ForgetNextTierLocked(SlotId slot, bool evicted) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sets a committed slot's next-tier mark and its clean mark in its component's index (clean: on the next tier).
  void SetMarkLocked(SlotId slot, uint8_t mark) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the slot (any component) holds a committed block; pins it when it does (PinCommittedLocked).
  bool CommittedLocked(SlotId slot) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool PinCommittedLocked(SlotId slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Write policy all: queues a just-committed slot (any component) for TakeWriteBack.
  void QueueCommitLocked(SlotId slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t StoreWaitMsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool WriteBackMayMakeRoomLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues Match's hits that are on the next tier for TakeTouched.
  void NoteHitsLocked(std::span<const SlotId> slots) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<uint8_t> touched_ ABSL_GUARDED_BY(mu_);     // per slot: queued in touch_queue_
  std::vector<uint64_t> component_bytes_stored_ ABSL_GUARDED_BY(mu_);  // per component (ComponentBytesStored)
  std::vector<SlotId> touch_queue_ ABSL_GUARDED_BY(mu_);
  int64_t store_wait_ms_ ABSL_GUARDED_BY(mu_) = 0;
  bool write_back_healthy_ ABSL_GUARDED_BY(mu_) = true;
  bool write_back_served_ ABSL_GUARDED_BY(mu_) = true;
  uint64_t store_waits_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t store_wait_expired_ ABSL_GUARDED_BY(mu_) = 0;
  // Pool preparation (SetPrepareInBackground). prepare_thread_ is started under mu_ (Admit) and joined under
  // thread_mu_ alone (StopPreparation; the thread takes mu_); pool_ is not replaced while it runs.
  bool prepare_in_background_ ABSL_GUARDED_BY(mu_) = false;
  Preparation preparation_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> prepare_stop_{false};
  mutable std::condition_variable pool_cv_;  // signalled when a preparation adopts its pool, grows or ends
  Mutex thread_mu_ ABSL_ACQUIRED_AFTER(mu_);
  std::thread prepare_thread_ ABSL_GUARDED_BY(thread_mu_);
  std::vector<Pool::Committed> unverified_ ABSL_GUARDED_BY(mu_);  // restored by RecoverPool, for TakeUnverified
  bool verifying_ ABSL_GUARDED_BY(mu_) = false;                  // between TakeUnverified and EndVerification
};

}  // namespace flexkv
