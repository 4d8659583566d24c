// See session_rings.h.
#include "client/session_rings.h"

#include <fmt/format.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <thread>

#include "common/clock.h"
#include "common/uds.h"

namespace flexkv {
namespace {

constexpr auto kSpin = std::chrono::microseconds(50);
constexpr auto kPureSpin = std::chrono::microseconds(2);

}  // namespace

Result<std::unique_ptr<SessionRings>> SessionRings::Map(UniqueFd ring_memfd, UniqueFd doorbell, UniqueFd channel) {
  struct stat st {};
  if (fstat(ring_memfd.get(), &st) != 0 || static_cast<uint64_t>(st.st_size) < sizeof(RingHeader)) {
    return Status::Internal("the daemon's ring memfd is too small for a ring header");
  }
  void* p = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, ring_memfd.get(), 0);
  if (p == MAP_FAILED) return Status::ResourceExhausted(fmt::format("mmap rings: {}", ErrnoText(errno)));
  auto r = std::unique_ptr<SessionRings>(new SessionRings());
  r->map_ = static_cast<uint8_t*>(p);
  r->map_bytes_ = static_cast<uint64_t>(st.st_size);
  r->hdr_ = static_cast<RingHeader*>(p);
  r->doorbell_ = std::move(doorbell);
  r->channel_ = std::move(channel);
  const RingHeader& h = *r->hdr_;
  const RingGeometry rg{h.submit_entries, h.completion_entries, h.arena_bytes};
  if (h.magic != kRingMagic || h.layout_version != kRingLayoutVersion || h.submit_entries == 0 ||
      (h.submit_entries & (h.submit_entries - 1)) != 0 || h.completion_entries == 0 ||
      (h.completion_entries & (h.completion_entries - 1)) != 0 || h.submit_offset != rg.submit_offset() ||
      h.completion_offset != rg.completion_offset() || h.arena_offset != rg.arena_offset() ||
      rg.total_bytes() > r->map_bytes_) {
    return Status::FailedPrecondition(fmt::format(
        "the daemon's ring layout (magic 0x{:x}, version {}) is not what this libflexkv speaks (version {})", h.magic,
        h.layout_version, kRingLayoutVersion));
  }
  r->submit_tail_ = h.submit_tail.value.load();
  r->completion_head_ = h.completion_head.value.load();
  r->free_[0] = h.arena_bytes;
  return r;
}

SessionRings::~SessionRings() {
  if (map_ != nullptr) munmap(map_, map_bytes_);
}

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
                                    std::span<const uint32_t> ids, uint64_t match_handle) {
  const uint64_t key_bytes = keys.size() * sizeof(BlockKey);
  const uint64_t id_bytes = ids.size() * sizeof(uint32_t);
  std::lock_guard lock(mu_);
  if (abandoned_.load()) return abandon_status_;
  ReapLocked();
  if (inflight_ >= hdr_->completion_entries) {
    return Status::ResourceExhausted(fmt::format("{} requests are in flight (the ring's limit); Wait for some first", inflight_));
  }
  const uint32_t head = hdr_->submit_head.value.load(std::memory_order_acquire);
  if (submit_tail_ - head >= hdr_->submit_entries) {
    return Status::ResourceExhausted("the submit ring is full; the daemon has not caught up yet");
  }
  uint64_t offset = 0;
  const uint64_t payload = key_bytes + id_bytes;
  if (payload > 0) {
    auto got = AllocLocked(payload);
    if (!got) {
      return Status::ResourceExhausted(fmt::format("no {} bytes free in the {}-byte payload arena; Wait for requests in flight",
                                                   payload, hdr_->arena_bytes));
    }
    offset = *got;
    uint8_t* arena = map_ + hdr_->arena_offset;
    if (key_bytes > 0) std::memcpy(arena + offset, keys.data(), key_bytes);
    if (id_bytes > 0) std::memcpy(arena + offset + key_bytes, ids.data(), id_bytes);
  }
  const uint64_t ticket = next_ticket_++;
  SubmitDescriptor d{};
  d.user_data = ticket;
  d.opcode = static_cast<uint16_t>(op);
  d.flags = flags;
  d.count = count;
  d.keys_offset = offset;
  d.block_ids_offset = offset + key_bytes;
  d.match_handle = match_handle;
  auto* entries = reinterpret_cast<SubmitDescriptor*>(map_ + hdr_->submit_offset);
  entries[submit_tail_ & (hdr_->submit_entries - 1)] = d;
  ++submit_tail_;
  hdr_->submit_tail.value.store(submit_tail_, std::memory_order_seq_cst);
  if (payload > 0) arena_of_[ticket] = {offset, payload};
  pending_.insert(ticket);
  ++inflight_;
  if (hdr_->daemon_parked.value.load(std::memory_order_seq_cst) != 0) {
    const uint64_t one = 1;
    ssize_t ignored = write(doorbell_.get(), &one, sizeof(one));
    (void)ignored;
  }
  return Ticket{ticket, 0};
}

void SessionRings::ReapLocked() {
  const uint32_t tail = hdr_->completion_tail.value.load(std::memory_order_acquire);
  if (tail == completion_head_) return;
  const auto* entries = reinterpret_cast<const CompletionDescriptor*>(map_ + hdr_->completion_offset);
  while (completion_head_ != tail) {
    CompletionDescriptor c = entries[completion_head_ & (hdr_->completion_entries - 1)];
    ++completion_head_;
    c.message[sizeof(c.message) - 1] = '\0';
    if ((c.flags & kCompletionFlagLayerDone) != 0) {
      uint32_t& landed = layers_landed_[c.user_data];
      landed = std::max(landed, c.matched_blocks + 1);
      continue;
    }
    layers_landed_.erase(c.user_data);
    OpResult r;
    if (c.status_code != 0) r.status = Status(static_cast<StatusCode>(c.status_code), c.message);
    r.matched_blocks = c.matched_blocks;
    r.done_blocks = c.done_blocks;
    r.match_handle = c.match_handle;
    auto a = arena_of_.find(c.user_data);
    if (a != arena_of_.end()) {
      FreeLocked(a->second.first, a->second.second);
      arena_of_.erase(a);
    }
    if (inflight_ > 0) --inflight_;
    if (pending_.erase(c.user_data) == 0) continue;  // not a request of ours in flight: nobody waits for it
    done_[c.user_data] = std::move(r);
  }
  hdr_->completion_head.value.store(completion_head_, std::memory_order_release);
}

SessionRings::TicketState SessionRings::StateLocked(uint64_t id) const {
  if (done_.count(id) != 0) return TicketState::kEnded;
  if (pending_.count(id) != 0) return TicketState::kInFlight;
  if (id == 0 || id >= next_ticket_) return TicketState::kNeverIssued;
  return TicketState::kTaken;
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
    std::lock_guard lock(mu_);
    if (abandoned_.load()) return;
    abandon_status_ = why.ok() ? Status::FailedPrecondition("this session was dropped") : std::move(why);
    abandoned_.store(true);
  }
  // Waiters parked on the completion tail look at the flag now rather than at the end of their futex slice.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&hdr_->completion_tail.value), FUTEX_WAKE, INT32_MAX, nullptr,
          nullptr, 0);
}

Status SessionRings::GoneStatus() {
  std::lock_guard lock(mu_);
  if (abandoned_.load()) return abandon_status_;
  return Status::Unavailable("flexkvd closed this session (daemon stopped or restarted); Attach again");
}

Result<std::optional<OpResult>> SessionRings::TryWait(Ticket ticket) {
  {
    std::lock_guard lock(mu_);
    ReapLocked();
    const TicketState state = StateLocked(ticket.id);
    if (state == TicketState::kEnded) return std::optional<OpResult>(TakeLocked(ticket.id));
    if (state != TicketState::kInFlight) return NoResultLocked(ticket.id, state);
  }
  if (!DaemonGone()) return std::optional<OpResult>();
  {
    std::lock_guard lock(mu_);
    ReapLocked();  // its completion may have come in just before the daemon went
    if (StateLocked(ticket.id) == TicketState::kEnded) return std::optional<OpResult>(TakeLocked(ticket.id));
  }
  return GoneStatus();
}

OpResult SessionRings::TakeLocked(uint64_t id) {
  auto it = done_.find(id);
  OpResult r = std::move(it->second);
  done_.erase(it);
  return r;
}

bool SessionRings::DaemonGone() const {
  if (abandoned_.load()) return true;
  pollfd pfd{channel_.get(), POLLRDHUP, 0};
  return poll(&pfd, 1, 0) > 0 && (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

Status SessionRings::WaitUntil(const std::function<bool()>& ready, std::chrono::steady_clock::time_point deadline,
                               uint64_t ticket) {
  auto spin_until = std::chrono::steady_clock::now() + kSpin;
  for (;;) {
    {
      std::lock_guard lock(mu_);
      ReapLocked();
      if (ready()) return Status::Ok();
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      return Status::DeadlineExceeded(fmt::format("ticket {} did not complete in time; it is still in flight", ticket));
    }
    const uint32_t seen = hdr_->completion_tail.value.load(std::memory_order_acquire);
    if (now < spin_until) {
      // Spin a couple of microseconds, then keep polling but yield the CPU between polls: when there are
      // more spinning threads than cores (the daemon's poller among them), yielding lets the poller run at
      // once instead of after our whole spin window.
      if (now + kSpin - kPureSpin < spin_until) {
        CpuRelax();
      } else {
        sched_yield();
      }
      continue;
    }
    if (DaemonGone()) {
      {
        std::lock_guard lock(mu_);
        ReapLocked();
        if (ready()) return Status::Ok();
      }
      return GoneStatus();
    }
    hdr_->client_waiting.value.fetch_add(1, std::memory_order_seq_cst);
    if (hdr_->completion_tail.value.load(std::memory_order_seq_cst) == seen) {
      const auto left = std::min<std::chrono::nanoseconds>(deadline - now, std::chrono::milliseconds(20));
      timespec ts{static_cast<time_t>(left.count() / 1000000000), static_cast<long>(left.count() % 1000000000)};
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&hdr_->completion_tail.value), FUTEX_WAIT, seen, &ts, nullptr, 0);
    }
    hdr_->client_waiting.value.fetch_sub(1, std::memory_order_seq_cst);
    spin_until = std::chrono::steady_clock::now() + kSpin;
  }
}

Result<OpResult> SessionRings::Wait(Ticket ticket, std::chrono::microseconds timeout) {
  OpResult result;
  Status no_result;  // set when the ticket has no result to wait for (never issued, or taken by another call)
  Status st = WaitUntil(
      [&] {
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
      [&] {
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

}  // namespace flexkv
