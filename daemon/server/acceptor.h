// Acceptor: accepts every connection on the control socket itself, so that each one's peer
// credentials (SO_PEERCRED) are known, then routes it by its first bytes: HTTP/2 ("PRI ") to gRPC,
// "FKVS" to the session registry. Connections that say neither within a few seconds are closed.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>
#include <unordered_map>

#include "common/clock.h"
#include "common/log.h"
#include "common/uds.h"
#include "common/unique_fd.h"
#include "flexkv/status.h"

namespace flexkv {

class Acceptor {
 public:
  struct Handlers {
    // Takes ownership of `fd` (hands it to gRPC). Called on the acceptor thread.
    std::function<void(int fd, const PeerCredentials& peer)> on_grpc;
    // Takes ownership of a connection whose first sizeof(SessionHello) bytes are waiting to be read.
    std::function<void(UniqueFd fd, const PeerCredentials& peer)> on_session_channel;
  };

  // `listen_fd` stays owned by the caller and must outlive Stop().
  Acceptor(int listen_fd, Handlers handlers);
  ~Acceptor();
  Acceptor(const Acceptor&) = delete;
  Acceptor& operator=(const Acceptor&) = delete;

  Status Start();
  // Stops accepting; closes connections not yet routed. Idempotent.
  void Stop();

  // Monotonic milliseconds of the loop's last turn (the watchdog checks it).
  int64_t last_turn_ms() const { return last_turn_ms_.load(std::memory_order_relaxed); }

 private:
  // A connection that has not said yet what it speaks; it owns its fd until Route hands it on.
  struct Pending {
    UniqueFd fd;
    PeerCredentials peer;
    int64_t deadline_ms;
  };
  void Loop();
  void AcceptAll();
  void Route(int fd);
  void Drop(int fd);

  const int listen_fd_;
  Handlers handlers_;
  UniqueFd epoll_fd_;
  UniqueFd stop_fd_;
  std::thread thread_;
  std::atomic<int64_t> last_turn_ms_{0};
  std::unordered_map<int, Pending> pending_;  // by fd; owned by the acceptor thread
  // Warnings a flood of connections can repeat: at most one line a second each, with the count suppressed.
  log::RateLimited out_of_fds_log_;
  log::RateLimited refused_log_;
  log::RateLimited silent_log_;
};

}  // namespace flexkv
