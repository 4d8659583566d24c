// See flexkv/kv_events.h. A channel of its own per subscription, with a small receive window: a subscriber that
// does not read holds back the daemon's writer soon, so that the daemon sees it fall behind and cuts it off with
// the reason, instead of the transport buffering megabytes for it.
#include "flexkv/kv_events.h"

#include <fmt/format.h>
#include <grpcpp/grpcpp.h>

#include <optional>
#include <thread>

#include "common/grpc_convert.h"
#include "common/paths.h"
#include "common/uds.h"
#include "flexkv/v1/control.grpc.pb.h"

namespace flexkv {

struct KvEventSubscription::Impl {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Control::Stub> stub;
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<v1::KvEventBatch>> reader;
  std::optional<Status> ended;
};

namespace {

std::string CauseName(v1::KvEvent::Cause cause) {
  switch (cause) {
    case v1::KvEvent::STORE: return "store";
    case v1::KvEvent::PROMOTED: return "promoted";
    case v1::KvEvent::PULLED: return "pulled";
    case v1::KvEvent::RESTORED: return "restored";
    case v1::KvEvent::WRITTEN_BACK: return "written_back";
    case v1::KvEvent::EVICTED: return "evicted";
    case v1::KvEvent::DROPPED: return "dropped";
    case v1::KvEvent::DOMAIN_DROPPED: return "domain_dropped";
    default: return "unknown";
  }
}

}  // namespace

KvEventSubscription::KvEventSubscription(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

KvEventSubscription::~KvEventSubscription() {
  if (impl_->reader && !impl_->ended) {
    impl_->context.TryCancel();
    (void)impl_->reader->Finish();
  }
}

Result<std::unique_ptr<KvEventSubscription>> KvEventSubscription::Open(const ConnectOptions& connect,
                                                                       const KvSubscribeOptions& options) {
  if (options.max_batch_events > 65536) {
    return Status::InvalidArgument(
        fmt::format("max_batch_events {}: expected 0 (the daemon's default) to 65536", options.max_batch_events));
  }
  const std::string socket_path = ResolveSocketPath(connect.socket_path);
  const auto deadline = std::chrono::steady_clock::now() + connect.connect_timeout;
  for (;;) {
    auto probe = ConnectUnix(socket_path);
    if (probe.ok()) break;
    const StatusCode code = probe.status().code();
    if (code != StatusCode::kNotFound && code != StatusCode::kUnavailable) return probe.status();
    if (std::chrono::steady_clock::now() >= deadline) {
      return Status::Unavailable(fmt::format("{} (waited {} ms)", probe.status().message(), connect.connect_timeout.count()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  auto impl = std::make_unique<Impl>();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);                    // keep the window small ...
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 256 << 10);  // ... a few batches ahead at most
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);           // a connection of its own
  impl->channel = grpc::CreateCustomChannel("unix:" + socket_path, grpc::InsecureChannelCredentials(), args);
  impl->stub = v1::Control::NewStub(impl->channel);
  v1::SubscribeKvEventsRequest request;
  request.set_max_batch_events(options.max_batch_events);
  request.set_skip_snapshot(options.skip_snapshot);
  impl->reader = impl->stub->SubscribeKvEvents(&impl->context, request);
  return std::unique_ptr<KvEventSubscription>(new KvEventSubscription(std::move(impl)));
}

Result<KvEventBatch> KvEventSubscription::Next() {
  if (impl_->ended) return *impl_->ended;
  v1::KvEventBatch b;
  if (!impl_->reader->Read(&b)) {
    const grpc::Status st = impl_->reader->Finish();
    Status s = FromGrpc(st);
    if (s.ok()) s = Status::Unavailable("the daemon ended the KV event stream; subscribe again");
    impl_->ended = s;
    return s;
  }
  KvEventBatch out;
  out.instance_id = b.instance_id();
  out.started_unix_ms = b.started_unix_ms();
  out.snapshot = b.snapshot();
  out.snapshot_end = b.snapshot_end();
  out.snapshot_seq = b.snapshot_seq();
  out.head_seq = b.head_seq();
  out.position = b.position();
  out.events.reserve(b.events_size());
  for (const v1::KvEvent& e : b.events()) {
    KvBlockEvent ev;
    ev.seq = e.seq();
    ev.kind = static_cast<KvBlockEvent::Kind>(e.kind());
    ev.tier = static_cast<KvBlockEvent::Tier>(e.tier());
    ev.key = BlockKey{e.key_lo(), e.key_hi()};
    ev.parent = BlockKey{e.parent_lo(), e.parent_hi()};
    ev.model_namespace = e.model_namespace();
    ev.tokens_per_block = e.tokens_per_block();
    ev.cause = CauseName(e.cause());
    ev.component = e.component();
    ev.kv_cache_spec_kind = e.kv_cache_spec_kind();
    ev.sliding_window_tokens = e.sliding_window_tokens();
    out.events.push_back(std::move(ev));
  }
  return out;
}

void KvEventSubscription::Cancel() { impl_->context.TryCancel(); }

}  // namespace flexkv
