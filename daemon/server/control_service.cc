// flexkv.v1.Control handlers; see control_service.h. One handler per RPC sharing the service's helpers (admin
// checks, domain lookups); GetStatus's converters are in status_proto.cc, and SubscribeKvEvents' streams are served
// by KvEventSubscriptions (kv_event_subscriptions.cc).
#include "daemon/server/control_service.h"

#include <algorithm>
#include <atomic>
#include <map>

#include <fmt/format.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <string_view>
#include <utility>
#include <condition_variable>
#include <future>
#include <mutex>
#include <optional>
#include <thread>

#include "common/grpc_convert.h"
#include "common/log.h"
#include "common/version.h"
#include "common/clock.h"
#include "common/units.h"
#include "daemon/events/kv_event_stream.h"
#include "daemon/events/zmq_publisher.h"
#include "daemon/server/status_proto.h"
#include "daemon/tiers/tier_lookup.h"
#include "daemon/tiers/tier_set.h"

namespace flexkv {

namespace {
// How long an Attach waits for a new domain's pool (prepared in the background) before it answers anyway.
constexpr std::chrono::milliseconds kAttachPoolWait{500};
}  // namespace

ControlService::ControlService(ControlContext ctx) : ctx_(ctx) {
  if (ctx_.kv_events != nullptr) {
    kv_subscriptions_ = std::make_unique<KvEventSubscriptions>(
        ctx_.kv_events, ctx_.kv_event_limits, static_cast<uint64_t>(ctx_.started_unix_ms), ctx_.errors);
  }
}

grpc::Status ControlService::Answer(const Status& status) {
  if (!status.ok()) ctx_.errors->Add(status.code());
  return ToGrpc(status);
}

bool ControlService::MaySee(std::string_view model_namespace, const std::optional<PeerCredentials>& peer,
                            bool admin) const {
  if (admin) return true;
  return peer.has_value() && ctx_.access->MayReadDomainNamed(model_namespace, *peer, admin);
}

bool ControlService::IsAdmin(const std::optional<PeerCredentials>& peer) const {
  if (!peer) return false;
  if (peer->uid == 0 || peer->uid == geteuid()) return true;
  return ctx_.admin_gid.has_value() && peer->InGroup(*ctx_.admin_gid);
}

Status ControlService::RequireAdmin(grpc::ServerContext* context, const char* call) const {
  const auto peer = ctx_.peers->Find(context->peer());
  if (IsAdmin(peer)) return Status::Ok();
  const std::string who = peer ? fmt::format("uid {} (pid {})", peer->uid, peer->pid) : std::string("an unknown peer");
  log::Warning("control", "{} refused for {}: not an admin", call, who);
  return Status::PermissionDenied(fmt::format(
      "{} is an admin call; {} is neither root, the daemon's uid {} nor in the admin group{}", call, who, geteuid(),
      ctx_.admin_gid ? fmt::format(" (gid {})", *ctx_.admin_gid) : std::string(" (none configured: --admin-group)")));
}

grpc::Status ControlService::Attach(grpc::ServerContext* context, const v1::AttachRequest* request,
                                    v1::AttachResponse* response) {
  if (request->protocol_version() != kProtocolVersion) {
    return Answer(Status::FailedPrecondition(fmt::format(
        "protocol_version {} is not supported; this daemon (flexkvd {}) speaks {}; use a matching libflexkv",
        request->protocol_version(), kVersion, kProtocolVersion)));
  }
  Status name_ok = CheckName("client_name", request->client_name(), 128, /*may_be_empty=*/true);
  if (!name_ok.ok()) return Answer(name_ok);
  if (!request->has_geometry()) return Answer(Status::InvalidArgument("geometry is missing; expected the KV cache shape"));
  if (!ctx_.lifecycle->admitting()) {
    return Answer(Status::Unavailable("flexkvd is draining; new sessions are refused until an admin runs Resume"));
  }
  const auto peer = ctx_.peers->Find(context->peer());
  if (!peer) return Answer(Status::Internal("cannot identify the calling process (no peer credentials)"));
  const bool admin = IsAdmin(peer);
  // Readers first: a peer that may not use the namespace must not fix the domain either.
  Status readable = ctx_.access->CheckReader(request->model_namespace(), *peer, admin);
  if (!readable.ok()) {
    access_refusal_log_.Warning("control", "Attach from pid {} uid {} refused: {}", peer->pid, peer->uid,
                                readable.message());
    return Answer(readable);
  }
  const Geometry geometry = FromProto(request->geometry());
  Result<SessionRegistry::Grant> grant = Status::Internal("not opened");
  bool read_only = false;
  Cache* cache = nullptr;
  {
    MutexLock lock(&domain_mu_);
    Result<Cache*> admitted = AdmitLocked(request->model_namespace(), geometry, *peer);
    if (!admitted.ok()) {
      log::Info("control", "Attach from pid {} refused: {}", peer->pid, admitted.status().ToString());
      return Answer(admitted.status());
    }
    cache = *admitted;
    const CacheDomain::View view = cache->Domain();
    SessionAccess access = ctx_.access->Decide(request->model_namespace(), *peer, admin, view.creator_uid);
    read_only = !access.may_store();
    SessionIdentity identity{request->client_name(), request->dp_rank(), request->tp_rank(),
                             request->model_namespace(), geometry};
    grant = ctx_.sessions->Open(std::move(identity), *peer, std::move(access));
  }
  if (!grant.ok()) return Answer(grant.status());
  // A new domain's pool is prepared in the background (Cache::SetPrepareInBackground): a small one is ready within
  // this wait, as it always was at Attach; a pool of tens of GiB is not waited for (its first grants serve within
  // seconds, and until then stores are told to retry and matches miss; the rest grows in while it serves).
  (void)cache->WaitForPreparation(kAttachPoolWait);
  // The domain cannot go while this session exists: its fields are the session's domain's.
  const CacheDomain::View view = cache->Domain();
  response->set_session_id(grant->session_id);
  response->set_session_token(grant->token.data(), grant->token.size());
  response->set_block_bytes(view.block_bytes);
  response->set_capacity_blocks(view.capacity_blocks);
  for (size_t c = 0; c < geometry.component_count(); ++c) {
    const std::optional<PoolRegion> sub = cache->pool_region(c);
    // While the pool is being prepared it has no active slot yet: capacity 0, slot sizes from the geometry.
    if (c == 0) response->set_capacity_blocks(sub ? sub->slots : 0);  // a hybrid pool's FULL part is below the budget
    response->add_component_slot_bytes(sub ? sub->slot_bytes : geometry.Component(c).host_block_bytes());
    response->add_component_capacity(sub ? sub->slots : 0);
  }
  response->set_protocol_version(kProtocolVersion);
  response->set_submit_ring_entries(ctx_.data_plane->options().submit_entries);
  response->set_completion_ring_entries(ctx_.data_plane->options().completion_entries);
  response->set_arena_bytes(ctx_.data_plane->options().arena_bytes);
  response->set_read_only(read_only);
  return grpc::Status::OK;
}

Result<Cache*> ControlService::AdmitLocked(const std::string& model_namespace, const Geometry& geometry,
                                           const PeerCredentials& peer) {
  const auto in_use = [this](const std::string& name) { return ctx_.sessions->CountIn(name) != 0; };
  const bool unused = !in_use(model_namespace);
  // A namespace whose blocks a tier keeps across reboots has the owner recorded with them (issue 29 item 5): after a
  // reboot (no pool file) the first uid to attach must not become its owner. Otherwise the first uid to attach creates
  // it.
  const std::optional<uid_t> recorded = ctx_.tiers ? ctx_.tiers->RecordedOwner(model_namespace) : std::nullopt;
  const uid_t creator = recorded.value_or(peer.uid);
  if (Cache* current = ctx_.caches->Find(model_namespace); current != nullptr && unused && !recorded) {
    const CacheDomain::View view = current->Domain();
    if (view.geometry && view.creator_uid && *view.creator_uid != peer.uid &&
        ctx_.access->AclOf(model_namespace) == nullptr &&
        ctx_.caches->DropDomain(model_namespace, /*only_if_empty=*/true, nullptr).ok()) {
      // The same namespace, created by another uid that left without storing a block: its creator decides who
      // writes by default, so an early squatter would make every later engine read-only. The caller creates it.
      log::Info("control",
                "namespace '{}' had no session and no block: its creator uid {} is replaced by pid {}'s uid {}",
                model_namespace, *view.creator_uid, peer.pid, peer.uid);
    }
  }
  // Domains nobody uses and that hold no block are not kept for later sessions (one odd Attach must not lock every
  // engine out): CacheSet drops them when this Attach needs their room.
  std::vector<std::string> replaced;
  Result<Cache*> admitted = ctx_.caches->Admit(model_namespace, geometry, creator, in_use, &replaced);
  for (const std::string& old : replaced) {
    log::Info("control", "cache domain '{}' had no session and no block: replaced by pid {}'s '{}'", old, peer.pid,
              model_namespace);
  }
  if (admitted.ok() || admitted.status().code() != StatusCode::kFailedPrecondition || !unused ||
      ctx_.caches->Find(model_namespace) == nullptr) {
    return admitted;
  }
  // The namespace's domain has another geometry; one nobody uses and that holds no block gives way.
  if (!ctx_.caches->DropDomain(model_namespace, /*only_if_empty=*/true, nullptr).ok()) return admitted;
  log::Info("control", "cache domain '{}' had no session and no block: replaced by pid {}'s '{}'", model_namespace,
            peer.pid, model_namespace);
  return ctx_.caches->Admit(model_namespace, geometry, creator, in_use);
}

uint64_t ControlService::IdleSeconds(const CacheSet::Domain& domain) const {
  if (ctx_.sessions->CountIn(domain.model_namespace) != 0) return 0;
  int64_t since = domain.created_ms;
  if (const std::optional<int64_t> ended = ctx_.sessions->LastEndedMs(domain.model_namespace)) {
    since = std::max(since, *ended);
  }
  return static_cast<uint64_t>(std::max<int64_t>(MonotonicMs() - since, 0) / 1000);
}

grpc::Status ControlService::Detach(grpc::ServerContext* context, const v1::DetachRequest* request,
                                    v1::DetachResponse* /*response*/) {
  if (request->session_id() == 0) return Answer(Status::InvalidArgument("session_id is 0; expected the id from Attach"));
  const std::string& token = request->session_token();
  // An admin may end any session by sending no token; a token, when sent, is always checked (a stale client
  // of an earlier daemon must not end whichever session now has its old id).
  const bool admin = token.empty() && IsAdmin(ctx_.peers->Find(context->peer()));
  if (!admin && token.size() != kSessionTokenBytes) {
    return Answer(Status::InvalidArgument(
        fmt::format("session_token has {} bytes; expected {}", token.size(), kSessionTokenBytes)));
  }
  return Answer(ctx_.sessions->Close(
      request->session_id(), std::span(reinterpret_cast<const uint8_t*>(token.data()), token.size()), admin));
}


grpc::Status ControlService::GetStatus(grpc::ServerContext* context, const v1::GetStatusRequest* /*request*/,
                                       v1::GetStatusResponse* response) {
  // A domain's name, geometry, blocks and counters are shown to its namespace's readers (and admins); the others'
  // count in the totals only.
  const auto peer = ctx_.peers->Find(context->peer());
  const bool admin = IsAdmin(peer);
  response->set_state(ServingStateName(ctx_.lifecycle->state()));
  response->set_version(kVersion);
  response->set_pid(static_cast<uint32_t>(getpid()));
  response->set_uptime_s(static_cast<uint64_t>((MonotonicMs() - ctx_.started_ms) / 1000));
  const std::vector<CacheSet::Domain> domains = ctx_.caches->Domains();
  auto* pool = response->mutable_pool();
  auto* counters = response->mutable_counters();
  uint64_t blocks = 0, evicted = 0;
  std::string backing;
  for (const CacheSet::Domain& d : domains) {
    const CacheDomain::View view = d.cache->Domain();
    const Cache::Stats stats = d.cache->GetStats();
    if (MaySee(d.model_namespace, peer, admin)) {
      v1::DomainStatus* out = response->add_domains();
      out->set_model_namespace(d.model_namespace);
      ToProto(d.geometry, out->mutable_geometry());
      FillPool(view, stats, d.budget_bytes, out->mutable_pool());
      FillPreparation(d.cache->preparation(), out->mutable_pool());
      out->mutable_index()->set_blocks(stats.blocks);
      FillCounters(d.counters, stats.evicted, out->mutable_counters());
      out->set_sessions(static_cast<uint32_t>(ctx_.sessions->CountIn(d.model_namespace)));
      out->set_idle_s(IdleSeconds(d));
      out->set_limit_bytes(d.limit_bytes);
    }
    // The totals.
    pool->set_capacity_blocks(pool->capacity_blocks() + stats.capacity);
    pool->set_used_blocks(pool->used_blocks() + stats.used);
    pool->set_pinned_blocks(pool->pinned_blocks() + stats.pinned);
    pool->set_unverified_blocks(pool->unverified_blocks() + stats.unverified);
    blocks += stats.blocks;
    backing += (backing.empty() ? "" : ", ") + stats.backing;
    evicted += stats.evicted;
  }
  // Every request since start, those of dropped domains included, as before several domains existed.
  FillCounters(ctx_.caches->TotalCounters(), evicted, counters);
  if (domains.size() == 1) {
    // One domain: the top-level fields are its own, as before several domains existed.
    const CacheDomain::View view = domains[0].cache->Domain();
    FillPool(view, domains[0].cache->GetStats(), ctx_.caches->budget_bytes(), pool);
    FillPreparation(domains[0].cache->preparation(), pool);
    if (MaySee(domains[0].model_namespace, peer, admin)) {
      response->set_model_namespace(domains[0].model_namespace);
      ToProto(domains[0].geometry, response->mutable_geometry());
    }
  }
  pool->set_backing(backing);
  pool->set_budget_bytes(ctx_.caches->budget_bytes());
  response->mutable_index()->set_blocks(blocks);
  response->set_sessions(static_cast<uint32_t>(ctx_.sessions->Count()));
  counters->set_errors(errors() + ctx_.data_plane->errors());
  if (ctx_.tiers != nullptr) ctx_.tiers->ReportStatus(response);
  if (ctx_.kv_events != nullptr) {
    auto* ev = response->mutable_kv_events();
    ev->set_instance_id(ctx_.kv_events->instance_id());
    ev->set_last_seq(ctx_.kv_events->last_seq());
    // The gRPC subscriptions as their limits count them (until each call has ended, not only until its end was
    // decided: a uid sees its count go down when it may open another), and the ZMQ publisher.
    const size_t grpc_subscriptions = kv_subscriptions_ != nullptr ? kv_subscriptions_->open() : 0;
    ev->set_subscribers(static_cast<uint32_t>(grpc_subscriptions + (ctx_.kv_events_zmq != nullptr ? 1 : 0)));
    ev->set_cut_off(ctx_.kv_events->cut_off());
    ev->set_buffer_events(ctx_.kv_events->capacity());
    if (ctx_.kv_events_zmq != nullptr) {
      ev->set_zmq_endpoint(ctx_.kv_events_zmq->endpoint());
      ev->set_zmq_batches(ctx_.kv_events_zmq->batches());
      ev->set_zmq_events(ctx_.kv_events_zmq->events());
      ev->set_zmq_resyncs(ctx_.kv_events_zmq->resyncs());
    }
  }
  for (const EngineMemoryBackend* backend : ctx_.backends->List()) {
    auto* out = response->add_backends();
    out->set_name(std::string(backend->name()));
    for (const std::string& device : backend->devices()) out->add_devices(device);
  }
  return grpc::Status::OK;
}

grpc::Status ControlService::ListSessions(grpc::ServerContext* context, const v1::ListSessionsRequest* /*request*/,
                                          v1::ListSessionsResponse* response) {
  // Client names, pids and namespaces say what other users run: a caller who is not an admin sees the
  // sessions of its own uid only (an unidentified caller sees none).
  const auto peer = ctx_.peers->Find(context->peer());
  const bool admin = IsAdmin(peer);
  for (const SessionSnapshot& s : ctx_.sessions->List()) {
    if (!admin && (!peer || s.peer.uid != peer->uid)) continue;
    auto* out = response->add_sessions();
    out->set_session_id(s.id);
    out->set_client_name(s.identity.client_name);
    out->set_pid(static_cast<uint32_t>(s.peer.pid));
    out->set_uid(s.peer.uid);
    out->set_gid(s.peer.gid);
    out->set_dp_rank(s.identity.dp_rank);
    out->set_tp_rank(s.identity.tp_rank);
    out->set_model_namespace(s.identity.model_namespace);
    out->set_state(s.channel_open ? "active" : "attaching");
    out->set_attached_unix_ms(s.attached_unix_ms);
    const DataPlane::SessionStats stats = ctx_.data_plane->StatsOf(s.id);
    out->set_pinned_blocks(stats.pinned_blocks);
    out->set_inflight_requests(stats.inflight_requests);
  }
  return grpc::Status::OK;
}

namespace {

// The families with the samples of the namespaces `may_see` refuses folded into one sample per family and other
// labels, whose namespace label is empty (no namespace, in Prometheus' terms): the totals, not whose they are.
std::vector<prometheus::MetricFamily> FoldHiddenNamespaces(std::vector<prometheus::MetricFamily> families,
                                                           const std::function<bool(const std::string&)>& may_see) {
  for (prometheus::MetricFamily& family : families) {
    std::vector<prometheus::ClientMetric> kept;
    std::map<std::vector<std::pair<std::string, std::string>>, size_t> folded;  // other labels -> index in kept
    for (prometheus::ClientMetric& m : family.metric) {
      const auto ns = std::find_if(m.label.begin(), m.label.end(),
                                   [](const prometheus::ClientMetric::Label& l) { return l.name == "namespace"; });
      if (ns == m.label.end() || may_see(ns->value)) {
        kept.push_back(std::move(m));
        continue;
      }
      ns->value.clear();
      std::vector<std::pair<std::string, std::string>> key;
      for (const auto& l : m.label) key.emplace_back(l.name, l.value);
      auto [it, fresh] = folded.emplace(std::move(key), kept.size());
      if (fresh) {
        kept.push_back(std::move(m));
        continue;
      }
      prometheus::ClientMetric& total = kept[it->second];
      total.counter.value += m.counter.value;
      total.gauge.value += m.gauge.value;
      total.untyped.value += m.untyped.value;
    }
    family.metric = std::move(kept);
  }
  return families;
}

}  // namespace

grpc::Status ControlService::GetMetrics(grpc::ServerContext* context, const v1::GetMetricsRequest* /*request*/,
                                        v1::GetMetricsResponse* response) {
  // Per-namespace samples only for the namespace's readers (and admins), as GetStatus.
  const auto peer = ctx_.peers->Find(context->peer());
  const bool admin = IsAdmin(peer);
  if (admin) {
    response->set_text(ctx_.metrics->Text());
    return grpc::Status::OK;
  }
  const auto may_see = [&](const std::string& model_namespace) { return MaySee(model_namespace, peer, admin); };
  response->set_text(RenderText(FoldHiddenNamespaces(ctx_.metrics->Collect(), may_see)));
  return grpc::Status::OK;
}

grpc::Status ControlService::Match(grpc::ServerContext* context, const v1::MatchRequest* request,
                                   v1::MatchResponse* response) {
  const std::string& token = request->session_token();
  Status authentic = ctx_.sessions->Authenticate(
      request->session_id(), std::span(reinterpret_cast<const uint8_t*>(token.data()), token.size()));
  if (!authentic.ok()) return Answer(authentic);
  // The caller must be a reader itself: holding a reader's session token is not enough.
  const auto peer = ctx_.peers->Find(context->peer());
  if (!peer) return Answer(Status::Internal("cannot identify the calling process (no peer credentials)"));
  // The session's own domain, and its namespace's readers: a session never sees another domain's blocks.
  Result<std::string> model_namespace = ctx_.sessions->NamespaceOf(request->session_id());
  if (!model_namespace.ok()) return Answer(model_namespace.status());
  Status readable = ctx_.access->CheckReader(*model_namespace, *peer, IsAdmin(peer));
  if (!readable.ok()) return Answer(readable);
  Cache* cache = ctx_.caches->Find(*model_namespace);
  if (cache == nullptr) {
    return Answer(Status::FailedPrecondition(fmt::format(
        "the cache domain '{}' this session attached to was dropped by an admin; Attach again", *model_namespace)));
  }
  const std::string& raw = request->keys();
  if (raw.empty() || raw.size() % sizeof(BlockKey) != 0 || raw.size() / sizeof(BlockKey) > 65536) {
    return Answer(Status::InvalidArgument(
        fmt::format("keys has {} bytes; expected 1..65536 keys of 16 bytes each", raw.size())));
  }
  std::vector<BlockKey> keys(raw.size() / sizeof(BlockKey));
  std::memcpy(keys.data(), raw.data(), raw.size());
  // The ring's lookup path: DRAM, then the tiers that promote on match, then DRAM again, so that the answer says what a
  // Load can have now. A drive that hangs must not hang the control plane: after 10 s (or the call's deadline) the
  // answer is what DRAM has; the promotion still ends on its own (the state is shared with its callback).
  struct Answer {
    std::promise<size_t> hit;
  };
  auto answer = std::make_shared<Answer>();
  std::future<size_t> answered = answer->hit.get_future();
  TierLookupRequest lookup;
  lookup.cache = cache;
  lookup.keys = keys;
  static const TierSet kNoTiers;
  MatchThroughTiers(ctx_.tiers != nullptr ? *ctx_.tiers : kNoTiers, *ctx_.lifecycle, std::move(lookup),
                    [answer](size_t hit, std::vector<SlotId>) { answer->hit.set_value(hit); });
  auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(10);
  deadline = std::min(deadline, context->deadline());
  const size_t hit = answered.wait_until(deadline) == std::future_status::ready
                         ? answered.get()
                         : cache->Match(keys, /*pin=*/false, nullptr);
  auto& counters = cache->counters();
  counters.match_requests.fetch_add(1, std::memory_order_relaxed);
  counters.match_blocks.fetch_add(keys.size(), std::memory_order_relaxed);
  counters.hit_blocks.fetch_add(hit, std::memory_order_relaxed);
  response->set_matched_blocks(static_cast<uint32_t>(hit));
  return grpc::Status::OK;
}

Status ControlService::TakeVmmFds(uint64_t session_id, std::span<const uint8_t> token, const v1::CudaKvMemory& cuda,
                                  std::map<uint32_t, std::shared_ptr<UniqueFd>>* fds) {
  // Bounds the work one request can ask of the driver (one cuMemMap per entry).
  constexpr size_t kMaxVmmEntries = 65536;
  size_t entries = 0;
  for (const auto& r : cuda.regions()) entries += static_cast<size_t>(r.vmm_allocations_size());
  Status first_error;
  for (const auto& r : cuda.regions()) {
    for (const auto& a : r.vmm_allocations()) {
      if (fds->contains(a.fd_tag())) continue;
      auto fd = ctx_.sessions->TakeOfferedFd(session_id, token, a.fd_tag());
      if (fd.ok()) {
        fds->emplace(a.fd_tag(), std::make_shared<UniqueFd>(std::move(*fd)));
      } else if (first_error.ok()) {
        first_error = fd.status().WithContext("cuMem/VMM allocation of a cuda region");
      }
    }
  }
  if (entries > kMaxVmmEntries) {
    return Status::InvalidArgument(fmt::format("{} VMM allocation entries in the regions; expected at most {}", entries,
                                               kMaxVmmEntries));
  }
  return first_error;
}

grpc::Status ControlService::RegisterKv(grpc::ServerContext* /*context*/, const v1::RegisterKvRequest* request,
                                        v1::RegisterKvResponse* response) {
  const std::string& token = request->session_token();
  const std::span<const uint8_t> token_bytes(reinterpret_cast<const uint8_t*>(token.data()), token.size());
  Status authentic = ctx_.sessions->Authenticate(request->session_id(), token_bytes);
  if (!authentic.ok()) return Answer(authentic);
  // The offered fds this request names are taken before anything else is checked, so that every refusal below
  // closes them instead of leaving them parked in the session until it ends.
  std::map<uint32_t, std::shared_ptr<UniqueFd>> vmm_fds;
  Result<UniqueFd> host_fd = Status::NotFound("no host memory in the request");
  if (request->memory_case() == v1::RegisterKvRequest::kCuda) {
    Status taken = TakeVmmFds(request->session_id(), token_bytes, request->cuda(), &vmm_fds);
    if (!taken.ok()) return Answer(taken);
  } else if (request->memory_case() == v1::RegisterKvRequest::kHost) {
    host_fd = ctx_.sessions->TakeOfferedFd(request->session_id(), token_bytes, request->host().fd_tag());
    if (!host_fd.ok()) return Answer(host_fd.status());
  }
  KvLayout layout;
  switch (request->layout()) {
    case v1::KV_LAYOUT_LAYER_FIRST: layout = KvLayout::kLayerFirst; break;
    case v1::KV_LAYOUT_BLOCK_FIRST: layout = KvLayout::kBlockFirst; break;
    case v1::KV_LAYOUT_LAYER_BLOCK: layout = KvLayout::kLayerBlock; break;
    case v1::KV_LAYOUT_LAYER_BLOCK_REGIONS: layout = KvLayout::kLayerBlockRegions; break;
    default:
      return Answer(Status::InvalidArgument(fmt::format("layout {} is not valid; expected KV_LAYOUT_LAYER_FIRST, "
                                                        "KV_LAYOUT_BLOCK_FIRST, KV_LAYOUT_LAYER_BLOCK or "
                                                        "KV_LAYOUT_LAYER_BLOCK_REGIONS",
                                                        static_cast<int>(request->layout()))));
  }
  if (request->memory_case() == v1::RegisterKvRequest::kCuda) {
    GpuKvDescription d;
    d.gpu_uuid = request->cuda().gpu_uuid();
    d.layout = layout;
    d.num_blocks = request->num_blocks();
    d.tp_rank = request->cuda().tp_rank();
    for (const auto& r : request->cuda().regions()) {
      GpuKvRegion region{r.ipc_handle(), r.offset(), r.bytes(), {}};
      for (const auto& a : r.vmm_allocations()) region.vmm_allocations.push_back({a.fd_tag(), a.bytes()});
      d.regions.push_back(std::move(region));
    }
    d.vmm_fds = std::move(vmm_fds);
    KvRegistration registration{std::move(d)};
    registration.component = request->component();
    auto bytes = ctx_.data_plane->RegisterKv(request->session_id(), std::move(registration));
    if (!bytes.ok()) {
      log::Warning("control", "RegisterKv (cuda) of session {} refused: {}", request->session_id(), bytes.status().ToString());
      return Answer(bytes.status());
    }
    response->set_bytes_required(*bytes);
    return grpc::Status::OK;
  }
  if (request->memory_case() != v1::RegisterKvRequest::kHost) {
    return Answer(Status::InvalidArgument(
        "memory is missing; expected host (a memfd offered on the session channel) or cuda (IPC handles or VMM fds)"));
  }
  KvRegistration registration{HostKvMemory{std::move(*host_fd), layout, request->num_blocks()}};
  registration.component = request->component();
  auto bytes = ctx_.data_plane->RegisterKv(request->session_id(), std::move(registration));
  if (!bytes.ok()) return Answer(bytes.status());
  response->set_bytes_required(*bytes);
  return grpc::Status::OK;
}

grpc::Status ControlService::RegisterLayerEvents(grpc::ServerContext* /*context*/,
                                                 const v1::RegisterLayerEventsRequest* request,
                                                 v1::RegisterLayerEventsResponse* response) {
  const std::string& token = request->session_token();
  Status authentic = ctx_.sessions->Authenticate(
      request->session_id(), std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(token.data()), token.size()));
  if (!authentic.ok()) return Answer(authentic);
  // Bounds what one request may ask the driver to open before the geometry check looks at it.
  constexpr int kMaxHandles = 64 * 1024;
  int handles = 0;
  for (const auto& r : request->ranks()) handles += r.handles_size();
  if (request->ranks_size() > 256 || handles > kMaxHandles) {
    return Answer(Status::InvalidArgument(fmt::format(
        "{} ranks with {} event handles; expected at most 256 ranks and {} handles (one per layer and TP rank)",
        request->ranks_size(), handles, kMaxHandles)));
  }
  std::vector<LayerEventsRank> ranks;
  for (const auto& r : request->ranks()) {
    LayerEventsRank rank{r.gpu_uuid(), r.tp_rank(), {}};
    rank.handles.assign(r.handles().begin(), r.handles().end());
    ranks.push_back(std::move(rank));
  }
  auto set = ctx_.data_plane->RegisterLayerEvents(request->session_id(), std::move(ranks));
  if (!set.ok()) {
    log::Warning("control", "RegisterLayerEvents of session {} refused: {}", request->session_id(),
                 set.status().ToString());
    return Answer(set.status());
  }
  response->set_event_set(*set);
  return grpc::Status::OK;
}

grpc::Status ControlService::ReleaseLayerEvents(grpc::ServerContext* /*context*/,
                                                const v1::ReleaseLayerEventsRequest* request,
                                                v1::ReleaseLayerEventsResponse* /*response*/) {
  const std::string& token = request->session_token();
  Status authentic = ctx_.sessions->Authenticate(
      request->session_id(), std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(token.data()), token.size()));
  if (!authentic.ok()) return Answer(authentic);
  return Answer(ctx_.data_plane->ReleaseLayerEvents(request->session_id(), request->event_set()));
}

grpc::Status ControlService::Drain(grpc::ServerContext* context, const v1::DrainRequest* /*request*/,
                                   v1::DrainResponse* response) {
  Status allowed = RequireAdmin(context, "Drain");
  if (!allowed.ok()) return Answer(allowed);
  const ServingState state = ctx_.lifecycle->Drain();
  log::Info("control", "Drain requested: state {}, {} request(s) in flight", ServingStateName(state),
            ctx_.lifecycle->inflight());
  response->set_state(ServingStateName(state));
  response->set_inflight_requests(ctx_.lifecycle->inflight());
  return grpc::Status::OK;
}

grpc::Status ControlService::DropDomain(grpc::ServerContext* context, const v1::DropDomainRequest* request,
                                        v1::DropDomainResponse* response) {
  Status allowed = RequireAdmin(context, "DropDomain");
  if (!allowed.ok()) return Answer(allowed);
  if (!request->model_namespace().empty()) {  // it goes into messages: no control characters
    Status name_ok = CheckName("model_namespace", request->model_namespace(), 256);
    if (!name_ok.ok()) return Answer(name_ok);
  }
  MutexLock lock(&domain_mu_);
  const std::vector<CacheSet::Domain> domains = ctx_.caches->Domains();
  std::string names;
  for (const CacheSet::Domain& d : domains) {
    names += fmt::format("{}'{}'", names.empty() ? "" : ", ", d.model_namespace);
  }
  const CacheSet::Domain* target = nullptr;
  if (request->model_namespace().empty()) {
    if (domains.empty()) return Answer(Status::NotFound("no cache domain is set; the first Attach fixes one"));
    if (domains.size() > 1) {
      return Answer(Status::InvalidArgument(fmt::format(
          "model_namespace is empty but there are {} cache domains ({}); expected the namespace of the one to drop",
          domains.size(), names)));
    }
    target = &domains[0];
  } else {
    for (const CacheSet::Domain& d : domains) {
      if (d.model_namespace == request->model_namespace()) target = &d;
    }
    if (target == nullptr) {
      return Answer(Status::NotFound(fmt::format("no cache domain has namespace '{}'; the domains are: {}",
                                                 request->model_namespace(), names.empty() ? "none" : names)));
    }
  }
  const std::string& name = target->model_namespace;
  if (const size_t n = ctx_.sessions->CountIn(name); n != 0) {
    return Answer(Status::FailedPrecondition(fmt::format(
        "{} session(s) are attached to the domain '{}'; expected none: their engines must detach first (flexkvctl "
        "sessions lists them)",
        n, name)));
  }
  if (const uint64_t idle = IdleSeconds(*target); idle < request->min_idle_s()) {
    return Answer(Status::FailedPrecondition(fmt::format(
        "the domain '{}' had a session {} s ago; expected at least min_idle_s {} s without one", name, idle,
        request->min_idle_s())));
  }
  uint64_t dropped = 0;
  // Pinned or reserved blocks (a load or store of its sessions still finishing) refuse it, naming them; the
  // other domains' sessions go on meanwhile.
  Status st = ctx_.caches->DropDomain(name, /*only_if_empty=*/false, &dropped);
  if (!st.ok()) return Answer(st);
  response->set_model_namespace(name);
  response->set_dropped_blocks(dropped);
  return grpc::Status::OK;
}

grpc::Status ControlService::Resume(grpc::ServerContext* context, const v1::ResumeRequest* /*request*/,
                                    v1::ResumeResponse* response) {
  Status allowed = RequireAdmin(context, "Resume");
  if (!allowed.ok()) return Answer(allowed);
  response->set_state(ServingStateName(ctx_.lifecycle->Resume()));
  log::Info("control", "Resume requested: serving");
  return grpc::Status::OK;
}

grpc::Status ControlService::Scrub(grpc::ServerContext* context, const v1::ScrubRequest* request,
                                   v1::ScrubResponse* response) {
  Status allowed = RequireAdmin(context, "Scrub");
  if (!allowed.ok()) return Answer(allowed);
  ScrubOptions options;
  options.max_bytes_per_s = request->max_bytes_per_s();
  options.cancelled = [context] { return context->IsCancelled(); };
  const std::string& name = request->model_namespace();
  if (!name.empty()) {  // it goes into the log and messages: no control characters
    Status name_ok = CheckName("model_namespace", name, 256);
    if (!name_ok.ok()) return Answer(name_ok);
  }
  log::Info("control", "Scrub requested{}{}", name.empty() ? std::string() : fmt::format(" of domain '{}'", name),
            options.max_bytes_per_s == 0 ? std::string()
                                         : fmt::format(" at most {}/s", FormatByteSize(options.max_bytes_per_s)));
  std::vector<size_t> slots;
  std::string names;
  for (const CacheSet::Domain& d : ctx_.caches->Domains()) {
    names += fmt::format("{}'{}'", names.empty() ? "" : ", ", d.model_namespace);
    if (name.empty() || d.model_namespace == name) slots.push_back(d.slot);
  }
  if (!name.empty() && slots.empty()) {
    return Answer(Status::NotFound(fmt::format("no cache domain has namespace '{}'; the domains are: {}", name,
                                               names.empty() ? "none" : names)));
  }
  if (slots.empty()) slots.push_back(0);  // no domain: the verifier says there is nothing to scrub
  Result<ScrubReport> report = ScrubReport{};
  for (size_t slot : slots) {
    Result<ScrubReport> one = ctx_.caches->verifier(slot).Scrub(options);
    if (!one.ok()) {
      // A domain dropped since the list was taken has nothing left to check.
      if (slots.size() > 1 && one.status().code() == StatusCode::kFailedPrecondition) continue;
      return Answer(one.status());
    }
    report->checked_blocks += one->checked_blocks;
    report->failed_blocks += one->failed_blocks;
    report->dropped_blocks += one->dropped_blocks;
    report->bytes += one->bytes;
    report->seconds += one->seconds;
  }
  response->set_checked_blocks(report->checked_blocks);
  response->set_failed_blocks(report->failed_blocks);
  response->set_dropped_blocks(report->dropped_blocks);
  response->set_bytes(report->bytes);
  response->set_seconds(report->seconds);
  return grpc::Status::OK;
}

}  // namespace flexkv

namespace flexkv {

grpc::ServerWriteReactor<v1::KvEventBatch>* ControlService::SubscribeKvEvents(
    grpc::CallbackServerContext* context, const v1::SubscribeKvEventsRequest* request) {
  if (kv_subscriptions_ == nullptr) {
    return KvEventSubscriptions::Refuse(Answer(Status::Unavailable("this daemon serves no KV event stream")));
  }
  const auto peer = ctx_.peers->Find(context->peer());
  if (!peer) return KvEventSubscriptions::Refuse(Answer(Status::Internal("cannot identify the calling process (no peer credentials)")));
  // A subscriber sees the events of the namespaces it may read (admins: all), snapshot and live alike: the keys say
  // which prompts are cached.
  const bool admin = IsAdmin(peer);
  const NamespaceAccess* access = ctx_.access;
  auto readable = [access, who = *peer, admin](std::string_view domain_name) {
    return access->MayReadDomainNamed(domain_name, who, admin);
  };
  return kv_subscriptions_->Subscribe(context, *request, peer->uid, std::move(readable));
}

}  // namespace flexkv
