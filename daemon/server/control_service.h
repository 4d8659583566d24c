// ControlService: flexkv.v1.Control over gRPC. Validates every request, checks admin rights and namespace access
// (NamespaceAccess) from the caller's SO_PEERCRED identity (PeerTable), and answers from the daemon's parts.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>

#include "common/log.h"
#include "daemon/cache/cache.h"
#include "daemon/cache/cache_set.h"
#include "daemon/dataplane/data_plane.h"
#include "daemon/lifecycle/lifecycle.h"
#include "daemon/server/daemon_metrics.h"
#include "daemon/metrics/request_metrics.h"
#include "daemon/server/kv_event_subscriptions.h"
#include "daemon/server/peer_table.h"
#include "daemon/sessions/namespace_access.h"
#include "daemon/sessions/session_registry.h"
#include "daemon/transfer/engine_memory_backends.h"
#include "flexkv/v1/control.grpc.pb.h"

namespace flexkv {

class TierSet;
class KvEventStream;
class ZmqKvEventPublisher;

// The daemon's parts the control plane answers from. All outlive the service.
struct ControlContext {
  CacheSet* caches;  // the cache domains, each with its verifier (Scrub)
  DataPlane* data_plane;
  const EngineMemoryBackends* backends;  // what Status lists
  SessionRegistry* sessions;
  Lifecycle* lifecycle;
  PeerTable* peers;
  std::optional<gid_t> admin_gid;
  int64_t started_ms;  // monotonic
  ErrorCounts* errors;  // where the service counts its answers with an error, by code
  const DaemonMetrics* metrics;  // what GetMetrics renders
  const NamespaceAccess* access;  // who may read and write a namespace, checked at Attach and Match
  const TierSet* tiers = nullptr;  // the tiers below DRAM: each reports its status; a gRPC Match continues into those
                                  // that promote (the ring's lookup path); namespace owners they recorded
  KvEventStream* kv_events = nullptr;   // the KV event stream (SubscribeKvEvents, GetStatus kv_events)
  const ZmqKvEventPublisher* kv_events_zmq = nullptr;  // its ZMQ publisher, when --kv-events-zmq is set
  int64_t started_unix_ms = 0;
  KvSubscriptionLimits kv_event_limits;  // --kv-events-max-subscribers-per-uid, --kv-events-max-subscribers
};

// SubscribeKvEvents uses gRPC's callback API (KvEventSubscriptions: no thread per stream); the other calls are
// synchronous.
class ControlService final : public v1::Control::WithCallbackMethod_SubscribeKvEvents<v1::Control::Service> {
 public:
  explicit ControlService(ControlContext ctx);

  grpc::Status Attach(grpc::ServerContext* context, const v1::AttachRequest* request,
                      v1::AttachResponse* response) override;
  grpc::Status Detach(grpc::ServerContext* context, const v1::DetachRequest* request,
                      v1::DetachResponse* response) override;
  grpc::Status GetStatus(grpc::ServerContext* context, const v1::GetStatusRequest* request,
                         v1::GetStatusResponse* response) override;
  grpc::Status ListSessions(grpc::ServerContext* context, const v1::ListSessionsRequest* request,
                            v1::ListSessionsResponse* response) override;
  grpc::Status GetMetrics(grpc::ServerContext* context, const v1::GetMetricsRequest* request,
                          v1::GetMetricsResponse* response) override;
  grpc::Status Match(grpc::ServerContext* context, const v1::MatchRequest* request,
                     v1::MatchResponse* response) override;
  grpc::Status RegisterKv(grpc::ServerContext* context, const v1::RegisterKvRequest* request,
                          v1::RegisterKvResponse* response) override;
  grpc::Status RegisterLayerEvents(grpc::ServerContext* context, const v1::RegisterLayerEventsRequest* request,
                                   v1::RegisterLayerEventsResponse* response) override;
  grpc::Status ReleaseLayerEvents(grpc::ServerContext* context, const v1::ReleaseLayerEventsRequest* request,
                                  v1::ReleaseLayerEventsResponse* response) override;
  grpc::Status Drain(grpc::ServerContext* context, const v1::DrainRequest* request,
                     v1::DrainResponse* response) override;
  grpc::Status Resume(grpc::ServerContext* context, const v1::ResumeRequest* request,
                      v1::ResumeResponse* response) override;
  grpc::Status DropDomain(grpc::ServerContext* context, const v1::DropDomainRequest* request,
                          v1::DropDomainResponse* response) override;
  grpc::Status Scrub(grpc::ServerContext* context, const v1::ScrubRequest* request,
                     v1::ScrubResponse* response) override;
  grpc::ServerWriteReactor<v1::KvEventBatch>* SubscribeKvEvents(grpc::CallbackServerContext* context,
                                                                const v1::SubscribeKvEventsRequest* request) override;

  // Requests answered with an error (the `errors` counter).
  uint64_t errors() const { return ctx_.errors->Total(); }

 private:
  // Root, the daemon's own uid, or a member of --admin-group. Unknown peers are not admins.
  bool IsAdmin(const std::optional<PeerCredentials>& peer) const;
  Status RequireAdmin(grpc::ServerContext* context, const char* call) const;
  // Takes every offered fd the cuda memory's VMM allocations name (each tag once) into `fds`, even when some
  // are missing (NOT_FOUND for the first) or there are too many entries (INVALID_ARGUMENT): what was taken
  // closes with `fds`.
  Status TakeVmmFds(uint64_t session_id, std::span<const uint8_t> token, const v1::CudaKvMemory& cuda,
                    std::map<uint32_t, std::shared_ptr<UniqueFd>>* fds);
  grpc::Status Answer(const Status& status);
  // CacheSet::Admit, replacing a domain that has no session and no block when the caller's needs its room or its
  // namespace with another geometry (or, without a config ACL, another creator uid).
  Result<Cache*> AdmitLocked(const std::string& model_namespace, const Geometry& geometry, const PeerCredentials& peer)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(domain_mu_);
  // Seconds since the last session of the domain ended or it was created; 0 while one is attached.
  uint64_t IdleSeconds(const CacheSet::Domain& domain) const;

  // Whether the caller may see the blocks, sessions and counters of `model_namespace` (a reader of it, or an admin):
  // GetStatus and GetMetrics show the others' only in totals.
  bool MaySee(std::string_view model_namespace, const std::optional<PeerCredentials>& peer, bool admin) const;

  ControlContext ctx_;
  std::unique_ptr<KvEventSubscriptions> kv_subscriptions_;  // when the daemon serves KV events
  // Serializes an Attach's admission and session opening with DropDomain: a domain is dropped only while no
  // session of it exists, and none can appear halfway.
  Mutex domain_mu_;
  log::RateLimited access_refusal_log_;  // Attach refused by a namespace's readers
};

}  // namespace flexkv
