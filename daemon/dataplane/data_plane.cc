// The session rings and their poller; see data_plane.h.
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
#include "daemon/dataplane/descriptor_validation.h"

namespace flexkv {
struct DataPlane::Session {
  uint64_t id = 0;
  Geometry geometry;
  std::unique_ptr<ring::RingConsumer> ring;                  // the rings' daemon end; set once by OpenSession

  std::mutex mu;                                            // guards everything below
  std::shared_ptr<HostKv> kv;
  std::vector<std::shared_ptr<GpuKv>> gpu_kv;               // by TP rank; empty without GPU registration

  // The KV buffers' block count, once registered (host, or every GPU rank); 0 otherwise.
  uint32_t RegisteredBlocksLocked(std::string* missing) const {
    if (kv) return kv->num_blocks();
    if (gpu_kv.empty()) {
      *missing = "no KV buffers registered (RegisterKv)";
      return 0;
    }
    uint32_t blocks = UINT32_MAX;
    for (size_t r = 0; r < gpu_kv.size(); ++r) {
      if (!gpu_kv[r]) {
        *missing = fmt::format("tp rank {} of {} has not registered its GPU KV buffers", r, gpu_kv.size());
        return 0;
      }
      blocks = std::min(blocks, GpuKvNumBlocks(*gpu_kv[r]));
    }
    return blocks;
  }
  struct Handle {
    std::vector<SlotId> slots;
    uint32_t loads_in_flight = 0;
    bool released = false;  // Release or session end arrived while a load was copying
  };
  std::map<uint64_t, Handle> handles;
  uint64_t next_handle = 1;
  std::atomic<bool> dead{false};
  std::atomic<uint64_t> pinned{0};
};

DataPlane::DataPlane(Cache* cache, Lifecycle* lifecycle, CudaBackend* cuda, DataPlaneOptions options)
    : cache_(cache), lifecycle_(lifecycle), cuda_(cuda), options_(options) {}

DataPlane::~DataPlane() { Stop(); }

Status DataPlane::Start() {
  unsigned threads = options_.copy_threads;
  if (threads == 0) threads = std::max(2u, std::thread::hardware_concurrency());
  workers_ = std::make_unique<WorkerPool>(threads);
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
  workers_.reset();  // runs what is queued: every accepted request ends
}

Result<std::vector<UniqueFd>> DataPlane::OpenSession(uint64_t session_id, const Geometry& geometry) {
  auto s = std::make_shared<Session>();
  s->id = session_id;
  s->geometry = geometry;
  auto created = ring::RingConsumer::Create(
      RingGeometry{options_.submit_entries, options_.completion_entries, options_.arena_bytes});
  if (!created.ok()) return created.status();
  s->ring = std::move(created->consumer);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = session_id;
  if (epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, s->ring->doorbell_fd(), &ev) != 0) {
    return Status::Internal(fmt::format("epoll_ctl(doorbell): {}", ErrnoText(errno)));
  }
  {
    std::lock_guard lock(mu_);
    sessions_[session_id] = s;
  }
  generation_.fetch_add(1);
  std::vector<UniqueFd> fds;
  fds.push_back(std::move(created->memfd));
  fds.push_back(std::move(created->doorbell));
  return fds;
}

Result<uint64_t> DataPlane::RegisterHostKv(uint64_t session_id, UniqueFd memfd, KvLayout layout, uint32_t num_blocks) {
  std::shared_ptr<Session> s;
  {
    std::lock_guard lock(mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) {
      return Status::FailedPrecondition(fmt::format("session {} has no open session channel", session_id));
    }
    s = it->second;
  }
  auto kv = HostKv::Map(std::move(memfd), s->geometry, layout, num_blocks);
  if (!kv.ok()) return kv.status();
  std::lock_guard lock(s->mu);
  if (s->kv || !s->gpu_kv.empty()) {
    return Status::AlreadyExists(fmt::format("session {} already registered its KV buffers", session_id));
  }
  s->kv = std::move(*kv);
  log::Info("dataplane", "session {} registered host KV: {} blocks", session_id, num_blocks);
  return KvBytesRequired(s->geometry, num_blocks);
}

Status DataPlane::RegisterGpuKv(uint64_t session_id, const GpuKvDescription& description) {
  if (cuda_ == nullptr) {
    return Status::FailedPrecondition("this flexkvd has no CUDA backend (no GPU visible or built without CUDA)");
  }
  std::shared_ptr<Session> s;
  {
    std::lock_guard lock(mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) {
      return Status::FailedPrecondition(fmt::format("session {} has no open session channel", session_id));
    }
    s = it->second;
  }
  // Refusals that need no driver work come first (Open maps memory: a repeated registration must not redo it).
  auto check_slot = [&]() -> Status {
    if (s->kv) return Status::AlreadyExists(fmt::format("session {} registered host KV buffers already", session_id));
    const uint32_t ranks = s->geometry.tp_size;
    if (description.tp_rank >= ranks) {
      return Status::InvalidArgument(fmt::format("tp_rank {} is not below tp_size {}", description.tp_rank, ranks));
    }
    if (!s->gpu_kv.empty() && s->gpu_kv[description.tp_rank]) {
      return Status::AlreadyExists(fmt::format("tp rank {} of session {} is registered already", description.tp_rank, session_id));
    }
    return Status::Ok();
  };
  {
    std::lock_guard lock(s->mu);
    FLEXKV_RETURN_IF_ERROR(check_slot());
  }
  FLEXKV_RETURN_IF_ERROR(cache_->RegisterPoolForDma(*cuda_));
  auto kv = cuda_->Open(description, s->geometry);
  if (!kv.ok()) return kv.status();
  std::lock_guard lock(s->mu);
  FLEXKV_RETURN_IF_ERROR(check_slot());  // again: another registration of this rank may have won meanwhile
  if (s->gpu_kv.empty()) s->gpu_kv.resize(s->geometry.tp_size);
  s->gpu_kv[description.tp_rank] = std::move(*kv);
  return Status::Ok();
}

void DataPlane::ReleaseHandleLocked(Session& s, uint64_t handle) {
  auto it = s.handles.find(handle);
  if (it == s.handles.end()) return;
  if (it->second.loads_in_flight > 0) {
    it->second.released = true;  // the last load copying from these slots unpins them
    return;
  }
  cache_->Unpin(it->second.slots);
  s.pinned.fetch_sub(it->second.slots.size());
  s.handles.erase(it);
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
  epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, s->ring->doorbell_fd(), nullptr);
  std::lock_guard lock(s->mu);
  s->dead = true;
  std::vector<uint64_t> handles;
  for (const auto& [h, unused] : s->handles) handles.push_back(h);
  for (uint64_t h : handles) ReleaseHandleLocked(*s, h);
  s->ring->Close();
  // Copies still running hold `s` (and its KV mapping) until they finish; nothing waits for them here.
}

DataPlane::SessionStats DataPlane::StatsOf(uint64_t session_id) const {
  std::lock_guard lock(mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return {};
  return {it->second->pinned.load(), it->second->ring->inflight()};
}

void DataPlane::Complete(Session& s, CompletionDescriptor c) { s.ring->Post(c); }

void DataPlane::Fail(Session& s, const SubmitDescriptor& d, int64_t taken_ns, const Status& status) {
  CompletionDescriptor c{};
  c.user_data = d.user_data;
  c.status_code = static_cast<int32_t>(status.code());
  c.opcode = d.opcode;
  std::snprintf(c.message, sizeof(c.message), "%s", status.message().c_str());
  RecordEnd(d.opcode, taken_ns, c.status_code);
  Complete(s, c);
}

void DataPlane::RecordCopy(OpKind op, int64_t taken_ns, int64_t copy_start_ns) {
  metrics_.wait[Index(op)].Observe(copy_start_ns - taken_ns);
  metrics_.transfer[Index(op)].Observe(NowNs() - copy_start_ns);
}

void DataPlane::RecordEnd(uint16_t opcode, int64_t taken_ns, int32_t status_code) {
  const OpKind op = OpKindOf(opcode);
  if (op != OpKind::kInvalid) metrics_.end_to_end[Index(op)].Observe(NowNs() - taken_ns);
  if (status_code != 0) metrics_.errors[Index(op)].Add(static_cast<StatusCode>(status_code));
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
        metrics_.taken[Index(OpKindOf(t.descriptor.opcode))].fetch_add(1, std::memory_order_relaxed);
        Process(self, t.descriptor, taken_ns);
        work = true;
        break;
      }
    }
  }
}

void DataPlane::Process(const std::shared_ptr<Session>& sp, const SubmitDescriptor& d, int64_t taken_ns) {
  Session& s = *sp;
  DescriptorLimits limits;
  limits.max_blocks_per_request = options_.max_blocks_per_request;
  std::string kv_missing;
  const auto op = static_cast<RingOp>(d.opcode);
  if (op == RingOp::kLoad || op == RingOp::kStore) {
    // Registration only ever goes from nothing to every block (once per session, or once per GPU rank), so the
    // count read here still holds when the copy runs.
    std::lock_guard lock(s.mu);
    limits.registered_blocks = s.RegisteredBlocksLocked(&kv_missing);
    limits.kv_missing = kv_missing;
  }
  Result<DescriptorPayload> payload =
      ValidateDescriptor(d, s.ring->arena(), limits);
  if (!payload.ok()) return Fail(s, d, taken_ns, payload.status());
  if (!cache_->has_pool()) return Fail(s, d, taken_ns, Status::FailedPrecondition("the pool does not exist yet"));
  std::vector<BlockKey> keys = std::move(payload->keys);
  std::vector<uint32_t> ids = std::move(payload->block_ids);

  switch (op) {
    case RingOp::kMatch: {
      const bool pin = (d.flags & kMatchFlagPin) != 0;
      std::vector<SlotId> slots;
      const size_t hit = cache_->Match(keys, pin, pin ? &slots : nullptr);
      auto& counters = cache_->counters();
      counters.match_requests.fetch_add(1, std::memory_order_relaxed);
      counters.match_blocks.fetch_add(d.count, std::memory_order_relaxed);
      counters.hit_blocks.fetch_add(hit, std::memory_order_relaxed);
      CompletionDescriptor c{};
      c.user_data = d.user_data;
      c.opcode = d.opcode;
      c.matched_blocks = static_cast<uint32_t>(hit);
      if (pin && hit > 0) {
        std::lock_guard lock(s.mu);
        if (s.dead) {
          cache_->Unpin(slots);
          return;
        }
        c.match_handle = s.next_handle++;
        s.pinned.fetch_add(slots.size());
        s.handles[c.match_handle].slots = std::move(slots);
      }
      RecordEnd(d.opcode, taken_ns, 0);
      return Complete(s, c);
    }
    case RingOp::kRelease: {
      std::lock_guard lock(s.mu);
      auto it = s.handles.find(d.match_handle);
      const Status held = ValidateHandleUse(
          d, it == s.handles.end() || it->second.released ? std::nullopt : std::optional(it->second.slots.size()));
      if (!held.ok()) {
        CompletionDescriptor c{};
        c.user_data = d.user_data;
        c.opcode = d.opcode;
        c.status_code = static_cast<int32_t>(held.code());
        std::snprintf(c.message, sizeof(c.message), "%s", held.message().c_str());
        RecordEnd(d.opcode, taken_ns, c.status_code);
        Complete(s, c);
        return;
      }
      ReleaseHandleLocked(s, d.match_handle);
      CompletionDescriptor c{};
      c.user_data = d.user_data;
      c.opcode = d.opcode;
      RecordEnd(d.opcode, taken_ns, 0);
      Complete(s, c);
      return;
    }
    case RingOp::kLoad:
      return StartLoad(sp, d, taken_ns, std::move(ids));
    case RingOp::kStore:
      return StartStore(sp, d, taken_ns, std::move(keys), std::move(ids));
  }
}

// Splits `count` blocks over the workers; `done` runs once, after the last part, with when the first began.
namespace {

struct Fanout {
  std::atomic<uint32_t> parts_left;
  std::atomic<int64_t> start_ns{0};  // when the first part began
  std::function<void(int64_t)> done;
};

void RunParts(WorkerPool& pool, uint32_t count, const std::function<void(uint32_t, uint32_t)>& part,
              std::function<void(int64_t start_ns)> done) {
  const uint32_t parts = std::max(1u, std::min(count, pool.size()));
  auto fan = std::make_shared<Fanout>();
  fan->parts_left = parts;
  fan->done = std::move(done);
  for (uint32_t i = 0; i < parts; ++i) {
    const uint32_t begin = static_cast<uint32_t>(uint64_t{count} * i / parts);
    const uint32_t end = static_cast<uint32_t>(uint64_t{count} * (i + 1) / parts);
    pool.Submit([fan, part, begin, end] {
      if (fan->start_ns.load(std::memory_order_relaxed) == 0) {
        int64_t unset = 0;
        fan->start_ns.compare_exchange_strong(unset, NowNs(), std::memory_order_relaxed);
      }
      part(begin, end);
      if (fan->parts_left.fetch_sub(1) == 1) fan->done(fan->start_ns.load(std::memory_order_relaxed));
    });
  }
}

}  // namespace

void DataPlane::RunCopies(const std::shared_ptr<Session>& sp, bool to_host,
                          std::shared_ptr<std::vector<uint32_t>> kv_blocks, std::shared_ptr<std::vector<SlotId>> slots,
                          std::function<void(uint32_t)> layer_done,
                          std::function<void(Status, int64_t copy_start_ns)> done) {
  std::shared_ptr<HostKv> host;
  std::vector<std::shared_ptr<GpuKv>> ranks;
  {
    std::lock_guard lock(sp->mu);
    host = sp->kv;
    ranks = sp->gpu_kv;
  }
  const uint32_t count = static_cast<uint32_t>(slots->size());
  if (host) {
    Cache* cache = cache_;
    RunParts(
        *workers_, count,
        [host, kv_blocks, slots, cache, to_host](uint32_t begin, uint32_t end) {
          for (uint32_t i = begin; i < end; ++i) {
            if (to_host) {
              host->CopyToSlot((*kv_blocks)[i], cache->SlotData((*slots)[i]));
            } else {
              host->CopyFromSlot(cache->SlotData((*slots)[i]), (*kv_blocks)[i]);
            }
          }
        },
        [layer_done, done, this, sp](int64_t start_ns) {
          if (layer_done) {
            for (uint32_t l = 0; l < sp->geometry.num_layers; ++l) layer_done(l);
          }
          done(Status::Ok(), start_ns);
        });
    return;
  }
  // GPU: every TP rank copies its shard. MLA KV is identical on every rank: stored once (rank 0), loaded
  // into every rank.
  if (to_host && sp->geometry.is_mla()) ranks.resize(1);
  struct FanIn {
    std::mutex mu;
    uint32_t left;
    Status first_error;
    std::vector<uint32_t> layer_left;
  };
  auto fan = std::make_shared<FanIn>();
  fan->left = static_cast<uint32_t>(ranks.size());
  fan->layer_left.assign(sp->geometry.num_layers, fan->left);
  const int64_t handed_ns = NowNs();  // the backend's own queueing counts as transfer
  for (const auto& rank : ranks) {
    std::function<void(uint32_t)> on_layer;
    if (layer_done) {
      on_layer = [fan, layer_done](uint32_t layer) {
        bool all;
        {
          std::lock_guard lock(fan->mu);
          all = --fan->layer_left[layer] == 0;
        }
        if (all) layer_done(layer);
      };
    }
    cuda_->Copy(rank, to_host, *kv_blocks, *slots, std::move(on_layer), [fan, done, handed_ns](Status st) {
      bool last;
      Status result;
      {
        std::lock_guard lock(fan->mu);
        if (!st.ok() && fan->first_error.ok()) fan->first_error = st;
        last = --fan->left == 0;
        result = fan->first_error;
      }
      if (last) done(result, handed_ns);
    });
  }
}

void DataPlane::StartLoad(const std::shared_ptr<Session>& sp, const SubmitDescriptor& d, int64_t taken_ns,
                          std::vector<uint32_t> ids) {
  Session& s = *sp;
  std::vector<SlotId> slots;
  auto refuse_locked = [&](const Status& status) {
    CompletionDescriptor c{};
    c.user_data = d.user_data;
    c.opcode = d.opcode;
    c.status_code = static_cast<int32_t>(status.code());
    std::snprintf(c.message, sizeof(c.message), "%s", status.message().c_str());
    RecordEnd(d.opcode, taken_ns, c.status_code);
    Complete(s, c);
  };
  {
    // Process validated the descriptor and its block ids; the handle is looked up here, under the lock that
    // also takes its slots.
    std::lock_guard lock(s.mu);
    auto it = s.handles.find(d.match_handle);
    const Status held = ValidateHandleUse(
        d, it == s.handles.end() || it->second.released ? std::nullopt : std::optional(it->second.slots.size()));
    if (!held.ok()) return refuse_locked(held);
    if (!lifecycle_->TryBegin()) return refuse_locked(Status::Unavailable("flexkvd is draining; retry after Resume"));
    it->second.loads_in_flight++;
    slots.assign(it->second.slots.begin(), it->second.slots.begin() + d.count);
  }
  const uint64_t block_bytes = cache_->block_bytes();
  std::function<void(uint32_t)> layer_done;
  if ((d.flags & kLoadFlagLayerwise) != 0) {
    layer_done = [this, sp, d](uint32_t layer) {
      CompletionDescriptor p{};
      p.user_data = d.user_data;
      p.opcode = d.opcode;
      p.flags = kCompletionFlagLayerDone;
      p.matched_blocks = layer;
      Complete(*sp, p);
    };
  }
  RunCopies(sp, /*to_host=*/false, std::make_shared<std::vector<uint32_t>>(std::move(ids)),
            std::make_shared<std::vector<SlotId>>(std::move(slots)), std::move(layer_done),
            [this, sp, d, block_bytes, taken_ns](Status st, int64_t copy_start_ns) {
              RecordCopy(OpKind::kLoad, taken_ns, copy_start_ns);
              Session& ss = *sp;
              CompletionDescriptor c{};
              c.user_data = d.user_data;
              c.opcode = d.opcode;
              if (st.ok()) {
                c.done_blocks = d.count;
                cache_->counters().load_blocks.fetch_add(d.count, std::memory_order_relaxed);
                cache_->counters().bytes_loaded.fetch_add(uint64_t{d.count} * block_bytes, std::memory_order_relaxed);
              } else {
                c.status_code = static_cast<int32_t>(st.code());
                std::snprintf(c.message, sizeof(c.message), "%s", st.message().c_str());
              }
              RecordEnd(d.opcode, taken_ns, c.status_code);
              {
                std::lock_guard lock(ss.mu);
                auto it = ss.handles.find(d.match_handle);
                if (it != ss.handles.end() && --it->second.loads_in_flight == 0 && it->second.released) {
                  it->second.released = false;
                  ReleaseHandleLocked(ss, d.match_handle);
                }
                if (!ss.dead) {
                  Complete(ss, c);
                }
              }
              lifecycle_->Finish();
            });
}

void DataPlane::StartStore(const std::shared_ptr<Session>& sp, const SubmitDescriptor& d, int64_t taken_ns,
                           std::vector<BlockKey> keys, std::vector<uint32_t> ids) {
  Session& s = *sp;  // Process validated the descriptor and the block ids against the registered blocks
  if (!lifecycle_->TryBegin()) {
    return Fail(s, d, taken_ns, Status::Unavailable("flexkvd is draining; retry after Resume"));
  }
  PrefixIndex::Reservation r = cache_->Reserve(keys);
  const uint32_t reserved = static_cast<uint32_t>(r.slots.size());
  CompletionDescriptor c{};
  c.user_data = d.user_data;
  c.opcode = d.opcode;
  c.matched_blocks = static_cast<uint32_t>(r.cached);
  c.done_blocks = reserved;
  if (r.shortfall != StatusCode::kOk) {
    c.status_code = static_cast<int32_t>(r.shortfall);
    const size_t stopped = r.cached + reserved;
    if (r.shortfall == StatusCode::kResourceExhausted) {
      std::snprintf(c.message, sizeof(c.message), "pool full of pinned blocks: stored blocks up to %zu of %u", stopped,
                    d.count);
    } else {
      std::snprintf(c.message, sizeof(c.message), "block %zu is being stored by another request", stopped);
    }
  }
  if (reserved == 0) {
    RecordEnd(d.opcode, taken_ns, c.status_code);
    lifecycle_->Finish();
    return Complete(s, c);
  }
  const size_t first = r.cached;
  auto keys_shared = std::make_shared<std::vector<BlockKey>>(std::move(keys));
  auto src = std::make_shared<std::vector<uint32_t>>(ids.begin() + static_cast<ptrdiff_t>(first),
                                                     ids.begin() + static_cast<ptrdiff_t>(first + reserved));
  auto slots_shared = std::make_shared<std::vector<SlotId>>(std::move(r.slots));
  const uint64_t block_bytes = cache_->block_bytes();
  RunCopies(sp, /*to_host=*/true, src, slots_shared, nullptr,
            [this, sp, c, keys_shared, slots_shared, first, block_bytes, taken_ns](Status st,
                                                                                   int64_t copy_start_ns) mutable {
              RecordCopy(OpKind::kStore, taken_ns, copy_start_ns);
              // Publish after transfer; a failed copy, or a session that died meanwhile, returns the slots.
              if (!st.ok() || sp->dead) {
                cache_->Abort(*slots_shared);
                if (!st.ok()) {
                  c.status_code = static_cast<int32_t>(st.code());
                  c.done_blocks = 0;
                  std::snprintf(c.message, sizeof(c.message), "%s", st.message().c_str());
                }
              } else {
                cache_->Commit(*keys_shared, first, *slots_shared);
                cache_->counters().store_blocks.fetch_add(slots_shared->size(), std::memory_order_relaxed);
                cache_->counters().bytes_stored.fetch_add(slots_shared->size() * block_bytes, std::memory_order_relaxed);
              }
              RecordEnd(c.opcode, taken_ns, c.status_code);
              Complete(*sp, c);
              lifecycle_->Finish();
            });
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
      for (auto& s : active) s->ring->Unpark();
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
    bool pending = false;   // submissions we can take now
    bool backlog = false;   // completions waiting for the client to make room (e.g. it is stopped)
    for (auto& s : active) {
      pending |= !s->ring->Park();
      backlog |= s->ring->HasBacklog();
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
        it->second->ring->DrainDoorbell();
      }
    }
    for (auto& s : active) s->ring->Unpark();
    last_work_ns = NowNs();
  }
}

}  // namespace flexkv
