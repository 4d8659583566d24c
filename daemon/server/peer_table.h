// PeerTable: the credentials of every gRPC connection, keyed by the fd the acceptor handed to gRPC.
// gRPC names such a peer "fd:<n>", which is how a handler finds who is calling. An fd number is reused
// only after its connection closed, and the acceptor overwrites the entry before gRPC sees the new one.
#pragma once

#include <optional>
#include <string_view>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"
#include "common/uds.h"

namespace flexkv {

class PeerTable {
 public:
  void Add(int fd, const PeerCredentials& peer);
  // `grpc_peer` is ServerContext::peer(). Empty when the peer is unknown (callers deny privileges then).
  std::optional<PeerCredentials> Find(std::string_view grpc_peer) const;

 private:
  mutable Mutex mu_;
  std::unordered_map<int, PeerCredentials> by_fd_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flexkv
