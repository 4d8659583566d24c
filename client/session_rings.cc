// See session_rings.h.
#include "client/session_rings.h"

#include <fmt/format.h>
#include <poll.h>
#include <pthread.h>

#include <algorithm>
#include <cstring>

#include "common/clock.h"
#include "common/uds.h"

namespace flexkv {

LeaseRenewer::LeaseRenewer(std::chrono::milliseconds interval, std::function<void()> beat)
    : thread_([this, interval, beat = std::move(beat)] {
        MutexLock lock(&mu_);
        while (!stopping_) {
          beat();
          mu_.WaitFor(&wake_, interval);
        }
      }) {
  MutexLock lock(&mu_);
  pthread_setname_np(thread_.native_handle(), "flexkv-lease");  // what `top -H` shows in the engine
}

void LeaseRenewer::Stop() {
  std::thread thread;  // taken by the first Stop only: one join
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    thread = std::move(thread_);
  }
  wake_.notify_all();
  if (thread.joinable()) thread.join();
}

namespace {

// How often the client renews a lease of `lease_ms`: four times per lease, and at least every second, so that a
// process briefly starved of CPU still renews in time.
std::chrono::milliseconds RenewInterval(uint32_t lease_ms) {
  return std::chrono::milliseconds(std::clamp<uint32_t>(lease_ms / 4, 1, 1000));
}

// A heartbeat value that differs from the previous one (the daemon looks only for change).
uint64_t NextHeartbeat(uint64_t previous) {
  return std::max(static_cast<uint64_t>(MonotonicMs()), previous + 1);
}

}  // namespace

Result<std::unique_ptr<SessionRings>> SessionRings::Map(UniqueFd ring_memfd, UniqueFd doorbell, UniqueFd channel) {
  auto ring = ring::RingSubmitter::Map(std::move(ring_memfd), std::move(doorbell));
  if (!ring.ok()) return ring.status();
  auto r = std::unique_ptr<SessionRings>(new SessionRings(std::move(*ring), std::move(channel)));
  if (const uint32_t lease_ms = r->ring_->pin_lease_ms(); lease_ms > 0) {
    ring::RingSubmitter* submitter = r->ring_.get();
    r->renewer_ = std::make_unique<LeaseRenewer>(RenewInterval(lease_ms), [submitter, last = uint64_t{0}]() mutable {
      last = NextHeartbeat(last);
      submitter->Heartbeat(last);
    });
  }
  return r;
}

SessionRings::SessionRings(std::unique_ptr<ring::RingSubmitter> ring, UniqueFd channel)
    : ring_(std::move(ring)), channel_(std::move(channel)) {
  free_[0] = ring_->arena_bytes();
}

SessionRings::~SessionRings() = default;

std::optional<uint64_t> SessionRings::AllocLocked(uint64_t bytes) {
  bytes = (bytes + 63) & ~uint64_t{63};
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < bytes) continue;
    const uint64_t offset = it->first;
    const uint64_t rest = it->second - bytes;
    free_.erase(it);
    if (rest > 0) free_[offset + bytes] = rest;
    return offset;
  }
  return std::nullopt;
}

void SessionRings::FreeLocked(uint64_t offset, uint64_t bytes) {
  bytes = (bytes + 63) & ~uint64_t{63};
  auto [it, inserted] = free_.emplace(offset, bytes);
  auto next = std::next(it);
  if (next != free_.end() && it->first + it->second == next->first) {
    it->second += next->second;
    free_.erase(next);
  }
  if (it != free_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second == it->first) {
      prev->second += it->second;
      free_.erase(it);
    }
  }
}

Result<Ticket> SessionRings::Submit(RingOp op, uint16_t flags, uint32_t count, std::span<const BlockKey> keys,
                                    std::span<const uint32_t> ids, uint64_t match_handle,
                                    const BlockKey& parent, uint32_t word56, uint32_t word60,
                                    int64_t launch_deadline_ns) {
  const uint64_t key_bytes = keys.size() * sizeof(BlockKey);
  const uint64_t id_bytes = ids.size() * sizeof(uint32_t);
  MutexLock lock(&mu_);
  if (abandoned_.load()) return abandon_status_;
  ReapLocked();
  if (inflight_ >= ring_->completion_entries()) {
    return Status::ResourceExhausted(fmt::format("{} requests are in flight (the ring's limit); Wait for some first", inflight_));
  }
  uint64_t offset = 0;
  const uint64_t payload = key_bytes + id_bytes;
  if (payload > 0) {
    auto got = AllocLocked(payload);
    if (!got) {
      return Status::ResourceExhausted(fmt::format("no {} bytes free in the {}-byte payload arena; Wait for requests in flight",
                                                   payload, ring_->arena_bytes()));
    }
    offset = *got;
    uint8_t* arena = ring_->arena();
    if (key_bytes > 0) std::memcpy(arena + offset, keys.data(), key_bytes);
    if (id_bytes > 0) std::memcpy(arena + offset + key_bytes, ids.data(), id_bytes);
  }
  const uint64_t ticket = next_ticket_;
  SubmitDescriptor d{};
  d.user_data = ticket;
  d.opcode = static_cast<uint16_t>(op);
  d.flags = flags;
  d.count = count;
  if (op == RingOp::kLoad) {
    d.launch_deadline_ns = static_cast<uint64_t>(launch_deadline_ns);  // a Load has no keys: the word is its deadline
  } else {
    d.keys_offset = offset;
  }
  d.block_ids_offset = offset + key_bytes;
  d.match_handle = match_handle;
  d.parent = parent;
  d.state_count = word56;  // or first_block: one word
  d.event_set = word60;    // or window_keys
  if (!ring_->Push(d)) {
    if (payload > 0) FreeLocked(offset, payload);
    return Status::ResourceExhausted("the submit ring is full; the daemon has not caught up yet");
  }
  ++next_ticket_;
  if (payload > 0) arena_of_[ticket] = {offset, payload};
  done_.emplace(ticket, std::nullopt);  // in flight: the reap fills the result in, the one allocation per request
  ++inflight_;
  return Ticket{ticket, 0};
}

void SessionRings::ReapLocked() {
  // Reap calls it before it returns, so under mu_; the analysis does not follow a lambda into the template that
  // calls it (ring_submitter.h), hence unchecked here and checked in OnCompletionLocked.
  ring_->Reap([this](const CompletionDescriptor& c) ABSL_NO_THREAD_SAFETY_ANALYSIS { OnCompletionLocked(c); });
}

void SessionRings::OnCompletionLocked(const CompletionDescriptor& c) {
  if ((c.flags & kCompletionFlagLaunched) != 0) {
    if (done_.contains(c.user_data)) launched_.insert(c.user_data);
    return;
  }
  if ((c.flags & kCompletionFlagLayerDone) != 0) {
    uint32_t& landed = layers_landed_[c.user_data];
    landed = std::max(landed, c.matched_blocks + 1);
    return;
  }
  layers_landed_.erase(c.user_data);
  launched_.erase(c.user_data);
  OpResult r;
  if (c.status_code != 0) r.status = Status(static_cast<StatusCode>(c.status_code), c.message);
  r.matched_blocks = c.matched_blocks;
  r.done_blocks = c.done_blocks;
  r.match_handle = c.match_handle;
  r.bytes = c.bytes;
  if (c.status_code == 0 && c.opcode == static_cast<uint16_t>(RingOp::kPrefetch)) {
    r.source = c.message;  // the source node, or why nothing was pulled ("": no peer had the blocks)
  }
  auto a = arena_of_.find(c.user_data);
  if (a != arena_of_.end()) {
    FreeLocked(a->second.first, a->second.second);
    arena_of_.erase(a);
  }
  if (inflight_ > 0) --inflight_;
  auto it = done_.find(c.user_data);
  if (it == done_.end() || it->second.has_value()) return;  // not a request of ours in flight: nobody waits for it
  it->second = std::move(r);
}

SessionRings::TicketState SessionRings::StateLocked(uint64_t id) const {
  auto it = done_.find(id);
  if (it != done_.end()) return it->second.has_value() ? TicketState::kEnded : TicketState::kInFlight;
  if (id == 0 || id >= next_ticket_) return TicketState::kNeverIssued;
  return TicketState::kTaken;
}

Status CheckLaunchDeadlineLayout(uint32_t layout_version, int64_t launch_deadline_ns) {
  if (launch_deadline_ns == 0 || layout_version >= 6) return Status::Ok();
  return Status::FailedPrecondition(fmt::format(
      "a launch deadline needs ring layout 6, and the daemon speaks layout {}: upgrade flexkvd, or load without one "
      "(and never give up on a load before it ended)", layout_version));
}

Status SessionRings::NoResultLocked(uint64_t id, TicketState state) const {
  if (state == TicketState::kTaken) {
    return Status::NotFound(fmt::format("the result of ticket {} was already taken by an earlier Wait or TryWait", id));
  }
  return Status::NotFound(fmt::format("ticket {} was never issued by this session (it issued tickets 1..{})", id,
                                      next_ticket_ - 1));
}

void SessionRings::Abandon(Status why) {
  {
    MutexLock lock(&mu_);
    if (abandoned_.load()) return;
    abandon_status_ = why.ok() ? Status::FailedPrecondition("this session was dropped") : std::move(why);
    abandoned_.store(true);
  }
  if (renewer_) renewer_->Stop();
  // Waiters parked on the completion tail look at the flag now rather than at the end of their futex slice.
  ring_->WakeWaiters();
}

Status SessionRings::GoneStatus() {
  MutexLock lock(&mu_);
  if (abandoned_.load()) return abandon_status_;
  return Status::Unavailable("flexkvd closed this session (daemon stopped or restarted); Attach again");
}

Result<std::optional<OpResult>> SessionRings::TryWait(Ticket ticket) {
  {
    MutexLock lock(&mu_);
    ReapLocked();
    const TicketState state = StateLocked(ticket.id);
    if (state == TicketState::kEnded) return std::optional<OpResult>(TakeLocked(ticket.id));
    if (state != TicketState::kInFlight) return NoResultLocked(ticket.id, state);
  }
  if (!DaemonGone()) return std::optional<OpResult>();
  {
    MutexLock lock(&mu_);
    ReapLocked();  // its completion may have come in just before the daemon went
    if (StateLocked(ticket.id) == TicketState::kEnded) return std::optional<OpResult>(TakeLocked(ticket.id));
  }
  return GoneStatus();
}

OpResult SessionRings::TakeLocked(uint64_t id) {
  auto it = done_.find(id);
  OpResult r = std::move(*it->second);
  done_.erase(it);
  return r;
}

bool SessionRings::DaemonGone() const {
  if (abandoned_.load()) return true;
  pollfd pfd{channel_.get(), POLLRDHUP, 0};
  return poll(&pfd, 1, 0) > 0 && (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

template <typename Ready>
Status SessionRings::WaitUntil(Ready&& ready, std::chrono::steady_clock::time_point deadline, uint64_t ticket) {
  const int64_t deadline_ns =
      NowNs() + std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - std::chrono::steady_clock::now()).count();
  const auto end = ring_->Wait(
      [&] {
        MutexLock lock(&mu_);
        ReapLocked();
        return ready();
      },
      [&] { return DaemonGone(); }, deadline_ns);
  switch (end) {
    case ring::RingSubmitter::WaitEnd::kReady:
      return Status::Ok();
    case ring::RingSubmitter::WaitEnd::kDeadline:
      return Status::DeadlineExceeded(fmt::format("ticket {} did not complete in time; it is still in flight", ticket));
    case ring::RingSubmitter::WaitEnd::kPeerGone:
      break;
  }
  return GoneStatus();
}

Result<OpResult> SessionRings::Wait(Ticket ticket, std::chrono::microseconds timeout) {
  OpResult result;
  Status no_result;  // set when the ticket has no result to wait for (never issued, or taken by another call)
  Status st = WaitUntil(
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        const TicketState state = StateLocked(ticket.id);
        if (state == TicketState::kInFlight) return false;
        if (state != TicketState::kEnded) {
          no_result = NoResultLocked(ticket.id, state);
          return true;
        }
        result = TakeLocked(ticket.id);
        return true;
      },
      std::chrono::steady_clock::now() + timeout, ticket.id);
  if (!st.ok()) return st;
  if (!no_result.ok()) return no_result;
  return result;
}

Result<uint32_t> SessionRings::WaitLayers(Ticket ticket, uint32_t layers, std::chrono::microseconds timeout) {
  uint32_t landed = 0;
  Status no_result;
  Status st = WaitUntil(
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        const TicketState state = StateLocked(ticket.id);
        if (state == TicketState::kNeverIssued) {
          no_result = NoResultLocked(ticket.id, state);
          return true;
        }
        if (state != TicketState::kInFlight) {  // ended (success or error): Wait reports which
          landed = layers;
          return true;
        }
        auto it = layers_landed_.find(ticket.id);
        landed = it == layers_landed_.end() ? 0 : it->second;
        return landed >= layers;
      },
      std::chrono::steady_clock::now() + timeout, ticket.id);
  if (!st.ok()) return st;
  if (!no_result.ok()) return no_result;
  return landed;
}

Status SessionRings::WaitLaunched(Ticket ticket, std::chrono::microseconds timeout) {
  Status outcome;
  Status st = WaitUntil(
      [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        const TicketState state = StateLocked(ticket.id);
        if (state == TicketState::kNeverIssued) {
          outcome = NoResultLocked(ticket.id, state);
          return true;
        }
        if (state == TicketState::kEnded) {  // done or failed: every record it made is complete, or none was made
          auto it = done_.find(ticket.id);
          if (it != done_.end() && it->second.has_value()) outcome = it->second->status;
          return true;
        }
        return state == TicketState::kTaken || launched_.contains(ticket.id);
      },
      std::chrono::steady_clock::now() + timeout, ticket.id);
  if (!st.ok()) return st;
  return outcome;
}

}  // namespace flexkv
