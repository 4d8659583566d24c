// UcxTransport; see ucx_transport.h. About 2,200 lines in one file: the transport's state (the UCP context and its
// lanes), a lane (UcxCore: worker, progress thread, endpoints, the get request/reply path (every transport), the
// handshake and Calls, sharing the lane's private state and its one lock) and the public methods that spread work
// over the lanes. The active-message protocols (get request/reply, handshake, Calls) are the part to move into a file
// of their own, behind a small interface to the lane; not done yet (issue 16 wired the transport into the daemon
// first, then lanes were added to reach the link's bandwidth).
#include "daemon/cluster/ucx/ucx_transport.h"

#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <regex>
#include <set>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "common/log.h"
#include "common/mutex.h"

namespace flexkv::cluster {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::string_view kLog = "ucx";

// Descriptor: "FKVU", version u16, reserved u16, base u64, length u64, rkey_len u32 (0), little endian. Version 2
// carries no rkey: no transport serves one-sided reads any more (see below), so there is nothing to unlock.
constexpr char kMagic[4] = {'F', 'K', 'V', 'U'};
constexpr uint16_t kVersion = 2;
constexpr size_t kHeaderBytes = 4 + 2 + 2 + 8 + 8 + 4;

// Every get is our own request/reply over UCP active messages, on every transport, and the UCP context never asks
// for UCP_FEATURE_RMA. With that feature UCX 1.13 installs its software RMA handlers (rma_sw.c) on every transport
// that carries active messages, verbs included: any endpoint can then get or put any address of this process
// (a forged rkey without a matching memory domain makes the requester fall back to them), with no rkey, no
// registration and no handshake checked; a get at an unmapped address kills the process (SIGSEGV), and its
// serving side aborts the process when the requester's connection fails mid-reply. Our handler serves only ranges
// inside regions registered here, only to authenticated endpoints. Over verbs a large reply still moves zero-copy:
// UCX's rendezvous hands the requester (an authenticated member) an rkey of the registration for that transfer.
constexpr unsigned kAmGetRequest = 0x4b31;  // "K1"
constexpr unsigned kAmGetReply = 0x4b32;
// Every request carries a fresh random token; its reply must echo it (with the request's id, on the endpoint the
// request went out on): a reply nobody asked for cannot be forged by guessing sequence ids.
constexpr size_t kTokenBytes = 16;
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
//   HELLO        client -> server  data: version u8 (1), node_len u8, client node id, client nonce (16)
//   HELLO_REPLY  server -> client  code 0: node_len u8, server node id, server nonce (16), MAC_s (32);
//                                  else code is a StatusCode and data the reason
//   PROOF        client -> server  data: MAC_c (32); empty: "your MAC_s was wrong" (the server counts it)
//   PROOF_REPLY  server -> client  code 0: authenticated; else code and reason
//   CALL         client -> server  aux: method; data: the request
//   CALL_REPLY   server -> client  code 0: data is the reply; else code and message
// MAC_s = HMAC-SHA256(secret, "flexkv-cluster-v1 server" | client_nonce | server_nonce | server_node | client_node)
// MAC_c = HMAC-SHA256(secret, "flexkv-cluster-v1 client" | server_nonce | client_nonce | client_node | server_node)
// with every field preceded by its length (u32 little endian).
constexpr unsigned kAmHello = 0x4b33;
constexpr unsigned kAmHelloReply = 0x4b34;
constexpr unsigned kAmProof = 0x4b35;
constexpr unsigned kAmProofReply = 0x4b36;
constexpr unsigned kAmCallRequest = 0x4b37;
constexpr unsigned kAmCallReply = 0x4b38;
struct AmHeader {
  uint64_t id;
  uint32_t code;  // a StatusCode in replies
  uint32_t aux;   // the method of a CALL
  uint8_t token[kTokenBytes];  // a request's fresh token; a reply echoes its request's (HELLO's serves PROOF too)
};
constexpr uint32_t kGetRangeRefused = 1;      // AmReplyHeader::status: no registered region covers it
constexpr uint32_t kGetNotAuthenticated = 2;  // AmReplyHeader::status: the endpoint has not proven the secret
// 2: every message carries a token (v1 nodes, whose headers lack it, cannot talk to v2 nodes: a rolling upgrade
// needs every node on the same version).
constexpr uint8_t kHandshakeVersion = 2;
constexpr size_t kNonceBytes = 16;
constexpr size_t kMacBytes = 32;
constexpr size_t kMaxNodeIdBytes = 64;
constexpr size_t kMaxErrorBytes = 1024;
constexpr size_t kMinSecretBytes = 16;

void PutLe(std::string* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t GetLe(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}

std::string UcsError(ucs_status_t s) { return ucs_status_string(s); }

bool ValidNodeId(std::string_view id) {
  if (id.empty() || id.size() > kMaxNodeIdBytes) return false;
  for (char c : id) {
    const bool ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
                    c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

// HMAC-SHA256(secret, len|field|len|field...): every field length-prefixed, so no two inputs read alike.
std::string Mac(const std::string& secret, std::initializer_list<std::string_view> fields) {
  std::string input;
  for (std::string_view f : fields) {
    PutLe(&input, f.size(), 4);
    input.append(f);
  }
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
           reinterpret_cast<const unsigned char*>(input.data()), input.size(), out, &len) == nullptr) {
    return std::string();  // never equal to a received MAC of kMacBytes
  }
  return std::string(reinterpret_cast<const char*>(out), len);
}

bool MacEqual(std::string_view a, std::string_view b) {
  return a.size() == kMacBytes && b.size() == kMacBytes && CRYPTO_memcmp(a.data(), b.data(), kMacBytes) == 0;
}

// A fresh request token (OpenSSL's DRBG; getrandom where it fails).
void NewToken(uint8_t (&token)[kTokenBytes]) {
  if (RAND_bytes(token, static_cast<int>(kTokenBytes)) == 1) return;
  size_t got = 0;
  while (got < kTokenBytes) {
    const ssize_t r = getrandom(token + got, kTokenBytes - got, 0);
    if (r > 0) {
      got += static_cast<size_t>(r);
    } else if (r < 0 && errno != EINTR) {
      log::Error(kLog, "no random bytes for a request token (OpenSSL and getrandom: {})", std::strerror(errno));
      std::abort();  // a node without randomness cannot tell its replies from forged ones
    }
  }
}

Result<std::string> RandomBytes(size_t n) {
  std::string out(n, '\0');
  size_t got = 0;
  while (got < n) {
    ssize_t r = getrandom(out.data() + got, n - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      return Status::Internal(std::string("getrandom: ") + std::strerror(errno));
    }
    got += static_cast<size_t>(r);
  }
  return out;
}

// An error that came over the wire: an unknown code reads UNKNOWN, the message is cut at kMaxErrorBytes.
Status StatusFromWire(uint32_t code, std::string_view message) {
  if (message.size() > kMaxErrorBytes) message = message.substr(0, kMaxErrorBytes);
  if (code == 0 || code > static_cast<uint32_t>(StatusCode::kUnauthenticated)) {
    return Status(StatusCode::kUnknown, "(code " + std::to_string(code) + ") " + std::string(message));
  }
  return Status(static_cast<StatusCode>(code), std::string(message));
}

// A value handed from the progress thread to a waiting caller (a mutex and a condition variable rather than
// std::promise, whose futex wait ThreadSanitizer does not see).
template <typename T>
class Rendezvous {
 public:
  void Set(T v) {
    std::lock_guard<std::mutex> lock(mu_);
    value_ = std::move(v);
    cv_.notify_all();
  }
  T Take() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return value_.has_value(); });
    return std::move(*value_);
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<T> value_;
};

bool IsSharedMemoryTransport(std::string_view t) {
  static const char* const kBad[] = {"all", "sm", "shm", "posix", "sysv", "cma", "knem", "xpmem", "self", "cuda_ipc",
                                     "rocm_ipc"};
  for (const char* b : kBad) {
    if (t == b) return true;
  }
  return false;
}

// "host:port" or "[v6]:port" (numeric host) -> sockaddr.
Result<std::pair<sockaddr_storage, socklen_t>> ParseEndpoint(const std::string& endpoint, bool port_required) {
  std::string host, port;
  if (!endpoint.empty() && endpoint[0] == '[') {
    auto close = endpoint.find(']');
    if (close == std::string::npos) return Status::InvalidArgument("endpoint '" + endpoint + "': missing ']'");
    host = endpoint.substr(1, close - 1);
    if (close + 1 < endpoint.size()) {
      if (endpoint[close + 1] != ':') return Status::InvalidArgument("endpoint '" + endpoint + "': expected ':port'");
      port = endpoint.substr(close + 2);
    }
  } else {
    auto colon = endpoint.rfind(':');
    if (colon == std::string::npos || endpoint.find(':') != colon) {
      host = endpoint;  // no port, or a bare IPv6 address
    } else {
      host = endpoint.substr(0, colon);
      port = endpoint.substr(colon + 1);
    }
  }
  if (host.empty()) return Status::InvalidArgument("endpoint '" + endpoint + "': empty host");
  if (port_required && port.empty()) return Status::InvalidArgument("endpoint '" + endpoint + "': no port");
  unsigned long port_value = 0;
  if (!port.empty()) {
    if (port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos)
      return Status::InvalidArgument("endpoint '" + endpoint + "': bad port");
    port_value = std::stoul(port);
    if (port_value > 65535 || (port_required && port_value == 0))
      return Status::InvalidArgument("endpoint '" + endpoint + "': bad port");
  }
  addrinfo hints{};
  hints.ai_flags = AI_NUMERICHOST;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || res == nullptr) {
    return Status::InvalidArgument("endpoint '" + endpoint + "': host is not a numeric address (" +
                                   gai_strerror(rc) + ")");
  }
  sockaddr_storage ss{};
  socklen_t len = static_cast<socklen_t>(res->ai_addrlen);
  std::memcpy(&ss, res->ai_addr, res->ai_addrlen);
  freeaddrinfo(res);
  const auto p = htons(static_cast<uint16_t>(port_value));
  if (ss.ss_family == AF_INET) {
    reinterpret_cast<sockaddr_in*>(&ss)->sin_port = p;
  } else {
    reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port = p;
  }
  return std::make_pair(ss, len);
}

std::string FormatSockaddr(const sockaddr_storage& ss) {
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

}  // namespace

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
    std::mutex mu;
    UcxCore* core = nullptr;
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
  std::mutex queue_mu;
  std::deque<std::function<void()>> queue;
  bool stop = false;  // guarded by queue_mu

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
  mutable std::mutex info_mu;
  std::function<bool(const sockaddr&)> accept_filter;  // guarded by info_mu
  std::set<std::string> ucx_lanes;                     // guarded by info_mu: "tl/dev" of our endpoints
  UcxTransport::Stats stats;                           // guarded by info_mu
  UcxTransport::CallHandler call_handler;              // guarded by info_mu
  log::RateLimited dropped_log{1000};                  // replies dropped (TakeReplyOp)
  log::RateLimited refused_log{1000};                  // gets of ranges not registered here

  ~UcxCore() {
    if (worker != nullptr) ucp_worker_destroy(worker);
    if (wake_fd >= 0) close(wake_fd);
  }

  bool OnLoopThread() const { return std::this_thread::get_id() == thread_id; }

  // Queues `fn` for the progress thread; false (and `fn` dropped) once the thread is stopping.
  bool Post(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(queue_mu);
      if (stop) return false;
      queue.push_back(std::move(fn));
    }
    uint64_t one = 1;
    ssize_t n = write(wake_fd, &one, sizeof one);
    (void)n;
    return true;
  }

  // Runs `fn` on the progress thread and waits for it (inline when already there); `fallback` once the thread
  // has stopped.
  template <typename T>
  T RunSync(std::function<T()> fn, T fallback) {
    if (OnLoopThread()) return fn();
    Rendezvous<T> result;
    if (!Post([&] { result.Set(fn()); })) return fallback;
    return result.Take();
  }

  // ---- UCX callbacks (progress thread, inside ucp_worker_progress or ucp_ep_close_nbx) ----
  static void OnOpDone(void* request, ucs_status_t status, void* user_data) {
    auto* op = static_cast<Op*>(user_data);
    op->ucs = status;
    ucp_request_free(request);
    op->core->completed.push_back(op);
  }
  static void OnGetRequestSent(void* request, ucs_status_t, void* user_data) {
    if (request != nullptr) ucp_request_free(request);
    delete static_cast<AmRequestHeader*>(user_data);
  }
  static void OnReplySent(void* request, ucs_status_t status, void* user_data) {
    if (request != nullptr) ucp_request_free(request);
    auto* reply = static_cast<Reply*>(user_data);
    if (status != UCS_OK) log::Debug(kLog, "a get reply was not delivered: {}", UcsError(status));
    if (auto it = reply->core->regions.find(reply->region_id); it != reply->core->regions.end()) {
      --it->second.replies;
    }
    delete reply;
  }
  static void OnAmData(void* request, ucs_status_t status, size_t, void* user_data) {
    OnOpDone(request, status, user_data);
  }
  // Serving side: a peer asks for [address, address + length).
  static ucs_status_t OnAmGetRequest(void* arg, const void* header, size_t header_length, void*, size_t,
                                     const ucp_am_recv_param_t* param) {
    auto* core = static_cast<UcxCore*>(arg);
    if (header_length != sizeof(AmRequestHeader) || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ||
        core->shutting_down.load()) {
      return UCS_OK;
    }
    AmRequestHeader req;
    std::memcpy(&req, header, sizeof req);
    auto* reply = new Reply;
    reply->core = core;
    reply->header.id = req.id;
    reply->header.status = kGetRangeRefused;
    std::memcpy(reply->header.token, req.token, kTokenBytes);
    if (!core->Authenticated(param)) {
      core->CountRefused("a get", param);
      reply->header.status = kGetNotAuthenticated;
      ucp_request_param_t rp{};
      // With the reply flag the requester learns which of its endpoints the reply came on (UCP_AM_RECV_ATTR_FIELD_REPLY_EP).
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
      rp.flags = UCP_AM_SEND_FLAG_REPLY;
      rp.cb.send = &UcxCore::OnReplySent;
      rp.user_data = reply;
      void* r = ucp_am_send_nbx(param->reply_ep, kAmGetReply, &reply->header, sizeof reply->header, nullptr, 0, &rp);
      if (!UCS_PTR_IS_PTR(r)) OnReplySent(nullptr, UCS_PTR_STATUS(r), reply);
      return UCS_OK;
    }
    const void* data = nullptr;
    size_t data_len = 0;
    ucp_mem_h memh = nullptr;
    for (auto& [id, region] : core->regions) {
      if (req.length != 0 && req.address >= region.base && req.length <= region.bytes &&
          req.address - region.base <= region.bytes - req.length) {
        reply->header.status = 0;
        reply->region_id = id;
        ++region.replies;
        data = reinterpret_cast<const void*>(req.address);
        data_len = req.length;
        memh = region.memh;
        break;
      }
    }
    if (reply->header.status != 0) {
      core->refused_log.Warning(kLog, "refused a get of {} bytes at {:#x} from {}: not in a registered region",
                                req.length, req.address, core->Who(param));
      std::lock_guard<std::mutex> lock(core->info_mu);
      ++core->stats.requests_refused;
    }
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_AM_SEND_FLAG_REPLY;
    rp.cb.send = &UcxCore::OnReplySent;
    rp.user_data = reply;
    if (memh != nullptr) {
      rp.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      rp.memh = memh;
    }
    void* r = ucp_am_send_nbx(param->reply_ep, kAmGetReply, &reply->header, sizeof reply->header, data, data_len, &rp);
    if (!UCS_PTR_IS_PTR(r)) OnReplySent(nullptr, UCS_PTR_STATUS(r), reply);
    return UCS_OK;
  }
  // Reading side: the bytes (or the refusal) for one of our gets; only for the get it names (by id and token), on
  // that get's endpoint, once authenticated (TakeReplyOp): anything else is dropped and counted.
  static ucs_status_t OnAmGetReply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                   const ucp_am_recv_param_t* param) {
    auto* core = static_cast<UcxCore*>(arg);
    if (header_length != sizeof(AmReplyHeader)) {
      core->DropReply("get reply", "a header of " + std::to_string(header_length) + " bytes", param);
      return UCS_OK;
    }
    AmReplyHeader rep;
    std::memcpy(&rep, header, sizeof rep);
    Op* op = core->TakeReplyOp(rep.id, rep.token, Op::Kind::kGet, "get reply", param);
    if (op == nullptr) return UCS_OK;
    if (rep.status == kGetNotAuthenticated) {
      op->ucs = UCS_ERR_REJECTED;
      op->result = Status::PermissionDenied("the peer refused the get: this connection has not proven the cluster "
                                            "secret (is a secret configured on this node?)");
    } else if (rep.status != 0) {
      op->ucs = UCS_ERR_INVALID_PARAM;
      op->result = Status::NotFound("the peer refused the range: no region it registered covers it (a stale or "
                                    "wrong descriptor)");
    } else if (length != op->len) {
      op->ucs = UCS_ERR_MESSAGE_TRUNCATED;
      op->result = Status::Unavailable("the peer sent " + std::to_string(length) + " bytes for a get of " +
                                       std::to_string(op->len));
    } else if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      rp.cb.recv_am = &UcxCore::OnAmData;
      rp.user_data = op;
      void* r = ucp_am_recv_data_nbx(core->worker, data, op->dst, length, &rp);
      if (UCS_PTR_IS_PTR(r)) return UCS_INPROGRESS;  // OnAmData finishes it
      op->ucs = UCS_PTR_STATUS(r);
    } else {
      std::memcpy(op->dst, data, length);
      op->ucs = UCS_OK;
    }
    core->completed.push_back(op);
    return UCS_OK;
  }

  // ---- authentication and Calls (progress thread) ----
  static void OnOutgoingSent(void* request, ucs_status_t status, void* user_data) {
    if (request != nullptr) ucp_request_free(request);
    if (status != UCS_OK) log::Debug(kLog, "a message was not delivered: {}", UcsError(status));
    delete static_cast<Outgoing*>(user_data);
  }
  // Sends an active message owning its bytes; an error only when UCX refused it at once.
  ucs_status_t SendAm(ucp_ep_h ep, unsigned am_id, AmHeader header, std::string data, bool want_reply) {
    auto* out = new Outgoing{header, std::move(data)};
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = want_reply ? UCP_AM_SEND_FLAG_REPLY : 0;
    p.cb.send = &UcxCore::OnOutgoingSent;
    p.user_data = out;
    void* r = ucp_am_send_nbx(ep, am_id, &out->header, sizeof out->header, out->data.data(), out->data.size(), &p);
    if (UCS_PTR_IS_PTR(r)) return UCS_OK;
    const ucs_status_t st = UCS_PTR_STATUS(r);
    OnOutgoingSent(nullptr, st, out);
    return st;
  }
  // The header of a reply to a request of `id` and `token`: it echoes both.
  static AmHeader ReplyHeader(uint64_t id, const uint8_t* token, uint32_t code = 0) {
    AmHeader h{id, code, 0, {}};
    std::memcpy(h.token, token, kTokenBytes);
    return h;
  }
  // A request's header with a fresh token (kept in `token` for its reply).
  static AmHeader RequestHeader(uint64_t id, uint32_t aux, uint8_t (&token)[kTokenBytes]) {
    NewToken(token);
    AmHeader h{id, 0, aux, {}};
    std::memcpy(h.token, token, kTokenBytes);
    return h;
  }
  // Replies go with the reply flag: the requester checks that they came on the endpoint its request went out on.
  void SendStatus(ucp_ep_h ep, unsigned am_id, uint64_t id, const uint8_t* token, const Status& status) {
    std::string message = status.message().substr(0, kMaxErrorBytes);
    (void)SendAm(ep, am_id, ReplyHeader(id, token, static_cast<uint32_t>(status.code())), std::move(message), true);
  }
  void SendStatus(ucp_ep_h ep, unsigned am_id, const AmHeader& request, const Status& status) {
    SendStatus(ep, am_id, request.id, request.token, status);
  }
  Accepted* FindAccepted(const ucp_am_recv_param_t* param) {
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return nullptr;
    auto it = accepted.find(param->reply_ep);
    return it == accepted.end() ? nullptr : &it->second;
  }
  // Whether requests on this endpoint are served: every one without a secret, else accepted and authenticated.
  bool Authenticated(const ucp_am_recv_param_t* param) {
    if (options.secret.empty()) return true;
    const Accepted* a = FindAccepted(param);
    return a != nullptr && a->authenticated;
  }
  std::string Who(const ucp_am_recv_param_t* param) {
    const Accepted* a = FindAccepted(param);
    return a != nullptr ? a->who : std::string("a connection we made");
  }
  void CountRefused(std::string_view what, const ucp_am_recv_param_t* param) {
    log::Warning(kLog, "refused {} from {}: the connection has not proven the cluster secret", what, Who(param));
    std::lock_guard<std::mutex> lock(info_mu);
    ++stats.requests_refused;
  }
  void CountMalformed(std::string_view what, const ucp_am_recv_param_t* param) {
    log::Warning(kLog, "refused a malformed {} from {}", what, Who(param));
    std::lock_guard<std::mutex> lock(info_mu);
    ++stats.requests_refused;
  }
  void CountAuthFailure() {
    std::lock_guard<std::mutex> lock(info_mu);
    ++stats.auth_failures;
  }
  static bool FixedHeader(const void* header, size_t header_length, AmHeader* out) {
    if (header_length != sizeof(AmHeader)) return false;
    std::memcpy(out, header, sizeof *out);
    return true;
  }

  // Server: HELLO. Answers with our node id, a nonce and MAC_s.
  static ucs_status_t OnAmHello(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                const ucp_am_recv_param_t* param) {
    auto* core = static_cast<UcxCore*>(arg);
    AmHeader h{};
    if (core->shutting_down.load() || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return UCS_OK;
    if (!FixedHeader(header, header_length, &h)) {
      core->CountMalformed("handshake hello (header size: from a flexkvd older than this one? every node must run "
                           "the same version)",
                           param);
      return UCS_OK;
    }
    ucp_ep_h ep = param->reply_ep;
    Accepted* a = core->FindAccepted(param);
    if (a == nullptr) {
      core->CountMalformed("handshake hello (not on an accepted connection)", param);
      core->SendStatus(ep, kAmHelloReply, h, Status::PermissionDenied("a handshake on a connection this node made"));
      return UCS_OK;
    }
    if (core->options.secret.empty()) {
      core->SendStatus(ep, kAmHelloReply, h,
                       Status::PermissionDenied("this node has no cluster secret configured; every node must have the "
                                                "same --cluster-secret-file"));
      return UCS_OK;
    }
    const auto* d = static_cast<const char*>(data);
    const bool sized = !(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) && length >= 2 &&
                       length == 2 + static_cast<uint8_t>(d[1]) + kNonceBytes;
    const std::string node = sized ? std::string(d + 2, static_cast<uint8_t>(d[1])) : std::string();
    if (!sized || static_cast<uint8_t>(d[0]) != kHandshakeVersion || !ValidNodeId(node)) {
      core->CountMalformed("handshake hello", param);
      core->SendStatus(ep, kAmHelloReply, h,
                       Status::InvalidArgument("malformed hello: expected version 2 (version 1 is a flexkvd older "
                                               "than this one: every node must run the same version), a node id of "
                                               "[A-Za-z0-9._-]{1,64} and a 16-byte nonce"));
      return UCS_OK;
    }
    if (a->authenticated || a->hello_used) {
      core->CountMalformed("second handshake hello", param);
      core->SendStatus(ep, kAmHelloReply, h, Status::FailedPrecondition("a handshake already ran on this connection"));
      return UCS_OK;
    }
    auto nonce = RandomBytes(kNonceBytes);
    if (!nonce.ok()) {
      core->SendStatus(ep, kAmHelloReply, h, nonce.status());
      return UCS_OK;
    }
    a->hello_used = true;
    a->proof_pending = true;
    a->client_node = node;
    a->client_nonce.assign(d + 2 + node.size(), kNonceBytes);
    a->server_nonce = std::move(*nonce);
    const std::string& self = core->options.node_id;
    std::string out;
    out.push_back(static_cast<char>(self.size()));
    out += self;
    out += a->server_nonce;
    out += Mac(core->options.secret,
               {"flexkv-cluster-v1 server", a->client_nonce, a->server_nonce, self, a->client_node});
    (void)core->SendAm(ep, kAmHelloReply, ReplyHeader(h.id, h.token), std::move(out), true);
    return UCS_OK;
  }
  // Server: PROOF. Checks MAC_c and the membership; marks the endpoint authenticated.
  static ucs_status_t OnAmProof(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                const ucp_am_recv_param_t* param) {
    auto* core = static_cast<UcxCore*>(arg);
    AmHeader h{};
    if (core->shutting_down.load() || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return UCS_OK;
    if (!FixedHeader(header, header_length, &h)) {
      core->CountMalformed("handshake proof (header size)", param);
      return UCS_OK;
    }
    ucp_ep_h ep = param->reply_ep;
    Accepted* a = core->FindAccepted(param);
    if (a == nullptr || !a->proof_pending || a->authenticated || core->options.secret.empty()) {
      core->CountMalformed("handshake proof (no hello before it)", param);
      core->SendStatus(ep, kAmProofReply, h, Status::FailedPrecondition("a proof without a hello before it"));
      return UCS_OK;
    }
    a->proof_pending = false;  // the nonces serve one proof
    if (length == 0) {
      log::Warning(kLog, "node '{}' at {} says this node did not prove the cluster secret: the secrets differ",
                   a->client_node, a->who);
      core->CountAuthFailure();
      return UCS_OK;
    }
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || length != kMacBytes) {
      core->CountMalformed("handshake proof (size)", param);
      core->SendStatus(ep, kAmProofReply, h,
                       Status::InvalidArgument("malformed proof of " + std::to_string(length) + " bytes; expected 32"));
      return UCS_OK;
    }
    const std::string expected = Mac(core->options.secret, {"flexkv-cluster-v1 client", a->server_nonce,
                                                            a->client_nonce, a->client_node, core->options.node_id});
    if (!MacEqual(expected, std::string_view(static_cast<const char*>(data), length))) {
      log::Warning(kLog, "node '{}' at {} did not prove the cluster secret", a->client_node, a->who);
      core->CountAuthFailure();
      core->SendStatus(ep, kAmProofReply, h,
                       Status::PermissionDenied("node '" + core->options.node_id + "' says: you did not prove the "
                                                "cluster secret: is --cluster-secret-file the same on every node?"));
      return UCS_OK;
    }
    if (core->options.is_member && !core->options.is_member(a->client_node)) {
      log::Warning(kLog, "node '{}' at {} proved the cluster secret but is not a member", a->client_node, a->who);
      core->CountAuthFailure();
      core->SendStatus(ep, kAmProofReply, h,
                       Status::PermissionDenied("node '" + a->client_node + "' is not a member of the cluster (says '" +
                                                core->options.node_id + "')"));
      return UCS_OK;
    }
    a->authenticated = true;
    log::Debug(kLog, "authenticated node '{}' at {}", a->client_node, a->who);
    (void)core->SendAm(ep, kAmProofReply, ReplyHeader(h.id, h.token), std::string(), true);
    return UCS_OK;
  }
  // Client: the op a reply answers, taken out of am_ops: the op waiting under `id` is of `kind` (and handshake
  // `stage`), the reply echoes its token, it came on the endpoint the request went out on (our peers reply with
  // UCP_AM_SEND_FLAG_REPLY, so UCX names our endpoint), and, for gets and calls with a secret, that endpoint has
  // completed its handshake. Anything else is dropped, counted (replies_dropped) and logged (rate-limited):
  // nullptr. The token is what makes it hold: the reply endpoint UCX reports comes from an id in the message.
  Op* TakeReplyOp(uint64_t id, const uint8_t* token, Op::Kind kind, std::string_view what,
                  const ucp_am_recv_param_t* param, int stage = 0) {
    auto it = am_ops.find(id);
    if (it == am_ops.end()) {
      DropReply(what, "no request of this id is waiting", param);
      return nullptr;
    }
    Op* op = it->second;
    if (op->kind != kind || (stage != 0 && op->stage != stage)) {
      DropReply(what, "the request of this id is of another kind", param);
      return nullptr;
    }
    if (CRYPTO_memcmp(op->token, token, kTokenBytes) != 0) {
      DropReply(what, "it does not carry its request's token", param);
      return nullptr;
    }
    auto pit = peers.find(op->peer_id);
    Peer* peer = pit == peers.end() ? nullptr : pit->second.get();
    if (peer == nullptr || peer->ep == nullptr || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ||
        param->reply_ep != peer->ep) {
      DropReply(what, "it did not come on the endpoint its request went out on", param);
      return nullptr;
    }
    if (kind != Op::Kind::kHandshake && !options.secret.empty() && (peer->connecting || peer->node_id.empty())) {
      DropReply(what, "its endpoint has not completed the handshake", param);
      return nullptr;
    }
    am_ops.erase(it);
    op->am_waiting = false;
    return op;
  }
  void DropReply(std::string_view what, std::string_view why, const ucp_am_recv_param_t* param) {
    {
      std::lock_guard<std::mutex> lock(info_mu);
      ++stats.replies_dropped;
    }
    std::string from = "an endpoint that did not say";
    if (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) {
      if (const Accepted* a = FindAccepted(param); a != nullptr) {
        from = "a connection from " + a->who;
      } else {
        from = "an unknown endpoint";
        for (const auto& [pid, peer] : peers) {
          if (peer->ep == param->reply_ep) from = "peer " + peer->endpoint;
        }
      }
    }
    dropped_log.Warning(kLog, "dropped a {} from {} on lane {}: {} (forged, or for a request that ended)", what,
                        from, lane, why);
  }
  // Client: the outcome of one of our handshake or call ops, by id; nullptr when it is not (or no longer) waiting.
  Op* TakeAmOp(uint64_t id, Op::Kind kind) {
    auto it = am_ops.find(id);
    if (it == am_ops.end() || it->second->kind != kind) return nullptr;
    Op* op = it->second;
    am_ops.erase(it);
    op->am_waiting = false;
    return op;
  }
  void FailAmOp(Op* op, Status status) {
    op->ucs = UCS_ERR_REJECTED;
    op->result = std::move(status);
    completed.push_back(op);
  }
  std::string PeerName(uint64_t peer_id) {
    auto it = peers.find(peer_id);
    return "peer " + (it == peers.end() ? std::string("?") : it->second->endpoint);
  }
  // Client: HELLO_REPLY. Checks MAC_s, then sends MAC_c.
  static ucs_status_t OnAmHelloReply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                     const ucp_am_recv_param_t* param) {
    auto* core = static_cast<UcxCore*>(arg);
    AmHeader h{};
    if (!FixedHeader(header, header_length, &h)) {
      core->DropReply("handshake reply", "a header of " + std::to_string(header_length) + " bytes", param);
      return UCS_OK;
    }
    Op* op = core->TakeReplyOp(h.id, h.token, Op::Kind::kHandshake, "handshake reply", param, 1);
    if (op == nullptr) return UCS_OK;
    const std::string name = core->PeerName(op->peer_id);
    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    const auto* d = static_cast<const char*>(data);
    if (h.code != 0) {
      core->CountAuthFailure();
      core->FailAmOp(op, Status::PermissionDenied(name + " refused the handshake: " +
                                                  StatusFromWire(h.code, rndv ? "" : std::string_view(d, length))
                                                      .ToString()));
      return UCS_OK;
    }
    const bool sized = !rndv && length >= 1 && length == 1 + static_cast<uint8_t>(d[0]) + kNonceBytes + kMacBytes;
    const std::string node = sized ? std::string(d + 1, static_cast<uint8_t>(d[0])) : std::string();
    if (!sized || !ValidNodeId(node)) {
      core->FailAmOp(op, Status::PermissionDenied(name + " sent a malformed handshake reply of " +
                                                  std::to_string(length) + " bytes"));
      return UCS_OK;
    }
    const std::string server_nonce(d + 1 + node.size(), kNonceBytes);
    const std::string_view mac_s(d + 1 + node.size() + kNonceBytes, kMacBytes);
    const std::string& self = core->options.node_id;
    auto pit = core->peers.find(op->peer_id);
    ucp_ep_h ep = pit == core->peers.end() ? nullptr : pit->second->ep;
    if (!MacEqual(Mac(core->options.secret, {"flexkv-cluster-v1 server", op->client_nonce, server_nonce, node, self}),
                  mac_s)) {
      core->CountAuthFailure();
      log::Warning(kLog, "{} (node '{}') did not prove the cluster secret", name, node);
      if (ep != nullptr) (void)core->SendAm(ep, kAmProof, ReplyHeader(h.id, op->token), std::string(), true);
      core->FailAmOp(op, Status::PermissionDenied(name + " did not prove the cluster secret: is "
                                                  "--cluster-secret-file the same on every node?"));
      return UCS_OK;
    }
    if (ep == nullptr) {
      core->FailAmOp(op, Status::Unavailable(name + ": the connection was closed during the handshake"));
      return UCS_OK;
    }
    op->server_node = node;
    op->stage = 2;
    std::string mac_c = Mac(core->options.secret, {"flexkv-cluster-v1 client", server_nonce, op->client_nonce, self,
                                                   node});
    op->am_waiting = true;
    core->am_ops[op->am_id] = op;
    const ucs_status_t st = core->SendAm(ep, kAmProof, ReplyHeader(h.id, op->token), std::move(mac_c), true);
    if (st != UCS_OK) {
      core->TakeAmOp(h.id, Op::Kind::kHandshake);
      core->FailAmOp(op, Status::Unavailable(name + ": sending the handshake proof: " + UcsError(st)));
    }
    return UCS_OK;
  }
  // Client: PROOF_REPLY. The server accepted us, or its reason.
  static ucs_status_t OnAmProofReply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                     const ucp_am_recv_param_t* param) {
    auto* core = static_cast<UcxCore*>(arg);
    AmHeader h{};
    if (!FixedHeader(header, header_length, &h)) {
      core->DropReply("handshake proof reply", "a header of " + std::to_string(header_length) + " bytes", param);
      return UCS_OK;
    }
    Op* op = core->TakeReplyOp(h.id, h.token, Op::Kind::kHandshake, "handshake proof reply", param, 2);
    if (op == nullptr) return UCS_OK;
    if (h.code != 0) {
      core->CountAuthFailure();
      const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
      const Status why = StatusFromWire(h.code, rndv ? "" : std::string_view(static_cast<const char*>(data), length));
      core->FailAmOp(op, Status::PermissionDenied(core->PeerName(op->peer_id) + " refused us: " + why.message()));
      return UCS_OK;
    }
    if (auto pit = core->peers.find(op->peer_id); pit != core->peers.end()) pit->second->node_id = op->server_node;
    op->ucs = UCS_OK;
    core->completed.push_back(op);
    return UCS_OK;
  }

  // Server: a CALL. Refused on unauthenticated endpoints; else handed to the handler once its bytes are here.
  static ucs_status_t OnAmCallRequest(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                      const ucp_am_recv_param_t* param) {
    auto* core = static_cast<UcxCore*>(arg);
    AmHeader h{};
    if (core->shutting_down.load() || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return UCS_OK;
    if (!FixedHeader(header, header_length, &h)) {
      core->CountMalformed("call (header size)", param);
      return UCS_OK;
    }
    ucp_ep_h ep = param->reply_ep;
    if (!core->Authenticated(param)) {
      core->CountRefused("a call", param);
      core->SendStatus(ep, kAmCallReply, h,
                       Status::PermissionDenied("this connection has not proven the cluster secret"));
      return UCS_OK;
    }
    if (length > kMaxCallBytes) {
      core->SendStatus(ep, kAmCallReply, h,
                       Status::InvalidArgument("call request of " + std::to_string(length) + " bytes; at most " +
                                               std::to_string(kMaxCallBytes)));
      return UCS_OK;
    }
    const Accepted* a = core->FindAccepted(param);
    auto* call = new ServerCall;
    call->core = core;
    call->serial = a != nullptr ? a->serial : 0;
    call->ep = ep;
    call->id = h.id;
    std::memcpy(call->token, h.token, kTokenBytes);
    call->method = static_cast<uint16_t>(h.aux);
    call->node = a != nullptr ? a->client_node : std::string();
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
      call->request.resize(length);
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      rp.cb.recv_am = &UcxCore::OnCallRequestData;
      rp.user_data = call;
      void* r = ucp_am_recv_data_nbx(core->worker, data, call->request.data(), length, &rp);
      if (UCS_PTR_IS_PTR(r)) return UCS_INPROGRESS;  // OnCallRequestData dispatches it
      OnCallRequestData(nullptr, UCS_PTR_STATUS(r), length, call);
      return UCS_OK;
    }
    call->request.assign(static_cast<const char*>(data), length);
    core->DispatchCall(call);
    return UCS_OK;
  }
  static void OnCallRequestData(void* request, ucs_status_t status, size_t, void* user_data) {
    if (request != nullptr) ucp_request_free(request);
    auto* call = static_cast<ServerCall*>(user_data);
    if (status != UCS_OK) {
      log::Debug(kLog, "receiving a call request failed: {}", UcsError(status));
      delete call;
      return;
    }
    call->core->DispatchCall(call);
  }
  void DispatchCall(ServerCall* call) {
    std::unique_ptr<ServerCall> owned(call);
    UcxTransport::CallHandler handler;
    {
      std::lock_guard<std::mutex> lock(info_mu);
      handler = call_handler;
    }
    if (!handler) {
      SendStatus(call->ep, kAmCallReply, call->id, call->token, Status::Unimplemented("no call handler on this node"));
      return;
    }
    auto once = std::make_shared<std::atomic<bool>>(false);
    std::array<uint8_t, kTokenBytes> token;
    std::memcpy(token.data(), call->token, kTokenBytes);
    auto reply = [gate = gate, once, serial = call->serial, ep = call->ep, id = call->id,
                  token](Result<std::string> r) {
      if (once->exchange(true)) return;
      std::lock_guard<std::mutex> lock(gate->mu);
      UcxCore* core = gate->core;
      if (core == nullptr) return;
      (void)core->Post([core, serial, ep, id, token, r = std::move(r)]() mutable {
        core->SendCallReply(serial, ep, id, token.data(), std::move(r));
      });
    };
    handler(call->node, call->method, std::move(call->request), std::move(reply));
  }
  void SendCallReply(uint64_t serial, ucp_ep_h ep, uint64_t id, const uint8_t* token, Result<std::string> r) {
    if (shutting_down.load()) return;
    if (serial != 0) {
      auto it = accepted.find(ep);
      if (it == accepted.end() || it->second.serial != serial) {
        log::Debug(kLog, "a call reply for a closed connection was dropped");
        return;
      }
    } else {
      // Without a secret a call may arrive on a connection we made: it must still be one of our peers' endpoints.
      bool found = false;
      for (auto& [pid, peer] : peers) found |= peer->ep == ep;
      if (!found) return;
    }
    if (!r.ok()) {
      SendStatus(ep, kAmCallReply, id, token, r.status());
    } else if (r->size() > kMaxCallBytes) {
      SendStatus(ep, kAmCallReply, id, token,
                 Status::ResourceExhausted("the call's reply of " + std::to_string(r->size()) +
                                           " bytes exceeds the limit of " + std::to_string(kMaxCallBytes)));
    } else {
      (void)SendAm(ep, kAmCallReply, ReplyHeader(id, token), std::move(r).value(), true);
    }
  }
  // Client: a CALL_REPLY.
  static ucs_status_t OnAmCallReply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                    const ucp_am_recv_param_t* param) {
    auto* core = static_cast<UcxCore*>(arg);
    AmHeader h{};
    if (!FixedHeader(header, header_length, &h)) {
      core->DropReply("call reply", "a header of " + std::to_string(header_length) + " bytes", param);
      return UCS_OK;
    }
    Op* op = core->TakeReplyOp(h.id, h.token, Op::Kind::kCall, "call reply", param);
    if (op == nullptr) return UCS_OK;
    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    if (h.code != 0) {
      core->FailAmOp(op, StatusFromWire(h.code, rndv ? "(message not received)"
                                                     : std::string_view(static_cast<const char*>(data), length)));
    } else if (length > kMaxCallBytes) {
      core->FailAmOp(op, Status::Unavailable("the peer sent a reply of " + std::to_string(length) +
                                             " bytes; at most " + std::to_string(kMaxCallBytes)));
    } else if (rndv) {
      op->reply.resize(length);
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      rp.cb.recv_am = &UcxCore::OnAmData;
      rp.user_data = op;
      void* r = ucp_am_recv_data_nbx(core->worker, data, op->reply.data(), length, &rp);
      if (UCS_PTR_IS_PTR(r)) return UCS_INPROGRESS;  // OnAmData finishes it
      op->ucs = UCS_PTR_STATUS(r);
      core->completed.push_back(op);
    } else {
      op->reply.assign(static_cast<const char*>(data), length);
      op->ucs = UCS_OK;
      core->completed.push_back(op);
    }
    return UCS_OK;
  }

  // `arg` is the core, not the peer: a peer may be gone (Disconnect) by the time UCX reports on an old endpoint.
  static void OnPeerError(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* core = static_cast<UcxCore*>(arg);
    for (auto& [id, peer] : core->peers) {
      if (peer->ep != ep) continue;
      if (peer->healthy) {
        log::Info(kLog, "connection to {} failed: {}", peer->endpoint, UcsError(status));
      } else {
        log::Debug(kLog, "connection to {} failed: {}", peer->endpoint, UcsError(status));
      }
      peer->healthy = false;
      peer->failed = true;
    }
  }
  static void OnAcceptedError(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* core = static_cast<UcxCore*>(arg);
    log::Debug(kLog, "accepted connection ended: {}", UcsError(status));
    if (core->accepted.count(ep)) core->accepted_failed.push_back(ep);
  }
  static void OnConnRequest(ucp_conn_request_h request, void* arg) {
    auto* core = static_cast<UcxCore*>(arg);
    ucp_conn_request_attr_t attr{};
    attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
    bool accept = false;
    std::string who = "?";
    if (ucp_conn_request_query(request, &attr) == UCS_OK) {
      who = FormatSockaddr(attr.client_address);
      std::function<bool(const sockaddr&)> filter;
      {
        std::lock_guard<std::mutex> lock(core->info_mu);
        filter = core->accept_filter;
      }
      accept = !filter || filter(*reinterpret_cast<const sockaddr*>(&attr.client_address));
    }
    if (!accept || core->shutting_down.load()) {
      log::Warning(kLog, "refused a connection request from {}", who);
      ucp_listener_reject(core->listener, request);
      std::lock_guard<std::mutex> lock(core->info_mu);
      ++core->stats.connections_rejected;
      return;
    }
    // The next lane takes the connection: its worker creates the endpoint (UCX moves an accepted connection to
    // the worker that creates its endpoint), its thread serves it. Not here, inside ucp_worker_progress, but once
    // the progress call returns (HandOffAccepts).
    const auto& lanes = core->state->lanes;
    const uint32_t next = core->state->next_accept_lane.fetch_add(1, std::memory_order_relaxed);
    core->pending_accepts.push_back({request, who, lanes[next % lanes.size()].get()});
  }
  // Lane 0, right after a ucp_worker_progress call returned: creates the endpoint of each connection request its
  // listener received, on the lane chosen for it, and waits for that lane's ucp_ep_create to return before the next.
  // Why wait: ucp_ep_create of another lane's worker moves the connection's socket from this worker's async context
  // to that lane's (uct_tcp_sockcm_ep_server_create removes the fd's handler and adds it again under the new
  // context). UCX 1.13 leaves an event of that fd that its async thread queued as "missed" on this worker (an event
  // that came while this worker's context was blocked) in this worker's queue, and the next ucp_worker_progress
  // here then finds the fd's handler under another context and aborts the process ("async.c: Assertion
  // handler->async == async"; UCX 1.18 purges a removed handler's missed events). This worker's queue was just
  // drained (the last thing ucp_worker_progress does), and while this thread waits it makes no UCP call: the only
  // time this worker's context is blocked while the socket moves is inside the other lane's ucp_ep_create (which
  // blocks it to move the fd; microseconds, while the client has nothing to send: it waits for our answer). Nor
  // does this thread touch its listener and connection manager while that ucp_ep_create uses them.
  void HandOffAccepts() {
    std::vector<PendingAccept> batch;
    batch.swap(pending_accepts);
    for (PendingAccept& p : batch) {
      if (shutting_down.load() && listener != nullptr) {
        ucp_listener_reject(listener, p.request);
        continue;
      }
      if (p.target == this) {
        Accept(p.request, p.who);
        continue;
      }
      Rendezvous<int> taken;
      UcxCore* target = p.target;
      if (target->Post([target, &p, &taken] {
            target->Accept(p.request, p.who);
            taken.Set(1);
          })) {
        (void)taken.Take();  // lanes never wait on one another otherwise, and every command ends: no deadlock
      } else {
        Accept(p.request, p.who);  // that lane has stopped: this one serves the connection
      }
    }
  }
  // Creates the endpoint of an accepted connection on this lane's worker (its progress thread).
  void Accept(ucp_conn_request_h request, const std::string& who) {
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.conn_request = request;
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = &UcxCore::OnAcceptedError;
    params.err_handler.arg = this;
    ucp_ep_h ep = nullptr;
    ucs_status_t s = ucp_ep_create(worker, &params, &ep);
    if (s != UCS_OK) {
      log::Warning(kLog, "accepting a connection from {} failed: {}", who, UcsError(s));
      return;
    }
    if (shutting_down.load()) {  // this lane shut down meanwhile: nothing serves it
      CloseEp(ep);
      return;
    }
    Accepted a;
    a.serial = next_accepted_serial++;
    a.since = Clock::now();
    a.who = who;
    accepted.emplace(ep, std::move(a));
    log::Debug(kLog, "lane {} accepted a connection from {}", lane, who);
    std::lock_guard<std::mutex> lock(info_mu);
    ++stats.connections_accepted;
  }

  // ---- progress-thread helpers ----
  // Forced: pending sends are cancelled. Not forced (after a refused handshake, to a peer that just answered):
  // what was sent is delivered first.
  void CloseEp(ucp_ep_h ep, bool force = true) {
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    void* req = ucp_ep_close_nbx(ep, &param);
    if (UCS_PTR_IS_PTR(req)) closing.push_back(req);
    closed_since_progress = true;
  }
  void ClosePeerEp(Peer* peer, bool force = true) {
    if (peer->ep == nullptr) return;
    ucp_ep_h ep = peer->ep;
    peer->ep = nullptr;
    peer->failed = false;
    CloseEp(ep, force);  // pending requests complete (UCS_ERR_CANCELED) through OnOpDone
    // Active-message gets still waiting for their reply: nothing of UCX writes their dst; end them.
    for (Op* op : peer->ops) {
      if (op->am_waiting) {
        op->am_waiting = false;
        am_ops.erase(op->am_id);
        op->ucs = UCS_ERR_CANCELED;
        completed.push_back(op);
      }
    }
  }
  Status CreatePeerEp(Peer* peer) {
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&peer->addr);
    params.sockaddr.addrlen = peer->addrlen;
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = &UcxCore::OnPeerError;
    params.err_handler.arg = this;
    ucs_status_t s = ucp_ep_create(worker, &params, &peer->ep);
    if (s != UCS_OK) {
      peer->ep = nullptr;
      return Status::Unavailable("connecting to " + peer->endpoint + ": " + UcsError(s));
    }
    peer->failed = false;
    peer->closed_by_deadline = false;
    if (peer->connected_once) {
      std::lock_guard<std::mutex> lock(info_mu);
      ++stats.reconnects;
    }
    peer->connected_once = true;
    return Status::Ok();
  }
  void RecordLanes(Peer* peer) {
    if (peer->ep == nullptr) return;
    char* text = nullptr;
    size_t size = 0;
    FILE* f = open_memstream(&text, &size);
    if (f == nullptr) return;
    ucp_ep_print_info(peer->ep, f);
    fclose(f);
    std::string info(text, size);
    free(text);
    // Lines like "#   lane[0]:  1:tcp/lo.0 md[1] ..." or "... rc_mlx5/mlx5_0:1 ...": take "tl/dev" tokens.
    static const std::regex kLane(R"(lane\[\d+\]:\s+\d+:([A-Za-z0-9_]+)/([A-Za-z0-9_.:\-]+))");
    std::lock_guard<std::mutex> lock(info_mu);
    for (std::sregex_iterator it(info.begin(), info.end(), kLane), end; it != end; ++it) {
      std::string dev = (*it)[2].str();
      if (auto dot = dev.rfind('.'); dot != std::string::npos && dot + 1 < dev.size() &&
                                     dev.find_first_not_of("0123456789", dot + 1) == std::string::npos) {
        dev.resize(dot);  // "lo.0": drop the path index
      }
      ucx_lanes.insert((*it)[1].str() + "/" + dev);
    }
  }

  // Ops finished by UCX: report them.
  void FinishCompleted() {
    while (!completed.empty()) {
      std::vector<Op*> batch;
      batch.swap(completed);
      for (Op* op : batch) Finish(op);
    }
  }
  void Finish(Op* op) {
    deadlines.erase({op->deadline, op});
    bool closed_by_deadline = false;
    if (auto it = peers.find(op->peer_id); it != peers.end()) {
      it->second->ops.erase(op);
      closed_by_deadline = it->second->closed_by_deadline;
    }
    Status status;
    if (op->ucs == UCS_OK) {
      status = Status::Ok();
    } else if (op->result.has_value()) {
      status = *op->result;
    } else if (op->deadline_hit) {
      status = Status::DeadlineExceeded("no completion within " + std::to_string(options.get_deadline.count()) +
                                        " ms; request cancelled, endpoint closed");
    } else if (shutting_down.load()) {
      status = Status::Cancelled("the transport is shutting down");
    } else if (op->ucs == UCS_ERR_CANCELED && closed_by_deadline) {
      status = Status::Unavailable("cancelled: another request to this peer hit its deadline");
    } else if (op->ucs == UCS_ERR_CANCELED) {
      status = Status::Unavailable("cancelled: the connection was closed");
    } else {
      status = Status::Unavailable(std::string("peer: ") + UcsError(op->ucs));
    }
    Deliver(op, std::move(status));
  }
  // Counts the op's outcome, deletes it and calls its callback.
  void Deliver(Op* op, Status status) {
    if (op->kind == Op::Kind::kGet || op->kind == Op::Kind::kCall) {
      std::lock_guard<std::mutex> lock(info_mu);
      const bool get = op->kind == Op::Kind::kGet;
      if (status.ok()) {
        ++(get ? stats.gets_ok : stats.calls_ok);
      } else {
        ++(get ? stats.gets_failed : stats.calls_failed);
        if (op->deadline_hit) ++stats.deadlines;
      }
    }
    auto done = std::move(op->done);
    auto call_done = std::move(op->call_done);
    std::string reply = std::move(op->reply);
    if (op->counted()) state->inflight.fetch_sub(1);
    const bool call = op->kind == Op::Kind::kCall;
    delete op;
    if (call) {
      if (call_done) call_done(status.ok() ? Result<std::string>(std::move(reply)) : Result<std::string>(status));
    } else if (done) {
      done(std::move(status));
    }
  }
  // Completes an op that UCX never took (or took and finished at once).
  void FinishNow(Op* op, ucs_status_t ucs) {
    op->ucs = ucs;
    Finish(op);
  }
  void FinishWith(Op* op, Status status) {
    deadlines.erase({op->deadline, op});
    if (auto it = peers.find(op->peer_id); it != peers.end()) it->second->ops.erase(op);
    Deliver(op, std::move(status));
  }

  void CheckDeadlines() {
    const auto now = Clock::now();
    std::vector<Peer*> to_close;
    for (auto it = deadlines.begin(); it != deadlines.end() && it->first <= now;) {
      Op* op = it->second;
      it = deadlines.erase(it);
      op->deadline_hit = true;
      auto pit = peers.find(op->peer_id);
      if (pit != peers.end() && pit->second->ep != nullptr) to_close.push_back(pit->second.get());
    }
    for (Peer* peer : to_close) {
      if (peer->ep == nullptr) continue;
      log::Warning(kLog, "a request to {} had no completion within {} ms: closing the endpoint", peer->endpoint,
                   options.get_deadline.count());
      peer->closed_by_deadline = true;
      ClosePeerEp(peer);
    }
  }
  int PollTimeoutMs() const {
    if (deadlines.empty()) return 1000;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadlines.begin()->first - Clock::now());
    return static_cast<int>(std::clamp<int64_t>(left.count() + 1, 0, 1000));
  }
  void Housekeeping() {
    for (auto& [id, peer] : peers) {
      if (peer->failed && peer->ep != nullptr) ClosePeerEp(peer.get());
    }
    for (ucp_ep_h ep : accepted_failed) {
      if (accepted.erase(ep)) CloseEp(ep);
    }
    accepted_failed.clear();
    // With a secret, a connection that has not completed its handshake within get_deadline is closed.
    if (!options.secret.empty()) {
      const auto now = Clock::now();
      for (auto it = accepted.begin(); it != accepted.end();) {
        if (!it->second.authenticated && now - it->second.since > options.get_deadline) {
          log::Warning(kLog, "closing the connection from {}: no handshake within {} ms", it->second.who,
                       options.get_deadline.count());
          CloseEp(it->first);
          it = accepted.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto it = closing.begin(); it != closing.end();) {
      if (ucp_request_check_status(*it) != UCS_INPROGRESS) {
        ucp_request_free(*it);
        it = closing.erase(it);
      } else {
        ++it;
      }
    }
  }
  // ucp_worker_progress until it has nothing to do, handing accepted connections over after each call. The last
  // thing each call does is run the async events its worker missed (events of UCX's async thread that came while
  // this thread blocked the worker's context). A socket closed since then (an endpoint closed) may have left such an
  // event behind in UCX 1.13, under the fd's number: it must run here before another lane's new socket can take that
  // number and register it under its own context, or the event would run under the wrong one and abort the process
  // (see HandOffAccepts). Hence every close is followed by a progress call before anything else waits or sleeps.
  void Progress() {
    for (;;) {
      const unsigned n = ucp_worker_progress(worker);
      closed_since_progress = false;
      if (!pending_accepts.empty()) HandOffAccepts();
      if (n == 0 && !closed_since_progress) break;
    }
  }
  void ProgressIfClosed() {
    if (closed_since_progress) Progress();
  }
  // One round of everything but sleeping.
  void Turn() {
    Progress();
    FinishCompleted();
    Housekeeping();
    ProgressIfClosed();
    FinishCompleted();
    CheckDeadlines();
    ProgressIfClosed();
    FinishCompleted();
  }

  void Loop() {
    for (;;) {
      std::deque<std::function<void()>> work;
      bool stopping;
      {
        std::lock_guard<std::mutex> lock(queue_mu);
        work.swap(queue);
        stopping = stop;
      }
      for (auto& fn : work) fn();
      Turn();
      if (stopping) break;
      {
        std::lock_guard<std::mutex> lock(queue_mu);
        if (!queue.empty() || stop) continue;
      }
      if (!completed.empty() || closed_since_progress) continue;
      ucs_status_t s = ucp_worker_arm(worker);
      if (s == UCS_ERR_BUSY) continue;
      pollfd fds[2] = {{worker_efd, POLLIN, 0}, {wake_fd, POLLIN, 0}};
      int rc = poll(fds, 2, PollTimeoutMs());
      if (rc > 0 && (fds[1].revents & POLLIN)) {
        uint64_t v;
        ssize_t n = read(wake_fd, &v, sizeof v);
        (void)n;
      }
    }
  }

  // ---- commands (progress thread) ----
  // The op's peer, connected and (with a secret) authenticated; nullptr when the op finished or now waits for a
  // (re)connection in `peer->waiting`.
  Peer* ReadyPeer(Op* op, uint64_t remote_address, void* dst, uint64_t len) {
    auto pit = peers.find(op->peer_id);
    if (pit == peers.end()) {
      FinishWith(op, Status::Unavailable("the peer was disconnected"));
      return nullptr;
    }
    Peer* peer = pit->second.get();
    if (peer->ep != nullptr && peer->failed) ClosePeerEp(peer);
    if (peer->ep == nullptr) {
      Status s = Reconnect(peer);
      if (!s.ok()) {
        FinishWith(op, s);
        return nullptr;
      }
    }
    if (peer->connecting) {
      peer->waiting.push_back({op, remote_address, dst, len});
      return nullptr;
    }
    return peer;
  }
  void StartCall(Op* op) {
    Peer* peer = ReadyPeer(op, 0, nullptr, 0);
    if (peer == nullptr) return;
    op->am_id = next_am_id++;
    op->am_waiting = true;
    am_ops[op->am_id] = op;
    peer->ops.insert(op);
    deadlines.insert({op->deadline, op});
    op->posted = true;
    const ucs_status_t st =
        SendAm(peer->ep, kAmCallRequest, RequestHeader(op->am_id, op->method, op->token), std::move(op->request), true);
    if (st != UCS_OK && op->am_waiting) {
      op->am_waiting = false;
      am_ops.erase(op->am_id);
      FinishNow(op, st);
    }
    // A send that fails later leaves the op waiting: the failed connection's close (or the deadline) ends it.
  }
  // After the wire-up, with a secret: HELLO, then (OnAmHelloReply) PROOF; ConnectDone runs with the outcome.
  void StartHandshake(Peer* peer) {
    auto* op = new Op;
    op->core = this;
    op->peer_id = peer->id;
    op->kind = Op::Kind::kHandshake;
    op->deadline = peer->connect_deadline;
    op->done = [this, id = peer->id](Status s) { ConnectDone(id, std::move(s)); };
    op->stage = 1;
    auto nonce = RandomBytes(kNonceBytes);
    if (!nonce.ok()) {
      FinishWith(op, nonce.status());
      return;
    }
    op->client_nonce = std::move(*nonce);
    op->am_id = next_am_id++;
    op->am_waiting = true;
    am_ops[op->am_id] = op;
    peer->ops.insert(op);
    deadlines.insert({op->deadline, op});
    op->posted = true;
    std::string hello;
    hello.push_back(static_cast<char>(kHandshakeVersion));
    hello.push_back(static_cast<char>(options.node_id.size()));
    hello += options.node_id;
    hello += op->client_nonce;
    const ucs_status_t st = SendAm(peer->ep, kAmHello, RequestHeader(op->am_id, 0, op->token), std::move(hello), true);
    if (st != UCS_OK && op->am_waiting) {
      op->am_waiting = false;
      am_ops.erase(op->am_id);
      FinishNow(op, st);
    }
  }

  void StartGet(Op* op, uint64_t remote_address, void* dst, uint64_t len) {
    Peer* peer = ReadyPeer(op, remote_address, dst, len);
    if (peer == nullptr) return;
    StartAmGet(peer, op, remote_address, dst, len);
  }

  void StartAmGet(Peer* peer, Op* op, uint64_t remote_address, void* dst, uint64_t len) {
    op->am_id = next_am_id++;
    op->dst = dst;
    op->len = len;
    op->am_waiting = true;
    am_ops[op->am_id] = op;
    peer->ops.insert(op);
    deadlines.insert({op->deadline, op});
    // UCX 1.13 reads the header until the send completes (there is no UCP_AM_SEND_FLAG_COPY_HEADER yet): a queued
    // send must not point at this stack frame (it did, and peers got garbage requests under load). The header lives
    // on the heap until the send callback, independent of the op, which a deadline may end first.
    NewToken(op->token);
    auto* header = new AmRequestHeader{op->am_id, remote_address, len, {}};
    std::memcpy(header->token, op->token, kTokenBytes);
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_USER_DATA;
    param.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    param.cb.send = &UcxCore::OnGetRequestSent;
    param.user_data = header;
    void* req = ucp_am_send_nbx(peer->ep, kAmGetRequest, header, sizeof *header, nullptr, 0, &param);
    if (!UCS_PTR_IS_PTR(req)) delete header;  // done (or refused) at once: UCX no longer needs it
    op->posted = true;
    if (UCS_PTR_IS_ERR(req) && op->am_waiting) {
      op->am_waiting = false;
      am_ops.erase(op->am_id);
      FinishNow(op, UCS_PTR_STATUS(req));
    }
    // A send that fails later leaves the op waiting: the failed connection's close (or the deadline) ends it.
  }

  // A new endpoint for a known peer; gets wait for its wire-up (a flush, bounded by get_deadline).
  Status Reconnect(Peer* peer) {
    FLEXKV_RETURN_IF_ERROR(CreatePeerEp(peer));
    peer->connecting = true;
    peer->node_id.clear();
    peer->connect_deadline = Clock::now() + options.get_deadline;
    auto* op = new Op;
    op->core = this;
    op->peer_id = peer->id;
    op->kind = Op::Kind::kFlush;
    op->deadline = peer->connect_deadline;
    op->done = [this, id = peer->id](Status s) { OnReconnected(id, std::move(s)); };
    StartFlush(op);
    return Status::Ok();
  }
  void OnReconnected(uint64_t peer_id, Status s) {
    auto it = peers.find(peer_id);
    if (it == peers.end()) return;
    if (s.ok() && !options.secret.empty() && it->second->ep != nullptr) {
      StartHandshake(it->second.get());
      return;
    }
    ConnectDone(peer_id, std::move(s));
  }
  // The end of a (re)connection: wired up and, with a secret, authenticated; or why not.
  void ConnectDone(uint64_t peer_id, Status s) {
    auto it = peers.find(peer_id);
    if (it == peers.end()) return;
    Peer* peer = it->second.get();
    peer->connecting = false;
    // A refused handshake leaves a working endpoint that must not be used: the next request reconnects. Closed
    // with a flush: our "your proof failed" message (OnAmHelloReply) must reach the peer, which counts it.
    if (s.code() == StatusCode::kPermissionDenied) ClosePeerEp(peer, /*force=*/false);
    std::vector<Peer::Waiting> waiting;
    waiting.swap(peer->waiting);
    if (s.ok()) {
      RecordLanes(peer);
      peer->healthy = true;
    }
    if (auto notify = std::move(peer->on_connected)) {
      peer->on_connected = nullptr;
      notify(s, peer->node_id);
    }
    for (auto& w : waiting) {
      if (s.ok() && Clock::now() < w.op->deadline) {
        if (w.op->kind == Op::Kind::kCall) {
          StartCall(w.op);
        } else {
          StartGet(w.op, w.address, w.dst, w.len);
        }
      } else if (s.code() == StatusCode::kPermissionDenied) {
        FinishWith(w.op, s);
      } else if (s.ok() || s.code() == StatusCode::kDeadlineExceeded) {
        {
          std::lock_guard<std::mutex> lock(info_mu);
          ++stats.deadlines;
        }
        FinishWith(w.op, Status::DeadlineExceeded("reconnecting to " + peer->endpoint + ": no answer within " +
                                                  std::to_string(options.get_deadline.count()) + " ms"));
      } else {
        FinishWith(w.op, Status::Unavailable("reconnecting to " + peer->endpoint + ": " + s.message()));
      }
    }
  }

  void StartFlush(Op* op) {
    auto pit = peers.find(op->peer_id);
    if (pit == peers.end() || pit->second->ep == nullptr) {
      FinishWith(op, Status::Unavailable("no connection"));
      return;
    }
    Peer* peer = pit->second.get();
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = &UcxCore::OnOpDone;
    param.user_data = op;
    peer->ops.insert(op);
    deadlines.insert({op->deadline, op});
    void* req = ucp_ep_flush_nbx(peer->ep, &param);
    if (req == nullptr) {
      FinishNow(op, UCS_OK);
    } else if (UCS_PTR_IS_ERR(req)) {
      FinishNow(op, UCS_PTR_STATUS(req));
    }
  }

  void Shutdown() {
    shutting_down.store(true);
    if (listener != nullptr) {
      // Every connection request received so far was handed over (or refused) when its progress call returned.
      ucp_listener_destroy(listener);
      listener = nullptr;
    }
    for (auto& [id, peer] : peers) ClosePeerEp(peer.get());
    for (auto& [ep, a] : accepted) CloseEp(ep);
    accepted.clear();
    // Let the cancellations and closes finish (bounded: a close that never completes is abandoned).
    const auto until = Clock::now() + std::chrono::seconds(5);
    for (;;) {
      Turn();
      bool ops_left = false;
      for (auto& [id, peer] : peers) ops_left |= !peer->ops.empty();
      if ((!ops_left && closing.empty()) || Clock::now() > until) break;
    }
    for (auto& [id, peer] : peers) {
      for (Op* op : std::vector<Op*>(peer->ops.begin(), peer->ops.end())) {
        log::Error(kLog, "a request to {} never completed after its endpoint was closed", peer->endpoint);
        (void)op;  // leaked on purpose: UCX may still own it
      }
    }
    for (void* req : closing) ucp_request_free(req);
    closing.clear();
    for (auto& [id, region] : regions) {
      if (region.replies != 0) leaked_regions.push_back(id);  // a send may still read it: never unmapped
    }
    regions.clear();
    peers.clear();
  }
};

// ---------------------------------------------------------------------------------------------------------------

UcxState::~UcxState() {
  lanes.clear();  // workers before their context
  if (context != nullptr) ucp_cleanup(context);
}

bool UcxState::OnAnyLoopThread() const {
  for (const auto& lane : lanes) {
    if (lane->OnLoopThread()) return true;
  }
  return false;
}

RegisteredRegion::RegisteredRegion(RegisteredRegion&& other) noexcept { *this = std::move(other); }

RegisteredRegion& RegisteredRegion::operator=(RegisteredRegion&& other) noexcept {
  if (this != &other) {
    Reset();
    state_ = std::move(other.state_);
    id_ = std::exchange(other.id_, 0);
    base_ = std::exchange(other.base_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    descriptor_ = std::move(other.descriptor_);
    other.descriptor_.clear();
  }
  return *this;
}

RegisteredRegion::~RegisteredRegion() { Reset(); }

void RegisteredRegion::Reset() {
  if (id_ == 0) return;
  const uint64_t id = std::exchange(id_, 0);
  if (auto state = state_.lock(); state && !state->shutting_down.load()) {
    // Every lane forgets it, once the replies it is sending from it are done (bounded); 1 = none left.
    bool clean = true, stopped = false;
    for (const auto& lane : state->lanes) {
      UcxCore* core = lane.get();
      const int r = core->RunSync<int>([core, id] {
        const auto until = Clock::now() + std::chrono::seconds(5);
        auto it = core->regions.find(id);
        while (it != core->regions.end() && it->second.replies != 0 && Clock::now() < until) {
          core->Turn();
          it = core->regions.find(id);
        }
        int left_clean = 1;
        if (it != core->regions.end()) {
          left_clean = it->second.replies == 0 ? 1 : 0;
          core->regions.erase(it);
        }
        return left_clean;
      }, -1);
      clean &= r == 1;
      stopped |= r == -1;
    }
    // A lane that stopped already: the transport's destructor unmaps it (or keeps it, if a reply may read it).
    if (!stopped) {
      UcxState* raw = state.get();
      (void)state->lanes[0]->RunSync<int>([raw, id, clean] {
        MutexLock lock(&raw->regions_mu);
        auto it = raw->regions.find(id);
        if (it == raw->regions.end()) return 0;
        if (clean) ucp_mem_unmap(raw->context, it->second);  // else leaked: a send may still read it
        raw->regions.erase(it);
        return 0;
      }, 0);
    }
  }
  state_.reset();
  base_ = nullptr;
  bytes_ = 0;
  descriptor_.clear();
}

Result<RemoteRegion> RemoteRegion::Parse(std::string_view d) {
  if (d.size() < kHeaderBytes) {
    return Status::InvalidArgument("region descriptor of " + std::to_string(d.size()) + " bytes; expected >= " +
                                   std::to_string(kHeaderBytes));
  }
  if (std::memcmp(d.data(), kMagic, 4) != 0) return Status::InvalidArgument("region descriptor: bad magic");
  const auto version = GetLe(d.data() + 4, 2);
  if (version != kVersion) {
    return Status::InvalidArgument("region descriptor version " + std::to_string(version) + "; expected " +
                                   std::to_string(kVersion));
  }
  RemoteRegion r;
  r.base_ = GetLe(d.data() + 8, 8);
  r.length_ = GetLe(d.data() + 16, 8);
  const auto rkey_len = GetLe(d.data() + 24, 4);
  if (r.length_ == 0) return Status::InvalidArgument("region descriptor: length 0");
  if (r.base_ == 0) return Status::InvalidArgument("region descriptor: base address 0");
  if (r.base_ + r.length_ < r.base_) return Status::InvalidArgument("region descriptor: base + length overflows");
  if (rkey_len != 0) {
    return Status::InvalidArgument("region descriptor: rkey of " + std::to_string(rkey_len) + " bytes; expected 0 "
                                   "(peers serve reads over active messages only)");
  }
  if (d.size() != kHeaderBytes) {
    return Status::InvalidArgument("region descriptor of " + std::to_string(d.size()) + " bytes; expected " +
                                   std::to_string(kHeaderBytes));
  }
  return r;
}

// ---------------------------------------------------------------------------------------------------------------

Result<std::unique_ptr<UcxTransport>> UcxTransport::Create(const UcxOptions& options) {
  // Validate the transport restriction.
  if (options.transports.empty()) return Status::InvalidArgument("ucx: transports is empty");
  {
    size_t start = 0;
    while (start <= options.transports.size()) {
      size_t comma = options.transports.find(',', start);
      if (comma == std::string::npos) comma = options.transports.size();
      std::string t = options.transports.substr(start, comma - start);
      if (!t.empty() && t[0] == '^') {
        return Status::InvalidArgument("ucx: transports '" + options.transports +
                                       "': exclusion lists ('^') are refused; list the transports to use");
      }
      if (t.empty() || IsSharedMemoryTransport(t)) {
        return Status::InvalidArgument("ucx: transports '" + options.transports + "': '" + t +
                                       "' is not allowed (peers must be reached over the network; shared memory "
                                       "would bypass it between namespaces of one host)");
      }
      start = comma + 1;
    }
  }
  if (options.max_inflight_gets == 0) return Status::InvalidArgument("ucx: max_inflight_gets is 0");
  if (options.lanes == 0 || options.lanes > kMaxLanes) {
    return Status::InvalidArgument("ucx: " + std::to_string(options.lanes) + " lanes; expected 1.." +
                                   std::to_string(kMaxLanes));
  }
  if (!options.secret.empty()) {
    if (options.secret.size() < kMinSecretBytes) {
      return Status::InvalidArgument("ucx: the cluster secret is " + std::to_string(options.secret.size()) +
                                     " bytes; expected at least " + std::to_string(kMinSecretBytes));
    }
    if (!ValidNodeId(options.node_id)) {
      return Status::InvalidArgument("ucx: node id '" + options.node_id +
                                     "': expected 1 to 64 characters of [A-Za-z0-9._-] (required with a secret)");
    }
  }
  if (options.get_deadline.count() <= 0) return Status::InvalidArgument("ucx: get_deadline must be > 0");
  std::optional<std::pair<sockaddr_storage, socklen_t>> listen_addr;
  if (!options.listen_address.empty()) {
    std::string ep = options.listen_address;
    if (ep.find(':') != std::string::npos && ep[0] != '[') ep = "[" + ep + "]";  // bare IPv6
    auto parsed = ParseEndpoint(ep + ":" + std::to_string(options.listen_port), false);
    if (!parsed.ok()) return parsed.status().WithContext("ucx: listen_address");
    listen_addr = *parsed;
  }

  auto state = std::make_shared<UcxState>();
  state->options = options;
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return Status::Internal("ucp_config_read: " + UcsError(s));
  s = ucp_config_modify(config, "TLS", options.transports.c_str());
  if (s == UCS_OK && !options.devices.empty()) s = ucp_config_modify(config, "NET_DEVICES", options.devices.c_str());
  // SO_REUSEADDR on the listener (UCX_CM_REUSEADDR, the tcp and rdma connection managers' common key): a restarted
  // daemon listens again at once, where the connections its previous run served leave the port in TIME_WAIT for a
  // minute ("Device is busy" without it). Linux still refuses a second live listener on the same address and port.
  if (s == UCS_OK) s = ucp_config_modify(config, "CM_REUSEADDR", "y");
  if (s != UCS_OK) {
    ucp_config_release(config);
    return Status::InvalidArgument("ucx: transports '" + options.transports + "' / devices '" + options.devices +
                                   "': " + UcsError(s));
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;  // never UCP_FEATURE_RMA: see kAmGetRequest
  params.mt_workers_shared = options.lanes > 1 ? 1 : 0;  // lanes' threads share the context (its memory maps)
  s = ucp_init(&params, config, &state->context);
  ucp_config_release(config);
  if (s != UCS_OK) {
    state->context = nullptr;
    return Status::Unavailable("ucp_init (transports '" + options.transports + "', devices '" + options.devices +
                               "'): " + UcsError(s));
  }
  for (uint32_t i = 0; i < options.lanes; ++i) {
    auto core = std::make_unique<UcxCore>();
    core->options = options;
    core->state = state.get();
    core->lane = i;
    core->context = state->context;
    ucp_worker_params_t wparams{};
    wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wparams.thread_mode = UCS_THREAD_MODE_SINGLE;
    s = ucp_worker_create(state->context, &wparams, &core->worker);
    if (s != UCS_OK) {
      core->worker = nullptr;
      return Status::Unavailable("ucp_worker_create: " + UcsError(s));
    }
    using Handler = std::pair<unsigned, ucp_am_recv_callback_t>;
    for (auto [id, cb] :
         {Handler{kAmGetRequest, &UcxCore::OnAmGetRequest}, Handler{kAmGetReply, &UcxCore::OnAmGetReply},
          Handler{kAmHello, &UcxCore::OnAmHello}, Handler{kAmHelloReply, &UcxCore::OnAmHelloReply},
          Handler{kAmProof, &UcxCore::OnAmProof}, Handler{kAmProofReply, &UcxCore::OnAmProofReply},
          Handler{kAmCallRequest, &UcxCore::OnAmCallRequest}, Handler{kAmCallReply, &UcxCore::OnAmCallReply}}) {
      ucp_am_handler_param_t hp{};
      hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
      hp.id = id;
      hp.cb = cb;
      hp.arg = core.get();
      s = ucp_worker_set_am_recv_handler(core->worker, &hp);
      if (s != UCS_OK) return Status::Internal("ucp_worker_set_am_recv_handler: " + UcsError(s));
    }
    s = ucp_worker_get_efd(core->worker, &core->worker_efd);
    if (s != UCS_OK) return Status::Unavailable("ucp_worker_get_efd: " + UcsError(s));
    core->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (core->wake_fd < 0) return Status::Internal(std::string("eventfd: ") + std::strerror(errno));
    state->lanes.push_back(std::move(core));
  }

  UcxCore* first = state->lanes[0].get();
  if (listen_addr) {
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&listen_addr->first);
    lp.sockaddr.addrlen = listen_addr->second;
    lp.conn_handler.cb = &UcxCore::OnConnRequest;
    lp.conn_handler.arg = first;
    s = ucp_listener_create(first->worker, &lp, &first->listener);
    if (s != UCS_OK) {
      first->listener = nullptr;
      return Status::Unavailable("ucx: listening on " + FormatSockaddr(listen_addr->first) + ": " + UcsError(s));
    }
    ucp_listener_attr_t la{};
    la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    s = ucp_listener_query(first->listener, &la);
    if (s != UCS_OK) {
      ucp_listener_destroy(first->listener);
      first->listener = nullptr;
      return Status::Internal("ucp_listener_query: " + UcsError(s));
    }
    first->endpoint_text = FormatSockaddr(la.sockaddr);
  }

  for (auto& core : state->lanes) {
    core->gate->core = core.get();  // no other thread sees the gate yet
    core->thread = std::thread([c = core.get()] { c->Loop(); });
    core->thread_id = core->thread.get_id();
  }
  log::Info(kLog, "transport up: transports '{}', devices '{}', listener '{}', {} lane(s)", options.transports,
            options.devices.empty() ? "all" : options.devices, first->endpoint_text, options.lanes);
  return std::unique_ptr<UcxTransport>(new UcxTransport(std::move(state)));
}

UcxTransport::~UcxTransport() {
  if (!state_) return;
  state_->shutting_down.store(true);
  // Lane 0 first: it destroys the listener once the connections it handed to the other lanes are taken.
  for (auto& lane : state_->lanes) {
    UcxCore* core = lane.get();
    core->RunSync<int>([core] {
      core->Shutdown();
      return 0;
    }, 0);
  }
  for (auto& lane : state_->lanes) {
    {
      std::lock_guard<std::mutex> lock(lane->queue_mu);
      lane->stop = true;
    }
    uint64_t one = 1;
    ssize_t n = write(lane->wake_fd, &one, sizeof one);
    (void)n;
  }
  for (auto& lane : state_->lanes) {
    lane->thread.join();
    std::lock_guard<std::mutex> lock(lane->gate->mu);
    lane->gate->core = nullptr;  // a CallHandler's late reply is dropped from now on
  }
  // Commands posted after the shutdown (a region's Reset racing with it) ran in the last turn or are dropped. No
  // thread uses the context now: unmap what is left, but never memory a reply may still read.
  MutexLock lock(&state_->regions_mu);
  for (const auto& lane : state_->lanes) {
    state_->leaked_regions.insert(lane->leaked_regions.begin(), lane->leaked_regions.end());
  }
  for (auto& [id, memh] : state_->regions) {
    if (state_->leaked_regions.count(id) == 0) ucp_mem_unmap(state_->context, memh);
  }
  state_->regions.clear();
}

Result<RegisteredRegion> UcxTransport::Register(void* base, uint64_t bytes) {
  if (base == nullptr || bytes == 0) return Status::InvalidArgument("ucx: registering an empty range");
  if (state_->shutting_down.load()) return Status::FailedPrecondition("ucx: shutting down");
  UcxState* state = state_.get();
  UcxCore* first = state->lanes[0].get();
  const uint64_t id = state->next_region_id.fetch_add(1);
  auto made = first->RunSync<Result<RegisteredRegion>>([&]() -> Result<RegisteredRegion> {
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = base;
    mp.length = bytes;
    ucp_mem_h memh = nullptr;
    ucs_status_t s = ucp_mem_map(state->context, &mp, &memh);
    if (s != UCS_OK) return Status::ResourceExhausted("ucp_mem_map of " + std::to_string(bytes) + " bytes: " + UcsError(s));
    RegisteredRegion region;
    region.descriptor_.assign(kMagic, 4);
    PutLe(&region.descriptor_, kVersion, 2);
    PutLe(&region.descriptor_, 0, 2);
    PutLe(&region.descriptor_, reinterpret_cast<uintptr_t>(base), 8);
    PutLe(&region.descriptor_, bytes, 8);
    PutLe(&region.descriptor_, 0, 4);  // no rkey
    {
      MutexLock lock(&state->regions_mu);
      state->regions[id] = memh;
    }
    region.base_ = base;
    region.bytes_ = bytes;
    return region;
  }, Status::FailedPrecondition("ucx: shutting down"));
  if (!made.ok()) return made.status();
  made->state_ = state_;
  made->id_ = id;  // from here on, Reset (on an error below too) unregisters it from every lane
  // Every lane serves gets from it.
  for (auto& lane : state->lanes) {
    UcxCore* core = lane.get();
    ucp_mem_h memh;
    {
      MutexLock lock(&state->regions_mu);
      memh = state->regions.at(id);
    }
    const int ok = core->RunSync<int>([core, id, memh, base, bytes] {
      core->regions[id] = UcxCore::Region{memh, reinterpret_cast<uintptr_t>(base), bytes};
      return 1;
    }, 0);
    if (ok != 1) return Status::FailedPrecondition("ucx: shutting down");
  }
  return made;
}

std::string UcxTransport::endpoint() const { return state_->lanes[0]->endpoint_text; }

void UcxTransport::set_accept_filter(std::function<bool(const sockaddr&)> filter) {
  UcxCore* first = state_->lanes[0].get();
  std::lock_guard<std::mutex> lock(first->info_mu);
  first->accept_filter = std::move(filter);
}

Result<PeerHandle> UcxTransport::Connect(const std::string& endpoint) {
  auto addr = ParseEndpoint(endpoint, true);
  if (!addr.ok()) return addr.status().WithContext("ucx: connect");
  if (state_->shutting_down.load()) return Status::FailedPrecondition("ucx: shutting down");
  const uint64_t id = state_->next_peer_id.fetch_add(1);
  PeerHandle handle{id, endpoint, {}};
  // One endpoint per lane, connected in parallel. The outcomes live on this caller's stack: each lane's progress
  // thread sets its own once and never touches it again (a shared_ptr released on a progress thread trips
  // ThreadSanitizer through libstdc++ 12's shared_ptr release fast path).
  const bool wait = !state_->OnAnyLoopThread();
  const size_t n = state_->lanes.size();
  std::vector<Rendezvous<std::pair<Status, std::string>>> outcomes(n);
  std::vector<bool> posted(n, false);
  for (size_t i = 0; i < n; ++i) {
    UcxCore* core = state_->lanes[i].get();
    auto* outcome = wait ? &outcomes[i] : nullptr;
    posted[i] = core->Post([core, id, endpoint, addr = *addr, outcome] {
      auto peer = std::make_unique<UcxCore::Peer>();
      peer->id = id;
      peer->endpoint = endpoint;
      peer->addr = addr.first;
      peer->addrlen = addr.second;
      // Wait for the wire-up (a flush completes once the connection is established, or fails); gets posted
      // meanwhile (from a callback on a progress thread, which cannot wait here) queue until then.
      if (outcome != nullptr) {
        peer->on_connected = [outcome](Status s, const std::string& node) { outcome->Set({std::move(s), node}); };
      }
      UcxCore::Peer* raw = peer.get();
      core->peers.emplace(id, std::move(peer));
      Status s = core->Reconnect(raw);
      if (!s.ok()) {
        core->peers.erase(id);
        if (outcome != nullptr) outcome->Set({std::move(s), std::string()});
      }
    });
  }
  if (!wait) return handle;  // called from a callback: cannot wait for the loops
  Status failed;
  for (size_t i = 0; i < n; ++i) {
    auto [s, node] = posted[i] ? outcomes[i].Take() : std::make_pair(Status::FailedPrecondition("ucx: shutting down"),
                                                                      std::string());
    if (i == 0) handle.node_id = node;
    if (!s.ok() && failed.ok()) failed = std::move(s);
  }
  if (failed.ok()) return handle;
  Disconnect(handle);
  if (failed.code() == StatusCode::kFailedPrecondition) return failed;
  if (failed.code() == StatusCode::kPermissionDenied) return Status::PermissionDenied("ucx: " + failed.message());
  if (failed.code() == StatusCode::kDeadlineExceeded) {
    // A peer of another flexkvd version drops our hello unanswered (its header has another size): say so here, the
    // peer's log names the version it expected.
    return Status::DeadlineExceeded(
        "ucx: connecting to " + endpoint + ": no answer within " + std::to_string(state_->options.get_deadline.count()) +
        " ms (the peer is down or unreachable, or runs a flexkvd of another cluster protocol version: every node must "
        "run the same version)");
  }
  return Status::Unavailable("ucx: connecting to " + endpoint + ": " + failed.message());
}

void UcxTransport::Disconnect(const PeerHandle& peer) {
  if (state_->shutting_down.load()) return;
  const bool wait = !state_->OnAnyLoopThread();
  for (auto& lane : state_->lanes) {
    UcxCore* core = lane.get();
    auto close = [core, id = peer.id] {
      auto it = core->peers.find(id);
      if (it == core->peers.end()) return 0;
      core->ClosePeerEp(it->second.get());
      // Wait for the cancelled requests (their dst must not be written after their done ran).
      const auto until = Clock::now() + std::chrono::seconds(5);
      while (!it->second->ops.empty() && Clock::now() < until) core->Turn();
      if (it->second->ops.empty()) core->peers.erase(it);  // else kept: the ops still point at it
      return 0;
    };
    if (wait || core->OnLoopThread()) {
      core->RunSync<int>(close, 0);
    } else {
      (void)core->Post([close] { (void)close(); });  // another lane's thread: never wait across lanes
    }
  }
}

Status UcxTransport::Get(const PeerHandle& peer, const RemoteRegion& remote, uint64_t remote_offset, void* dst,
                         uint64_t len, std::function<void(Status)> done) {
  if (dst == nullptr || len == 0) return Status::InvalidArgument("ucx: get of 0 bytes or into a null buffer");
  if (remote_offset > remote.length() || len > remote.length() - remote_offset) {
    return Status::InvalidArgument("ucx: get of [" + std::to_string(remote_offset) + ", +" + std::to_string(len) +
                                   ") outside the peer region of " + std::to_string(remote.length()) + " bytes");
  }
  if (remote.base() == 0) return Status::InvalidArgument("ucx: empty remote region");
  if (peer.id == 0) return Status::NotFound("ucx: invalid peer handle");
  if (state_->shutting_down.load()) return Status::FailedPrecondition("ucx: shutting down");
  const uint32_t before = state_->inflight.fetch_add(1);
  if (before >= state_->options.max_inflight_gets) {
    state_->inflight.fetch_sub(1);
    return Status::ResourceExhausted("ucx: " + std::to_string(state_->options.max_inflight_gets) +
                                     " gets already in flight");
  }
  UcxCore* core = state_->Pick();
  auto* op = new UcxCore::Op;
  op->core = core;
  op->peer_id = peer.id;
  op->kind = UcxCore::Op::Kind::kGet;
  op->deadline = Clock::now() + state_->options.get_deadline;
  op->done = std::move(done);
  const uint64_t address = remote.base() + remote_offset;
  const bool posted = core->Post([core, op, address, dst, len]() mutable {
    if (core->shutting_down.load()) {
      core->FinishWith(op, Status::Cancelled("the transport is shutting down"));
      return;
    }
    core->StartGet(op, address, dst, len);
  });
  if (!posted) {
    state_->inflight.fetch_sub(1);
    delete op;
    return Status::FailedPrecondition("ucx: shutting down");
  }
  return Status::Ok();
}

void UcxTransport::set_call_handler(CallHandler handler) {
  for (auto& lane : state_->lanes) {
    std::lock_guard<std::mutex> lock(lane->info_mu);
    lane->call_handler = handler;
  }
}

Status UcxTransport::Call(const PeerHandle& peer, uint16_t method, std::string request,
                          std::function<void(Result<std::string>)> done) {
  if (request.size() > kMaxCallBytes) {
    return Status::InvalidArgument("ucx: call request of " + std::to_string(request.size()) + " bytes; at most " +
                                   std::to_string(kMaxCallBytes));
  }
  if (peer.id == 0) return Status::NotFound("ucx: invalid peer handle");
  if (state_->shutting_down.load()) return Status::FailedPrecondition("ucx: shutting down");
  const uint32_t before = state_->inflight.fetch_add(1);
  if (before >= state_->options.max_inflight_gets) {
    state_->inflight.fetch_sub(1);
    return Status::ResourceExhausted("ucx: " + std::to_string(state_->options.max_inflight_gets) +
                                     " requests already in flight");
  }
  UcxCore* core = state_->Pick();
  auto* op = new UcxCore::Op;
  op->core = core;
  op->peer_id = peer.id;
  op->kind = UcxCore::Op::Kind::kCall;
  op->deadline = Clock::now() + state_->options.get_deadline;
  op->method = method;
  op->request = std::move(request);
  op->call_done = std::move(done);
  const bool posted = core->Post([core, op] {
    if (core->shutting_down.load()) {
      core->FinishWith(op, Status::Cancelled("the transport is shutting down"));
      return;
    }
    core->StartCall(op);
  });
  if (!posted) {
    state_->inflight.fetch_sub(1);
    delete op;
    return Status::FailedPrecondition("ucx: shutting down");
  }
  return Status::Ok();
}

Result<std::string> UcxTransport::CallSync(const PeerHandle& peer, uint16_t method, std::string request) {
  if (state_->OnAnyLoopThread()) {
    return Status::FailedPrecondition("ucx: CallSync on a progress thread (from a callback) would never return");
  }
  Rendezvous<Result<std::string>> outcome;
  Status s = Call(peer, method, std::move(request), [&outcome](Result<std::string> r) { outcome.Set(std::move(r)); });
  if (!s.ok()) return s;
  return outcome.Take();
}

std::vector<std::string> UcxTransport::transports_in_use() const {
  std::vector<std::string> out;
  out.push_back("config: TLS=" + state_->options.transports +
                " NET_DEVICES=" + (state_->options.devices.empty() ? "all" : state_->options.devices) +
                (state_->lanes.size() > 1 ? " LANES=" + std::to_string(state_->lanes.size()) : std::string()));
  std::set<std::string> used;
  for (const auto& lane : state_->lanes) {
    std::lock_guard<std::mutex> lock(lane->info_mu);
    used.insert(lane->ucx_lanes.begin(), lane->ucx_lanes.end());
  }
  out.insert(out.end(), used.begin(), used.end());
  return out;
}

UcxTransport::Stats UcxTransport::stats() const {
  Stats total;
  for (const auto& lane : state_->lanes) {
    std::lock_guard<std::mutex> lock(lane->info_mu);
    const Stats& s = lane->stats;
    total.gets_ok += s.gets_ok;
    total.gets_failed += s.gets_failed;
    total.deadlines += s.deadlines;
    total.connections_accepted += s.connections_accepted;
    total.connections_rejected += s.connections_rejected;
    total.reconnects += s.reconnects;
    total.auth_failures += s.auth_failures;
    total.requests_refused += s.requests_refused;
    total.calls_ok += s.calls_ok;
    total.calls_failed += s.calls_failed;
    total.replies_dropped += s.replies_dropped;
  }
  return total;
}

// ---------------------------------------------------------------------------------------------------------------

std::vector<RdmaPort> ListRdmaPorts() {
  std::vector<RdmaPort> out;
  int n = 0;
  errno = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (list == nullptr) {
    log::Debug(kLog, "no RDMA devices (ibv_get_device_list: {})", std::strerror(errno));
    return out;
  }
  for (int i = 0; i < n; ++i) {
    const char* name = ibv_get_device_name(list[i]);
    ibv_context* ctx = ibv_open_device(list[i]);
    if (ctx == nullptr) {
      log::Warning(kLog, "RDMA device {}: open failed: {}", name ? name : "?", std::strerror(errno));
      continue;
    }
    ibv_device_attr attr{};
    if (ibv_query_device(ctx, &attr) == 0) {
      for (int port = 1; port <= attr.phys_port_cnt; ++port) {
        ibv_port_attr pa{};
        if (ibv_query_port(ctx, static_cast<uint8_t>(port), &pa) != 0) continue;
        out.push_back(RdmaPort{name ? name : "?", port, ibv_port_state_str(pa.state),
                               pa.link_layer == IBV_LINK_LAYER_ETHERNET ? "Ethernet" : "InfiniBand"});
      }
    }
    ibv_close_device(ctx);
  }
  ibv_free_device_list(list);
  return out;
}

std::vector<std::string> ListRdmaDevices() {
  std::vector<std::string> out;
  for (const RdmaPort& p : ListRdmaPorts()) out.push_back(p.device + ":" + std::to_string(p.port));
  return out;
}

}  // namespace flexkv::cluster
