// The private side of UcxTransport (ucx_transport.h), shared by its four source files and included by nothing else:
// the wire format of the active messages, the transport's state (UcxState: the UCP context and its lanes) and a
// lane (UcxCore). Where each part lives:
//   ucx_transport.cc                the public methods: Create (the UCP context, the workers, the listener), the
//                                   destructor, Connect, Disconnect, Get, Call; the RDMA NIC inventory
//   ucx_lane.cc                     a lane: its progress thread and loop, endpoints (connecting, accepting,
//                                   closing), the completion of ops, deadlines, reconnects, shutdown
//   ucx_active_messages.cc          what every active-message protocol shares (sending, replies bound to their
//                                   request by id, token and endpoint, refusals) and the get protocol, with the
//                                   registered regions gets are checked against
//   ucx_handshake_and_calls.cc      the HMAC handshake that authenticates peers, and Calls
//
// Threading: a UcxCore's state belongs to its progress thread unless a member says otherwise (the command queue
// under queue_mu, what other threads read under info_mu, shutting_down); every UcxCore method runs on that thread
// except Post, RunSync, OnLoopThread and the destructor (UcxState's, once the thread has ended). The static On*
// functions are UCX's callbacks: they run on the progress thread inside ucp_worker_progress (or ucp_ep_close_nbx),
// their `arg` or `user_data` naming the lane, the op or the message.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "common/log.h"
#include "common/mutex.h"
#include "daemon/cluster/ucx/ucx_transport.h"

namespace flexkv::cluster {

using Clock = std::chrono::steady_clock;
inline constexpr std::string_view kLog = "ucx";

// Every get is our own request/reply over UCP active messages, on every transport, and the UCP context never asks
// for UCP_FEATURE_RMA. With that feature UCX 1.13 installs its software RMA handlers (rma_sw.c) on every transport
// that carries active messages, verbs included: any endpoint can then get or put any address of this process
// (a forged rkey without a matching memory domain makes the requester fall back to them), with no rkey, no
// registration and no handshake checked; a get at an unmapped address kills the process (SIGSEGV), and its
// serving side aborts the process when the requester's connection fails mid-reply. Our handler serves only ranges
// inside regions registered here, only to authenticated endpoints. Over verbs a large reply still moves zero-copy:
// UCX's rendezvous hands the requester (an authenticated member) an rkey of the registration for that transfer.
inline constexpr unsigned kAmGetRequest = 0x4b31;  // "K1"
inline constexpr unsigned kAmGetReply = 0x4b32;
// Every request carries a fresh random token; its reply must echo it (with the request's id, on the endpoint the
// request went out on): a reply nobody asked for cannot be forged by guessing sequence ids.
inline constexpr size_t kTokenBytes = 16;
struct AmRequestHeader {
  uint64_t id;
  uint64_t address;
  uint64_t length;
  uint8_t token[kTokenBytes];
};
struct AmReplyHeader {
  uint64_t id;
  uint32_t status;  // 0 OK, else the range is not registered here
  uint32_t reserved;
  uint8_t token[kTokenBytes];  // the request's
};

// Authentication and Calls, also active messages; each carries an AmHeader, its payload in the message's data.
//   HELLO        client -> server  data: version u8 (kHandshakeVersion), node_len u8, client node id, client nonce (16)
//   HELLO_REPLY  server -> client  code 0: node_len u8, server node id, server nonce (16), MAC_s (32);
//                                  else code is a StatusCode and data the reason
//   PROOF        client -> server  data: MAC_c (32); empty: "your MAC_s was wrong" (the server counts it)
//   PROOF_REPLY  server -> client  code 0: authenticated; else code and reason
//   CALL         client -> server  aux: method; data: the request
//   CALL_REPLY   server -> client  code 0: data is the reply; else code and message
// MAC_s = HMAC-SHA256(secret, "flexkv-cluster-v1 server" | client_nonce | server_nonce | server_node | client_node)
// MAC_c = HMAC-SHA256(secret, "flexkv-cluster-v1 client" | server_nonce | client_nonce | client_node | server_node)
// with every field preceded by its length (u32 little endian).
inline constexpr unsigned kAmHello = 0x4b33;
inline constexpr unsigned kAmHelloReply = 0x4b34;
inline constexpr unsigned kAmProof = 0x4b35;
inline constexpr unsigned kAmProofReply = 0x4b36;
inline constexpr unsigned kAmCallRequest = 0x4b37;
inline constexpr unsigned kAmCallReply = 0x4b38;
struct AmHeader {
  uint64_t id;
  uint32_t code;  // a StatusCode in replies
  uint32_t aux;   // the method of a CALL
  uint8_t token[kTokenBytes];  // a request's fresh token; a reply echoes its request's (HELLO's serves PROOF too)
};
inline constexpr uint32_t kGetRangeRefused = 1;      // AmReplyHeader::status: no registered region covers it
inline constexpr uint32_t kGetNotAuthenticated = 2;  // AmReplyHeader::status: the endpoint has not proven the secret
// 2: every message carries a token (v1 nodes, whose headers lack it, cannot talk to v2 nodes: a rolling upgrade
// needs every node on the same version).
inline constexpr uint8_t kHandshakeVersion = 2;
inline constexpr size_t kNonceBytes = 16;
inline constexpr size_t kMacBytes = 32;
inline constexpr size_t kMaxNodeIdBytes = 64;
inline constexpr size_t kMaxErrorBytes = 1024;
inline constexpr size_t kMinSecretBytes = 16;

// Little-endian integers of `bytes` bytes (the region descriptor, the handshake MAC input).
inline void PutLe(std::string* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
inline uint64_t GetLe(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}

inline std::string UcsError(ucs_status_t s) { return ucs_status_string(s); }

// A node id as the handshake carries it and UcxOptions::node_id takes it: [A-Za-z0-9._-]{1,64}.
inline bool ValidNodeId(std::string_view id) {
  if (id.empty() || id.size() > kMaxNodeIdBytes) return false;
  for (char c : id) {
    const bool ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
                    c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

// A value handed from the progress thread to a waiting caller (a mutex and a condition variable rather than
// std::promise, whose futex wait ThreadSanitizer does not see).
template <typename T>
class Rendezvous {
 public:
  void Set(T v) {
    MutexLock lock(&mu_);
    value_ = std::move(v);
    cv_.notify_all();
  }
  T Take() {
    MutexLock lock(&mu_);
    while (!value_.has_value()) mu_.Wait(&cv_);
    return std::move(*value_);
  }

 private:
  Mutex mu_;
  std::condition_variable cv_;
  std::optional<T> value_ ABSL_GUARDED_BY(mu_);
};

// "host:port" or "[v6]:port" of a socket address (numeric host).
inline std::string FormatSockaddr(const sockaddr_storage& ss) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &in->sin_addr, buf, sizeof buf);
    return std::string(buf) + ":" + std::to_string(ntohs(in->sin_port));
  }
  if (ss.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &in6->sin6_addr, buf, sizeof buf);
    return "[" + std::string(buf) + "]:" + std::to_string(ntohs(in6->sin6_port));
  }
  return "?";
}

// ---------------------------------------------------------------------------------------------------------------
// The transport's state: the UCP context and its lanes (a UcxCore each). Shared with RegisteredRegion handles
// through a weak_ptr; the lanes and the context live until the last reference goes.

struct UcxCore;
struct UcxState {
  UcxOptions options;
  ucp_context_h context = nullptr;
  std::vector<std::unique_ptr<UcxCore>> lanes;  // fixed after Create; lane 0 holds the listener
  std::atomic<uint32_t> inflight{0};            // Gets and Calls over all lanes (max_inflight_gets)
  std::atomic<uint64_t> next_peer_id{1};        // a peer has the same id on every lane
  std::atomic<uint64_t> next_region_id{1};      // a region has the same id on every lane
  std::atomic<uint32_t> next_lane{0};           // round robin of requests over the lanes
  std::atomic<uint32_t> next_accept_lane{0};    // round robin of accepted connections over the lanes
  std::atomic<bool> shutting_down{false};
  // Registered memory (one ucp_mem_h serves every lane's worker); unmapped by whoever erases it.
  Mutex regions_mu;
  std::map<uint64_t, ucp_mem_h> regions ABSL_GUARDED_BY(regions_mu);
  std::set<uint64_t> leaked_regions ABSL_GUARDED_BY(regions_mu);  // a reply still read them at shutdown: kept

  ~UcxState();
  UcxCore* Pick() { return lanes[next_lane.fetch_add(1, std::memory_order_relaxed) % lanes.size()].get(); }
  bool OnAnyLoopThread() const;
};

// ---------------------------------------------------------------------------------------------------------------
// A lane: everything its progress thread owns.

struct UcxCore {
  struct Op;
  struct Peer {
    uint64_t id = 0;
    std::string endpoint;
    sockaddr_storage addr{};
    socklen_t addrlen = 0;
    ucp_ep_h ep = nullptr;
    bool failed = false;          // the error handler ran; close the ep in the loop
    bool closed_by_deadline = false;
    bool connected_once = false;
    bool healthy = false;     // wired up since the last failure (only the first failure is logged at info)
    // Reconnecting: gets wait until the new endpoint is wired up (as Connect waits), then start.
    bool connecting = false;
    struct Waiting {
      Op* op;
      uint64_t address;
      void* dst;
      uint64_t len;
    };
    std::vector<Waiting> waiting;
    std::function<void(Status, const std::string&)> on_connected;  // Connect's wait: the outcome, the node id
    std::string node_id;                 // proven by the handshake on the current endpoint
    Clock::time_point connect_deadline;  // the wire-up and the handshake of the current endpoint
    std::unordered_set<Op*> ops;
  };
  // A Get, a Call, the flush that Connect waits on, or the handshake after it.
  struct Op {
    enum class Kind { kGet, kFlush, kHandshake, kCall };
    UcxCore* core = nullptr;
    uint64_t peer_id = 0;
    Kind kind = Kind::kGet;
    // Gets and Calls count against max_inflight_gets.
    bool counted() const { return kind == Kind::kGet || kind == Kind::kCall; }
    Clock::time_point deadline;
    bool deadline_hit = false;
    bool posted = false;
    ucs_status_t ucs = UCS_INPROGRESS;
    std::function<void(Status)> done;
    // Active-message gets, calls and handshakes: waiting for the reply (no UCX request writes dst yet), its id, the
    // token its reply must echo, where a get's bytes land.
    bool am_waiting = false;
    uint64_t am_id = 0;
    uint8_t token[kTokenBytes] = {};
    void* dst = nullptr;
    uint64_t len = 0;
    std::optional<Status> result;  // overrides the mapping of `ucs`
    // Calls: the request until sent, the reply as received, the caller's callback.
    uint16_t method = 0;
    std::string request;
    std::string reply;
    std::function<void(Result<std::string>)> call_done;
    // Handshakes: 1 waiting for HELLO_REPLY, 2 waiting for PROOF_REPLY.
    int stage = 0;
    std::string client_nonce;
    std::string server_node;
  };
  // A server-side endpoint (accepted connection) and its handshake.
  struct Accepted {
    uint64_t serial = 0;  // tells a reply for a closed endpoint from one for a new endpoint at the same address
    Clock::time_point since;
    std::string who;  // the client's address
    bool authenticated = false;
    bool hello_used = false;     // one handshake per connection
    bool proof_pending = false;  // a hello was answered: its nonces serve one proof
    std::string client_node;
    std::string client_nonce;
    std::string server_nonce;
  };
  // A Call being received or handled (serving side).
  struct ServerCall {
    UcxCore* core = nullptr;
    uint64_t serial = 0;
    ucp_ep_h ep = nullptr;
    uint64_t id = 0;
    uint8_t token[kTokenBytes] = {};
    uint16_t method = 0;
    std::string node;
    std::string request;
  };
  // A message we send: owns the header and the data until UCX is done with them.
  struct Outgoing {
    AmHeader header{};
    std::string data;
  };
  // What a CallHandler's `reply` reaches, from any thread: nulled (under `mu`) once the progress thread is gone.
  struct ReplyGate {
    Mutex mu;
    UcxCore* core ABSL_GUARDED_BY(mu) = nullptr;
  };
  struct Region {
    ucp_mem_h memh = nullptr;
    uintptr_t base = 0;
    uint64_t bytes = 0;
    uint32_t replies = 0;  // replies being sent from it
  };
  // A reply being sent from a region (serving side).
  struct Reply {
    UcxCore* core = nullptr;
    uint64_t region_id = 0;
    AmReplyHeader header{};
  };

  UcxOptions options;
  UcxState* state = nullptr;       // outlives the lane
  uint32_t lane = 0;               // its index in state->lanes
  ucp_context_h context = nullptr;  // state's
  ucp_worker_h worker = nullptr;
  ucp_listener_h listener = nullptr;
  int worker_efd = -1;
  int wake_fd = -1;
  std::string endpoint_text;
  std::thread thread;
  std::thread::id thread_id;

  // Commands for the progress thread.
  Mutex queue_mu;
  std::deque<std::function<void()>> queue ABSL_GUARDED_BY(queue_mu);
  bool stop ABSL_GUARDED_BY(queue_mu) = false;

  std::atomic<bool> shutting_down{false};

  // Progress-thread state (no lock: only the progress thread touches it).
  std::unordered_map<uint64_t, std::unique_ptr<Peer>> peers;
  std::set<std::pair<Clock::time_point, Op*>> deadlines;
  std::vector<Op*> completed;             // filled by UCX callbacks, drained after progress
  std::vector<void*> closing;             // ep close requests still in progress
  std::unordered_map<ucp_ep_h, Accepted> accepted;  // server-side endpoints
  uint64_t next_accepted_serial = 1;
  std::shared_ptr<ReplyGate> gate = std::make_shared<ReplyGate>();
  std::vector<ucp_ep_h> accepted_failed;
  std::unordered_map<uint64_t, Region> regions;  // the state's, with this lane's replies from each
  std::vector<uint64_t> leaked_regions;           // regions a reply still read when this lane shut down
  std::unordered_map<uint64_t, Op*> am_ops;  // active-message gets waiting for their reply
  uint64_t next_am_id = 1;
  // Lane 0: the connection requests its listener received during the progress call running now, each with the lane
  // that takes it; handed over as soon as that call returns (HandOffAccepts).
  struct PendingAccept {
    ucp_conn_request_h request = nullptr;
    std::string who;
    UcxCore* target = nullptr;
  };
  std::vector<PendingAccept> pending_accepts;
  // An endpoint was closed since the last ucp_worker_progress: progress again before sleeping (see Progress).
  bool closed_since_progress = false;

  // Read by other threads.
  mutable Mutex info_mu;
  std::function<bool(const sockaddr&)> accept_filter ABSL_GUARDED_BY(info_mu);
  std::set<std::string> ucx_lanes ABSL_GUARDED_BY(info_mu);  // "tl/dev" of our endpoints
  UcxTransport::Stats stats ABSL_GUARDED_BY(info_mu);
  UcxTransport::CallHandler call_handler ABSL_GUARDED_BY(info_mu);
  log::RateLimited dropped_log{1000};                  // replies dropped (TakeReplyOp)
  log::RateLimited refused_log{1000};                  // gets of ranges not registered here

  ~UcxCore();

  bool OnLoopThread() const { return std::this_thread::get_id() == thread_id; }

  // Queues `fn` for the progress thread; false (and `fn` dropped) once the thread is stopping. Any thread.
  bool Post(std::function<void()> fn);

  // Runs `fn` on the progress thread and waits for it (inline when already there); `fallback` once the thread
  // has stopped.
  template <typename T>
  T RunSync(std::function<T()> fn, T fallback) {
    if (OnLoopThread()) return fn();
    Rendezvous<T> result;
    if (!Post([&] { result.Set(fn()); })) return fallback;
    return result.Take();
  }

  // ---- the lane (ucx_lane.cc) ----
  // A UCX request of the Op `user_data` (a flush, a rendezvous receive) has completed: the op is queued for
  // FinishCompleted.
  static void OnOpDone(void* request, ucs_status_t status, void* user_data);
  // A connection we made failed: its peer is marked failed; Housekeeping closes the endpoint.
  static void OnPeerError(void* arg, ucp_ep_h ep, ucs_status_t status);
  // An accepted connection failed: Housekeeping closes and forgets it.
  static void OnAcceptedError(void* arg, ucp_ep_h ep, ucs_status_t status);
  // Lane 0's listener: a connection request, refused (accept filter, shutdown) or queued for HandOffAccepts with the
  // lane that takes it.
  static void OnConnRequest(ucp_conn_request_h request, void* arg);
  // Lane 0, right after a ucp_worker_progress call returned: creates the endpoint of each connection request its
  // listener received, on the lane chosen for it, and waits for that lane's ucp_ep_create to return before the next.
  void HandOffAccepts();
  // Creates the endpoint of an accepted connection on this lane's worker (its progress thread).
  void Accept(ucp_conn_request_h request, const std::string& who);
  // Forced: pending sends are cancelled. Not forced (after a refused handshake, to a peer that just answered):
  // what was sent is delivered first.
  void CloseEp(ucp_ep_h ep, bool force = true);
  // Closes the peer's endpoint (if any) and ends its active-message ops still waiting for a reply (CANCELED).
  void ClosePeerEp(Peer* peer, bool force = true);
  // A new endpoint to the peer's address (UNAVAILABLE when UCX refuses it at once); counts a reconnect.
  Status CreatePeerEp(Peer* peer);
  // Adds the transports/devices of the peer's endpoint to ucx_lanes (transports_in_use).
  void RecordLanes(Peer* peer);
  // Ops finished by UCX: report them.
  void FinishCompleted();
  // Ends an op: its status from `ucs`, `result`, its deadline or the shutdown; then Deliver.
  void Finish(Op* op);
  // Counts the op's outcome, deletes it and calls its callback.
  void Deliver(Op* op, Status status);
  // Completes an op that UCX never took (or took and finished at once).
  void FinishNow(Op* op, ucs_status_t ucs);
  // Ends, with `status`, an op that UCX holds no request of.
  void FinishWith(Op* op, Status status);
  // Marks the ops past their deadline and closes their peers' endpoints (forced), which ends every op on them.
  void CheckDeadlines();
  // How long the loop may sleep: until the next deadline, at most 1 s.
  int PollTimeoutMs() const;
  // Closes failed endpoints, accepted connections without a handshake within get_deadline (with a secret), and
  // frees finished close requests.
  void Housekeeping();
  // ucp_worker_progress until it has nothing to do, handing accepted connections over after each call.
  void Progress();
  // Progress, when an endpoint was closed since the last ucp_worker_progress.
  void ProgressIfClosed();
  // One round of everything but sleeping.
  void Turn();
  // The progress thread: commands, Turn, then sleep on the worker's event fd and wake_fd until `stop`.
  void Loop();
  // The op's peer, connected and (with a secret) authenticated; nullptr when the op finished or now waits for a
  // (re)connection in `peer->waiting`.
  Peer* ReadyPeer(Op* op, uint64_t remote_address, void* dst, uint64_t len);
  // A new endpoint for a known peer; gets wait for its wire-up (a flush, bounded by get_deadline).
  Status Reconnect(Peer* peer);
  // The wire-up's outcome: on success with a secret the handshake follows; else ConnectDone.
  void OnReconnected(uint64_t peer_id, Status s);
  // The end of a (re)connection: wired up and, with a secret, authenticated; or why not.
  void ConnectDone(uint64_t peer_id, Status s);
  // Flushes the op's peer endpoint: the op completes once the connection is wired up, or fails.
  void StartFlush(Op* op);
  // Destroys the listener, closes every endpoint and waits (at most 5 s) for their ops to end; forgets the regions
  // (those a reply may still read go to leaked_regions).
  void Shutdown();

  // ---- active messages: what every protocol shares, and gets (ucx_active_messages.cc) ----
  // Sends an active message owning its bytes; an error only when UCX refused it at once.
  ucs_status_t SendAm(ucp_ep_h ep, unsigned am_id, AmHeader header, std::string data, bool want_reply);
  // SendAm's completion: frees the message.
  static void OnOutgoingSent(void* request, ucs_status_t status, void* user_data);
  // The header of a reply to a request of `id` and `token`: it echoes both.
  static AmHeader ReplyHeader(uint64_t id, const uint8_t* token, uint32_t code = 0);
  // A request's header with a fresh token (kept in `token` for its reply).
  static AmHeader RequestHeader(uint64_t id, uint32_t aux, uint8_t (&token)[kTokenBytes]);
  // An error reply (its message cut at kMaxErrorBytes). Replies go with the reply flag: the requester checks that
  // they came on the endpoint its request went out on.
  void SendStatus(ucp_ep_h ep, unsigned am_id, uint64_t id, const uint8_t* token, const Status& status);
  void SendStatus(ucp_ep_h ep, unsigned am_id, const AmHeader& request, const Status& status);
  // The accepted connection a message came on; nullptr for one we made or one UCX did not name.
  Accepted* FindAccepted(const ucp_am_recv_param_t* param);
  // Whether requests on this endpoint are served: every one without a secret, else accepted and authenticated.
  bool Authenticated(const ucp_am_recv_param_t* param);
  // The client's address of the connection a message came on, for logs.
  std::string Who(const ucp_am_recv_param_t* param);
  // A request refused (unauthenticated, malformed): logged and counted (requests_refused).
  void CountRefused(std::string_view what, const ucp_am_recv_param_t* param);
  void CountMalformed(std::string_view what, const ucp_am_recv_param_t* param);
  // Client: the op a reply answers, taken out of am_ops: the op waiting under `id` is of `kind` (and handshake
  // `stage`), the reply echoes its token, it came on the endpoint the request went out on (our peers reply with
  // UCP_AM_SEND_FLAG_REPLY, so UCX names our endpoint), and, for gets and calls with a secret, that endpoint has
  // completed its handshake. Anything else is dropped, counted (replies_dropped) and logged (rate-limited):
  // nullptr. The token is what makes it hold: the reply endpoint UCX reports comes from an id in the message.
  Op* TakeReplyOp(uint64_t id, const uint8_t* token, Op::Kind kind, std::string_view what,
                  const ucp_am_recv_param_t* param, int stage = 0);
  // A reply that answers no request of ours: counted (replies_dropped) and logged, rate-limited.
  void DropReply(std::string_view what, std::string_view why, const ucp_am_recv_param_t* param);
  // A get request's send completed: frees its header.
  static void OnGetRequestSent(void* request, ucs_status_t, void* user_data);
  // A get reply's send completed: the region it was read from has one reply fewer in flight.
  static void OnReplySent(void* request, ucs_status_t status, void* user_data);
  // A rendezvous receive (a get's bytes, a call's reply) completed: as OnOpDone.
  static void OnAmData(void* request, ucs_status_t status, size_t, void* user_data);
  // Serving side: a peer asks for [address, address + length).
  static ucs_status_t OnAmGetRequest(void* arg, const void* header, size_t header_length, void*, size_t,
                                     const ucp_am_recv_param_t* param);
  // Reading side: the bytes (or the refusal) for one of our gets; only for the get it names (by id and token), on
  // that get's endpoint, once authenticated (TakeReplyOp): anything else is dropped and counted.
  static ucs_status_t OnAmGetReply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                   const ucp_am_recv_param_t* param);
  // A Get command: waits for the peer's (re)connection if needed (ReadyPeer), then StartAmGet.
  void StartGet(Op* op, uint64_t remote_address, void* dst, uint64_t len);
  // Sends the get request; the op waits in am_ops for OnAmGetReply, its close or its deadline.
  void StartAmGet(Peer* peer, Op* op, uint64_t remote_address, void* dst, uint64_t len);

  // ---- the handshake and Calls (ucx_handshake_and_calls.cc) ----
  // A handshake that failed a proof of the secret or the membership check: counted (auth_failures).
  void CountAuthFailure();
  // Copies an AmHeader out of a message; false when the header has another size (malformed, or another version).
  static bool FixedHeader(const void* header, size_t header_length, AmHeader* out);
  // Client: the outcome of one of our handshake or call ops, by id; nullptr when it is not (or no longer) waiting.
  Op* TakeAmOp(uint64_t id, Op::Kind kind);
  // Ends an active-message op with `status` (through `completed`).
  void FailAmOp(Op* op, Status status);
  // "peer host:port", for messages.
  std::string PeerName(uint64_t peer_id);
  // After the wire-up, with a secret: HELLO, then (OnAmHelloReply) PROOF; ConnectDone runs with the outcome.
  void StartHandshake(Peer* peer);
  // Server: HELLO. Answers with our node id, a nonce and MAC_s.
  static ucs_status_t OnAmHello(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                const ucp_am_recv_param_t* param);
  // Client: HELLO_REPLY. Checks MAC_s, then sends MAC_c.
  static ucs_status_t OnAmHelloReply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                     const ucp_am_recv_param_t* param);
  // Server: PROOF. Checks MAC_c and the membership; marks the endpoint authenticated.
  static ucs_status_t OnAmProof(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                const ucp_am_recv_param_t* param);
  // Client: PROOF_REPLY. The server accepted us, or its reason.
  static ucs_status_t OnAmProofReply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                     const ucp_am_recv_param_t* param);
  // A Call command: waits for the peer's (re)connection if needed (ReadyPeer), then sends the request; the op
  // waits in am_ops for OnAmCallReply, its close or its deadline.
  void StartCall(Op* op);
  // Server: a CALL. Refused on unauthenticated endpoints; else handed to the handler once its bytes are here.
  static ucs_status_t OnAmCallRequest(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                      const ucp_am_recv_param_t* param);
  // A CALL's request bytes came by rendezvous: DispatchCall, or dropped if the receive failed.
  static void OnCallRequestData(void* request, ucs_status_t status, size_t, void* user_data);
  // Hands the call (owned from here on) to the CallHandler, with a `reply` that any thread may call once; answers
  // UNIMPLEMENTED without a handler.
  void DispatchCall(ServerCall* call);
  // A handler's reply, on this lane's thread: sent only while the connection the call came on is still open (the
  // same accepted connection, or one of our peers' endpoints).
  void SendCallReply(uint64_t serial, ucp_ep_h ep, uint64_t id, const uint8_t* token, Result<std::string> r);
  // Client: a CALL_REPLY.
  static ucs_status_t OnAmCallReply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                    const ucp_am_recv_param_t* param);
};

}  // namespace flexkv::cluster
