// See zmq_publisher.h. The wire format is vLLM's (vllm/distributed/kv_events.py), written here from its published
// description: a multipart message [topic, seq (8 bytes, big-endian, per batch from 0), payload], the payload a
// msgpack KVEventBatch encoded array-like: [ts (float64 seconds), [event, ...]], each event a tagged array:
//   ["BlockStored", [hash, ...], parent_hash | nil, [token ids], block_size, lora_id | nil, medium, lora_name | nil,
//    extra_keys | nil, group_idx, kv_cache_spec_kind | nil, kv_cache_spec_sliding_window | nil]
//   ["BlockRemoved", [hash, ...], medium, group_idx]
//   ["AllBlocksCleared"]
// (vLLM's array-like structs: a decoder of an older vLLM that knows fewer fields ignores the trailing ones.) group_idx
// is the component of a hybrid geometry (0: FULL), the spec kind and window say what it is.
// A flexkvd key is a 16-byte msgpack bin: lo then hi, each little-endian (the bytes the key chain hashes).
#include "daemon/events/zmq_publisher.h"

#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "common/log.h"

#if FLEXKV_HAVE_ZMQ
#include <msgpack.h>
#include <zmq.h>
#endif

namespace flexkv {

ZmqKvEventPublisher::ZmqKvEventPublisher(KvEventStream* stream, std::string endpoint, std::string topic)
    : stream_(stream), endpoint_(std::move(endpoint)), topic_(std::move(topic)) {}

#if !FLEXKV_HAVE_ZMQ

Result<std::unique_ptr<ZmqKvEventPublisher>> ZmqKvEventPublisher::Start(KvEventStream*, const std::string& endpoint,
                                                                       const std::string&) {
  return Status::FailedPrecondition(fmt::format(
      "--kv-events-zmq {}: this flexkvd was built without libzmq/msgpack-c (install libzmq3-dev and libmsgpack-dev, "
      "scripts/deps.sh, and rebuild)", endpoint));
}
ZmqKvEventPublisher::~ZmqKvEventPublisher() = default;
void ZmqKvEventPublisher::Stop() {}
void ZmqKvEventPublisher::Run() {}

#else

namespace {

constexpr size_t kMaxBatchEvents = 1024;

void PackKey(msgpack_packer* pk, const BlockKey& key) {
  uint8_t bytes[16];
  for (int i = 0; i < 8; ++i) {
    bytes[i] = static_cast<uint8_t>(key.lo >> (8 * i));
    bytes[8 + i] = static_cast<uint8_t>(key.hi >> (8 * i));
  }
  msgpack_pack_bin(pk, sizeof(bytes));
  msgpack_pack_bin_body(pk, bytes, sizeof(bytes));
}

void PackStr(msgpack_packer* pk, std::string_view s) {
  msgpack_pack_str(pk, s.size());
  msgpack_pack_str_body(pk, s.data(), s.size());
}

std::string_view MediumOf(KvTier tier) { return tier == KvTier::kSsd ? "SSD" : "CPU"; }

// One vLLM event: a run of STORED events of one tier and domain that chain (each the parent of the next) becomes one
// BlockStored; a run of REMOVED events of one tier one BlockRemoved; CLEARED an AllBlocksCleared.
struct EventRun {
  KvEventKind kind;
  KvTier tier;
  uint16_t domain;
  uint8_t component;
  BlockKey parent;
  std::vector<BlockKey> keys;
};

std::vector<EventRun> Coalesce(const std::vector<KvEvent>& events) {
  std::vector<EventRun> runs;
  for (const KvEvent& e : events) {
    if (!runs.empty()) {
      EventRun& r = runs.back();
      const bool same = r.kind == e.kind && r.tier == e.tier && r.domain == e.domain && r.component == e.component &&
                        e.kind != KvEventKind::kCleared;
      // A window or state entry has no parent: consecutive ones of a component are one event.
      if (same && (e.kind == KvEventKind::kRemoved || e.component != 0 || e.parent == r.keys.back())) {
        r.keys.push_back(e.key);
        continue;
      }
    }
    runs.push_back(EventRun{e.kind, e.tier, e.domain, e.component, e.parent, {e.key}});
  }
  return runs;
}

}  // namespace

Result<std::unique_ptr<ZmqKvEventPublisher>> ZmqKvEventPublisher::Start(KvEventStream* stream,
                                                                       const std::string& endpoint,
                                                                       const std::string& topic) {
  std::unique_ptr<ZmqKvEventPublisher> p(new ZmqKvEventPublisher(stream, endpoint, topic));
  p->context_ = zmq_ctx_new();
  if (p->context_ == nullptr) return Status::Internal(fmt::format("zmq_ctx_new: {}", zmq_strerror(zmq_errno())));
  // XPUB: a PUB socket (plain SUB sockets connect to it) that also tells us when a subscriber joins, so that each
  // joining subscriber gets the snapshot (ZMQ's "slow joiner" would otherwise lose what was published before it).
  p->socket_ = zmq_socket(p->context_, ZMQ_XPUB);
  if (p->socket_ == nullptr) return Status::Internal(fmt::format("zmq_socket: {}", zmq_strerror(zmq_errno())));
  const int linger = 0;
  zmq_setsockopt(p->socket_, ZMQ_LINGER, &linger, sizeof(linger));
  const int hwm = 100000;  // messages per subscriber before ZMQ drops for it
  zmq_setsockopt(p->socket_, ZMQ_SNDHWM, &hwm, sizeof(hwm));
  const int verbose = 1;  // every subscription, also a second one to the same topic
  zmq_setsockopt(p->socket_, ZMQ_XPUB_VERBOSE, &verbose, sizeof(verbose));
  if (zmq_bind(p->socket_, endpoint.c_str()) != 0) {
    const int err = zmq_errno();
    const std::string why = zmq_strerror(err);
    return (err == EINVAL || err == EPROTONOSUPPORT || err == ENOENT)
               ? Status::InvalidArgument(fmt::format("--kv-events-zmq {}: {}; expected tcp://HOST:PORT or ipc://PATH",
                                                     endpoint, why))
               : Status::Unavailable(fmt::format("--kv-events-zmq {}: cannot bind: {}", endpoint, why));
  }
  ZmqKvEventPublisher* raw = p.get();
  p->thread_ = std::thread([raw] { raw->Run(); });
  p->thread_started_ = true;
  log::Info("events", "KV events published on {} (topic '{}', vLLM KV-event format)", endpoint, topic);
  return p;
}

ZmqKvEventPublisher::~ZmqKvEventPublisher() {
  Stop();
  if (socket_ != nullptr) {
    (void)zmq_unbind(socket_, endpoint_.c_str());
    zmq_close(socket_);
  }
  if (context_ != nullptr) zmq_ctx_term(context_);
  // An ipc:// endpoint's socket file is ours: leave no stale one behind.
  if (thread_started_ && endpoint_.rfind("ipc://", 0) == 0) ::unlink(endpoint_.c_str() + 6);
}

void ZmqKvEventPublisher::Stop() {
  stop_.store(true, std::memory_order_release);
  if (thread_.joinable()) thread_.join();
}

void ZmqKvEventPublisher::Run() {
  KvEventStream::Reader reader(stream_);
  uint64_t seq = 0;  // the multipart's batch sequence number (vLLM's)
  msgpack_sbuffer buf;
  msgpack_sbuffer_init(&buf);
  const auto publish = [&](const std::vector<KvEvent>& events, bool clear_first) {
    if (events.empty() && !clear_first) return;
    const std::vector<EventRun> runs = Coalesce(events);
    msgpack_sbuffer_clear(&buf);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &buf, msgpack_sbuffer_write);
    msgpack_pack_array(&pk, 2);
    const double ts = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    msgpack_pack_double(&pk, ts);
    msgpack_pack_array(&pk, runs.size() + (clear_first ? 1 : 0));
    if (clear_first) {
      msgpack_pack_array(&pk, 1);
      PackStr(&pk, "AllBlocksCleared");
    }
    for (const EventRun& r : runs) {
      switch (r.kind) {
        case KvEventKind::kStored: {
          const KvEventStream::DomainInfo domain = stream_->Domain(r.domain);
          msgpack_pack_array(&pk, 12);
          PackStr(&pk, "BlockStored");
          msgpack_pack_array(&pk, r.keys.size());
          for (const BlockKey& k : r.keys) PackKey(&pk, k);
          if (r.parent == BlockKey{}) {
            msgpack_pack_nil(&pk);
          } else {
            PackKey(&pk, r.parent);
          }
          msgpack_pack_array(&pk, 0);  // token ids: flexkvd never sees tokens, only their keys
          msgpack_pack_uint32(&pk, domain.tokens_per_block);
          msgpack_pack_nil(&pk);  // lora_id
          PackStr(&pk, MediumOf(r.tier));
          msgpack_pack_nil(&pk);  // lora_name: the adapter is in the keys (docs/protocol.md "Block keys")
          msgpack_pack_nil(&pk);  // extra_keys: likewise
          msgpack_pack_uint32(&pk, r.component);  // group_idx
          if (r.component < domain.components.size()) {
            const KvEventStream::ComponentInfo& c = domain.components[r.component];
            PackStr(&pk, c.spec_kind);
            if (c.sliding_window_tokens != 0) {
              msgpack_pack_uint32(&pk, c.sliding_window_tokens);
            } else {
              msgpack_pack_nil(&pk);
            }
          } else {  // the domain's geometry is unknown (an SSD block of a namespace not attached since the start)
            msgpack_pack_nil(&pk);
            msgpack_pack_nil(&pk);
          }
          break;
        }
        case KvEventKind::kRemoved:
          msgpack_pack_array(&pk, 4);
          PackStr(&pk, "BlockRemoved");
          msgpack_pack_array(&pk, r.keys.size());
          for (const BlockKey& k : r.keys) PackKey(&pk, k);
          PackStr(&pk, MediumOf(r.tier));
          msgpack_pack_uint32(&pk, r.component);  // group_idx
          break;
        case KvEventKind::kCleared:  // never here: Run publishes a dropped domain as a resync
          msgpack_pack_array(&pk, 1);
          PackStr(&pk, "AllBlocksCleared");
          break;
      }
    }
    uint8_t seq_bytes[8];
    for (int i = 0; i < 8; ++i) seq_bytes[i] = static_cast<uint8_t>(seq >> (8 * (7 - i)));
    // ZMQ_DONTWAIT: never block; a PUB socket drops for subscribers past their high-water mark.
    zmq_send(socket_, topic_.data(), topic_.size(), ZMQ_SNDMORE | ZMQ_DONTWAIT);
    zmq_send(socket_, seq_bytes, sizeof(seq_bytes), ZMQ_SNDMORE | ZMQ_DONTWAIT);
    zmq_send(socket_, buf.data, buf.size, ZMQ_DONTWAIT);
    ++seq;
    batches_.fetch_add(1, std::memory_order_relaxed);
    events_.fetch_add(events.size() + (clear_first ? 1 : 0), std::memory_order_relaxed);
  };
  // The view a router had of this node is void: it starts over from AllBlocksCleared and the snapshot. Between the
  // snapshot's batches the events that came meanwhile are read out of the ring (so that a long snapshot under heavy
  // traffic does not overrun the ring while it is published, which would start another snapshot, and so on) and
  // kept in `*after`, to be published after the snapshot's last batch: a subscriber applies the snapshot, then them.
  // kOverrun: the ring was overrun all the same (*behind says by how much; start over); kClosed: the daemon stops.
  enum class Resync { kDone, kOverrun, kClosed };
  const auto resync = [&](std::vector<KvEvent>* after, uint64_t* behind) {
    after->clear();
    KvEventStream::Snapshot snap = reader.TakeSnapshot();
    std::vector<KvEvent> chunk;
    bool first = true;
    for (size_t i = 0; i < snap.blocks.size(); i += kMaxBatchEvents) {
      chunk.assign(snap.blocks.begin() + static_cast<std::ptrdiff_t>(i),
                   snap.blocks.begin() + static_cast<std::ptrdiff_t>(std::min(snap.blocks.size(), i + kMaxBatchEvents)));
      publish(chunk, first);
      first = false;
      // What was stored meanwhile, held until the snapshot is out: at most the snapshot's size plus the ring's
      // capacity (one more means the events come faster than the snapshot goes out: start over, as if overrun).
      const size_t limit = snap.blocks.size() + stream_->capacity();
      const size_t room = after->size() > limit ? 0 : limit - after->size();
      const KvEventStream::Reader::Result r = reader.Read(room + 1, after, behind);
      if (r == KvEventStream::Reader::Result::kClosed) return Resync::kClosed;
      if (r == KvEventStream::Reader::Result::kOverrun) return Resync::kOverrun;
      if (after->size() > limit) {
        *behind = after->size();
        return Resync::kOverrun;
      }
    }
    if (first) publish({}, true);
    return Resync::kDone;
  };
  std::vector<KvEvent> events;
  std::vector<KvEvent> after;  // read from the ring while the last snapshot was published; published next
  bool closed = false;
  const auto resync_until_done = [&](bool fell_behind, uint64_t behind) {
    for (;;) {
      if (fell_behind) {
        log::Warning("events", "ZMQ publisher fell behind by {} events (--kv-events-buffer {}): publishing "
                     "AllBlocksCleared and a snapshot", behind, stream_->capacity());
        resyncs_.fetch_add(1, std::memory_order_relaxed);
      }
      const Resync r = resync(&after, &behind);
      if (r == Resync::kClosed) closed = true;
      if (r != Resync::kOverrun) return;
      fell_behind = true;
    }
  };
  resync_until_done(false, 0);
  uint8_t sub_msg[256];
  while (!closed && !stop_.load(std::memory_order_acquire)) {
    // A subscriber joined (first byte 1: subscribe): everyone gets AllBlocksCleared and the snapshot, which is
    // harmless for those who had the view already and the only way the newcomer gets it.
    bool joined = false;
    for (int n; (n = zmq_recv(socket_, sub_msg, sizeof(sub_msg), ZMQ_DONTWAIT)) > 0;) {
      if (sub_msg[0] == 1) joined = true;
    }
    if (joined) {
      resync_until_done(false, 0);
      continue;
    }
    events.clear();
    if (!after.empty()) {
      events.swap(after);  // read while the last snapshot was published
    } else {
      uint64_t behind = 0;
      const KvEventStream::Reader::Result r = reader.Read(kMaxBatchEvents, &events, &behind);
      if (r == KvEventStream::Reader::Result::kClosed) break;
      if (r == KvEventStream::Reader::Result::kOverrun) {
        resync_until_done(true, behind);
        continue;
      }
    }
    if (events.empty()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      continue;
    }
    // A cleared event (one domain dropped) has no form in vLLM's format but AllBlocksCleared, which would void the
    // other domains' blocks too: the events before it are published, then AllBlocksCleared and a snapshot, so that
    // subscribers end with the daemon's true set (the snapshot holds every event read so far, those after the clear
    // included).
    const auto cleared = std::find_if(events.begin(), events.end(),
                                      [](const KvEvent& e) { return e.kind == KvEventKind::kCleared; });
    const bool full = events.size() >= kMaxBatchEvents;
    for (size_t i = 0; i < static_cast<size_t>(cleared - events.begin()); i += kMaxBatchEvents) {
      const size_t end = std::min(static_cast<size_t>(cleared - events.begin()), i + kMaxBatchEvents);
      publish(std::vector<KvEvent>(events.begin() + static_cast<std::ptrdiff_t>(i),
                                   events.begin() + static_cast<std::ptrdiff_t>(end)),
              false);
    }
    if (cleared != events.end()) {
      log::Info("events", "ZMQ publisher: cache domain '{}' was dropped: publishing AllBlocksCleared and a snapshot "
                "(vLLM's format names no domain)", stream_->Domain(cleared->domain).model_namespace);
      resync_until_done(false, 0);
      continue;
    }
    // Batching: a batch that was not full lets events gather for a moment (fewer reads of the ring's lock).
    if (!full) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  msgpack_sbuffer_destroy(&buf);
}

#endif

}  // namespace flexkv
