// KvEventSubscriptions: the gRPC SubscribeKvEvents calls (docs/kv_events.md), served through gRPC's callback API
// and one feeder thread — never a thread per stream. Each call is a write reactor that holds one batch in flight; the
// next batch is built when the last one is written (on gRPC's thread) or, for a subscriber waiting for events, by the
// feeder, which sleeps until an event is appended, a batch is due, or a write has been stalled for the watchdog's
// 10 s. Subscriptions are bounded per uid and in total; each sees the events of the namespaces its uid may read.
#pragma once

#include <grpcpp/server_context.h>
#include <grpcpp/support/server_callback.h>
#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>

#include "daemon/events/kv_event_stream.h"
#include "daemon/metrics/request_metrics.h"
#include "flexkv/v1/control.pb.h"

namespace flexkv {

// How many event subscriptions may be open at once (flexkvd --kv-events-max-subscribers-per-uid and
// --kv-events-max-subscribers; docs/kv_events.md "Limits").
struct KvSubscriptionLimits {
  uint32_t per_uid = 64;
  uint32_t total = 1024;
};

class KvEventSubscriptions {
 public:
  // Whether the subscriber may see a domain's events, by the domain's name in the stream (a namespace, or "#<hash>"
  // for an SSD-only domain). Called once per domain per subscription, on the feeder's or a gRPC thread.
  using ReadableFn = std::function<bool(std::string_view domain_name)>;

  // `stream` and `errors` (where refusals and errors are counted by code) outlive this. Starts the feeder thread.
  KvEventSubscriptions(KvEventStream* stream, KvSubscriptionLimits limits, uint64_t started_unix_ms,
                       ErrorCounts* errors);
  // Stops the feeder. Destroy after the gRPC server has shut down (every call ended).
  ~KvEventSubscriptions();
  KvEventSubscriptions(const KvEventSubscriptions&) = delete;
  KvEventSubscriptions& operator=(const KvEventSubscriptions&) = delete;

  // The reactor of one call of `uid`: RESOURCE_EXHAUSTED naming the limit and its flag when the uid or the daemon
  // has as many subscriptions as allowed; otherwise a subscription (a snapshot unless the request skips it, then the
  // events) whose events are those of the domains `readable` allows.
  grpc::ServerWriteReactor<v1::KvEventBatch>* Subscribe(grpc::CallbackServerContext* context,
                                                        const v1::SubscribeKvEventsRequest& request, uid_t uid,
                                                        ReadableFn readable);
  // A reactor that ends the call at once with `status`.
  static grpc::ServerWriteReactor<v1::KvEventBatch>* Refuse(grpc::Status status);

  // Subscriptions open now (admitted and not yet ended).
  size_t open() const;
  const KvSubscriptionLimits& limits() const { return limits_; }

  class Feeder;
  class Subscriber;

 private:
  const KvSubscriptionLimits limits_;
  std::shared_ptr<Feeder> feeder_;
};

}  // namespace flexkv
