// RequestHandlers: what the daemon does with each validated ring request - Match (and pin), Release, Load, Store -
// against the cache, the session's handle table and KV registrations, and the copy scheduler; every answer is
// built by CompletionBuilder and posted through the session (RequestSession::Post). The ring side - taking
// descriptors off the submit ring, posting to the completion ring - is DataPlane's.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <memory>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"
#include "common/ring_layout.h"
#include "daemon/cache/cache.h"
#include "daemon/dataplane/completion_builder.h"
#include "daemon/dataplane/copy_scheduler.h"
#include "daemon/dataplane/handle_table.h"
#include "daemon/dataplane/session_kv.h"
#include "daemon/lifecycle/lifecycle.h"
#include "daemon/metrics/request_metrics.h"
#include "daemon/tiers/dram/dram_tier.h"
#include "flexkv/geometry.h"

namespace flexkv {

class TierSet;

// Bounds on pins (docs/protocol.md "Pins").
struct PinPolicy {
  double max_session_share = 0.5;  // of the pool's slots that one session may hold pinned, in (0, 1]
  int64_t lease_ms = 10000;        // pins lapse after this long without renewal; 0: never
};

// A session as the handlers see it: its handles, its KV registrations, and where its completions go.
class RequestSession {
 public:
  // `cache`: the session's cache domain, and `tier` its DRAM pool (both outlive the session); a session sees only
  // that domain's blocks. `pool_generation`: cache->generation() when the session was admitted; requests are
  // refused once it changed (an admin dropped the domain the session attached to). `store_access`: OK when the
  // session may store, else the error each of its Stores is answered with (decided once at Attach, NamespaceAccess);
  // `prefetch_access` the same for a Prefetch that would pull from peers (it stores what it pulls).
  RequestSession(uint64_t id, const Geometry& geometry, Cache* cache, const DramTier* tier, uint64_t pool_generation,
                 Status store_access = Status::Ok(), Status prefetch_access = Status::Ok())
      : id_(id),
        geometry_(geometry),
        cache_(cache),
        tier_(tier),
        pool_generation_(pool_generation),
        store_access_(std::move(store_access)),
        prefetch_access_(std::move(prefetch_access)) {
    for (size_t c = 0; c < geometry.component_count(); ++c) {
      kv_.push_back(std::make_unique<SessionKv>(id, geometry.Component(c)));
    }
  }
  virtual ~RequestSession() = default;

  // Posts a completion to the session's client; dropped once the session ended. Thread-safe.
  virtual void Post(const CompletionDescriptor& completion) = 0;
  // True once the session ended (EndSession): no more completions, pins go back.
  virtual bool ended() const = 0;

  uint64_t id() const { return id_; }
  const Geometry& geometry() const { return geometry_; }
  Cache& cache() const { return *cache_; }
  const DramTier* tier() const { return tier_; }
  const Status& store_access() const { return store_access_; }
  const Status& prefetch_access() const { return prefetch_access_; }
  // The KV buffers of geometry component `component` (< geometry().component_count(); 0 for full attention).
  SessionKv& kv(size_t component = 0) { return *kv_[component]; }
  // Blocks registered per component (hybrid sessions), and the least of them; 0 with the reason in `*missing`
  // while a component has none.
  uint32_t RegisteredBlocks(std::vector<uint32_t>* per_component, std::string* missing) const;
  uint64_t pinned_blocks() const;

  // CUDA layer-event sets (RegisterLayerEvents): `ranks` holds one opened LayerEvents per TP rank, indexed by rank.
  // Returns the set's id (never 0, never reused within the session). RESOURCE_EXHAUSTED beyond kMaxEventSets.
  static constexpr size_t kMaxEventSets = 16;  // an engine double-buffers with two; each set holds open events
  Result<uint32_t> AddEventSet(std::vector<std::shared_ptr<LayerEvents>> ranks);
  // Forgets set `id` (NOT_FOUND naming the sets there are when it is unknown). A load recording it keeps its events
  // open until its copy ends; the set id is free at once.
  Status ReleaseEventSet(uint32_t id);
  size_t event_sets() const;

 private:
  friend class RequestHandlers;
  const uint64_t id_;
  const Geometry geometry_;
  Cache* const cache_;
  const DramTier* const tier_;
  const uint64_t pool_generation_;
  const Status store_access_;
  const Status prefetch_access_;
  std::vector<std::unique_ptr<SessionKv>> kv_;  // one per geometry component
  // Takes set `id` for the load `user_data`: NOT_FOUND when unknown, FAILED_PRECONDITION when another load uses it.
  Result<std::vector<std::shared_ptr<LayerEvents>>> TakeEventSet(uint32_t id, uint64_t user_data);
  // The load that took set `id` ended (or never started): the set may serve the next load.
  void PutEventSet(uint32_t id);
  std::string EventSetIdsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable Mutex mu_;
  HandleTable handles_ ABSL_GUARDED_BY(mu_);
  struct EventSet {
    std::vector<std::shared_ptr<LayerEvents>> ranks;  // by TP rank
    bool busy = false;                                // a load in flight records it
    uint64_t busy_with = 0;                           // that load's user_data (its ticket id)
  };
  std::map<uint32_t, EventSet> event_sets_ ABSL_GUARDED_BY(mu_);
  uint32_t next_event_set_ ABSL_GUARDED_BY(mu_) = 1;
};

class RequestHandlers {
 public:
  // Every pointer outlives the handlers; `metrics` is where requests' times and errors are counted. Each request
  // works on its session's cache domain (RequestSession::cache).
  // `tiers` (optional): the tiers below DRAM. A Match whose DRAM prefix ends early continues into those that promote
  // on match (MatchThroughTiers); it is then answered once the promoted blocks are in DRAM, on the tier's thread. A
  // Prefetch pulls the blocks after its local prefix from the tier that pulls on prefetch; without one it is
  // answered with the local prefix alone.
  RequestHandlers(Lifecycle* lifecycle, CopyScheduler* copies, RequestMetrics* metrics,
                  uint32_t max_blocks_per_request, PinPolicy pins = {}, const TierSet* tiers = nullptr);

  // Answers `d` (copied off the session's submit ring at `taken_ns`, monotonic; not yet validated; its keys and
  // block ids are in `arena`, the session's payload arena, which the client may be writing). Release and a Match
  // served from DRAM are answered before it returns; a Match promoting blocks from SSD once they are in DRAM; Load
  // and Store once their copy ends, on a copy thread. Ring poller only.
  void Handle(const std::shared_ptr<RequestSession>& session, std::span<const uint8_t> arena, const SubmitDescriptor& d,
              int64_t taken_ns);
  // Answers `d` with `status` (an error).
  void Fail(RequestSession& session, const SubmitDescriptor& d, int64_t taken_ns, const Status& status);
  // The session ended (after ended() turned true): its handles go, their pins with them (after any load still
  // copying from them).
  void EndSession(RequestSession& session);
  // The session's pin lease ran out (the poller decides: PinLease): its held handles go, their pins with them
  // (after any load still copying from them), and a later Load or Release of one is answered FAILED_PRECONDITION
  // "pins lapsed". The session stays attached; its next Match pins again. Returns what lapsed.
  struct Lapsed {
    size_t handles = 0;
    size_t blocks = 0;  // unpinned now
  };
  Lapsed LapsePins(RequestSession& session);
  // The most blocks one session may hold pinned: max_session_share of its domain's pool slots, at least 1.
  uint64_t SessionPinCap(const RequestSession& session) const;

  // Stores waiting for the SSD tier's write-back: a store that could go on only by evicting DRAM blocks SSD does
  // not hold yet waits (Cache::StoreWaitMs, --ssd-store-wait) instead, its domain's later stores behind it, and is
  // retried here (at most once a millisecond) until it reserves without such an eviction, its wait runs out (it
  // then evicts them, counted as unwritten), or its session ends. Returns whether one still waits: the poller then
  // polls again within a millisecond. Ring poller only.
  bool RetryWaitingStores(int64_t now_ns);
  // The poller stops: every waiting store is answered UNAVAILABLE.
  void AbandonWaitingStores();

 private:
  void Match(const std::shared_ptr<RequestSession>& sp, const SubmitDescriptor& d, int64_t taken_ns,
             const std::vector<BlockKey>& keys);
  // Counts a match of `hit` blocks and answers it, holding `slots` (pinned with kMatchFlagPin) under a new handle.
  void AnswerMatch(RequestSession& s, const SubmitDescriptor& d, int64_t taken_ns, size_t hit, std::vector<SlotId> slots);
  void Release(RequestSession& s, const SubmitDescriptor& d, int64_t taken_ns);
  // The local prefix, then (with a tier that pulls on prefetch; full attention unless it moves hybrid blocks) a pull of
  // the rest; answered when the pull ended, on the tier's thread, counted in flight meanwhile (it writes into the
  // pool). With such a tier, a session that may not store is refused (prefetch_access): a pull stores into its
  // namespace.
  void Prefetch(const std::shared_ptr<RequestSession>& sp, const SubmitDescriptor& d, int64_t taken_ns,
                std::vector<BlockKey> keys);
  // A Load copies the handle's blocks [first_block, count) into `ids` (the engine holds those before first_block).
  void Load(const std::shared_ptr<RequestSession>& s, const SubmitDescriptor& d, int64_t taken_ns,
            std::vector<uint32_t> ids);
  void Store(const std::shared_ptr<RequestSession>& s, const SubmitDescriptor& d, int64_t taken_ns,
             std::vector<BlockKey> keys, std::vector<uint32_t> ids);
  // Load and Store of a hybrid geometry (docs/hybrid.md): one copy per component, joined; a Load moves only what the
  // end needs past first_block, a Store each window's ids for its last window_keys keys; stores all or none.
  void LoadHybrid(const std::shared_ptr<RequestSession>& s, const SubmitDescriptor& d, int64_t taken_ns,
                  std::vector<uint32_t> ids);
  void StoreHybrid(const std::shared_ptr<RequestSession>& s, const SubmitDescriptor& d, int64_t taken_ns,
                   std::vector<BlockKey> keys, std::vector<uint32_t> ids, std::vector<uint32_t> boundaries);
  // The start of a Load: the handle checked (a hybrid match loads whole), the request counted in flight, the
  // handle's slots taken. The refusal otherwise (nothing counted).
  // On success `*in_flight` holds the load's admission (Lifecycle::Admit): the caller ends it when the load ends.
  Result<std::vector<SlotId>> BeginLoad(RequestSession& s, const SubmitDescriptor& d, InFlight* in_flight);
  // The end of a Load's copy (`bytes` copied when OK): counters and the completion (count - first_block blocks and
  // `bytes`), the handle's slots.
  void EndLoad(const std::shared_ptr<RequestSession>& sp, const SubmitDescriptor& d, int64_t taken_ns, uint64_t bytes,
               const Status& st, int64_t copy_start_ns);
  // Starts one copy per part of `parts` and runs `done` once with the first error after all ended.
  void SubmitJoined(std::vector<CopyRequest> parts, std::function<void(Status, int64_t copy_start_ns)> done);
  // Posts the request's final answer, after counting its end-to-end time and its error (first, so that a client
  // that has seen the completion also sees it counted).
  void Finish(RequestSession& s, const SubmitDescriptor& d, int64_t taken_ns, const CompletionDescriptor& c);
  // The copy of a load or store ends now: its wait and transfer time.
  void RecordCopy(OpKind op, int64_t taken_ns, int64_t copy_start_ns);

  // A Store, counted in flight (its InFlight), that has not been answered yet.
  struct WaitingStore {
    std::shared_ptr<RequestSession> sp;
    SubmitDescriptor d;
    int64_t taken_ns = 0;
    std::vector<BlockKey> keys;
    std::vector<uint32_t> ids;
    int64_t deadline_ns = 0;  // its wait for the write-back ends then
    InFlight in_flight;       // moved to the copy, or ended with the answer
    bool hybrid = false;      // a hybrid geometry's store (StoreHybrid), with its state boundaries
    std::vector<uint32_t> boundaries;
  };
  // Reserves and copies `w` now, or queues it behind its domain's waiting stores (Store and StoreHybrid).
  void StartOrQueue(WaitingStore w);
  // The rest of a Store: reserve, copy, commit, answer. With `may_wait`, false (nothing reserved, not answered)
  // when the reservation would evict blocks the next tier does not hold (or, hybrid, a sub-pool is full of entries
  // pinned by write-backs); true once the store is answered or copying.
  bool ReserveAndCopy(WaitingStore& w, bool may_wait);
  bool ReserveAndCopyHybrid(WaitingStore& w, bool may_wait);
  static constexpr int64_t kStoreRetryNs = 1000000;
  std::deque<WaitingStore> waiting_;  // ring poller only
  int64_t next_retry_ns_ = 0;         // ring poller only

  Lifecycle* const lifecycle_;
  CopyScheduler* const copies_;
  RequestMetrics* const metrics_;
  const uint32_t max_blocks_per_request_;
  const PinPolicy pins_;
  const TierSet* const tiers_;  // may be null (no tier below DRAM)
};

}  // namespace flexkv
