// See session_rings.h.
#include "client/session_rings.h"

#include <fmt/format.h>
#include <poll.h>

#include <cstring>

#include "common/clock.h"
#include "common/uds.h"

namespace flexkv {

Result<std::unique_ptr<SessionRings>> SessionRings::Map(UniqueFd ring_memfd, UniqueFd doorbell, int channel_fd) {
  auto ring = ring::RingSubmitter::Map(std::move(ring_memfd), std::move(doorbell));
  if (!ring.ok()) return ring.status();
  auto r = std::unique_ptr<SessionRings>(new SessionRings());
  r->ring_ = std::move(*ring);
  r->channel_fd_ = channel_fd;
  r->free_[0] = r->ring_->arena_bytes();
  return r;
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
                                    std::span<const uint32_t> ids, uint64_t match_handle) {
  const uint64_t key_bytes = keys.size() * sizeof(BlockKey);
  const uint64_t id_bytes = ids.size() * sizeof(uint32_t);
  std::lock_guard lock(mu_);
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
  SubmitDescriptor d{};
  d.user_data = next_ticket_;
  d.opcode = static_cast<uint16_t>(op);
  d.flags = flags;
  d.count = count;
  d.keys_offset = offset;
  d.block_ids_offset = offset + key_bytes;
  d.match_handle = match_handle;
  if (!ring_->Push(d)) {
    if (payload > 0) FreeLocked(offset, payload);
    return Status::ResourceExhausted("the submit ring is full; the daemon has not caught up yet");
  }
  const uint64_t ticket = next_ticket_++;
  if (payload > 0) arena_of_[ticket] = {offset, payload};
  ++inflight_;
  return Ticket{ticket};
}

void SessionRings::ReapLocked() {
  ring_->Reap([this](const CompletionDescriptor& c) {
    if ((c.flags & kCompletionFlagLayerDone) != 0) {
      uint32_t& landed = layers_landed_[c.user_data];
      landed = std::max(landed, c.matched_blocks + 1);
      return;
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
    done_[c.user_data] = std::move(r);
  });
}

std::optional<OpResult> SessionRings::TryWait(Ticket ticket) {
  std::lock_guard lock(mu_);
  ReapLocked();
  auto it = done_.find(ticket.id);
  if (it == done_.end()) return std::nullopt;
  OpResult r = std::move(it->second);
  done_.erase(it);
  return r;
}

bool SessionRings::DaemonGone() const {
  if (abandoned_.load()) return true;
  pollfd pfd{channel_fd_, POLLRDHUP, 0};
  // POLLNVAL: the Client closed the fd right after Abandon (this call had read the flag just before).
  return poll(&pfd, 1, 0) > 0 && (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

Status SessionRings::WaitUntil(const std::function<bool()>& ready, std::chrono::steady_clock::time_point deadline,
                               uint64_t ticket) {
  const int64_t deadline_ns =
      NowNs() + std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - std::chrono::steady_clock::now()).count();
  const auto end = ring_->Wait(
      [&] {
        std::lock_guard lock(mu_);
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
  return Status::Unavailable("flexkvd closed this session (daemon stopped or restarted); Attach again");
}

Result<OpResult> SessionRings::Wait(Ticket ticket, std::chrono::microseconds timeout) {
  OpResult result;
  Status st = WaitUntil(
      [&] {
        auto it = done_.find(ticket.id);
        if (it == done_.end()) return false;
        result = std::move(it->second);
        done_.erase(it);
        return true;
      },
      std::chrono::steady_clock::now() + timeout, ticket.id);
  if (!st.ok()) return st;
  return result;
}

Result<uint32_t> SessionRings::WaitLayers(Ticket ticket, uint32_t layers, std::chrono::microseconds timeout) {
  uint32_t landed = 0;
  Status st = WaitUntil(
      [&] {
        if (done_.count(ticket.id) != 0) {  // ended (success or error): Wait reports which
          landed = layers;
          return true;
        }
        auto it = layers_landed_.find(ticket.id);
        landed = it == layers_landed_.end() ? 0 : it->second;
        return landed >= layers;
      },
      std::chrono::steady_clock::now() + timeout, ticket.id);
  if (!st.ok()) return st;
  return landed;
}

}  // namespace flexkv
