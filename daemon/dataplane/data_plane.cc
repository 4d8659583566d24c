// The session table, the rings and their poller; see data_plane.h.
#include "daemon/dataplane/data_plane.h"

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <fmt/format.h>
#include <linux/futex.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>

#include "common/clock.h"
#include "common/log.h"
#include "common/ring_layout.h"
#include "common/uds.h"

namespace flexkv {
namespace {

void FutexWakeAll(std::atomic<uint32_t>* addr) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

}  // namespace

struct DataPlane::Session final : RequestSession {
  Session(DataPlane* owner, uint64_t id, const Geometry& geometry) : RequestSession(id, geometry), plane(owner) {}
  DataPlane* const plane;
  RingGeometry rg{};
  uint8_t* ring = nullptr;
  RingHeader* hdr = nullptr;
  UniqueFd doorbell;

  std::mutex mu;                                            // guards the completion side below
  std::deque<CompletionDescriptor> overflow;                // completions waiting for ring space
  uint32_t completion_tail = 0;                             // our copy of the producer index
  uint32_t submit_head = 0;                                 // consumer index; poller thread only
  std::atomic<bool> dead{false};
  std::atomic<uint64_t> inflight{0};                        // requests submitted, not yet completed

  ~Session() override {
    if (ring != nullptr) munmap(ring, rg.total_bytes());
  }
  void Post(const CompletionDescriptor& c) override { plane->Complete(*this, c); }
  bool ended() const override { return dead.load(); }
  const SubmitDescriptor* submit_entries() const {
    return reinterpret_cast<const SubmitDescriptor*>(ring + rg.submit_offset());
  }
  CompletionDescriptor* completion_entries() const {
    return reinterpret_cast<CompletionDescriptor*>(ring + rg.completion_offset());
  }
  const uint8_t* arena() const { return ring + rg.arena_offset(); }
};

DataPlane::DataPlane(Cache* cache, Lifecycle* lifecycle, EngineMemoryBackends* backends, DataPlaneOptions options)
    : backends_(backends),
      options_(options),
      dram_(cache),
      copies_(&dram_),
      handlers_(cache, lifecycle, &copies_, &metrics_, options.max_blocks_per_request) {}

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
  copies_.WaitIdle();  // every accepted request ends
}

Result<std::vector<UniqueFd>> DataPlane::OpenSession(uint64_t session_id, const Geometry& geometry) {
  auto s = std::make_shared<Session>(this, session_id, geometry);
  s->rg = RingGeometry{options_.submit_entries, options_.completion_entries, options_.arena_bytes};
  UniqueFd memfd(static_cast<int>(syscall(SYS_memfd_create, "flexkv-rings", MFD_CLOEXEC | MFD_ALLOW_SEALING)));
  if (!memfd) return Status::ResourceExhausted(fmt::format("memfd_create: {}", ErrnoText(errno)));
  const uint64_t bytes = s->rg.total_bytes();
  if (ftruncate(memfd.get(), static_cast<off_t>(bytes)) != 0) {
    return Status::ResourceExhausted(fmt::format("sizing the ring memfd to {} bytes: {}", bytes, ErrnoText(errno)));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd.get(), 0);
  if (p == MAP_FAILED) return Status::ResourceExhausted(fmt::format("mmap rings: {}", ErrnoText(errno)));
  s->ring = static_cast<uint8_t*>(p);
  s->hdr = new (p) RingHeader{};
  s->hdr->magic = kRingMagic;
  s->hdr->layout_version = kRingLayoutVersion;
  s->hdr->submit_entries = s->rg.submit_entries;
  s->hdr->completion_entries = s->rg.completion_entries;
  s->hdr->submit_offset = s->rg.submit_offset();
  s->hdr->completion_offset = s->rg.completion_offset();
  s->hdr->arena_offset = s->rg.arena_offset();
  s->hdr->arena_bytes = s->rg.arena_bytes;
  s->hdr->total_bytes = bytes;
  // The poller may be parked in epoll_wait with a session list that lacks this one: until it picks the
  // session up (and clears the flag, below in PollerLoop) the client must ring the doorbell, which epoll
  // already watches. Starting at 0 made a new session's first request wait out the 200 ms park.
  s->hdr->daemon_parked.value.store(1, std::memory_order_seq_cst);
  // The client can neither shrink nor grow the mapping under the daemon, nor remove these seals.
  if (fcntl(memfd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return Status::Internal(fmt::format("sealing the ring memfd: {}", ErrnoText(errno)));
  }
  s->doorbell.reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!s->doorbell) return Status::ResourceExhausted(fmt::format("eventfd: {}", ErrnoText(errno)));
  UniqueFd client_doorbell(fcntl(s->doorbell.get(), F_DUPFD_CLOEXEC, 0));
  if (!client_doorbell) return Status::ResourceExhausted(fmt::format("dup: {}", ErrnoText(errno)));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = session_id;
  if (epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, s->doorbell.get(), &ev) != 0) {
    return Status::Internal(fmt::format("epoll_ctl(doorbell): {}", ErrnoText(errno)));
  }
  {
    std::lock_guard lock(mu_);
    sessions_[session_id] = s;
  }
  generation_.fetch_add(1);
  std::vector<UniqueFd> fds;
  fds.push_back(std::move(memfd));
  fds.push_back(std::move(client_doorbell));
  return fds;
}

Result<uint64_t> DataPlane::RegisterKv(uint64_t session_id, KvRegistration registration) {
  std::shared_ptr<Session> s;
  {
    std::lock_guard lock(mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) {
      return Status::FailedPrecondition(fmt::format("session {} has no open session channel", session_id));
    }
    s = it->second;
  }
  return s->kv().Register(*backends_, std::move(registration));
}

void DataPlane::EndSession(uint64_t session_id) {
  std::shared_ptr<Session> s;
  {
    std::lock_guard lock(mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) return;
    s = std::move(it->second);
    sessions_.erase(it);
  }
  generation_.fetch_add(1);
  epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, s->doorbell.get(), nullptr);
  {
    std::lock_guard lock(s->mu);
    s->dead = true;
    s->overflow.clear();
  }
  handlers_.EndSession(*s);
  // Copies still running hold `s` (and its KV mapping) until they finish; nothing waits for them here.
}

DataPlane::SessionStats DataPlane::StatsOf(uint64_t session_id) const {
  std::shared_ptr<Session> s;
  {
    std::lock_guard lock(mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) return {};
    s = it->second;
  }
  return {s->pinned_blocks(), s->inflight.load()};
}

void DataPlane::Complete(Session& s, CompletionDescriptor c) {
  std::lock_guard lock(s.mu);
  if (s.dead) return;
  s.overflow.push_back(c);
  FlushOverflow(s);
}

bool DataPlane::FlushOverflow(Session& s) {
  // Called with s.mu held.
  if (s.overflow.empty()) return false;
  const uint32_t entries = s.rg.completion_entries;
  const uint32_t head = s.hdr->completion_head.value.load(std::memory_order_acquire);
  bool wrote = false;
  while (!s.overflow.empty() && s.completion_tail - head < entries) {
    s.completion_entries()[s.completion_tail & (entries - 1)] = s.overflow.front();
    const bool progress = (s.overflow.front().flags & kCompletionFlagLayerDone) != 0;
    s.overflow.pop_front();
    ++s.completion_tail;
    if (!progress) s.inflight.fetch_sub(1);
    wrote = true;
  }
  if (wrote) {
    s.hdr->completion_tail.value.store(s.completion_tail, std::memory_order_seq_cst);
    if (s.hdr->client_waiting.value.load(std::memory_order_seq_cst) != 0) FutexWakeAll(&s.hdr->completion_tail.value);
  }
  return wrote;
}

void DataPlane::Fail(Session& s, const SubmitDescriptor& d, int64_t taken_ns, const Status& status) {
  handlers_.Fail(s, d, taken_ns, status);
}

bool DataPlane::PollSession(const std::shared_ptr<Session>& self) {
  Session& s = *self;
  bool work = false;
  {
    std::lock_guard lock(s.mu);
    work = FlushOverflow(s);
  }
  RingHeader* h = s.hdr;
  const uint32_t entries = s.rg.submit_entries;
  // The head is ours: the copy in shared memory only tells the client how far we are, and is never read back
  // (a client rewinding it cannot make us run old descriptors again).
  uint32_t head = s.submit_head;
  const uint32_t tail = h->submit_tail.value.load(std::memory_order_acquire);
  if (tail == head) return work;
  if (tail - head > entries) {
    // The client moved its tail past what the ring can hold: nothing in it can be trusted. Say so once per
    // completion slot; a client that keeps doing it without reading completions gets no more (bounded memory).
    s.submit_head = tail;
    h->submit_head.value.store(tail, std::memory_order_release);
    if (s.inflight.load() >= s.rg.completion_entries) return true;
    SubmitDescriptor none{};
    s.inflight.fetch_add(1);
    metrics_.taken[Index(OpKind::kInvalid)].fetch_add(1, std::memory_order_relaxed);
    Fail(s, none, NowNs(),
         Status::InvalidArgument(fmt::format("submit_tail {} is {} entries past head {}; ring holds {}", tail,
                                             tail - head, head, entries)));
    return true;
  }
  // Back-pressure: never accept more than the completion ring can eventually hold.
  while (head != tail && s.inflight.load() < s.rg.completion_entries) {
    SubmitDescriptor d;
    std::memcpy(&d, &s.submit_entries()[head & (entries - 1)], sizeof(d));  // copied once, then validated
    ++head;
    s.submit_head = head;
    h->submit_head.value.store(head, std::memory_order_release);
    s.inflight.fetch_add(1);
    const int64_t taken_ns = NowNs();
    metrics_.taken[Index(OpKindOf(d.opcode))].fetch_add(1, std::memory_order_relaxed);
    Process(self, d, taken_ns);
    work = true;
  }
  return work;
}

void DataPlane::Process(const std::shared_ptr<Session>& s, const SubmitDescriptor& d, int64_t taken_ns) {
  handlers_.Handle(s, std::span<const uint8_t>(s->arena(), s->rg.arena_bytes), d, taken_ns);
}

void DataPlane::PollerLoop() {
  std::vector<std::shared_ptr<Session>> active;
  uint64_t seen_generation = ~0ULL;
  int64_t last_work_ns = NowNs();
  epoll_event events[64];
  while (!stopping_.load(std::memory_order_relaxed)) {
    if (seen_generation != generation_.load()) {
      std::lock_guard lock(mu_);
      seen_generation = generation_.load();
      active.clear();
      for (auto& [id, s] : sessions_) active.push_back(s);
      // Awake: new sessions (which start "parked", see OpenSession) may stop ringing the doorbell.
      for (auto& s : active) s->hdr->daemon_parked.value.store(0, std::memory_order_seq_cst);
    }
    bool work = false;
    for (auto& s : active) {
      if (!s->dead) work |= PollSession(s);
    }
    const int64_t now = NowNs();
    last_turn_ms_.store(now / 1000000, std::memory_order_relaxed);
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
    for (auto& s : active) s->hdr->daemon_parked.value.store(1, std::memory_order_seq_cst);
    bool pending = false;   // submissions we can take now
    bool backlog = false;   // completions waiting for the client to make room (e.g. it is stopped)
    for (auto& s : active) {
      if (s->inflight.load() < s->rg.completion_entries) {
        pending |= s->hdr->submit_tail.value.load(std::memory_order_seq_cst) != s->submit_head;
      }
      std::lock_guard lock(s->mu);
      backlog |= !s->overflow.empty();
    }
    int n = 0;
    if (!pending) n = epoll_wait(epoll_fd_.get(), events, 64, backlog ? 5 : 200);
    last_turn_ms_.store(MonotonicMs(), std::memory_order_relaxed);
    for (int i = 0; i < n; ++i) {
      uint64_t drained;
      if (events[i].data.u64 == 0) {
        ssize_t ignored = read(wake_fd_.get(), &drained, sizeof(drained));
        (void)ignored;
        continue;
      }
      std::lock_guard lock(mu_);
      auto it = sessions_.find(events[i].data.u64);
      if (it != sessions_.end()) {
        ssize_t ignored = read(it->second->doorbell.get(), &drained, sizeof(drained));
        (void)ignored;
      }
    }
    for (auto& s : active) s->hdr->daemon_parked.value.store(0, std::memory_order_seq_cst);
    last_work_ns = NowNs();
  }
}

}  // namespace flexkv
