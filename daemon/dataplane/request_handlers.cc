// See request_handlers.h. Over 700 lines: one handler per ring opcode (Match, Load, Store, Release, Prefetch, layer
// events) and the stores waiting for the SSD write-back share the session and pin state kept here; splitting them
// would pass that state across files.
#include "daemon/dataplane/request_handlers.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/clock.h"
#include "common/hybrid_ids.h"
#include "daemon/dataplane/descriptor_validation.h"
#include "daemon/dataplane/hybrid_layers.h"
#include "daemon/transfer/launch_deadline.h"
#include "daemon/tiers/tier_lookup.h"
#include "daemon/tiers/tier_set.h"

namespace flexkv {

namespace {

Status DomainDropped() {
  return Status::FailedPrecondition("the cache domain this session attached to was dropped by an admin; Attach again");
}

}  // namespace

uint32_t RequestSession::RegisteredBlocks(std::vector<uint32_t>* per_component, std::string* missing) const {
  per_component->clear();
  uint32_t least = UINT32_MAX;
  for (size_t c = 0; c < kv_.size(); ++c) {
    std::string why;
    const uint32_t blocks = kv_[c]->RegisteredBlocks(&why);
    per_component->push_back(blocks);
    if (blocks == 0 && least != 0) {
      *missing = kv_.size() == 1 ? why
                                 : fmt::format("component {} ({}): {}", c, ComponentKindName(geometry_.component_kind(c)), why);
    }
    least = std::min(least, blocks);
  }
  return least;
}

uint64_t RequestSession::pinned_blocks() const {
  MutexLock lock(&mu_);
  return handles_.pinned_blocks();
}

RequestHandlers::RequestHandlers(Lifecycle* lifecycle, CopyScheduler* copies, RequestMetrics* metrics,
                                 uint32_t max_blocks_per_request, PinPolicy pins, const TierSet* tiers)
    : lifecycle_(lifecycle),
      copies_(copies),
      metrics_(metrics),
      max_blocks_per_request_(max_blocks_per_request),
      pins_(pins),
      tiers_(tiers) {}

namespace {

// What a Load or Release of a handle whose pins lapsed is answered (the completion's message holds 87 bytes).
Status LapsedHandle(int64_t lease_ms) {
  return Status::FailedPrecondition(
      fmt::format("pins lapsed after {} ms without renewal (process stopped?); Match again", lease_ms));
}

}  // namespace

void RequestHandlers::Handle(const std::shared_ptr<RequestSession>& sp, std::span<const uint8_t> arena,
                             const SubmitDescriptor& d, int64_t taken_ns) {
  RequestSession& s = *sp;
  DescriptorLimits limits;
  limits.max_blocks_per_request = max_blocks_per_request_;
  std::string kv_missing;
  const auto op = static_cast<RingOp>(d.opcode);
  const bool hybrid = s.geometry().is_hybrid();
  if (hybrid) limits.geometry = &s.geometry();
  if (op == RingOp::kLoad || op == RingOp::kStore) {
    limits.registered_blocks = s.RegisteredBlocks(&limits.component_blocks, &kv_missing);
    limits.kv_missing = kv_missing;
  }
  Result<DescriptorPayload> payload = ValidateDescriptor(d, arena, limits);
  if (!payload.ok()) return Fail(s, d, taken_ns, payload.status());
  if (!s.cache().has_pool()) {
    // A pool being prepared (its first grants are being allocated and registered) holds nothing yet: a Match is a
    // miss; what needs the pool is told to retry, with the progress.
    if (op == RingOp::kMatch && s.cache().preparation().preparing) return AnswerMatch(s, d, taken_ns, 0, {});
    return Fail(s, d, taken_ns, s.cache().PoolNotReady());
  }
  if (s.cache().generation() != s.pool_generation_) return Fail(s, d, taken_ns, DomainDropped());
  switch (op) {
    case RingOp::kMatch:
      return Match(sp, d, taken_ns, payload->keys);
    case RingOp::kRelease:
      return Release(s, d, taken_ns);
    case RingOp::kPrefetch:
      return Prefetch(sp, d, taken_ns, std::move(payload->keys));
    case RingOp::kLoad:
      if (hybrid) return LoadHybrid(sp, d, taken_ns, std::move(payload->block_ids));
      return Load(sp, d, taken_ns, std::move(payload->block_ids));
    case RingOp::kStore:
      if (hybrid) {
        return StoreHybrid(sp, d, taken_ns, std::move(payload->keys), std::move(payload->block_ids),
                           std::move(payload->boundaries));
      }
      return Store(sp, d, taken_ns, std::move(payload->keys), std::move(payload->block_ids));
  }
}

void RequestHandlers::Fail(RequestSession& s, const SubmitDescriptor& d, int64_t taken_ns, const Status& status) {
  Finish(s, d, taken_ns, CompletionBuilder::Error(d, status));
}

Result<uint32_t> RequestSession::AddEventSet(std::vector<std::shared_ptr<LayerEvents>> ranks) {
  MutexLock lock(&mu_);
  // EndSession clears the sets under mu_ after ended() turned true: a set added after that would stay open.
  if (ended()) return Status::FailedPrecondition(fmt::format("session {} has ended", id_));
  if (event_sets_.size() >= kMaxEventSets) {
    return Status::ResourceExhausted(fmt::format(
        "session {} holds {} layer-event sets already (sets {}); expected at most {}: release one (ReleaseLayerEvents)",
        id_, event_sets_.size(), EventSetIdsLocked(), kMaxEventSets));
  }
  const uint32_t id = next_event_set_++;
  event_sets_[id].ranks = std::move(ranks);
  return id;
}

Status RequestSession::ReleaseEventSet(uint32_t id) {
  MutexLock lock(&mu_);
  if (event_sets_.erase(id) == 0) {
    return Status::NotFound(fmt::format("layer-event set {} is not registered in session {}; its sets are: {}", id,
                                        id_, EventSetIdsLocked()));
  }
  return Status::Ok();
}

size_t RequestSession::event_sets() const {
  MutexLock lock(&mu_);
  return event_sets_.size();
}

std::string RequestSession::EventSetIdsLocked() const {
  if (event_sets_.empty()) return "none";
  std::string ids;
  for (const auto& [id, set] : event_sets_) ids += (ids.empty() ? "" : ", ") + std::to_string(id);
  return ids;
}

Result<std::vector<std::shared_ptr<LayerEvents>>> RequestSession::TakeEventSet(uint32_t id, uint64_t user_data) {
  MutexLock lock(&mu_);
  auto it = event_sets_.find(id);
  if (it == event_sets_.end()) {
    return Status::NotFound(fmt::format("event_set {} is not registered in this session (registered: {}); expected "
                                        "an id RegisterLayerEvents returned and not released", id, EventSetIdsLocked()));
  }
  if (it->second.busy) {
    // Short: a ring completion's message holds 87 bytes.
    return Status::FailedPrecondition(fmt::format(
        "event_set {} is busy (ticket {} loads with it); one load per set at a time", id, it->second.busy_with));
  }
  it->second.busy = true;
  it->second.busy_with = user_data;
  return it->second.ranks;
}

void RequestSession::PutEventSet(uint32_t id) {
  MutexLock lock(&mu_);
  auto it = event_sets_.find(id);  // released meanwhile: nothing to free
  if (it != event_sets_.end()) it->second.busy = false;
}

void RequestHandlers::EndSession(RequestSession& s) {
  std::vector<SlotId> unpin;
  {
    MutexLock lock(&s.mu_);
    unpin = s.handles_.ReleaseAll();
    s.event_sets_.clear();  // closes each set's IPC events once no load records them any more
  }
  if (!unpin.empty()) s.cache().Unpin(unpin);
}

RequestHandlers::Lapsed RequestHandlers::LapsePins(RequestSession& s) {
  Lapsed lapsed;
  std::vector<SlotId> unpin;
  {
    MutexLock lock(&s.mu_);
    if (s.handles_.pinned_blocks() == 0) return lapsed;
    unpin = s.handles_.Lapse(&lapsed.handles);
  }
  lapsed.blocks = unpin.size();
  if (!unpin.empty()) s.cache().Unpin(unpin);
  return lapsed;
}

uint64_t RequestHandlers::SessionPinCap(const RequestSession& s) const {
  const auto cap = static_cast<uint64_t>(pins_.max_session_share * s.cache().capacity_slots());
  return std::max<uint64_t>(cap, 1);
}

void RequestHandlers::Match(const std::shared_ptr<RequestSession>& sp, const SubmitDescriptor& d, int64_t taken_ns,
                            const std::vector<BlockKey>& keys) {
  const bool pin = (d.flags & kMatchFlagPin) != 0;
  const auto answer = [this, sp, d, taken_ns](size_t hit, std::vector<SlotId> slots) {
    if (sp->cache().generation() != sp->pool_generation_) {  // as in Store: these pins would be another domain's
      if (!slots.empty()) sp->cache().Unpin(slots);
      return Fail(*sp, d, taken_ns, DomainDropped());
    }
    AnswerMatch(*sp, d, taken_ns, hit, std::move(slots));
  };
  if (tiers_ == nullptr || tiers_->empty()) {
    std::vector<SlotId> slots;
    const size_t hit = sp->cache().Match(keys, pin, pin ? &slots : nullptr);
    return answer(hit, std::move(slots));
  }
  // The one lookup path (the gRPC Match's too): DRAM, then the tiers that promote on match, then DRAM again.
  TierLookupRequest request;
  request.cache = &sp->cache();
  request.keys = keys;
  request.pin = pin;
  request.may_promote = [sp] { return sp->cache().generation() == sp->pool_generation_; };
  MatchThroughTiers(*tiers_, *lifecycle_, std::move(request), answer);
}

void RequestHandlers::Prefetch(const std::shared_ptr<RequestSession>& sp, const SubmitDescriptor& d,
                               int64_t taken_ns, std::vector<BlockKey> keys) {
  RequestSession& s = *sp;
  // A pull commits blocks into the session's namespace: only a session that may store there may ask for one. Refused
  // whether or not this prompt would pull, so that a read-only engine learns it at its first Prefetch.
  CacheTier* puller = tiers_ != nullptr ? tiers_->puller() : nullptr;
  if (puller != nullptr && !s.prefetch_access().ok()) return Fail(s, d, taken_ns, s.prefetch_access());
  const auto local = static_cast<uint32_t>(s.cache().Match(keys, /*pin=*/false, nullptr));
  const auto answer = [this, d, taken_ns](RequestSession& session, const PrefetchResult& r) {
    if (!r.status.ok()) return Fail(session, d, taken_ns, r.status);
    CompletionBuilder c(d);
    c.MatchedBlocks(r.local_blocks).DoneBlocks(r.pulled_blocks).Bytes(r.pulled_bytes).Note(r.source);
    Finish(session, d, taken_ns, c.descriptor());
  };
  PrefetchResult here;
  here.local_blocks = local;
  if (local == keys.size() || puller == nullptr) return answer(s, here);
  if (s.geometry().is_hybrid() && !puller->capabilities().hybrid) {
    here.source = fmt::format("hybrid geometries are not pulled from the {} tier", puller->name());
    return answer(s, here);
  }
  InFlight admitted = lifecycle_->Admit();
  if (!admitted) {
    here.source = "the daemon is draining";
    return answer(s, here);
  }
  auto in_flight = std::make_shared<InFlight>(std::move(admitted));
  std::weak_ptr<RequestSession> weak = sp;
  puller->Prefetch(
      &s.cache(), std::move(keys), local, s.id(),
      [weak] {
        auto alive = weak.lock();
        return !alive || alive->ended();
      },
      [this, sp, d, taken_ns, answer, in_flight](PrefetchResult r) {
        if (sp->cache().generation() != sp->pool_generation_) {
          Fail(*sp, d, taken_ns, DomainDropped());
        } else {
          answer(*sp, r);
        }
        in_flight->End();
      });
}

void RequestHandlers::AnswerMatch(RequestSession& s, const SubmitDescriptor& d, int64_t taken_ns, size_t hit,
                                  std::vector<SlotId> slots) {
  const bool pin = (d.flags & kMatchFlagPin) != 0;
  CacheCounters& counters = s.cache().counters();
  counters.match_requests.fetch_add(1, std::memory_order_relaxed);
  counters.match_blocks.fetch_add(d.count, std::memory_order_relaxed);
  counters.hit_blocks.fetch_add(hit, std::memory_order_relaxed);
  CompletionBuilder c(d);
  c.MatchedBlocks(static_cast<uint32_t>(hit));
  if (pin && hit > 0) {
    bool held = false;
    uint64_t pinned = 0;
    const uint64_t cap = SessionPinCap(s);
    {
      MutexLock lock(&s.mu_);
      pinned = s.handles_.pinned_blocks();
      // EndSession sets ended() before it releases the table's handles: a handle added after that would leak.
      if (!s.ended() && pinned + slots.size() <= cap) {
        const std::optional<size_t> prefix = s.geometry().is_hybrid() ? std::optional<size_t>(hit) : std::nullopt;
        c.MatchHandle(s.handles_.Add(std::move(slots), prefix));
        held = true;
      }
    }
    if (!held) {
      s.cache().Unpin(slots);
      if (s.ended()) return;  // nobody is left to answer
      // Over the session's cap: nothing is pinned (a partial pin would leave a handle to leak on an error path).
      c.Status(Status::ResourceExhausted(
          fmt::format("session pin cap: {} pinned + {} > {} (--max-session-pin-share); Release handles", pinned,
                      slots.size(), cap)));
    }
  }
  Finish(s, d, taken_ns, c.descriptor());
}

void RequestHandlers::Release(RequestSession& s, const SubmitDescriptor& d, int64_t taken_ns) {
  std::vector<SlotId> unpin;
  Status held;
  {
    MutexLock lock(&s.mu_);
    if (s.handles_.Lapsed(d.match_handle)) {
      s.handles_.ForgetLapsed(d.match_handle);
      held = LapsedHandle(pins_.lease_ms);
    } else {
      held = ValidateHandleUse(d, s.handles_.HeldBlocks(d.match_handle));
    }
    if (held.ok()) unpin = s.handles_.Release(d.match_handle);
  }
  if (!held.ok()) return Fail(s, d, taken_ns, held);
  if (!unpin.empty()) s.cache().Unpin(unpin);
  Finish(s, d, taken_ns, CompletionBuilder(d).descriptor());
}

Result<std::vector<SlotId>> RequestHandlers::BeginLoad(RequestSession& s, const SubmitDescriptor& d,
                                                       InFlight* in_flight) {
  // Handle validated the descriptor and its block ids; the handle is looked up here, under the lock that also
  // takes its slots.
  MutexLock lock(&s.mu_);
  const std::optional<size_t> held = s.handles_.HeldBlocks(d.match_handle);
  Status refused = s.handles_.Lapsed(d.match_handle) ? LapsedHandle(pins_.lease_ms) : ValidateHandleUse(d, held);
  if (refused.ok() && s.geometry().is_hybrid() && d.count != *held) {
    refused = Status::InvalidArgument(fmt::format(
        "count {} but the hybrid match ends at {}: a hybrid match loads whole (its windows and states serve only that "
        "end)",
        d.count, *held));
  }
  InFlight admitted;
  if (refused.ok() && !(admitted = lifecycle_->Admit())) {
    refused = Status::Unavailable("flexkvd is draining; retry after Resume");
  }
  // Counted in flight from here on, so no DropDomain can start: check once more that the pool is the session's.
  if (refused.ok() && s.cache().generation() != s.pool_generation_) refused = DomainDropped();
  if (!refused.ok()) return refused;  // `admitted` ends here
  Result<std::vector<SlotId>> slots = s.handles_.BeginLoad(d.match_handle, d.count);
  if (slots.ok()) *in_flight = std::move(admitted);
  return slots;
}

void RequestHandlers::EndLoad(const std::shared_ptr<RequestSession>& sp, const SubmitDescriptor& d, int64_t taken_ns,
                              uint64_t bytes, const Status& st, int64_t copy_start_ns) {
  RecordCopy(OpKind::kLoad, taken_ns, copy_start_ns);
  CompletionBuilder c(d);
  if (st.ok()) {
    // Only the blocks past the engine's own prefix moved (first_block, layout 5).
    const uint32_t moved = d.count - d.first_block;
    c.DoneBlocks(moved).Bytes(bytes);
    sp->cache().counters().load_blocks.fetch_add(moved, std::memory_order_relaxed);
    sp->cache().counters().bytes_loaded.fetch_add(bytes, std::memory_order_relaxed);
  } else {
    c.Status(st);
  }
  std::vector<SlotId> unpin;
  {
    MutexLock lock(&sp->mu_);
    unpin = sp->handles_.EndLoad(d.match_handle);
  }
  if (!unpin.empty()) sp->cache().Unpin(unpin);
  Finish(*sp, d, taken_ns, c.descriptor());
}

namespace {

// A Load's launch deadline (layout 6), shared by all its copies; null without one (0). ValidateDescriptor checked
// that it fits an int64.
std::shared_ptr<LaunchDeadline> LaunchDeadlineOf(const SubmitDescriptor& d) {
  if (d.launch_deadline_ns == 0) return nullptr;
  return std::make_shared<LaunchDeadline>(static_cast<int64_t>(d.launch_deadline_ns));
}

}  // namespace

void RequestHandlers::Load(const std::shared_ptr<RequestSession>& sp, const SubmitDescriptor& d, int64_t taken_ns,
                           std::vector<uint32_t> ids) {
  RequestSession& s = *sp;
  // A set's events are recorded by one load at a time: taken here, given back just before the final completion.
  std::vector<std::shared_ptr<LayerEvents>> events;
  if (d.event_set != 0) {
    auto taken = s.TakeEventSet(d.event_set, d.user_data);
    if (!taken.ok()) return Fail(s, d, taken_ns, taken.status());
    events = std::move(*taken);
  }
  InFlight admitted;
  Result<std::vector<SlotId>> slots = BeginLoad(s, d, &admitted);
  if (!slots.ok()) {
    if (d.event_set != 0) s.PutEventSet(d.event_set);
    return Fail(s, d, taken_ns, slots.status());
  }
  CopyRequest copy;
  copy.direction = CopyDirection::kFromPool;
  copy.tier = s.tier();
  copy.launch_deadline = LaunchDeadlineOf(d);
  s.kv().FillTargets(&copy);
  if (d.event_set != 0) {
    // Each target (TP rank) records its own rank's events; a set holds every rank (RegisterLayerEvents checked).
    for (const std::shared_ptr<EngineKv>& target : copy.targets) {
      copy.layer_events.push_back(target->tp_rank() < events.size() ? events[target->tp_rank()] : nullptr);
    }
    const uint32_t layers = s.geometry().num_layers;
    copy.launched = [sp, d, layers] { sp->Post(CompletionBuilder::Launched(d, layers)); };
  }
  // The handle's first `count` slots; the engine holds the blocks before first_block, ids name [first_block, count).
  copy.engine_blocks = std::make_shared<const std::vector<uint32_t>>(std::move(ids));
  copy.slots = std::make_shared<const std::vector<SlotId>>(slots->begin() + d.first_block, slots->end());
  copy.num_layers = s.geometry().num_layers;
  if ((d.flags & kLoadFlagLayerwise) != 0) {
    copy.layer_done = [sp, d](uint32_t layer) { sp->Post(CompletionBuilder::LayerDone(d, layer)); };
  }
  const uint64_t bytes = uint64_t{d.count - d.first_block} * s.cache().block_bytes();
  auto in_flight = std::make_shared<InFlight>(std::move(admitted));
  copy.done = [this, sp, d, bytes, taken_ns, in_flight](Status st, int64_t copy_start_ns) {
    if (d.event_set != 0) sp->PutEventSet(d.event_set);  // free before the final completion: reusable once seen
    EndLoad(sp, d, taken_ns, bytes, st, copy_start_ns);
    in_flight->End();
  };
  copies_->Submit(std::move(copy));
}

void RequestHandlers::Store(const std::shared_ptr<RequestSession>& sp, const SubmitDescriptor& d, int64_t taken_ns,
                            std::vector<BlockKey> keys, std::vector<uint32_t> ids) {
  RequestSession& s = *sp;  // Handle validated the descriptor and the block ids against the registered blocks
  if (!s.store_access().ok()) return Fail(s, d, taken_ns, s.store_access());  // a read-only session
  InFlight admitted = lifecycle_->Admit();
  if (!admitted) return Fail(s, d, taken_ns, Status::Unavailable("flexkvd is draining; retry after Resume"));
  // Counted in flight from here on, so no DropDomain can start: check once more that the pool is the session's.
  if (s.cache().generation() != s.pool_generation_) return Fail(s, d, taken_ns, DomainDropped());
  StartOrQueue(WaitingStore{sp, d, taken_ns, std::move(keys), std::move(ids), 0, std::move(admitted),
                            /*hybrid=*/false, {}});
}

void RequestHandlers::StartOrQueue(WaitingStore w) {
  Cache& cache = w.sp->cache();
  const int64_t wait_ms = cache.StoreWaitMs();
  w.deadline_ns = w.taken_ns + wait_ms * 1000000;
  // A domain's stores wait in arrival order: a later one must not take the blocks written for an earlier one.
  const bool queued_behind = wait_ms > 0 && std::any_of(waiting_.begin(), waiting_.end(), [&](const WaitingStore& o) {
    return &o.sp->cache() == &cache;
  });
  if (queued_behind || !ReserveAndCopy(w, /*may_wait=*/wait_ms > 0)) {
    cache.CountStoreWait(false);
    waiting_.push_back(std::move(w));
  }
}

bool RequestHandlers::RetryWaitingStores(int64_t now_ns) {
  if (waiting_.empty()) return false;
  if (now_ns < next_retry_ns_) return true;
  next_retry_ns_ = now_ns + kStoreRetryNs;
  std::vector<const Cache*> blocked;  // domains whose oldest waiting store still waits: the later ones do too
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    RequestSession& s = *it->sp;
    Cache* cache = &s.cache();
    if (s.ended() || cache->generation() != s.pool_generation_) {
      Fail(s, it->d, it->taken_ns, s.ended() ? Status::Cancelled("the session ended") : DomainDropped());
      it = waiting_.erase(it);  // ends its request
      continue;
    }
    if (std::find(blocked.begin(), blocked.end(), cache) != blocked.end()) {
      ++it;
      continue;
    }
    if (ReserveAndCopy(*it, /*may_wait=*/true)) {
      it = waiting_.erase(it);
      continue;
    }
    if (now_ns >= it->deadline_ns || cache->StoreWaitMs() == 0) {
      // The wait ran out (or write-back stopped working): evict what the store needs, counted as unwritten.
      cache->CountStoreWait(true);
      (void)ReserveAndCopy(*it, /*may_wait=*/false);
      it = waiting_.erase(it);
      continue;
    }
    blocked.push_back(cache);
    ++it;
  }
  return !waiting_.empty();
}

void RequestHandlers::AbandonWaitingStores() {
  for (WaitingStore& w : waiting_) {
    w.in_flight.End();
    Fail(*w.sp, w.d, w.taken_ns, Status::Unavailable("flexkvd is stopping; the store was not done"));
  }
  waiting_.clear();
}

bool RequestHandlers::ReserveAndCopy(WaitingStore& w, bool may_wait) {
  if (w.hybrid) return ReserveAndCopyHybrid(w, may_wait);
  const std::shared_ptr<RequestSession>& sp = w.sp;
  RequestSession& s = *sp;
  const SubmitDescriptor& d = w.d;
  const int64_t taken_ns = w.taken_ns;
  const BlockKey parent = d.parent;  // kRootParent, or the key keys[0] hangs under
  PrefixIndex::Reservation r = s.cache().Reserve(parent, w.keys, may_wait);
  // A drop of the domain (possible only while this session's end is processed: DropDomain waits for no request,
  // only for reserved and pinned slots) may have given the Cache to another domain just before the Reserve.
  if (s.cache().generation() != s.pool_generation_) {
    s.cache().Abort(r.slots);
    w.in_flight.End();
    Fail(s, d, taken_ns, DomainDropped());
    return true;
  }
  if (r.dirty_only && may_wait) {  // only blocks SSD does not hold yet are left to evict: wait for the write-back
    s.cache().Abort(r.slots);
    return false;
  }
  std::vector<BlockKey>& keys = w.keys;
  std::vector<uint32_t>& ids = w.ids;
  const uint32_t reserved = static_cast<uint32_t>(r.slots.size());
  CompletionBuilder c(d);
  c.MatchedBlocks(static_cast<uint32_t>(r.cached)).DoneBlocks(reserved);
  if (r.parent_refused) {  // the message fits the completion's 87 bytes, hence no key in it
    c.Status(Status(r.shortfall, r.shortfall == StatusCode::kFailedPrecondition
                                     ? "parent key not cached, nothing stored; "
                                       "store from the prompt's first uncached block"
                                     : "parent key still being stored or verified, nothing stored; "
                                       "retry once it completes"));
  } else if (r.shortfall == StatusCode::kResourceExhausted && reserved == 0 && s.cache().preparation().preparing) {
    c.Status(s.cache().PoolNotReady());  // its grants are still being registered: none is handed out yet
  } else if (r.shortfall != StatusCode::kOk) {
    const size_t stopped = r.cached + reserved;
    c.Status(Status(r.shortfall, r.shortfall == StatusCode::kResourceExhausted
                                     ? fmt::format("pool full of pinned blocks: stored blocks up to {} of {}", stopped, d.count)
                                     : fmt::format("block {} is being stored by another request or verified after a "
                                                   "restart",
                                                   stopped)));
  }
  if (reserved == 0) {
    w.in_flight.End();
    Finish(s, d, taken_ns, c.descriptor());
    return true;
  }
  const size_t first = r.cached;
  CopyRequest copy;
  copy.direction = CopyDirection::kToPool;
  copy.tier = s.tier();
  s.kv().FillTargets(&copy);
  copy.engine_blocks = std::make_shared<const std::vector<uint32_t>>(ids.begin() + static_cast<ptrdiff_t>(first),
                                                                     ids.begin() + static_cast<ptrdiff_t>(first + reserved));
  auto slots = std::make_shared<const std::vector<SlotId>>(std::move(r.slots));
  copy.slots = slots;
  copy.num_layers = s.geometry().num_layers;
  auto checksums = std::make_shared<std::vector<uint64_t>>();
  copy.checksums = checksums;
  const uint64_t block_bytes = s.cache().block_bytes();
  auto in_flight = std::make_shared<InFlight>(std::move(w.in_flight));
  copy.done = [this, sp, d, c, parent, keys = std::move(keys), slots, checksums, first, block_bytes, taken_ns,
               in_flight](Status st, int64_t copy_start_ns) mutable {
    RecordCopy(OpKind::kStore, taken_ns, copy_start_ns);
    // Publish after transfer; a failed copy, or a session that ended meanwhile, returns the slots.
    Cache& cache = sp->cache();
    if (!st.ok() || sp->ended()) {
      cache.Abort(*slots);
      if (!st.ok()) c.Status(st).DoneBlocks(0);
    } else {
      cache.Commit(parent, keys, first, *slots, *checksums);
      cache.counters().store_blocks.fetch_add(slots->size(), std::memory_order_relaxed);
      cache.counters().bytes_stored.fetch_add(slots->size() * block_bytes, std::memory_order_relaxed);
    }
    Finish(*sp, d, taken_ns, c.descriptor());
    in_flight->End();
  };
  copies_->Submit(std::move(copy));
  return true;
}

void RequestHandlers::SubmitJoined(std::vector<CopyRequest> parts,
                                   std::function<void(Status, int64_t copy_start_ns)> done) {
  struct Join {
    Mutex mu;
    size_t left ABSL_GUARDED_BY(mu) = 0;
    Status first_error ABSL_GUARDED_BY(mu);
    int64_t start_ns ABSL_GUARDED_BY(mu) = INT64_MAX;
  };
  auto join = std::make_shared<Join>();
  {
    MutexLock lock(&join->mu);
    join->left = parts.size();
  }
  auto shared_done = std::make_shared<std::function<void(Status, int64_t)>>(std::move(done));
  for (CopyRequest& part : parts) {
    part.done = [join, shared_done](Status st, int64_t start_ns) {
      Status result;
      int64_t start;
      {
        MutexLock lock(&join->mu);
        if (!st.ok() && join->first_error.ok()) join->first_error = st;
        join->start_ns = std::min(join->start_ns, start_ns);
        if (--join->left != 0) return;
        result = join->first_error;
        start = join->start_ns;
      }
      (*shared_done)(result, start);
    };
    copies_->Submit(std::move(part));
  }
}

namespace {

// One component's part of a hybrid copy: the engine ids and the slots (made local to the component's sub-pool).
CopyRequest ComponentCopy(RequestSession& s, size_t c, CopyDirection direction, std::vector<uint32_t> engine_ids,
                          std::vector<SlotId> local_slots) {
  CopyRequest copy;
  copy.direction = direction;
  copy.component = static_cast<uint32_t>(c);
  copy.tier = s.tier();
  s.kv(c).FillTargets(&copy);
  copy.engine_blocks = std::make_shared<const std::vector<uint32_t>>(std::move(engine_ids));
  copy.slots = std::make_shared<const std::vector<SlotId>>(std::move(local_slots));
  copy.num_layers = s.geometry().Component(c).num_layers;
  return copy;
}

}  // namespace

void RequestHandlers::LoadHybrid(const std::shared_ptr<RequestSession>& sp, const SubmitDescriptor& d,
                                 int64_t taken_ns, std::vector<uint32_t> ids) {
  RequestSession& s = *sp;
  const Geometry& g = s.geometry();
  // A set's events are recorded by one load at a time: taken here, given back just before the final completion.
  std::vector<std::shared_ptr<LayerEvents>> events;
  if (d.event_set != 0) {
    auto taken = s.TakeEventSet(d.event_set, d.user_data);
    if (!taken.ok()) return Fail(s, d, taken_ns, taken.status());
    events = std::move(*taken);
  }
  InFlight admitted;
  Result<std::vector<SlotId>> begun = BeginLoad(s, d, &admitted);
  if (!begun.ok()) {
    if (d.event_set != 0) s.PutEventSet(d.event_set);
    return Fail(s, d, taken_ns, begun.status());
  }
  // The handle pins the whole end in the layout of a Load from block 0; the request's ids name only what the
  // engine lacks (first_block k): FULL [k, e), each window's [max(k, e - w), e) - the tail of what is pinned - and
  // the state at e.
  const std::vector<SlotId>& slots = *begun;
  const HybridIdLayout pinned = LayoutIds(g, false, d.count);
  const IdExtent extent = ExtentOf(d);
  const HybridIdLayout layout = LayoutIds(g, false, d.count, extent);
  const std::vector<SlotId> bases = s.cache().component_bases();
  std::vector<std::optional<CopyRequest>> components(g.component_count());
  uint64_t bytes = 0;
  for (size_t c = 0; c < g.component_count(); ++c) {
    const uint64_t n = ComponentIdCount(g, c, false, d.count, extent);
    if (n == 0) continue;
    const auto at = static_cast<ptrdiff_t>(layout.offset[c]);
    const auto from = static_cast<ptrdiff_t>(pinned.offset[c] + ComponentIdCount(g, c, false, d.count) - n);
    std::vector<uint32_t> engine(ids.begin() + at, ids.begin() + at + static_cast<ptrdiff_t>(n));
    std::vector<SlotId> local(slots.begin() + from, slots.begin() + from + static_cast<ptrdiff_t>(n));
    for (SlotId& slot : local) slot -= bases[c];
    components[c] = ComponentCopy(s, c, CopyDirection::kFromPool, std::move(engine), std::move(local));
    if (d.event_set != 0) {
      // Each target (TP rank) records its own rank's events (a set holds every rank: RegisterLayerEvents checked).
      for (const std::shared_ptr<EngineKv>& target : components[c]->targets) {
        components[c]->layer_events.push_back(target->tp_rank() < events.size() ? events[target->tp_rank()] : nullptr);
      }
    }
    bytes += n * g.Component(c).host_block_bytes();
  }
  std::vector<CopyRequest> parts;
  if ((d.flags & kLoadFlagLayerwise) != 0 || d.event_set != 0) {
    // Layer by layer, in Geometry::LayerOrder across the components: progress reports at each layer's index there,
    // the set's event at that index recorded right after the layer's copies.
    std::shared_ptr<OrderedLayerProgress> progress;
    if ((d.flags & kLoadFlagLayerwise) != 0) {
      progress = std::make_shared<OrderedLayerProgress>(
          g.total_layers(), [sp, d](uint32_t index) { sp->Post(CompletionBuilder::LayerDone(d, index)); });
    }
    std::function<void()> launched;
    if (d.event_set != 0) {
      launched = [sp, d, layers = g.total_layers()] { sp->Post(CompletionBuilder::Launched(d, layers)); };
    }
    parts = HybridLayerCopies(g, std::move(components), progress, std::move(launched));
  } else {
    for (std::optional<CopyRequest>& part : components) {
      if (part) parts.push_back(std::move(*part));
    }
  }
  if (parts.empty()) {  // nothing past the engine's prefix (a window-only geometry loaded from its end)
    if (d.event_set != 0) {
      sp->Post(CompletionBuilder::Launched(d, g.total_layers()));  // nothing to wait for: every event passes
      s.PutEventSet(d.event_set);
    }
    EndLoad(sp, d, taken_ns, 0, Status::Ok(), NowNs());
    return;  // `admitted` ends here
  }
  // One deadline for every component's copies: each starts only before it.
  const std::shared_ptr<LaunchDeadline> deadline = LaunchDeadlineOf(d);
  for (CopyRequest& part : parts) part.launch_deadline = deadline;
  auto in_flight = std::make_shared<InFlight>(std::move(admitted));
  SubmitJoined(std::move(parts), [this, sp, d, bytes, taken_ns, in_flight](Status st, int64_t copy_start_ns) {
    if (d.event_set != 0) sp->PutEventSet(d.event_set);  // free before the final completion: reusable once seen
    EndLoad(sp, d, taken_ns, bytes, st, copy_start_ns);
    in_flight->End();
  });
}

void RequestHandlers::StoreHybrid(const std::shared_ptr<RequestSession>& sp, const SubmitDescriptor& d,
                                  int64_t taken_ns, std::vector<BlockKey> keys, std::vector<uint32_t> ids,
                                  std::vector<uint32_t> boundaries) {
  RequestSession& s = *sp;
  if (!s.store_access().ok()) return Fail(s, d, taken_ns, s.store_access());
  InFlight admitted = lifecycle_->Admit();
  if (!admitted) return Fail(s, d, taken_ns, Status::Unavailable("flexkvd is draining; retry after Resume"));
  if (s.cache().generation() != s.pool_generation_) return Fail(s, d, taken_ns, DomainDropped());
  StartOrQueue(WaitingStore{sp, d, taken_ns, std::move(keys), std::move(ids), 0, std::move(admitted),
                            /*hybrid=*/true, std::move(boundaries)});
}

bool RequestHandlers::ReserveAndCopyHybrid(WaitingStore& w, bool may_wait) {
  const std::shared_ptr<RequestSession>& sp = w.sp;
  RequestSession& s = *sp;
  const SubmitDescriptor& d = w.d;
  const int64_t taken_ns = w.taken_ns;
  const Geometry& g = s.geometry();
  const BlockKey parent = d.parent;
  auto r = std::make_shared<Cache::HybridReservation>(
      s.cache().ReserveHybrid(parent, w.keys, w.boundaries, d.window_keys, may_wait));
  if (s.cache().generation() != s.pool_generation_) {  // as in Store
    s.cache().AbortHybrid(*r);
    w.in_flight.End();
    Fail(s, d, taken_ns, DomainDropped());
    return true;
  }
  if (r->wait_for_write_back) return false;  // nothing reserved: retried by RetryWaitingStores
  std::vector<BlockKey>& keys = w.keys;
  const std::vector<uint32_t>& ids = w.ids;
  CompletionBuilder answer(d);
  answer.MatchedBlocks(static_cast<uint32_t>(r->full.cached)).DoneBlocks(static_cast<uint32_t>(r->full.slots.size()));
  if (r->shortfall != StatusCode::kOk) {
    answer.DoneBlocks(0);
    std::string why;  // fits the completion's 87 bytes
    if (r->full.parent_refused) {
      why = r->shortfall == StatusCode::kFailedPrecondition ? "parent key not cached, nothing stored"
                                                            : "parent key still being stored or verified, nothing stored";
    } else if (r->shortfall == StatusCode::kResourceExhausted && s.cache().preparation().preparing) {
      why = s.cache().PoolNotReady().message();
      r->shortfall = StatusCode::kUnavailable;
    } else if (r->shortfall == StatusCode::kResourceExhausted) {
      why = fmt::format("component {} ({}) sub-pool full of pinned blocks: nothing stored", r->component,
                        ComponentKindName(g.component_kind(r->component)));
    } else {
      why = fmt::format("component {} ({}): a block is being stored or verified: nothing stored", r->component,
                        ComponentKindName(g.component_kind(r->component)));
    }
    answer.Status(Status(r->shortfall, why));
    w.in_flight.End();
    Finish(s, d, taken_ns, answer.descriptor());
    return true;
  }
  const HybridIdLayout layout = LayoutIds(g, true, d.count, ExtentOf(d));
  const std::vector<SlotId> bases = s.cache().component_bases();
  std::vector<CopyRequest> parts;
  std::vector<std::shared_ptr<std::vector<uint64_t>>> sums(g.component_count());
  uint64_t bytes = 0;
  for (size_t c = 0; c < g.component_count(); ++c) {
    std::vector<uint32_t> engine;
    std::vector<SlotId> local;
    if (c == 0) {
      for (size_t i = 0; i < r->full.slots.size(); ++i) {
        engine.push_back(ids[layout.offset[0] + r->full.cached + i]);
        local.push_back(r->full.slots[i]);
      }
    } else {
      for (size_t i = 0; i < r->slots[c].size(); ++i) {
        if (r->slots[c][i] == ComponentIndex::kNoSlot) continue;
        engine.push_back(ids[layout.offset[c] + i]);
        local.push_back(r->slots[c][i] - bases[c]);
      }
    }
    sums[c] = std::make_shared<std::vector<uint64_t>>();
    if (engine.empty()) continue;
    bytes += engine.size() * g.Component(c).host_block_bytes();
    CopyRequest copy = ComponentCopy(s, c, CopyDirection::kToPool, std::move(engine), std::move(local));
    copy.checksums = sums[c];
    parts.push_back(std::move(copy));
  }
  if (parts.empty()) {  // everything was cached already
    w.in_flight.End();
    Finish(s, d, taken_ns, answer.descriptor());
    return true;
  }
  auto in_flight = std::make_shared<InFlight>(std::move(w.in_flight));
  SubmitJoined(std::move(parts), [this, sp, d, c = answer, parent, keys = std::move(keys), r, sums, bytes, taken_ns,
                                  in_flight](Status st, int64_t copy_start_ns) mutable {
    RecordCopy(OpKind::kStore, taken_ns, copy_start_ns);
    Cache& cache = sp->cache();
    if (!st.ok() || sp->ended()) {
      cache.AbortHybrid(*r);
      if (!st.ok()) c.Status(st).DoneBlocks(0);
    } else {
      std::vector<std::vector<uint64_t>> checksums;
      for (const auto& part : sums) checksums.push_back(*part);
      cache.CommitHybrid(parent, keys, *r, checksums);
      cache.counters().store_blocks.fetch_add(r->full.slots.size(), std::memory_order_relaxed);
      cache.counters().bytes_stored.fetch_add(bytes, std::memory_order_relaxed);
    }
    Finish(*sp, d, taken_ns, c.descriptor());
    in_flight->End();
  });
  return true;
}

void RequestHandlers::Finish(RequestSession& s, const SubmitDescriptor& d, int64_t taken_ns,
                             const CompletionDescriptor& c) {
  const OpKind op = OpKindOf(d.opcode);
  if (op != OpKind::kInvalid) metrics_->end_to_end[Index(op)].Observe(NowNs() - taken_ns);
  if (c.status_code != 0) metrics_->errors[Index(op)].Add(static_cast<StatusCode>(c.status_code));
  s.Post(c);
}

void RequestHandlers::RecordCopy(OpKind op, int64_t taken_ns, int64_t copy_start_ns) {
  metrics_->wait[Index(op)].Observe(copy_start_ns - taken_ns);
  metrics_->transfer[Index(op)].Observe(NowNs() - copy_start_ns);
}

}  // namespace flexkv
