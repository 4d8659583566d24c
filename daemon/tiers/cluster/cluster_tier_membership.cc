// The cluster tier's membership (cluster_tier_impl.h): the transport and its listener, the join (retried with
// backoff while the node serves its own cache), the member list, and the transport's accept filter and call handler.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>

#include <algorithm>

#include "common/log.h"
#include "daemon/tiers/cluster/cluster_tier_impl.h"

namespace flexkv {
namespace {

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

}  // namespace

Status ClusterTier::Impl::StartTransport() {
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
    MutexLock lock(&members_mu);
    endpoint = t->endpoint();
    rdma_devices = std::move(devices);
  }
  // The grants the pools announced meanwhile are registered now; AddPoolRegion registers later ones itself
  // (both under regions_mu, so each grant is registered once).
  MutexLock lock(&regions_mu);
  transport = std::move(t);
  for (auto& [base, grant] : regions) RegisterGrant(grant);
  transport_up.store(true, std::memory_order_release);
  return Status::Ok();
}

void ClusterTier::Impl::RegisterGrant(Grant& grant) {
  auto registered = transport->Register(grant.base, grant.bytes);
  if (!registered.ok()) {
    log::Warning("cluster", "cannot register a pool grant of {} bytes for peers: {}", grant.bytes,
                 registered.status().ToString());
    return;  // the grant serves locally; peers' lookups do not offer its blocks
  }
  grant.registered = std::move(*registered);
}

// A member record of this node id that a live lease still holds, with the transfer endpoint this process listens
// on now, is this node's previous run (killed before it could leave: its lease lives on until its ttl): no other
// live process can listen on that address and port, so the record is released (its lease revoked, and every entry
// of that run with it) and the join is tried again at once. Only until this process first joined (`may_release`):
// a record that appears later under our id with our endpoint is not a previous run of ours (two misconfigured hosts
// sharing an address and a --node-id would otherwise take it from each other in turn); it is waited out like any
// other holder.
Status ClusterTier::Impl::JoinOnce(bool may_release) {
  cluster::NodeInfo self;
  self.node_id = options.node_id;
  {
    MutexLock lock(&members_mu);
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

void ClusterTier::Impl::RefreshMembers() {
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
  MutexLock lock(&members_mu);
  members = std::move(fresh);
  member_hosts = std::move(hosts);
}

void ClusterTier::Impl::MembershipLoop() {
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
          MutexLock lock(&members_mu);
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
          MutexLock lock(&members_mu);
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
    MutexLock lock(&members_mu);
    const Clock::time_point until =
        Clock::now() + std::chrono::milliseconds(directory->joined() ? 1000 : backoff_ms);
    while (!refresh_asked && !stopping.load(std::memory_order_acquire) && Clock::now() < until) {
      members_mu.WaitFor(&members_cv, until - Clock::now());
    }
    refresh_asked = false;
  }
}

bool ClusterTier::Impl::AcceptFrom(const sockaddr& from) {
  if (stopping.load(std::memory_order_acquire)) return false;
  const std::string host = HostOf(from);
  MutexLock lock(&members_mu);
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

void ClusterTier::Impl::OnCall(const std::string& peer, uint16_t method, std::string request,
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
  MutexLock lock(&serve_mu);
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

std::string ClusterTier::Impl::State() const {
  if (stopping.load(std::memory_order_acquire)) return "stopped";
  if (directory->joined()) return "joined";
  MutexLock lock(&members_mu);
  if (join_state == "joined") return "retrying: the lease was lost (the store was out of reach for a lease ttl)";
  return join_state;
}

void ClusterTier::Impl::AskRefresh() {
  MutexLock lock(&members_mu);
  refresh_asked = true;
  members_cv.notify_all();
}

std::optional<cluster::NodeInfo> ClusterTier::Impl::Member(const std::string& node_id) const {
  MutexLock lock(&members_mu);
  auto it = members.find(node_id);
  if (it == members.end()) return std::nullopt;
  return it->second;
}

}  // namespace flexkv
