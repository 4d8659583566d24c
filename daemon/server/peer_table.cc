// See peer_table.h.
#include "daemon/server/peer_table.h"

#include <charconv>

namespace flexkv {

void PeerTable::Add(int fd, const PeerCredentials& peer) {
  MutexLock lock(&mu_);
  by_fd_[fd] = peer;
}

std::optional<PeerCredentials> PeerTable::Find(std::string_view grpc_peer) const {
  const size_t pos = grpc_peer.rfind("fd:");
  if (pos == std::string_view::npos) return std::nullopt;
  int fd = -1;
  const char* begin = grpc_peer.data() + pos + 3;
  const char* end = grpc_peer.data() + grpc_peer.size();
  auto [ptr, ec] = std::from_chars(begin, end, fd);
  if (ec != std::errc() || ptr != end) return std::nullopt;
  MutexLock lock(&mu_);
  auto it = by_fd_.find(fd);
  if (it == by_fd_.end()) return std::nullopt;
  return it->second;
}

}  // namespace flexkv
