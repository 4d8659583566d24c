// See cluster_tier.h. About 1,000 lines in one file: the four threads below share Impl's state (members, the
// directory sets, the peer connections, the counters); the directory sync and the pull path are the parts to move out
// into files of their own when a second peer call or another store backend arrives. Threads: the membership thread
// (the transport and the join, retried with backoff while the node serves its own cache; the member list every
// second; joins again after a lost lease), the publisher (directory updates, batched and retried), the pullers (one
// Prefetch each, max_pulls of them) and the lookup server (peers' lookups, handed over from the transport's progress
// thread, which must never wait on the cache's lock: the pool hooks hold that lock while they wait on the progress
// thread to (un)register).
#include "daemon/tiers/cluster/cluster_tier.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <random>
#include <unordered_set>

#include "common/block_checksum.h"
#include "common/log.h"
#include "common/unique_fd.h"
#include "daemon/cache/cache_set.h"
#include "daemon/cluster/etcd/etcd_directory.h"
#include "daemon/tiers/cluster/peer_lookup.h"
#include "daemon/tiers/cluster/publish_policy.h"

namespace flexkv {
namespace {

using Clock = std::chrono::steady_clock;

// Reads the cluster secret: a regular file nobody but its owner may read (mode & 077 == 0), >= 16 bytes after a
// trailing newline is cut. The secret never appears in a message.
Result<std::string> ReadSecretFile(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  if (!fd) {
    return Status::NotFound(fmt::format("cannot open the cluster secret file {}: {}", path, strerror(errno)));
  }
  struct stat st{};
  if (fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) {
    return Status::InvalidArgument(fmt::format("the cluster secret file {} is not a regular file", path));
  }
  if ((st.st_mode & 077) != 0) {
    return Status::PermissionDenied(fmt::format(
        "the cluster secret file {} has mode {:o}: others may read it; expected 0600 or 0400 (chmod 600 {})", path,
        st.st_mode & 0777, path));
  }
  std::string secret(static_cast<size_t>(std::min<off_t>(st.st_size, 4096)), '\0');
  const ssize_t n = ::read(fd.get(), secret.data(), secret.size());
  if (n < 0) return Status::Internal(fmt::format("reading {}: {}", path, strerror(errno)));
  secret.resize(static_cast<size_t>(n));
  while (!secret.empty() && (secret.back() == '\n' || secret.back() == '\r')) secret.pop_back();
  if (secret.size() < 16) {
    return Status::InvalidArgument(fmt::format(
        "the cluster secret in {} is {} bytes; expected at least 16 (e.g. head -c 32 /dev/urandom | base64 > {})", path,
        secret.size(), path));
  }
  return secret;
}

// The numeric host of a sockaddr, as UcxTransport::endpoint() and member records write it (without the port).
std::string HostOf(const sockaddr& sa) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (sa.sa_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in&>(sa).sin_addr, buf, sizeof buf);
  } else if (sa.sa_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6&>(sa).sin6_addr, buf, sizeof buf);
  }
  return buf;
}

// "host:port" or "[v6]:port" -> host.
std::string HostOfEndpoint(const std::string& endpoint) {
  if (!endpoint.empty() && endpoint[0] == '[') {
    const size_t close = endpoint.find(']');
    return close == std::string::npos ? endpoint : endpoint.substr(1, close - 1);
  }
  const size_t colon = endpoint.rfind(':');
  return colon == std::string::npos ? endpoint : endpoint.substr(0, colon);
}

// Requests (reads and lookups) the transport takes at once, over all pulls; each pull reads with a window of its
// share, so that a long pull neither starves the others nor hits the limit.
constexpr uint32_t kTransportInflight = 1024;

}  // namespace

struct ClusterTier::Impl {
  ClusterTierOptions options;
  CacheSet* caches = nullptr;
  std::unique_ptr<cluster::Directory> directory;
  // The transport, created by the membership thread (MembershipLoop: its listener may find the port taken for a
  // while, and the node serves its own cache meanwhile) and kept until ~Impl. `transport` is written once, before
  // `transport_up` is set (release); every other thread reads it only after seeing `transport_up`.
  cluster::UcxOptions ucx_options;
  std::unique_ptr<cluster::UcxTransport> transport;
  std::atomic<bool> transport_up{false};
  std::string endpoint;  // guarded by members_mu; set with the transport

  std::atomic<bool> stopping{false};
  std::mutex stop_mu;  // Stop runs once
  bool stopped = false;

  // The pool grants, by base address: registered for peers' reads once the transport is up (until then, and when
  // a registration failed, `registered` is empty: the grant serves locally, peers' lookups do not offer its blocks).
  struct Grant {
    void* base = nullptr;
    uint64_t bytes = 0;
    cluster::RegisteredRegion registered;
  };
  mutable std::mutex regions_mu;
  std::map<uintptr_t, Grant> regions;

  // Members (from the store, refreshed every second), their hosts (the transport's accept filter).
  mutable std::mutex members_mu;
  std::map<std::string, cluster::NodeInfo> members;
  std::unordered_set<std::string> member_hosts;
  std::string join_state = "joining";  // "joining" until the first attempt ends, then "joined" or "retrying: ..."
  std::condition_variable members_cv;  // wakes the membership thread (a refresh asked for, or Stop)
  bool refresh_asked = false;
  int64_t last_refresh_ask_ms = 0, last_refusal_log_ms = 0;  // the accept filter's rate limits

  // Directory state, per cache (domain slot): what should be published (`desired`: the local truth, changed at
  // once by the cache's events), what the store has (`published`, changed only once a store call succeeded), and
  // the differences still to send. Bounded by the blocks the cache holds, whatever the store does.
  struct DirectoryState {
    std::string published_ns;  // the namespace `published` was published under
    std::unordered_set<BlockKey, BlockKeyHash> desired, published, to_publish, to_withdraw;
  };
  mutable std::mutex pub_mu;
  std::condition_variable pub_cv;
  std::map<Cache*, DirectoryState> directory_state;
  uint64_t lease_generation = 0;  // bumped by RepublishAll: a store call begun under an older lease changes nothing

  // Connections to peers, by node id (the epoch they were made for: a new epoch reconnects).
  std::mutex peers_mu;
  struct Peer {
    cluster::PeerHandle handle;
    uint64_t epoch = 0;
    std::string endpoint;
  };
  std::map<std::string, Peer> peers;

  // Pulls.
  struct PullJob {
    Cache* cache = nullptr;
    std::vector<BlockKey> keys;
    uint32_t local = 0;
    uint64_t session = 0;
    std::function<bool()> cancelled;
    std::function<void(PrefetchResult)> done;
  };
  std::mutex pull_mu;
  std::condition_variable pull_cv;
  std::deque<PullJob> jobs;
  std::map<uint64_t, uint32_t> session_pulls;
  uint32_t pulls_admitted = 0;  // queued + running

  // Peers' lookups, handed over by the transport's progress thread.
  struct ServeJob {
    std::string peer;
    std::string request;
    std::function<void(Result<std::string>)> reply;
  };
  std::mutex serve_mu;
  std::condition_variable serve_cv;
  std::deque<ServeJob> serve_jobs;

  std::vector<std::thread> threads;

  std::atomic<uint64_t> publish_failures{0}, rejoins{0}, prefetches{0}, pulls_ok{0},
      pulls_failed{0}, pulled_blocks{0}, pulled_bytes{0}, verify_failures{0}, pulls_running{0}, lookups_served{0},
      blocks_offered{0};
  mutable std::mutex error_mu;
  std::string last_error;
  std::vector<std::string> rdma_devices;  // guarded by members_mu; listed by the membership thread

  // The transport's progress thread runs callbacks that use the members above: it ends first (every region left
  // becomes inert).
  ~Impl() { transport.reset(); }

  void NoteError(const std::string& what) {
    std::lock_guard<std::mutex> lock(error_mu);
    last_error = what;
  }

  // --- membership ---------------------------------------------------------------------------------------------

  // The transport and its listener, once (the membership thread). A failure is retried by the caller, except a
  // refusal of the configuration (INVALID_ARGUMENT: a transport list UCX cannot take), which stays.
  Status StartTransport() {
    auto made = cluster::UcxTransport::Create(ucx_options);
    if (!made.ok()) return made.status();
    std::unique_ptr<cluster::UcxTransport> t = std::move(*made);
    Impl* raw = this;
    t->set_accept_filter([raw](const sockaddr& from) { return raw->AcceptFrom(from); });
    t->set_call_handler([raw](const std::string& peer, uint16_t method, std::string request,
                              std::function<void(Result<std::string>)> reply) {
      raw->OnCall(peer, method, std::move(request), std::move(reply));
    });
    std::vector<std::string> devices;
    for (const cluster::RdmaPort& p : cluster::ListRdmaPorts()) {
      devices.push_back(fmt::format("{}:{} {} {}", p.device, p.port, p.state, p.link_layer));
    }
    {
      std::lock_guard<std::mutex> lock(members_mu);
      endpoint = t->endpoint();
      rdma_devices = std::move(devices);
    }
    // The grants the pools announced meanwhile are registered now; AddPoolRegion registers later ones itself
    // (both under regions_mu, so each grant is registered once).
    std::lock_guard<std::mutex> lock(regions_mu);
    transport = std::move(t);
    for (auto& [base, grant] : regions) RegisterGrant(grant);
    transport_up.store(true, std::memory_order_release);
    return Status::Ok();
  }

  // Under regions_mu, with the transport up.
  void RegisterGrant(Grant& grant) {
    auto registered = transport->Register(grant.base, grant.bytes);
    if (!registered.ok()) {
      log::Warning("cluster", "cannot register a pool grant of {} bytes for peers: {}", grant.bytes,
                   registered.status().ToString());
      return;  // the grant serves locally; peers' lookups do not offer its blocks
    }
    grant.registered = std::move(*registered);
  }

  // One attempt to join. A member record of this node id that a live lease still holds, with the transfer endpoint
  // this process listens on now, is this node's previous run (killed before it could leave: its lease lives on
  // until its ttl): no other live process can listen on that address and port, so the record is released (its
  // lease revoked, and every entry of that run with it) and the join is tried again at once. Only until this process
  // first joined (`may_release`): a record that appears later under our id with our endpoint is not a previous run
  // of ours (two misconfigured hosts sharing an address and a --node-id would otherwise take it from each other in
  // turn); it is waited out like any other holder.
  Status JoinOnce(bool may_release) {
    cluster::NodeInfo self;
    self.node_id = options.node_id;
    {
      std::lock_guard<std::mutex> lock(members_mu);
      self.transfer_endpoint = endpoint;
    }
    Status joined = directory->Join(self, options.lease_ttl);
    if (may_release && joined.code() == StatusCode::kFailedPrecondition && !stopping.load(std::memory_order_acquire)) {
      auto listed = directory->Members();
      for (const cluster::NodeInfo& m : listed.ok() ? *listed : std::vector<cluster::NodeInfo>{}) {
        if (m.node_id != self.node_id || m.transfer_endpoint != self.transfer_endpoint) continue;
        log::Info("cluster",
                  "node id '{}' is still held by this node's previous run (epoch {}, transfer endpoint {}, which this "
                  "process listens on now): releasing it",
                  self.node_id, m.epoch, m.transfer_endpoint);
        const Status released = directory->ReleaseNodeId(self.node_id, self.transfer_endpoint);
        if (!released.ok()) {
          joined = released.WithContext("releasing the previous run's member record");
          break;
        }
        joined = directory->Join(self, options.lease_ttl);
        break;
      }
    }
    return joined;
  }

  void RefreshMembers() {
    auto listed = directory->Members();
    if (!listed.ok()) {
      // Keep the last list: a store that is briefly away must not cut peers off; the lease decides membership.
      log::Debug("cluster", "member list: {}", listed.status().ToString());
      return;
    }
    std::map<std::string, cluster::NodeInfo> fresh;
    std::unordered_set<std::string> hosts;
    for (cluster::NodeInfo& m : *listed) {
      hosts.insert(HostOfEndpoint(m.transfer_endpoint));
      fresh[m.node_id] = std::move(m);
    }
    std::lock_guard<std::mutex> lock(members_mu);
    members = std::move(fresh);
    member_hosts = std::move(hosts);
  }

  // The membership thread: the transport, the join (both retried with backoff while the node serves its own
  // cache), the member list every second, and a join again after a lost lease.
  void MembershipLoop() {
    constexpr int64_t kFirstBackoffMs = 200, kMaxBackoffMs = 2000;
    bool was_joined = false;
    bool transport_refused = false;
    int64_t backoff_ms = kFirstBackoffMs;
    uint64_t attempts = 0;
    std::string last_logged;
    Clock::time_point last_log{}, first_attempt{};
    while (!stopping.load(std::memory_order_acquire)) {
      if (!directory->joined() && !transport_refused) {
        if (++attempts == 1) first_attempt = Clock::now();
        Status s = transport_up.load(std::memory_order_acquire) ? Status::Ok() : StartTransport();
        if (!s.ok()) {
          transport_refused = s.code() == StatusCode::kInvalidArgument;
          s = s.WithContext("the transfer endpoint");
        }
        if (s.ok()) s = JoinOnce(/*may_release=*/!was_joined);
        if (s.ok()) {
          const double waited_s = std::chrono::duration<double>(Clock::now() - first_attempt).count();
          {
            std::lock_guard<std::mutex> lock(members_mu);
            join_state = "joined";
            log::Info("cluster", "joined the cluster as '{}' epoch {} at {}{}", options.node_id, directory->epoch(),
                      endpoint,
                      attempts > 1 ? fmt::format(" (attempt {}, {:.1f} s after the first)", attempts, waited_s)
                                   : std::string());
          }
          if (was_joined) rejoins.fetch_add(1, std::memory_order_relaxed);
          was_joined = true;
          attempts = 0;
          backoff_ms = kFirstBackoffMs;
          RepublishAll();
        } else {
          const bool held = s.code() == StatusCode::kFailedPrecondition;
          const std::string why = fmt::format(
              "{}{}", s.ToString(),
              held ? "; a live lease holds this node id: another daemon started with the same --node-id, or this "
                     "node's previous run at another transfer endpoint until its lease ends"
                   : "");
          {
            std::lock_guard<std::mutex> lock(members_mu);
            join_state = transport_refused ? fmt::format("failed: {} (fix the configuration and restart)", why)
                                           : fmt::format("retrying: {} (attempt {})", why, attempts);
          }
          NoteError(fmt::format("joining the cluster: {}", s.ToString()));
          // Logged when the reason changes and every 30 s: a port or a store that takes a minute fills no log.
          const auto now = Clock::now();
          if (transport_refused) {
            log::Error("cluster", "the cluster tier cannot start: {}; this node serves its own cache only", why);
          } else if (why != last_logged || now - last_log >= std::chrono::seconds(30)) {
            log::Warning("cluster", "not in the cluster yet: {} (attempt {}; retrying; this node serves its own "
                         "cache meanwhile)", why, attempts);
            last_logged = why;
            last_log = now;
          }
          backoff_ms = std::min<int64_t>(backoff_ms * 2, kMaxBackoffMs);
        }
      }
      RefreshMembers();
      std::unique_lock<std::mutex> lock(members_mu);
      members_cv.wait_for(lock, std::chrono::milliseconds(directory->joined() ? 1000 : backoff_ms),
                          [this] { return refresh_asked || stopping.load(std::memory_order_acquire); });
      refresh_asked = false;
    }
  }

  // The transport's accept filter (lane 0's progress thread): only current members' hosts get in.
  bool AcceptFrom(const sockaddr& from) {
    if (stopping.load(std::memory_order_acquire)) return false;
    const std::string host = HostOf(from);
    std::lock_guard<std::mutex> lock(members_mu);
    if (member_hosts.count(host) > 0) return true;
    // A node that joined a moment ago: a refresh now lets its next attempt in. A stranger knocking again and again
    // costs at most five member reads and one log line a second.
    const int64_t now = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch()).count();
    if (now - last_refresh_ask_ms >= 200) {
      last_refresh_ask_ms = now;
      refresh_asked = true;
      members_cv.notify_all();
    }
    if (now - last_refusal_log_ms >= 1000) {
      last_refusal_log_ms = now;
      log::Warning("cluster", "refused a connection from {}: not the address of a current member", host);
    }
    return false;
  }

  // The transport's call handler (a lane's progress thread): peers' lookups go to the lookup server.
  void OnCall(const std::string& peer, uint16_t method, std::string request,
              std::function<void(Result<std::string>)> reply) {
    if (stopping.load(std::memory_order_acquire)) {
      reply(Status::Unavailable("the node is leaving the cluster"));
      return;
    }
    if (method != kPeerLookupMethod) {
      reply(Status::Unimplemented(fmt::format("peer call method {} is unknown; expected {}", method,
                                              kPeerLookupMethod)));
      return;
    }
    std::lock_guard<std::mutex> lock(serve_mu);
    if (stopping.load(std::memory_order_acquire)) {
      reply(Status::Unavailable("the node is leaving the cluster"));
      return;
    }
    if (serve_jobs.size() >= 1024) {
      reply(Status::ResourceExhausted("too many lookups waiting on this node; retry"));
      return;
    }
    serve_jobs.push_back({peer, std::move(request), std::move(reply)});
    serve_cv.notify_one();
  }

  // What status shows: "joined", "joining" (the first attempt), "retrying: <why> (attempt N)", "failed: <why>",
  // "stopped".
  std::string State() const {
    if (stopping.load(std::memory_order_acquire)) return "stopped";
    if (directory->joined()) return "joined";
    std::lock_guard<std::mutex> lock(members_mu);
    if (join_state == "joined") return "retrying: the lease was lost (the store was out of reach for a lease ttl)";
    return join_state;
  }

  void AskRefresh() {
    std::lock_guard<std::mutex> lock(members_mu);
    refresh_asked = true;
    members_cv.notify_all();
  }

  std::optional<cluster::NodeInfo> Member(const std::string& node_id) const {
    std::lock_guard<std::mutex> lock(members_mu);
    auto it = members.find(node_id);
    if (it == members.end()) return std::nullopt;
    return it->second;
  }

  // --- directory updates ---------------------------------------------------------------------------------

  // Under the cache's lock: only the sets change here.
  void OnBlockEvent(Cache* cache, const Cache::BlockEvent& e) {
    std::lock_guard<std::mutex> lock(pub_mu);
    DirectoryState& d = directory_state[cache];
    switch (e.kind) {
      case Cache::BlockEvent::kCommitted:
        if (!IsPublishedKey(e.key, e.request_end, options.chunk_blocks)) return;
        d.desired.insert(e.key);
        d.to_withdraw.erase(e.key);
        if (d.published.count(e.key) == 0) d.to_publish.insert(e.key);
        break;
      case Cache::BlockEvent::kRemoved:
        if (d.desired.erase(e.key) == 0) return;
        d.to_publish.erase(e.key);
        if (d.published.count(e.key) > 0) d.to_withdraw.insert(e.key);
        break;
      case Cache::BlockEvent::kDomainDropped:
        d.desired.clear();
        d.to_publish.clear();
        d.to_withdraw = d.published;
        break;
    }
    pub_cv.notify_one();
  }

  // After a new Join every entry of the old lease is gone: publish everything still held again.
  void RepublishAll() {
    std::lock_guard<std::mutex> lock(pub_mu);
    ++lease_generation;
    for (auto& [cache, d] : directory_state) {
      d.published.clear();
      d.to_withdraw.clear();
      d.to_publish = d.desired;
    }
    pub_cv.notify_one();
  }

  size_t PendingLocked() const {
    size_t n = 0;
    for (const auto& [cache, d] : directory_state) n += d.to_publish.size() + d.to_withdraw.size();
    return n;
  }

  void PublishLoop() {
    int64_t backoff_ms = 100;
    while (!stopping.load(std::memory_order_acquire)) {
      {
        std::unique_lock<std::mutex> lock(pub_mu);
        pub_cv.wait_for(lock, std::chrono::milliseconds(500),
                        [this] { return PendingLocked() > 0 || stopping.load(std::memory_order_acquire); });
      }
      if (stopping.load(std::memory_order_acquire)) return;
      if (!directory->joined()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the membership thread joins again
        continue;
      }
      const Status s = PublishRound();
      if (s.ok()) {
        backoff_ms = 100;
        continue;
      }
      publish_failures.fetch_add(1, std::memory_order_relaxed);
      NoteError(fmt::format("directory update: {}", s.ToString()));
      log::Warning("cluster", "directory update failed, retrying in {} ms: {}", backoff_ms, s.ToString());
      std::unique_lock<std::mutex> lock(pub_mu);
      pub_cv.wait_for(lock, std::chrono::milliseconds(backoff_ms),
                      [this] { return stopping.load(std::memory_order_acquire); });
      backoff_ms = std::min<int64_t>(backoff_ms * 2, 2000);
    }
  }

  // One round: per cache, up to 1024 withdrawals first, then (once nothing of another namespace is left) up to 1024
  // publishes. The sets change only for what the store took.
  Status PublishRound() {
    std::vector<Cache*> caches_now;
    {
      std::lock_guard<std::mutex> lock(pub_mu);
      for (const auto& [cache, d] : directory_state) {
        if (!d.to_publish.empty() || !d.to_withdraw.empty()) caches_now.push_back(cache);
      }
    }
    for (Cache* cache : caches_now) {
      const std::string ns = cache->Domain().model_namespace;  // not under the cache's lock
      std::vector<cluster::DirectoryEntry> withdraw, publish;
      uint64_t generation = 0;
      {
        std::lock_guard<std::mutex> lock(pub_mu);
        generation = lease_generation;
        DirectoryState& d = directory_state[cache];
        for (auto it = d.to_withdraw.begin(); it != d.to_withdraw.end() && withdraw.size() < 1024; ++it) {
          withdraw.push_back({*it, d.published_ns, 1});
        }
        if (d.published.empty()) d.published_ns = ns;
        if (d.published_ns == ns && !ns.empty()) {
          for (auto it = d.to_publish.begin(); it != d.to_publish.end() && publish.size() < 1024; ++it) {
            publish.push_back({*it, ns, 1});
          }
        } else if (d.published_ns != ns && d.to_withdraw.empty()) {
          // A new domain in a reused slot, and the old one's entries are not all queued: withdraw them all.
          d.to_withdraw = d.published;
        }
      }
      if (!withdraw.empty()) {
        FLEXKV_RETURN_IF_ERROR(directory->Withdraw(withdraw));
        std::lock_guard<std::mutex> lock(pub_mu);
        if (generation != lease_generation) continue;  // joined again meanwhile: everything is published anew
        DirectoryState& d = directory_state[cache];
        for (const auto& e : withdraw) {
          d.published.erase(e.chunk_key);
          d.to_withdraw.erase(e.chunk_key);
          if (d.desired.count(e.chunk_key) > 0) d.to_publish.insert(e.chunk_key);  // stored again meanwhile
        }
      }
      if (!publish.empty()) {
        FLEXKV_RETURN_IF_ERROR(directory->Publish(publish));
        std::lock_guard<std::mutex> lock(pub_mu);
        if (generation != lease_generation) continue;
        DirectoryState& d = directory_state[cache];
        for (const auto& e : publish) {
          d.to_publish.erase(e.chunk_key);
          d.published.insert(e.chunk_key);
          if (d.desired.count(e.chunk_key) == 0) d.to_withdraw.insert(e.chunk_key);  // evicted meanwhile
        }
      }
    }
    return Status::Ok();
  }

  // --- regions ------------------------------------------------------------------------------------------------

  // The registered region holding [addr, addr + bytes): (descriptor, offset in it).
  std::optional<std::pair<std::string, uint64_t>> Locate(const uint8_t* addr, uint64_t bytes) const {
    std::lock_guard<std::mutex> lock(regions_mu);
    const auto a = reinterpret_cast<uintptr_t>(addr);
    auto it = regions.upper_bound(a);
    if (it == regions.begin()) return std::nullopt;
    --it;
    const cluster::RegisteredRegion& r = it->second.registered;
    if (!r.valid()) return std::nullopt;
    const uint64_t off = a - it->first;
    if (off > r.bytes() || bytes > r.bytes() - off) return std::nullopt;
    return std::make_pair(r.descriptor(), off);
  }

  // --- the lookup server --------------------------------------------------------------------------------------

  void ServeLoop() {
    for (;;) {
      ServeJob job;
      {
        std::unique_lock<std::mutex> lock(serve_mu);
        serve_cv.wait(lock, [this] { return !serve_jobs.empty() || stopping.load(std::memory_order_acquire); });
        if (serve_jobs.empty()) return;
        job = std::move(serve_jobs.front());
        serve_jobs.pop_front();
      }
      job.reply(ServeLookup(job.peer, job.request));
    }
  }

  Result<std::string> ServeLookup(const std::string& peer, const std::string& bytes) {
    auto request = DecodeLookupRequest(bytes);
    if (!request.ok()) {
      log::Warning("cluster", "peer '{}' sent a lookup that does not parse: {}", peer, request.status().message());
      return request.status();
    }
    const uint64_t my_epoch = directory->epoch();
    if (request->epoch != my_epoch) {
      return Status::FailedPrecondition(fmt::format(
          "node '{}' is at epoch {}, not {}: its blocks of that epoch are gone", options.node_id, my_epoch,
          request->epoch));
    }
    Cache* cache = caches->Find(request->model_namespace);
    if (cache == nullptr || !cache->has_pool()) {
      return Status::NotFound(fmt::format("node '{}' has no cache domain '{}'", options.node_id,
                                          request->model_namespace));
    }
    const CacheDomain::View domain = cache->Domain();
    if (domain.geometry && domain.geometry->is_hybrid()) {
      return Status::FailedPrecondition(fmt::format(
          "node '{}' serves '{}' with a hybrid geometry: its blocks are not pulled by peers", options.node_id,
          request->model_namespace));
    }
    const std::string layout = domain.geometry ? domain.geometry->ToString() : std::string();
    if (layout != request->layout) {
      return Status::FailedPrecondition(fmt::format(
          "blocks laid out differently: node '{}' serves '{}' as {}, not {}", options.node_id,
          request->model_namespace, layout, request->layout));
    }
    if (cache->block_bytes() != request->block_bytes) {
      return Status::FailedPrecondition(fmt::format(
          "node '{}' stores blocks of {} bytes in '{}', not {}: the geometries differ", options.node_id,
          cache->block_bytes(), request->model_namespace, request->block_bytes));
    }
    std::vector<SlotId> slots;
    const size_t matched = cache->Match(request->keys, /*pin=*/true, &slots);
    PeerLookupReply reply;
    reply.matched = static_cast<uint32_t>(matched);
    std::map<std::string, uint32_t> region_index;
    for (size_t i = request->from; i < matched; ++i) {
      const SlotId slot = slots[i];
      const std::optional<uint64_t> checksum = cache->EntryChecksum(slot);
      const auto where = Locate(cache->SlotData(slot), cache->SlotBytes(slot));
      if (!checksum || !where) break;  // not registered (a grant being added) or no entry: the answer ends here
      auto [it, added] = region_index.emplace(where->first, static_cast<uint32_t>(reply.regions.size()));
      if (added) reply.regions.push_back(where->first);
      reply.blocks.push_back({it->second, where->second, *checksum});
    }
    cache->Unpin(slots);
    lookups_served.fetch_add(1, std::memory_order_relaxed);
    blocks_offered.fetch_add(reply.blocks.size(), std::memory_order_relaxed);
    return EncodeLookupReply(reply);
  }

  // --- pulls --------------------------------------------------------------------------------------------------

  void PullLoop() {
    for (;;) {
      PullJob job;
      {
        std::unique_lock<std::mutex> lock(pull_mu);
        pull_cv.wait(lock, [this] { return !jobs.empty() || stopping.load(std::memory_order_acquire); });
        if (stopping.load(std::memory_order_acquire)) return;  // Stop answers what is queued
        job = std::move(jobs.front());
        jobs.pop_front();
      }
      pulls_running.fetch_add(1, std::memory_order_relaxed);
      PrefetchResult result = Pull(job);
      pulls_running.fetch_sub(1, std::memory_order_relaxed);
      {
        std::lock_guard<std::mutex> lock(pull_mu);
        --pulls_admitted;
        if (--session_pulls[job.session] == 0) session_pulls.erase(job.session);
      }
      job.done(std::move(result));
    }
  }

  Result<cluster::PeerHandle> PeerFor(const std::string& node_id, uint64_t epoch) {
    std::optional<cluster::NodeInfo> member = Member(node_id);
    if (!member || member->epoch != epoch) {
      AskRefresh();
      return Status::Unavailable(fmt::format("node '{}' epoch {} is not a current member", node_id, epoch));
    }
    {
      std::lock_guard<std::mutex> lock(peers_mu);
      auto it = peers.find(node_id);
      if (it != peers.end() && it->second.epoch == epoch && it->second.endpoint == member->transfer_endpoint) {
        return it->second.handle;
      }
      if (it != peers.end()) {
        transport->Disconnect(it->second.handle);
        peers.erase(it);
      }
    }
    auto connected = transport->Connect(member->transfer_endpoint);
    if (!connected.ok() && connected.status().code() != StatusCode::kDeadlineExceeded) {
      // A peer refuses a node that joined after its last member refresh (once a second); the refusal makes it
      // refresh at once, so one retry a moment later gets in.
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
      connected = transport->Connect(member->transfer_endpoint);
    }
    if (!connected.ok()) return connected.status();
    if (!connected->node_id.empty() && connected->node_id != node_id) {
      transport->Disconnect(*connected);
      return Status::PermissionDenied(fmt::format("the endpoint {} of node '{}' proved to be node '{}'",
                                                  member->transfer_endpoint, node_id, connected->node_id));
    }
    std::lock_guard<std::mutex> lock(peers_mu);
    auto [it, added] = peers.try_emplace(node_id, Peer{*connected, epoch, member->transfer_endpoint});
    if (!added) {
      if (it->second.epoch == epoch && it->second.endpoint == member->transfer_endpoint) {
        // Another puller connected meanwhile: one connection per peer.
        transport->Disconnect(*connected);
        return it->second.handle;
      }
      transport->Disconnect(it->second.handle);  // of an earlier epoch or endpoint
      it->second = Peer{*connected, epoch, member->transfer_endpoint};
    }
    return *connected;
  }

  // Closes the connection `handle` to a peer that failed (the next pull reconnects), unless another puller has
  // replaced it already.
  void DropPeer(const std::string& node_id, const cluster::PeerHandle& handle) {
    std::lock_guard<std::mutex> lock(peers_mu);
    auto it = peers.find(node_id);
    if (it == peers.end() || it->second.handle.id != handle.id) return;
    transport->Disconnect(it->second.handle);
    peers.erase(it);
  }

  // Reads blocks[i] of `peer` into slots[i] (i < slots.size()), at most `window` at once, and returns each read's
  // end. Stops posting after the first failure (only the verified prefix is committed). Every read posted has
  // ended when it returns (a read the transport refused as over its limit is retried once one of ours ends).
  std::vector<Status> ReadBlocks(Cache& cache, const cluster::PeerHandle& peer,
                                 const std::vector<cluster::RemoteRegion>& peer_regions,
                                 std::span<const PeerLookupReply::Block> blocks, std::span<const SlotId> slots) {
    struct Reads {
      std::mutex mu;
      std::condition_variable cv;
      size_t in_flight = 0;
      bool failed = false;
    } reads;
    const size_t window = std::max<size_t>(4, kTransportInflight / (options.max_pulls + 1));
    std::vector<Status> got(slots.size(), Status::Cancelled("not read: an earlier block failed"));
    for (size_t i = 0; i < slots.size(); ++i) {
      {
        std::unique_lock<std::mutex> lock(reads.mu);
        reads.cv.wait(lock, [&] { return reads.in_flight < window || reads.failed; });
        if (reads.failed || stopping.load(std::memory_order_acquire)) break;
        ++reads.in_flight;
      }
      const PeerLookupReply::Block& b = blocks[i];
      Status posted;
      for (int attempt = 0;; ++attempt) {
        posted = transport->Get(peer, peer_regions[b.region], b.offset, cache.SlotData(slots[i]), cache.SlotBytes(slots[i]),
                                [&reads, &got, i](Status s) {
                                  std::lock_guard<std::mutex> lock(reads.mu);
                                  if (!s.ok()) reads.failed = true;
                                  got[i] = std::move(s);
                                  --reads.in_flight;
                                  reads.cv.notify_all();
                                });
        if (posted.code() != StatusCode::kResourceExhausted || attempt >= 200) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));  // other pulls hold the transport's reads
      }
      if (!posted.ok()) {
        std::lock_guard<std::mutex> lock(reads.mu);
        got[i] = posted;
        reads.failed = true;
        --reads.in_flight;
        break;
      }
    }
    std::unique_lock<std::mutex> lock(reads.mu);
    reads.cv.wait(lock, [&] { return reads.in_flight == 0; });
    return got;
  }

  // The pull itself (a puller thread). Every exit answers; a failure after a peer was found counts as failed.
  PrefetchResult Pull(const PullJob& job) {
    PrefetchResult r;
    r.local_blocks = job.local;
    const auto cancelled = [&] { return stopping.load(std::memory_order_acquire) || job.cancelled(); };
    prefetches.fetch_add(1, std::memory_order_relaxed);
    Cache& cache = *job.cache;
    const auto fail = [&](std::string why) {
      pulls_failed.fetch_add(1, std::memory_order_relaxed);
      NoteError(why);
      log::Debug("cluster", "pull: {}", why);
      r.source = std::move(why);
      return r;
    };
    if (!cache.has_pool() || !transport_up.load(std::memory_order_acquire)) return r;
    const CacheDomain::View domain = cache.Domain();
    if (!domain.geometry || domain.geometry->is_hybrid()) return r;
    const std::string ns = domain.model_namespace;
    const std::string layout = domain.geometry->ToString();
    const uint64_t block_bytes = cache.block_bytes();
    const size_t n = job.keys.size();
    // A lookup names at most kMaxLookupKeys keys (the chain from the root): deeper blocks are not pulled.
    const size_t reach = std::min<size_t>(n, kMaxLookupKeys);
    // Candidates, deepest first: the keys after the local prefix that a peer may have published and that are
    // reached only by asking for them (publish_policy.h).
    const std::vector<size_t> candidates = LookupCandidates(job.keys, job.local, reach, options.chunk_blocks);
    size_t deepest = n;
    std::vector<cluster::Owner> owners;
    for (size_t at = 0; at < candidates.size() && deepest == n; at += cluster::kLookupBatch) {
      if (cancelled()) return r;
      std::vector<BlockKey> asked;
      for (size_t i = at; i < std::min(candidates.size(), at + cluster::kLookupBatch); ++i) {
        asked.push_back(job.keys[candidates[i]]);
      }
      auto found = directory->Lookup(ns, asked);
      if (!found.ok()) return fail(fmt::format("directory lookup: {}", found.status().message()));
      for (size_t i = 0; i < found->size(); ++i) {
        if (!(*found)[i].empty()) {
          deepest = candidates[at + i];
          owners = (*found)[i];
          break;
        }
      }
    }
    if (deepest == n) return r;  // no peer has any of it: a plain miss
    // Found at a sampled key: a commit end just above it (not asked yet) names a deeper owner, if there is one.
    const std::vector<size_t> gap = LookupGapAbove(job.keys, deepest, reach, options.chunk_blocks);
    for (size_t at = 0; at < gap.size(); at += cluster::kLookupBatch) {
      if (cancelled()) return r;
      std::vector<BlockKey> asked;
      for (size_t i = at; i < std::min(gap.size(), at + cluster::kLookupBatch); ++i) asked.push_back(job.keys[gap[i]]);
      auto found = directory->Lookup(ns, asked);
      if (!found.ok()) break;  // the sampled key's owners answer still
      const auto hit = std::find_if(found->begin(), found->end(), [](const auto& o) { return !o.empty(); });
      if (hit != found->end()) {
        deepest = gap[at + static_cast<size_t>(hit - found->begin())];
        owners = *hit;
        break;
      }
    }
    static thread_local std::minstd_rand pick(static_cast<unsigned>(std::random_device{}()));
    const cluster::Owner owner = owners[pick() % owners.size()];
    if (cancelled()) return r;

    auto peer = PeerFor(owner.node_id, owner.epoch);
    if (!peer.ok()) return fail(fmt::format("peer {}: {}", owner.node_id, peer.status().message()));
    PeerLookupRequest request;
    request.model_namespace = ns;
    request.layout = layout;
    request.block_bytes = block_bytes;
    request.epoch = owner.epoch;
    request.from = job.local;
    // The whole chain, not only up to the key found: the owner answers with all of it it holds (a commit end past
    // the sampled key found, which the directory was not asked about, or blocks it holds unpublished).
    request.keys.assign(job.keys.begin(), job.keys.begin() + static_cast<ptrdiff_t>(reach));
    auto answer = transport->CallSync(*peer, kPeerLookupMethod, EncodeLookupRequest(request));
    for (int attempt = 0; !answer.ok() && answer.status().code() == StatusCode::kResourceExhausted && attempt < 200;
         ++attempt) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));  // other pulls hold the transport's requests
      answer = transport->CallSync(*peer, kPeerLookupMethod, EncodeLookupRequest(request));
    }
    if (!answer.ok()) {
      if (answer.status().code() == StatusCode::kDeadlineExceeded || answer.status().code() == StatusCode::kUnavailable) {
        DropPeer(owner.node_id, *peer);
      }
      return fail(fmt::format("peer {}: {}", owner.node_id, answer.status().message()));
    }
    auto reply = DecodeLookupReply(*answer, request.from, request.keys.size());
    if (!reply.ok()) return fail(fmt::format("peer {}: {}", owner.node_id, reply.status().message()));
    if (reply->blocks.empty()) return fail(fmt::format("peer {}: no longer holds the blocks", owner.node_id));
    std::vector<cluster::RemoteRegion> peer_regions;
    for (const std::string& d : reply->regions) {
      auto parsed = cluster::RemoteRegion::Parse(d);
      if (!parsed.ok()) return fail(fmt::format("peer {}: {}", owner.node_id, parsed.status().message()));
      peer_regions.push_back(*parsed);
    }
    if (cancelled()) return r;

    // Pending local slots for the blocks offered, under the local prefix.
    const BlockKey parent = job.local == 0 ? BlockKey{} : job.keys[job.local - 1];
    const std::span<const BlockKey> wanted(job.keys.data() + job.local, reply->blocks.size());
    PrefixIndex::Reservation reserved = cache.Reserve(parent, wanted);
    if (reserved.parent_refused) return fail("the local prefix was evicted during the pull");
    const size_t first = reserved.cached;  // stored here meanwhile: not pulled again
    const size_t count = reserved.slots.size();
    if (count == 0) {
      r.local_blocks = static_cast<uint32_t>(job.local + first);
      return r;
    }
    const std::vector<Status> got =
        ReadBlocks(cache, *peer, peer_regions, std::span(reply->blocks).subspan(first, count), reserved.slots);
    size_t verified = 0;
    std::vector<uint64_t> checksums;
    std::string why;
    for (; verified < count; ++verified) {
      if (!got[verified].ok()) {
        why = fmt::format("peer {}: block {}: {}", owner.node_id, job.local + first + verified, got[verified].message());
        break;
      }
      const uint64_t expected = reply->blocks[first + verified].checksum;
      const SlotId slot = reserved.slots[verified];
      if (BlockChecksum(cache.SlotData(slot), cache.SlotBytes(slot)) != expected) {
        verify_failures.fetch_add(1, std::memory_order_relaxed);
        why = fmt::format("peer {}: block {} did not match its checksum (overwritten or evicted during the read)",
                          owner.node_id, job.local + first + verified);
        break;
      }
      checksums.push_back(expected);
    }
    const std::span<const SlotId> good(reserved.slots.data(), verified);
    if (verified > 0) cache.Commit(parent, wanted, first, good, checksums, Cache::BlockEvent::kPulled);
    if (verified < count) cache.Abort(std::span<const SlotId>(reserved.slots.data() + verified, count - verified));
    if (verified == 0) {
      if (got[0].code() == StatusCode::kDeadlineExceeded || got[0].code() == StatusCode::kUnavailable) {
        DropPeer(owner.node_id, *peer);
      }
      return fail(why);
    }
    if (!why.empty()) {
      NoteError(why);
      log::Debug("cluster", "pull stopped early: {}", why);
    }
    r.local_blocks = static_cast<uint32_t>(job.local + first);
    r.pulled_blocks = static_cast<uint32_t>(verified);
    for (size_t i = 0; i < verified; ++i) r.pulled_bytes += cache.SlotBytes(reserved.slots[i]);
    r.source = owner.node_id;
    pulls_ok.fetch_add(1, std::memory_order_relaxed);
    pulled_blocks.fetch_add(verified, std::memory_order_relaxed);
    pulled_bytes.fetch_add(r.pulled_bytes, std::memory_order_relaxed);
    return r;
  }
};

ClusterTier::ClusterTier(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ClusterTier::~ClusterTier() { Stop(); }

Result<std::unique_ptr<ClusterTier>> ClusterTier::Create(ClusterTierOptions options, CacheSet* caches) {
  if (options.node_id.empty() || options.node_id.size() > 64 ||
      options.node_id.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-") !=
          std::string::npos) {
    return Status::InvalidArgument(fmt::format(
        "--node-id '{}' is not valid; expected 1..64 characters of [A-Za-z0-9._-], unique in the cluster",
        options.node_id));
  }
  if (options.etcd_endpoints.empty()) {
    return Status::InvalidArgument("--etcd-endpoints is empty; expected the cluster's etcd, e.g. 10.0.0.2:2379");
  }
  if (options.listen_address.empty() || options.listen_address == "0.0.0.0" || options.listen_address == "::") {
    return Status::InvalidArgument(fmt::format(
        "--cluster-listen address '{}' is not one peers can reach; expected this node's cluster address, e.g. "
        "10.0.0.7:7471 (the daemon listens only where it is told)",
        options.listen_address));
  }
  if (options.chunk_blocks == 0) return Status::InvalidArgument("--cluster-chunk-blocks is 0; expected >= 1");
  if (options.max_pulls == 0 || options.max_session_pulls == 0) {
    return Status::InvalidArgument("--cluster-max-pulls and --cluster-max-session-pulls must be >= 1");
  }
  auto secret = ReadSecretFile(options.secret_file);
  if (!secret.ok()) return secret.status();

  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->caches = caches;

  cluster::EtcdOptions etcd;
  etcd.endpoints = options.etcd_endpoints;
  etcd.deadline = std::min<std::chrono::milliseconds>(options.pull_deadline, std::chrono::milliseconds(2000));
  etcd.secret = *secret;  // member records and directory entries are signed with it
  if (!options.etcd_credentials_file.empty()) {
    auto creds = cluster::ReadCredentialsFile(options.etcd_credentials_file);
    if (!creds.ok()) return creds.status();
    etcd.user = creds->user;
    etcd.password = creds->password;
  }
  auto directory = cluster::ConnectEtcd(etcd);
  if (!directory.ok()) return directory.status();
  impl->directory = std::move(*directory);

  cluster::UcxOptions& ucx = impl->ucx_options;
  ucx.devices = options.transfer_devices;
  ucx.transports = options.transports;
  ucx.listen_address = options.listen_address;
  ucx.listen_port = options.listen_port;
  ucx.get_deadline = options.pull_deadline;
  ucx.max_inflight_gets = kTransportInflight;
  ucx.lanes = options.lanes;
  ucx.secret = *secret;
  ucx.node_id = options.node_id;
  Impl* raw = impl.get();
  ucx.is_member = [raw](std::string_view node) {
    std::lock_guard<std::mutex> lock(raw->members_mu);
    return raw->members.count(std::string(node)) > 0;
  };

  for (size_t i = 0; i < caches->max_domains(); ++i) {
    Cache* cache = &caches->cache(i);
    cache->SetBlockListener([raw, cache](const Cache::BlockEvent& e) { raw->OnBlockEvent(cache, e); });
  }
  impl->threads.emplace_back([raw] { raw->MembershipLoop(); });
  impl->threads.emplace_back([raw] { raw->PublishLoop(); });
  impl->threads.emplace_back([raw] { raw->ServeLoop(); });
  for (uint32_t i = 0; i < options.max_pulls; ++i) impl->threads.emplace_back([raw] { raw->PullLoop(); });
  return std::unique_ptr<ClusterTier>(new ClusterTier(std::move(impl)));
}

Status ClusterTier::AddPoolRegion(const PoolRegion& region) {
  Impl& m = *impl_;
  if (m.stopping.load(std::memory_order_acquire)) return Status::Ok();
  std::lock_guard<std::mutex> lock(m.regions_mu);
  Impl::Grant& grant = m.regions[reinterpret_cast<uintptr_t>(region.base)];
  grant = Impl::Grant{region.base, region.bytes, {}};
  if (m.transport_up.load(std::memory_order_acquire)) m.RegisterGrant(grant);  // else StartTransport registers it
  return Status::Ok();
}

void ClusterTier::RemovePoolRegion(const PoolRegion& region) {
  cluster::RegisteredRegion gone;
  {
    std::lock_guard<std::mutex> lock(impl_->regions_mu);
    auto it = impl_->regions.find(reinterpret_cast<uintptr_t>(region.base));
    if (it == impl_->regions.end()) return;
    gone = std::move(it->second.registered);
    impl_->regions.erase(it);
  }
  gone.Reset();  // before the grant's memory goes back
}

void ClusterTier::Prefetch(Cache* cache, std::vector<BlockKey> keys, uint32_t local_blocks, uint64_t session,
                           std::function<bool()> cancelled, std::function<void(PrefetchResult)> done) {
  Impl& m = *impl_;
  PrefetchResult refused;
  refused.local_blocks = local_blocks;
  if (!m.stopping.load(std::memory_order_acquire) && !m.directory->joined()) {
    // Not a member (joining, the store out of reach, the lease lost): the directory cannot answer, and asking it
    // would cost every Prefetch the store's deadline. The local prefix is the answer, at once.
    refused.source = fmt::format("not pulled: this node is not in the cluster ({})", m.State());
    done(std::move(refused));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(m.pull_mu);
    if (m.stopping.load(std::memory_order_acquire)) {
      refused.status = Status::Unavailable("the cluster tier is stopping");
    } else if (m.pulls_admitted >= m.options.max_pulls * 4) {
      refused.status = Status::ResourceExhausted(fmt::format(
          "{} prefetches are pulling or waiting on this node (--cluster-max-pulls {}); retry later",
          m.pulls_admitted, m.options.max_pulls));
    } else if (m.session_pulls[session] >= m.options.max_session_pulls) {
      refused.status = Status::ResourceExhausted(fmt::format(
          "this session has {} prefetches in flight (--cluster-max-session-pulls {}); wait for one",
          m.session_pulls[session], m.options.max_session_pulls));
      if (m.session_pulls[session] == 0) m.session_pulls.erase(session);
    } else {
      ++m.pulls_admitted;
      ++m.session_pulls[session];
      m.jobs.push_back(Impl::PullJob{cache, std::move(keys), local_blocks, session, std::move(cancelled), std::move(done)});
      m.pull_cv.notify_one();
      return;
    }
  }
  done(std::move(refused));
}

void ClusterTier::Stop() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.stop_mu);
    if (m.stopped) return;
    m.stopped = true;
  }
  // Set under each waiter's mutex, so that no thread checks the flag and then sleeps past the notify.
  for (std::mutex* mu : {&m.pull_mu, &m.serve_mu, &m.pub_mu, &m.members_mu}) {
    std::lock_guard<std::mutex> lock(*mu);
    m.stopping.store(true, std::memory_order_release);
  }
  m.pull_cv.notify_all();
  m.serve_cv.notify_all();
  m.pub_cv.notify_all();
  m.members_cv.notify_all();
  for (size_t i = 0; i < m.caches->max_domains(); ++i) m.caches->cache(i).SetBlockListener({});
  // Pullers end the pull they are in at its next step (each Get ends by its deadline at the latest); the queued
  // ones are answered here.
  for (std::thread& t : m.threads) t.join();
  m.threads.clear();
  std::deque<Impl::PullJob> left;
  {
    std::lock_guard<std::mutex> lock(m.pull_mu);
    left.swap(m.jobs);
  }
  for (Impl::PullJob& job : left) {
    PrefetchResult r;
    r.local_blocks = job.local;
    r.status = Status::Unavailable("the daemon is stopping");
    job.done(std::move(r));
  }
  {
    std::lock_guard<std::mutex> lock(m.serve_mu);
    for (Impl::ServeJob& job : m.serve_jobs) job.reply(Status::Unavailable("the node is leaving the cluster"));
    m.serve_jobs.clear();
  }
  // Peers read nothing more from this node's pool (the caches may go before this tier does).
  std::map<uintptr_t, Impl::Grant> regions;
  {
    std::lock_guard<std::mutex> lock(m.regions_mu);
    regions.swap(m.regions);
  }
  regions.clear();
  const bool was_member = m.directory->joined();
  if (Status left_cluster = m.directory->Leave(); !left_cluster.ok()) {
    log::Warning("cluster", "leaving the cluster: {} (its entries go when the lease ends)", left_cluster.ToString());
  } else if (was_member) {
    log::Info("cluster", "left the cluster: this node's directory entries are gone");
  }
}

ClusterTierStatus ClusterTier::GetStatus() const {
  const Impl& m = *impl_;
  ClusterTierStatus s;
  s.node_id = m.options.node_id;
  s.epoch = m.directory->epoch();
  s.state = m.State();
  {
    std::lock_guard<std::mutex> lock(m.members_mu);
    s.endpoint = m.endpoint;
    s.rdma_devices = m.rdma_devices;
    for (const auto& [id, info] : m.members) {
      s.members.push_back({id, info.epoch, info.transfer_endpoint, id == m.options.node_id});
    }
  }
  {
    std::lock_guard<std::mutex> lock(m.pub_mu);
    for (const auto& [cache, d] : m.directory_state) s.published_keys += d.published.size();
    s.publish_queue = m.PendingLocked();
  }
  s.publish_failures = m.publish_failures.load();
  s.rejoins = m.rejoins.load();
  s.prefetches = m.prefetches.load();
  s.pulls_ok = m.pulls_ok.load();
  s.pulls_failed = m.pulls_failed.load();
  s.pulled_blocks = m.pulled_blocks.load();
  s.pulled_bytes = m.pulled_bytes.load();
  s.verify_failures = m.verify_failures.load();
  s.pulls_in_flight = m.pulls_running.load();
  s.lookups_served = m.lookups_served.load();
  s.blocks_offered = m.blocks_offered.load();
  s.directory_unauthenticated = m.directory->unauthenticated_values();
  if (m.transport_up.load(std::memory_order_acquire)) {
    s.transport = m.transport->stats();
    s.transports_in_use = m.transport->transports_in_use();
  }
  {
    std::lock_guard<std::mutex> lock(m.error_mu);
    s.last_error = m.last_error;
  }
  return s;
}

}  // namespace flexkv
