// See cluster_tier.h. The public ClusterTier: Create (the options, the secret, the store client, the threads), the
// pool hooks, Prefetch's admission, Stop and GetStatus. The threads' code is in the files cluster_tier_impl.h names.
#include "daemon/tiers/cluster/cluster_tier.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/log.h"
#include "common/unique_fd.h"
#include "daemon/cache/cache_set.h"
#include "daemon/cluster/etcd/etcd_directory.h"
#include "daemon/tiers/cluster/cluster_tier_impl.h"

namespace flexkv {
namespace {

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

}  // namespace

void ClusterTier::Impl::NoteError(const std::string& what) {
  MutexLock lock(&error_mu);
  last_error = what;
}

void ClusterTier::Impl::BeginStop() {
  {
    MutexLock lock(&pull_mu);
    stopping.store(true, std::memory_order_release);
  }
  {
    MutexLock lock(&serve_mu);
    stopping.store(true, std::memory_order_release);
  }
  {
    MutexLock lock(&pub_mu);
    stopping.store(true, std::memory_order_release);
  }
  {
    MutexLock lock(&members_mu);
    stopping.store(true, std::memory_order_release);
  }
  pull_cv.notify_all();
  serve_cv.notify_all();
  pub_cv.notify_all();
  members_cv.notify_all();
}

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
  ucx.max_inflight_gets = Impl::kTransportInflight;
  ucx.lanes = options.lanes;
  ucx.secret = *secret;
  ucx.node_id = options.node_id;
  Impl* raw = impl.get();
  ucx.is_member = [raw](std::string_view node) {
    MutexLock lock(&raw->members_mu);
    return raw->members.count(std::string(node)) > 0;
  };

  auto tier = std::unique_ptr<ClusterTier>(new ClusterTier(std::move(impl)));
  ClusterTier* self = tier.get();
  for (size_t i = 0; i < caches->max_domains(); ++i) {
    Cache* cache = &caches->cache(i);
    auto observer = std::make_shared<FunctionCacheObserver>(
        [self](const PoolRegion& region) {
          (void)self->AddPoolRegion(region);  // a grant peers cannot read still serves here
          return Status::Ok();
        },
        [self](const PoolRegion& region) { self->RemovePoolRegion(region); },
        [raw, cache](const Cache::BlockEvent& e) {
          // The directory names FULL blocks only, hybrid domains' too: it finds the peer, and the peer's lookup
          // applies the hit rule to the windows and states it holds.
          if (e.component == 0 || e.kind == Cache::BlockEvent::kDomainDropped) raw->OnBlockEvent(cache, e);
        });
    cache->AddObserver(observer);
    raw->observers.push_back(std::move(observer));
  }
  raw->threads.emplace_back([raw] { raw->MembershipLoop(); });
  raw->threads.emplace_back([raw] { raw->PublishLoop(); });
  raw->threads.emplace_back([raw] { raw->ServeLoop(); });
  for (uint32_t i = 0; i < options.max_pulls; ++i) raw->threads.emplace_back([raw] { raw->PullLoop(); });
  return tier;
}

Status ClusterTier::AddPoolRegion(const PoolRegion& region) {
  Impl& m = *impl_;
  if (m.stopping.load(std::memory_order_acquire)) return Status::Ok();
  MutexLock lock(&m.regions_mu);
  Impl::Grant& grant = m.regions[reinterpret_cast<uintptr_t>(region.base)];
  grant = Impl::Grant{region.base, region.bytes, {}};
  if (m.transport_up.load(std::memory_order_acquire)) m.RegisterGrant(grant);  // else StartTransport registers it
  return Status::Ok();
}

void ClusterTier::RemovePoolRegion(const PoolRegion& region) {
  cluster::RegisteredRegion gone;
  {
    MutexLock lock(&impl_->regions_mu);
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
    MutexLock lock(&m.pull_mu);
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
    MutexLock lock(&m.stop_mu);
    if (m.stopped) return;
    m.stopped = true;
  }
  m.BeginStop();
  for (size_t i = 0; i < m.caches->max_domains() && i < m.observers.size(); ++i) {
    m.caches->cache(i).RemoveObserver(m.observers[i].get());
  }
  // Pullers end the pull they are in at its next step (each Get ends by its deadline at the latest); the queued
  // ones are answered here.
  for (std::thread& t : m.threads) t.join();
  m.threads.clear();
  std::deque<Impl::PullJob> left;
  {
    MutexLock lock(&m.pull_mu);
    left.swap(m.jobs);
  }
  for (Impl::PullJob& job : left) {
    PrefetchResult r;
    r.local_blocks = job.local;
    r.status = Status::Unavailable("the daemon is stopping");
    job.done(std::move(r));
  }
  {
    MutexLock lock(&m.serve_mu);
    for (Impl::ServeJob& job : m.serve_jobs) job.reply(Status::Unavailable("the node is leaving the cluster"));
    m.serve_jobs.clear();
  }
  // Peers read nothing more from this node's pool (the caches may go before this tier does).
  std::map<uintptr_t, Impl::Grant> regions;
  {
    MutexLock lock(&m.regions_mu);
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
    MutexLock lock(&m.members_mu);
    s.endpoint = m.endpoint;
    s.rdma_devices = m.rdma_devices;
    for (const auto& [id, info] : m.members) {
      s.members.push_back({id, info.epoch, info.transfer_endpoint, id == m.options.node_id});
    }
  }
  {
    MutexLock lock(&m.pub_mu);
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
  s.pulled_entries = m.pulled_entries.load();
  s.pulled_entry_bytes = m.pulled_entry_bytes.load();
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
    MutexLock lock(&m.error_mu);
    s.last_error = m.last_error;
  }
  return s;
}

}  // namespace flexkv
