// The session table, the rings and their poller; see data_plane.h.
#include "daemon/dataplane/data_plane.h"

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <fmt/format.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/clock.h"
#include "common/log.h"
#include "common/ring/ring_consumer.h"
#include "common/ring_layout.h"
#include "common/uds.h"
#include "daemon/dataplane/pin_lease.h"

namespace flexkv {
struct DataPlane::Session final : RequestSession {
  Session(DataPlane* owner, uint64_t id, const Geometry& geometry, Cache* cache, const DramTier* tier,
          uint64_t pool_generation, Status store_access, Status prefetch_access)
      : RequestSession(id, geometry, cache, tier, pool_generation, std::move(store_access),
                       std::move(prefetch_access)),
        plane(owner),
        lease(owner->options_.pins.lease_ms * 1000000, NowNs()) {}
  DataPlane* const plane;
  std::unique_ptr<ring::RingConsumer> ring;  // the rings' daemon end; set once by OpenSession
  std::atomic<bool> dead{false};
  PinLease lease;  // the poller's only

  void Post(const CompletionDescriptor& c) override { plane->Complete(*this, c); }
  bool ended() const override { return dead.load(); }
};

DataPlane::DataPlane(Lifecycle* lifecycle, EngineMemoryBackends* backends, DataPlaneOptions options)
    : backends_(backends),
      options_(options),
      handlers_(lifecycle, &copies_, &metrics_, options.max_blocks_per_request, options.pins, options.tiers) {}

DataPlane::~DataPlane() { Stop(); }

Status DataPlane::Start() {
  epoll_fd_.reset(epoll_create1(EPOLL_CLOEXEC));
  wake_fd_.reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!epoll_fd_ || !wake_fd_) return Status::Internal(fmt::format("epoll/eventfd: {}", ErrnoText(errno)));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = 0;
  epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, wake_fd_.get(), &ev);
  last_turn_ms_ = MonotonicMs();
  poller_ = std::thread([this] { PollerLoop(); });
  if (options_.poller_cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(options_.poller_cpu, &set);
    const int rc = pthread_setaffinity_np(poller_.native_handle(), sizeof(set), &set);
    if (rc != 0) {
      log::Warning("dataplane", "cannot pin the ring poller to CPU {}: {}; it runs unpinned", options_.poller_cpu,
                   ErrnoText(rc));
    } else {
      log::Info("dataplane", "ring poller pinned to CPU {}", options_.poller_cpu);
    }
  }
  return Status::Ok();
}

void DataPlane::Stop() {
  if (!poller_.joinable()) return;
  stopping_ = true;
  uint64_t one = 1;
  ssize_t ignored = write(wake_fd_.get(), &one, sizeof(one));
  (void)ignored;
  poller_.join();
  handlers_.AbandonWaitingStores();  // the poller no longer retries them
  copies_.WaitIdle();  // every accepted request ends
}

const DramTier* DataPlane::TierOf(Cache* cache) {
  MutexLock lock(&tiers_mu_);
  std::unique_ptr<DramTier>& tier = tiers_[cache];
  if (!tier) tier = std::make_unique<DramTier>(cache);
  return tier.get();
}

Result<std::vector<UniqueFd>> DataPlane::OpenSession(uint64_t session_id, Cache* cache, const Geometry& geometry,
                                                     const SessionAccess& access) {
  // The session was admitted under its domain's current pool: a drop needs every session of it gone, this one
  // included.
  auto s = std::make_shared<Session>(this, session_id, geometry, cache, TierOf(cache), cache->generation(),
                                     access.store, access.prefetch);
  auto created = ring::RingConsumer::Create(
      RingGeometry{options_.submit_entries, options_.completion_entries, options_.arena_bytes},
      static_cast<uint32_t>(options_.pins.lease_ms));
  if (!created.ok()) return created.status();
  s->ring = std::move(created->consumer);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = session_id;
  if (epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, s->ring->doorbell_fd(), &ev) != 0) {
    return Status::Internal(fmt::format("epoll_ctl(doorbell): {}", ErrnoText(errno)));
  }
  {
    MutexLock lock(&mu_);
    sessions_[session_id] = s;
  }
  generation_.fetch_add(1);
  std::vector<UniqueFd> fds;
  fds.push_back(std::move(created->memfd));
  fds.push_back(std::move(created->doorbell));
  return fds;
}

Result<uint64_t> DataPlane::RegisterKv(uint64_t session_id, KvRegistration registration) {
  std::shared_ptr<Session> s;
  {
    MutexLock lock(&mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) {
      return Status::FailedPrecondition(fmt::format("session {} has no open session channel", session_id));
    }
    s = it->second;
  }
  const Geometry& g = s->geometry();
  if (registration.component >= g.component_count()) {
    return Status::InvalidArgument(fmt::format(
        "component {} is not in the session's geometry; expected 0..{} ({})", registration.component,
        g.component_count() - 1, g.is_hybrid() ? "its components" : "0: a full-attention geometry has one"));
  }
  const uint32_t component = registration.component;
  // A pool-registration error of a backend refuses only sessions of the domain whose pool it concerns.
  const std::optional<PoolRegion> pool = s->cache().pool_region(0);
  return s->kv(component).Register(*backends_, std::move(registration), pool ? pool->base : nullptr);
}

Result<std::shared_ptr<DataPlane::Session>> DataPlane::SessionOf(uint64_t session_id) const {
  MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) {
    return Status::FailedPrecondition(fmt::format("session {} has no open session channel", session_id));
  }
  return it->second;
}

Result<uint32_t> DataPlane::RegisterLayerEvents(uint64_t session_id, std::vector<LayerEventsRank> ranks) {
  constexpr size_t kIpcEventHandleBytes = 64;  // sizeof(cudaIpcEventHandle_t); no CUDA header here
  auto found = SessionOf(session_id);
  if (!found.ok()) return found.status();
  Session& s = **found;
  const Geometry& g = s.geometry();
  if (ranks.size() != g.tp_size) {
    return Status::InvalidArgument(fmt::format(
        "{} ranks of layer events; expected one per TP rank of the geometry: {}", ranks.size(), g.tp_size));
  }
  std::vector<bool> seen(g.tp_size, false);
  for (size_t i = 0; i < ranks.size(); ++i) {
    const LayerEventsRank& r = ranks[i];
    if (r.tp_rank >= g.tp_size || seen[r.tp_rank]) {
      return Status::InvalidArgument(fmt::format(
          "ranks[{}].tp_rank is {}; expected each rank 0..{} exactly once", i, r.tp_rank, g.tp_size - 1));
    }
    seen[r.tp_rank] = true;
    if (r.handles.size() != g.total_layers()) {
      return Status::InvalidArgument(fmt::format(
          "ranks[{}] (tp rank {}) has {} event handles; expected one per layer of the geometry: {}{}", i, r.tp_rank,
          r.handles.size(), g.total_layers(),
          g.is_hybrid() ? " (every component's layers, in the order of a layer-wise load: docs/hybrid.md)" : ""));
    }
    for (size_t l = 0; l < r.handles.size(); ++l) {
      if (r.handles[l].size() != kIpcEventHandleBytes) {
        return Status::InvalidArgument(fmt::format(
            "ranks[{}] (tp rank {}) handle of layer {} has {} bytes; expected a cudaIpcEventHandle_t ({} bytes)", i,
            r.tp_rank, l, r.handles[l].size(), kIpcEventHandleBytes));
      }
    }
  }
  auto backend = backends_->SelectLayerEvents();
  if (!backend.ok()) return backend.status();
  std::vector<std::shared_ptr<LayerEvents>> opened(g.tp_size);
  for (const LayerEventsRank& r : ranks) {
    auto events = (*backend)->OpenLayerEvents(r);
    if (!events.ok()) return events.status().WithContext(fmt::format("tp rank {}", r.tp_rank));
    opened[r.tp_rank] = std::move(*events);
  }
  return s.AddEventSet(std::move(opened));
}

Status DataPlane::ReleaseLayerEvents(uint64_t session_id, uint32_t set_id) {
  auto found = SessionOf(session_id);
  if (!found.ok()) return found.status();
  return (*found)->ReleaseEventSet(set_id);
}

void DataPlane::EndSession(uint64_t session_id) {
  std::shared_ptr<Session> s;
  {
    MutexLock lock(&mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) return;
    s = std::move(it->second);
    sessions_.erase(it);
  }
  generation_.fetch_add(1);
  epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, s->ring->doorbell_fd(), nullptr);
  // Closed first: a completion the ring still takes was built while ended() was false. Completions after this are
  // dropped (a Store whose copy ends now sees ended() and aborts instead of publishing).
  s->ring->Close();
  s->dead = true;
  handlers_.EndSession(*s);
  // Copies still running hold `s` (and its KV mapping) until they finish; nothing waits for them here.
}

DataPlane::SessionStats DataPlane::StatsOf(uint64_t session_id) const {
  std::shared_ptr<Session> s;
  {
    MutexLock lock(&mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) return {};
    s = it->second;
  }
  return {s->pinned_blocks(), s->ring->inflight()};
}

void DataPlane::Complete(Session& s, CompletionDescriptor c) { s.ring->Post(c); }

void DataPlane::Fail(Session& s, const SubmitDescriptor& d, int64_t taken_ns, const Status& status) {
  handlers_.Fail(s, d, taken_ns, status);
}

bool DataPlane::PollSession(const std::shared_ptr<Session>& self) {
  Session& s = *self;
  bool work = s.ring->Flush();
  for (;;) {
    ring::RingConsumer::Taken t = s.ring->Take();
    switch (t.kind) {
      case ring::RingConsumer::Taken::kNone:
        return work;
      case ring::RingConsumer::Taken::kCorrupt:
        if (t.counted) {
          metrics_.taken[Index(OpKind::kInvalid)].fetch_add(1, std::memory_order_relaxed);
          Fail(s, SubmitDescriptor{}, NowNs(), t.error);
        }
        return true;
      case ring::RingConsumer::Taken::kDescriptor: {
        const int64_t taken_ns = NowNs();
        s.lease.Renew(taken_ns);
        metrics_.taken[Index(OpKindOf(t.descriptor.opcode))].fetch_add(1, std::memory_order_relaxed);
        Process(self, t.descriptor, taken_ns);
        work = true;
        break;
      }
    }
  }
}

void DataPlane::Process(const std::shared_ptr<Session>& s, const SubmitDescriptor& d, int64_t taken_ns) {
  handlers_.Handle(s, s->ring->arena(), d, taken_ns);
}

void DataPlane::CheckPinLeases(const std::vector<std::shared_ptr<Session>>& active, int64_t now_ns) {
  for (const auto& s : active) {
    if (s->dead) continue;
    s->lease.Observe(s->ring->client_heartbeat(), now_ns);
    if (!s->lease.Expired(now_ns)) continue;
    const RequestHandlers::Lapsed lapsed = handlers_.LapsePins(*s);
    if (lapsed.handles == 0) continue;
    pin_lapses_.fetch_add(1, std::memory_order_relaxed);
    pin_lapsed_blocks_.fetch_add(lapsed.blocks, std::memory_order_relaxed);
    lapse_log_.Warning("dataplane",
                       "session {}: pins lapsed after {} ms without renewal (process stopped?): {} match handles "
                       "released, {} blocks unpinned (--pin-lease)",
                       s->id(), s->lease.SilentNs(now_ns) / 1000000, lapsed.handles, lapsed.blocks);
  }
}

void DataPlane::PollerLoop() {
  std::vector<std::shared_ptr<Session>> active;
  uint64_t seen_generation = ~0ULL;
  int64_t last_work_ns = NowNs();
  // Pin leases are checked a few times per lease, and at least every 200 ms (the longest park).
  const int64_t lease_ns = options_.pins.lease_ms * 1000000;
  const int64_t lease_check_ns = std::clamp<int64_t>(lease_ns / 4, 1000000, 200000000);
  int64_t next_lease_check_ns = NowNs() + lease_check_ns;
  const int64_t park_ms = lease_ns > 0 ? lease_check_ns / 1000000 : 200;
  epoll_event events[64];
  while (!stopping_.load(std::memory_order_relaxed)) {
    if (seen_generation != generation_.load()) {
      MutexLock lock(&mu_);
      seen_generation = generation_.load();
      active.clear();
      for (auto& [id, s] : sessions_) active.push_back(s);
      // Awake: new sessions (which start "parked", see OpenSession) may stop ringing the doorbell.
      for (auto& s : active) s->ring->Unpark();
    }
    bool work = false;
    for (auto& s : active) {
      if (!s->dead) work |= PollSession(s);
    }
    const int64_t now = NowNs();
    const bool stores_waiting = handlers_.RetryWaitingStores(now);
    last_turn_ms_.store(now / 1000000, std::memory_order_relaxed);
    if (lease_ns > 0 && now >= next_lease_check_ns) {
      CheckPinLeases(active, now);
      next_lease_check_ns = now + lease_check_ns;
    }
    if (work) {
      last_work_ns = now;
      continue;
    }
    if (now - last_work_ns < options_.spin_ns) {
      // Spin a couple of microseconds, then keep polling but yield between polls: a client that shares this
      // CPU (more spinning threads than cores) then runs at once instead of after the whole spin window.
      if (now - last_work_ns < 2000) {
        CpuRelax();
      } else {
        sched_yield();
      }
      continue;
    }
    // Park: announce it, then look once more (a client that pushed before seeing the flag is caught here;
    // one that sees it rings the doorbell).
    bool pending = false;   // submissions we can take now
    bool backlog = false;   // completions waiting for the client to make room (e.g. it is stopped)
    for (auto& s : active) {
      pending |= !s->ring->Park();
      backlog |= s->ring->HasBacklog();
    }
    int n = 0;
    if (!pending) n = epoll_wait(epoll_fd_.get(), events, 64, stores_waiting ? 1 : backlog ? 5 : static_cast<int>(park_ms));
    last_turn_ms_.store(MonotonicMs(), std::memory_order_relaxed);
    for (int i = 0; i < n; ++i) {
      uint64_t drained;
      // epoll_event is packed on x86-64: its u64 is misaligned, so it is copied out, never bound to a reference.
      const uint64_t tag = events[i].data.u64;
      if (tag == 0) {
        ssize_t ignored = read(wake_fd_.get(), &drained, sizeof(drained));
        (void)ignored;
        continue;
      }
      MutexLock lock(&mu_);
      auto it = sessions_.find(tag);
      if (it != sessions_.end()) {
        it->second->ring->DrainDoorbell();
      }
    }
    for (auto& s : active) s->ring->Unpark();
    last_work_ns = NowNs();
  }
}

}  // namespace flexkv
