// libflexkv: how an engine process talks to the node's flexkvd. One Client per process (per DP/TP
// worker); it holds one gRPC channel and, once attached, one session.
//
//   auto client = flexkv::Client::Connect({});            // $FLEXKV_SOCKET or the default socket
//   if (!client.ok()) return client.status();
//   auto session = (*client)->Attach({.client_name = "vllm-dp0", .model_namespace = "llama3-8b",
//                                     .geometry = flexkv::Llama3_8B()});
//
// Thread safety: all methods may be called from several threads. No method throws.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "flexkv/geometry.h"
#include "flexkv/status.h"

namespace flexkv {

struct ConnectOptions {
  // Empty: $FLEXKV_SOCKET, else the default socket of a flexkvd started by the same user.
  std::string socket_path;
  // How long Connect waits for a daemon that is not up yet (socket missing or refusing).
  std::chrono::milliseconds connect_timeout{5000};
  // Deadline of each control call.
  std::chrono::milliseconds call_timeout{10000};
};

struct AttachOptions {
  std::string client_name;      // shown by `flexkvctl sessions`
  uint32_t dp_rank = 0;
  uint32_t tp_rank = 0;
  std::string model_namespace;  // cache domain; sessions share blocks within it
  Geometry geometry;
};

struct SessionInfo {
  uint64_t session_id = 0;
  uint64_t block_bytes = 0;      // host bytes per block, fixed by the daemon
  uint64_t capacity_blocks = 0;  // pool slots
};

struct DaemonStatus {
  std::string state;  // "serving" | "draining" | "drained"
  std::string version;
  uint32_t pid = 0;
  uint64_t uptime_s = 0;
  struct Pool {
    uint64_t block_bytes = 0, capacity_blocks = 0, used_blocks = 0, pinned_blocks = 0, budget_bytes = 0;
    std::string backing;
  } pool;
  uint64_t index_blocks = 0;
  uint32_t sessions = 0;
  std::map<std::string, uint64_t> counters;  // only the counters this daemon counts
  struct Backend {
    std::string name;
    std::vector<std::string> devices;
  };
  std::vector<Backend> backends;
  std::string model_namespace;
};

struct SessionEntry {
  uint64_t session_id = 0;
  std::string client_name;
  uint32_t pid = 0, uid = 0, gid = 0, dp_rank = 0, tp_rank = 0;
  std::string model_namespace;
  std::string state;  // "attaching" | "active"
  uint64_t attached_unix_ms = 0, pinned_blocks = 0, inflight_requests = 0;
};

class Client {
 public:
  // Connects to flexkvd. Retries only while the daemon is not up yet (no socket, or nobody listening)
  // until connect_timeout, then UNAVAILABLE. Any other failure (permission denied, not a flexkvd)
  // returns at once with its cause. The message always names the socket path.
  static Result<std::unique_ptr<Client>> Connect(const ConnectOptions& options);

  // Detaches the session, if any.
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Opens this process's session: validates the geometry against the daemon's cache domain and opens
  // the session channel that ties the session to this process. FAILED_PRECONDITION when already
  // attached, a geometry mismatch or a version mismatch; INVALID_ARGUMENT for a bad geometry.
  Result<SessionInfo> Attach(const AttachOptions& options);
  // Ends the session; everything it held is released. OK when not attached.
  Status Detach();
  bool attached() const;

  Result<DaemonStatus> GetStatus();
  Result<std::vector<SessionEntry>> ListSessions();
  // Admin calls (root, the daemon's uid, or --admin-group). Return the state after the call.
  Result<std::string> Drain();
  Result<std::string> Resume();
  // grpc.health.v1 Check of the whole server: OK when SERVING, UNAVAILABLE otherwise.
  Status CheckHealth();

  const std::string& socket_path() const;

 private:
  struct Impl;
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace flexkv
