// UcxTransport: the cluster tier's bytes (issue 16, docs/cluster.md). Reads blocks from peers' registered memory: a get
// is our own request/reply over UCP active messages on every transport (UCX chooses its transports within
// `UcxOptions::transports`), served only for ranges inside regions registered here and only to authenticated
// endpoints. The UCP context never asks for UCP_FEATURE_RMA (issue 29): with it, UCX 1.13 installs its software
// RMA handlers (rma_sw.c) on every transport that carries active messages, verbs too, and they get or put any
// address of the process for any endpoint, with no rkey, registration or handshake checked (a get at an unmapped
// address killed the node with SIGSEGV; a requester that fails mid-reply made UCX abort it). So there is no
// one-sided read, no rkey is packed or sent, and over verbs a large reply moves by UCX's rendezvous (zero-copy, an
// rkey of the registration handed to the authenticated requester for that transfer). The serving side must progress
// its worker: the transport's own progress thread does that (it sleeps on the worker's event fd).
//
// Threading: thread-safe. One UCP context and `UcxOptions::lanes` lanes: a lane is a worker
// (UCS_THREAD_MODE_SINGLE) owned by a progress thread of its own that makes every UCP call on it; the public
// methods hand work to a lane's thread. A peer is connected once per lane (an endpoint, a TCP connection and a
// handshake each), and its Gets and Calls are spread over the lanes round robin; the listener sits on lane 0 and
// hands each accepted connection to the next lane, so the serving side's work is spread too. `done` callbacks of
// Get run on the thread of the lane that carried it: keep them short; they may call Get, but Connect called from a
// callback does not wait for the connection, and Register, RegisteredRegion::Reset and Disconnect must not be
// called from one. `done` of Call and the CallHandler also run on a lane's thread; a CallHandler's `reply` may be
// called from any thread.
//
// Security (docs/cluster.md "UCX transport", docs/operations.md "Cluster threat model"). With `UcxOptions::secret`
// set, Connect runs a mutual HMAC-SHA256 challenge-response over active messages (both sides prove the cluster
// secret, the server also asks `is_member`), and the server answers our own requests (gets, Calls) only on endpoints
// that completed it: anything else gets a PERMISSION_DENIED reply, never bytes. Every request carries a fresh
// 16-byte random token; a reply is taken only when it names a waiting request of its kind, echoes that request's
// token, comes on the endpoint the request went out on and (gets, Calls) that endpoint has completed the handshake;
// anything else is dropped, counted (Stats::replies_dropped) and logged, rate-limited. So a process that can send to
// this node but never saw the request cannot answer it, whatever sequence ids it tries. The accept filter
// (set_accept_filter: only current members' addresses) is a second fence, not the only one. What is NOT covered:
// the handshake is not bound to the connection's addresses, and the messages after it are neither encrypted nor
// MACed: a node on the path that relays both directions can sit in the middle, read and change bytes (the block
// checksum a puller verifies is no MAC: docs/operations.md). Below UCP, UCX's tcp transport accepts connections on
// its own listening port and its PUT protocol writes where the frame says (uct tcp_ep.c, as read in UCX 1.13.1's source,
// not tried; nothing this transport can switch off): keep the cluster network to the cluster's hosts. The listener binds only
// to `listen_address` (never 0.0.0.0 unless that is what is configured), and shared-memory transports are refused in
// `transports` (UCX would otherwise go around the network between network namespaces of one host).
#pragma once

#include <sys/socket.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "flexkv/status.h"

namespace flexkv::cluster {

struct UcxOptions {
  // --transfer-dev: UCX_NET_DEVICES, e.g. "mlx5_0:1,mlx5_1:1" or "eth0"; empty: UCX's choice (all devices).
  std::string devices;
  // UCX_TLS-like restriction (comma list). Shared-memory transports (sm, shm, posix, sysv, cma, knem, xpmem) and
  // "all" are refused: between namespaces of one host UCX would use them instead of the network.
  std::string transports = "rc,tcp";
  // The listener: the node's cluster address ("10.0.0.7", "::1"; numeric only). Empty: no listener (this
  // transport only reads from peers). Port 0: UCX picks one; endpoint() says which.
  std::string listen_address;
  uint16_t listen_port = 0;
  // A Get that has not completed after this long ends with DEADLINE_EXCEEDED: the request is cancelled by a
  // forced close of the peer's endpoint (UCX never reports a silent partition), and the next Get to that peer
  // reconnects. Connect waits at most this long for the connection too.
  std::chrono::milliseconds get_deadline{2000};
  // Gets and Calls accepted but not yet completed, over all peers and lanes; one beyond it returns
  // RESOURCE_EXHAUSTED at once.
  uint32_t max_inflight_gets = 64;
  // Lanes (1..kMaxLanes; else INVALID_ARGUMENT): workers with a progress thread each, every peer connected once per
  // lane. Over tcp one worker moves ~1.2 GB/s of gets whatever the number in flight (docs/performance.md "Cluster
  // tier"): more lanes are more TCP connections and more threads on both sides.
  uint32_t lanes = 1;

  // Peer authentication. `secret`: the cluster secret (>= 16 bytes, else Create says INVALID_ARGUMENT). Empty: no
  // authentication (tests of the transport alone): Connect does no handshake and every endpoint is served.
  std::string secret;
  // This node's id, sent in the handshake: [A-Za-z0-9._-]{1,64} (checked by Create when `secret` is set).
  std::string node_id;
  // Server side, on any lane's progress thread (several may call at once: thread-safe): whether a node id that
  // proved the secret is a current member (the daemon answers from its directory's member list; must not block).
  // Unset: any node that proves the secret.
  std::function<bool(std::string_view node_id)> is_member;
};

// The largest Call request or reply, in bytes.
inline constexpr uint64_t kMaxCallBytes = 4ull << 20;
// The most lanes a transport takes.
inline constexpr uint32_t kMaxLanes = 16;

class UcxTransport;
struct UcxState;

// A local memory range registered for remote reads. Move-only; unregisters on destruction. Must not outlive
// its transport's use (destroying the transport first unregisters everything, and the handle becomes inert).
class RegisteredRegion {
 public:
  RegisteredRegion() = default;
  RegisteredRegion(RegisteredRegion&& other) noexcept;
  RegisteredRegion& operator=(RegisteredRegion&& other) noexcept;
  RegisteredRegion(const RegisteredRegion&) = delete;
  RegisteredRegion& operator=(const RegisteredRegion&) = delete;
  ~RegisteredRegion();

  bool valid() const { return id_ != 0; }
  void* base() const { return base_; }
  uint64_t bytes() const { return bytes_; }
  // What a peer needs to ask for ranges of the region (base address, length; no rkey: reads are served over active
  // messages only), as bytes to send over the caller's authenticated channel; the peer parses it with
  // RemoteRegion::Parse.
  const std::string& descriptor() const { return descriptor_; }
  // Unregisters now (idempotent).
  void Reset();

 private:
  friend class UcxTransport;
  std::weak_ptr<UcxState> state_;
  uint64_t id_ = 0;
  void* base_ = nullptr;
  uint64_t bytes_ = 0;
  std::string descriptor_;
};

// A peer's region, parsed from its descriptor bytes (untrusted: every length is checked; a malformed
// descriptor is INVALID_ARGUMENT, never a crash). Copyable.
class RemoteRegion {
 public:
  static Result<RemoteRegion> Parse(std::string_view descriptor);
  uint64_t base() const { return base_; }
  uint64_t length() const { return length_; }

 private:
  uint64_t base_ = 0;
  uint64_t length_ = 0;
};

// A connection to a peer (client side), from Connect. Copyable; valid until Disconnect or the transport's end.
struct PeerHandle {
  uint64_t id = 0;
  std::string endpoint;
  std::string node_id;  // the peer's node id as proven in the handshake; empty without a secret
};

class UcxTransport {
 public:
  static Result<std::unique_ptr<UcxTransport>> Create(const UcxOptions& options);
  // Ends every pending Get (UNAVAILABLE or CANCELLED through its `done`), closes endpoints and the listener,
  // unregisters every region still registered.
  ~UcxTransport();
  UcxTransport(const UcxTransport&) = delete;
  UcxTransport& operator=(const UcxTransport&) = delete;

  // Registers [base, base + bytes) for remote reads (the DRAM pool's grants).
  Result<RegisteredRegion> Register(void* base, uint64_t bytes);

  // The address peers connect to, "host:port" ("[v6]:port" for IPv6); empty without a listener.
  std::string endpoint() const;

  // Called on lane 0's progress thread for every incoming connection request with the client's address; a request
  // it rejects is refused (ucp_listener_reject). Unset: every request is accepted (tests only: see the security
  // note above).
  void set_accept_filter(std::function<bool(const sockaddr&)> filter);

  // Connects to a peer's endpoint ("host:port", numeric host), once per lane, and waits until UCX has wired every
  // lane's connection up and, with a secret, each lane's handshake is done (at most get_deadline; the first lane
  // that fails fails the Connect): UNAVAILABLE if the peer refuses or cannot be
  // reached, DEADLINE_EXCEEDED if it does not answer in time, INVALID_ARGUMENT for a malformed endpoint,
  // PERMISSION_DENIED if the peer did not prove the cluster secret or refused us (its reason: "not a member", a
  // wrong secret, no secret configured there). Every reconnect (after a deadline or a failure) redoes the handshake;
  // requests queued meanwhile end with its PERMISSION_DENIED if it fails.
  Result<PeerHandle> Connect(const std::string& endpoint);
  // Closes the connection on every lane (forced: pending Gets end with UNAVAILABLE). The handle is invalid
  // afterwards.
  void Disconnect(const PeerHandle& peer);

  // Reads `len` bytes at `remote_offset` of the peer region `remote` into `dst` (a request and reply over active
  // messages, whatever the transport). `dst` must stay valid until `done` ran.
  //
  // Returns an error at once, and then never calls `done`: INVALID_ARGUMENT (len 0, null dst, the range outside
  // the descriptor, overflow), RESOURCE_EXHAUSTED (max_inflight_gets already pending), NOT_FOUND (unknown or
  // disconnected peer), FAILED_PRECONDITION (the transport is shutting down). Returns OK otherwise, and then
  // `done` is called exactly once, on the progress thread of the lane that carried it (the lanes take Gets round
  // robin), after UCX has finished with `dst`: OK (the bytes are there), DEADLINE_EXCEEDED (no completion within
  // get_deadline: cancelled, that lane's endpoint closed, its next Get reconnects), UNAVAILABLE (peer gone, connection refused, or cancelled because another Get to the same peer hit
  // its deadline), NOT_FOUND (no region the peer has registered covers the range, i.e. a stale or wrong
  // descriptor), PERMISSION_DENIED (the peer has a secret and this connection did not prove it; or the reconnect's handshake failed), CANCELLED (the
  // transport was destroyed).
  Status Get(const PeerHandle& peer, const RemoteRegion& remote, uint64_t remote_offset, void* dst, uint64_t len,
             std::function<void(Status)> done);

  // Calls: small request/reply RPCs between daemons over active messages.
  //
  // Server side: set before peers connect (replaces any previous handler). Called on a lane's progress thread for each
  // request from an authenticated peer (any peer without a secret; `peer_node_id` is then empty); requests from
  // an endpoint that has not completed the handshake are answered PERMISSION_DENIED without calling it, and
  // without a handler every request is answered UNIMPLEMENTED. The handler must not block: it hands the work to
  // its own thread and calls `reply` exactly once, from any thread (thread-safe; further calls are ignored; a
  // reply after the transport's destruction or the peer's disconnect is dropped silently). An error reply carries
  // its code and message (truncated to 1 KiB); an OK reply larger than kMaxCallBytes is sent as RESOURCE_EXHAUSTED.
  using CallHandler = std::function<void(const std::string& peer_node_id, uint16_t method, std::string request,
                                         std::function<void(Result<std::string>)> reply)>;
  void set_call_handler(CallHandler handler);

  // Client side: sends `request` to the peer's CallHandler. Returns an error at once, and then never calls `done`:
  // INVALID_ARGUMENT (request larger than kMaxCallBytes), RESOURCE_EXHAUSTED (max_inflight_gets requests of all
  // kinds pending), NOT_FOUND (invalid peer handle), FAILED_PRECONDITION (shutting down). Returns OK otherwise, and
  // then `done` runs exactly once on a lane's progress thread: the reply bytes, the handler's error (its code and
  // message), UNIMPLEMENTED (the peer has no handler), PERMISSION_DENIED (the peer refused this endpoint or the
  // handshake failed), DEADLINE_EXCEEDED (no reply within get_deadline: the endpoint is force-closed as for Get,
  // the next request reconnects), UNAVAILABLE (peer gone or disconnected), CANCELLED (transport destroyed).
  Status Call(const PeerHandle& peer, uint16_t method, std::string request,
              std::function<void(Result<std::string>)> done);
  // Call, waiting for its outcome. FAILED_PRECONDITION when called on a progress thread (from a callback).
  Result<std::string> CallSync(const PeerHandle& peer, uint16_t method, std::string request);

  // The transports/devices UCX uses for the connections made so far, e.g. "tcp/lo", "rc_mlx5/mlx5_0:1" (from
  // ucp_ep_print_info), preceded by the configured restriction ("config: TLS=tcp NET_DEVICES=all", with
  // " LANES=4" appended where there is more than one lane).
  std::vector<std::string> transports_in_use() const;

  // Counters (for status and tests).
  struct Stats {
    uint64_t gets_ok = 0;
    uint64_t gets_failed = 0;
    uint64_t deadlines = 0;
    uint64_t connections_accepted = 0;
    uint64_t connections_rejected = 0;
    uint64_t reconnects = 0;
    uint64_t auth_failures = 0;     // handshakes that failed a proof of the secret or the membership check (either side)
    uint64_t requests_refused = 0;  // gets/calls/handshake messages refused: unauthenticated endpoint or malformed
    uint64_t calls_ok = 0;          // client side
    uint64_t calls_failed = 0;      // client side
    // Replies (to gets, calls, handshakes) that answered no request of ours: an unknown id, another kind, not the
    // request's token, not on the endpoint the request went out on, or on one that has not completed the handshake.
    // Dropped (never written anywhere) and logged, rate-limited: forged, or for a request that ended.
    uint64_t replies_dropped = 0;
  };
  Stats stats() const;

 private:
  explicit UcxTransport(std::shared_ptr<UcxState> state) : state_(std::move(state)) {}
  std::shared_ptr<UcxState> state_;
};

// One RDMA port of the NIC inventory (libibverbs).
struct RdmaPort {
  std::string device;      // "mlx5_0"
  int port = 0;            // 1-based
  std::string state;       // "PORT_ACTIVE", ...
  std::string link_layer;  // "InfiniBand" or "Ethernet" (RoCE)
};
// Every port of every RDMA device; empty (not an error) where the kernel has none (ibv_get_device_list NULL with
// ENOSYS, as on the dev VM) or there are no devices.
std::vector<RdmaPort> ListRdmaPorts();
// The same as "device:port" names, the form UCX_NET_DEVICES (--transfer-dev) takes.
std::vector<std::string> ListRdmaDevices();

}  // namespace flexkv::cluster
