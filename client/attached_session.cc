// See attached_session.h.
#include "client/attached_session.h"

#include <fmt/format.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>

#include <cstring>
#include <span>

#include "common/session_channel.h"
#include "common/uds.h"

namespace flexkv {

void KvMapping::Reset() {
  if (data_ != nullptr) munmap(data_, bytes_);
  data_ = nullptr;
  bytes_ = 0;
}

bool AttachedSession::Lost() const {
  pollfd pfd{channel.get(), POLLRDHUP, 0};
  return poll(&pfd, 1, 0) > 0 && (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

std::vector<KvMapping> AttachedSession::Drop(const Status& why) {
  rings->Abandon(why);
  shutdown(channel.get(), SHUT_RDWR);
  absl::MutexLock lock(&mu);
  dropped = true;
  std::vector<KvMapping> out;
  for (KvMapping& m : kv) {
    if (m) out.push_back(std::move(m));
  }
  return out;
}

Result<uint32_t> AttachedSession::OfferFd(int fd, const char* what, std::chrono::milliseconds call_timeout) {
  absl::MutexLock lock(&mu);
  if (dropped) return Status::FailedPrecondition("not attached: the session was detached");
  const uint32_t tag = next_fd_tag++;
  ChannelMessage offer{};
  std::memcpy(offer.magic, kChannelMessageMagic, 4);
  offer.type = static_cast<uint32_t>(ChannelMessageType::kOfferFd);
  offer.tag = tag;
  Status st = SendWithFds(channel.get(), &offer, sizeof(offer), std::span<const int>(&fd, 1));
  ChannelMessage ack{};
  // Acks come in offer order; one that arrives after its offer timed out is read (and dropped) here.
  do {
    if (st.ok()) st = RecvWithFds(channel.get(), &ack, sizeof(ack), nullptr);
    if (st.code() == StatusCode::kDeadlineExceeded) {
      st = Status::DeadlineExceeded(
          fmt::format("the daemon did not acknowledge the {} within {} ms", what, call_timeout.count()));
    }
  } while (st.ok() && std::memcmp(ack.magic, kChannelMessageMagic, 4) == 0 &&
           ack.type == static_cast<uint32_t>(ChannelMessageType::kOfferFdAck) && ack.tag < tag);
  if (st.ok() && (std::memcmp(ack.magic, kChannelMessageMagic, 4) != 0 ||
                  ack.type != static_cast<uint32_t>(ChannelMessageType::kOfferFdAck) || ack.tag != tag)) {
    st = Status::Internal(fmt::format("unexpected reply on the session channel (type {}, tag {}; expected the ack of {})",
                                      ack.type, ack.tag, tag));
  }
  if (st.ok() && ack.status_code != 0) {
    st = Status(static_cast<StatusCode>(ack.status_code),
                fmt::format("the daemon refused the {} (too many fds offered and not registered?)", what));
  }
  if (!st.ok()) return st.WithContext(fmt::format("offering the {}", what));
  return tag;
}

}  // namespace flexkv
