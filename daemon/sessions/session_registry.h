// SessionRegistry: one Session per attached engine process, and the reaper that ends a session the
// moment its process dies. A session is tied to two things the kernel signals: its session channel
// (a connection the client keeps open; hang-up = gone) and a pidfd of the process that called Attach
// (readable when it exits). Either ends the session and runs the end callback, which releases what the
// session held. Thread-safe.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/log.h"
#include "common/mutex.h"
#include "common/session_channel.h"
#include "common/uds.h"
#include "common/unique_fd.h"
#include "daemon/sessions/namespace_access.h"
#include "flexkv/geometry.h"
#include "flexkv/status.h"

namespace flexkv {

// What a client says about itself in Attach (untrusted except for what the daemon validated).
struct SessionIdentity {
  std::string client_name;
  uint32_t dp_rank = 0;
  uint32_t tp_rank = 0;
  std::string model_namespace;
  Geometry geometry;
};

using SessionToken = std::array<uint8_t, kSessionTokenBytes>;

// Bounds on sessions that were granted by Attach but have not opened their session channel yet ("pending"): each
// holds a pidfd and a registry entry until its attach timeout, so a client that floods Attach could otherwise take
// every fd the daemon has. Zero disables a bound.
struct SessionLimits {
  int64_t attach_timeout_ms = 10000;  // how long a new session may go without opening its channel
  size_t max_pending_per_uid = 64;    // pending sessions of one uid
  size_t max_pending_total = 1024;    // pending sessions of all uids
  size_t fd_reserve = 256;            // Attach is refused while fewer fds than this are free (control plane, admin)
};

// A point-in-time copy of one session, for ListSessions and status.
struct SessionSnapshot {
  uint64_t id = 0;
  SessionIdentity identity;
  PeerCredentials peer;
  bool channel_open = false;  // false: "attaching"
  uint64_t attached_unix_ms = 0;
};

class SessionRegistry {
 public:
  // Runs on the reaper thread after a session was removed; releases what it held.
  using EndCallback = std::function<void(uint64_t session_id, const std::string& reason)>;

  explicit SessionRegistry(SessionLimits limits);
  // Default bounds with this attach timeout.
  explicit SessionRegistry(int64_t attach_timeout_ms) : SessionRegistry(SessionLimits{.attach_timeout_ms = attach_timeout_ms}) {}
  ~SessionRegistry();
  SessionRegistry(const SessionRegistry&) = delete;
  SessionRegistry& operator=(const SessionRegistry&) = delete;

  void SetEndCallback(EndCallback cb);
  // Runs when a session's channel is accepted, before the hello is answered, with what Open granted (the identity
  // names the session's namespace, hence its cache domain, and geometry); returns the fds that ride on the reply
  // (the data plane's ring memfd and doorbell). An error refuses the channel with that status.
  using ChannelOpenCallback = std::function<Result<std::vector<UniqueFd>>(
      uint64_t session_id, const SessionIdentity& identity, const SessionAccess& access)>;
  void SetChannelOpenCallback(ChannelOpenCallback cb);
  Status Start();
  // Stops the reaper and ends every session (reason "daemon stopping"). Idempotent.
  void Stop();

  struct Grant {
    uint64_t session_id;
    SessionToken token;
  };
  // Registers a session for `peer` (the process that called Attach), with what it may do in its namespace
  // (`access`, decided by the caller; handed to the channel-open callback). RESOURCE_EXHAUSTED, with the bound, the
  // caller's count and what to do, when `peer`'s uid or all uids together hold as many pending sessions as
  // SessionLimits allows, or when fewer than fd_reserve fds are free; such refusals are logged at most once a second.
  Result<Grant> Open(SessionIdentity identity, const PeerCredentials& peer, SessionAccess access);

  // Ends a session on request. `token` must match unless `admin`. NOT_FOUND for an unknown id,
  // PERMISSION_DENIED for a wrong token.
  Status Close(uint64_t session_id, std::span<const uint8_t> token, bool admin);

  // Takes a connection whose SessionHello is waiting to be read; answers it and, when it names a
  // session of the same uid with the right token, makes it that session's channel.
  void AdoptChannel(UniqueFd fd, const PeerCredentials& peer);

  // Takes the fd the session offered on its channel under `tag` (for RegisterKv). NOT_FOUND when there is
  // none; PERMISSION_DENIED for a wrong token.
  Result<UniqueFd> TakeOfferedFd(uint64_t session_id, std::span<const uint8_t> token, uint32_t tag);
  // Checks a (session id, token) pair.
  Status Authenticate(uint64_t session_id, std::span<const uint8_t> token) const;

  std::vector<SessionSnapshot> List() const;
  size_t Count() const;
  // The namespace a session attached in; NOT_FOUND for an unknown id.
  Result<std::string> NamespaceOf(uint64_t session_id) const;
  // Sessions of `model_namespace` (attached, or still opening their channel).
  size_t CountIn(std::string_view model_namespace) const;
  // When the last session of `model_namespace` ended (monotonic ms), nullopt when none has ended since start.
  std::optional<int64_t> LastEndedMs(std::string_view model_namespace) const;
  int64_t last_turn_ms() const { return last_turn_ms_.load(std::memory_order_relaxed); }

 private:
  struct Session {
    uint64_t id = 0;
    SessionIdentity identity;
    PeerCredentials peer;
    SessionAccess access;
    SessionToken token{};
    UniqueFd channel;
    UniqueFd pidfd;
    int64_t opened_ms = 0;
    uint64_t attached_unix_ms = 0;
    std::map<uint32_t, UniqueFd> offered_fds;
  };
  void ReaperLoop();
  // Reads one message from a session's channel; false when the session must end (reason set).
  bool ReadChannel(uint64_t session_id, std::string* reason);
  void End(uint64_t session_id, const std::string& reason);
  void Watch(int fd, uint64_t tag);  // epoll_fd_ is set once in Start(), so any thread may add to it

  // OK, or why `peer` may not have one more pending session.
  Status CheckPendingBounds(const PeerCredentials& peer) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const SessionLimits limits_;
  log::RateLimited refusal_log_;
  EndCallback on_end_;
  ChannelOpenCallback on_channel_open_;
  mutable Mutex mu_;
  std::map<uint64_t, std::unique_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_);  // not reused across restarts
  std::map<std::string, int64_t, std::less<>> last_ended_ms_ ABSL_GUARDED_BY(mu_);  // by namespace
  UniqueFd epoll_fd_;
  UniqueFd stop_fd_;
  std::thread reaper_;
  std::atomic<int64_t> last_turn_ms_{0};
};

}  // namespace flexkv
