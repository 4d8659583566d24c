// The daemon's KV event stream (docs/kv_events.md): every block stored in or removed from a tier (DRAM, SSD), with
// its key, parent, tier and cache domain, numbered per daemon instance. A subscription first yields a snapshot of
// every key per tier, then the events after it; applying both gives exactly what the daemon holds.
//
//   auto sub = flexkv::KvEventSubscription::Open({}, {});
//   while (true) {
//     auto batch = (*sub)->Next();
//     if (!batch.ok()) break;  // RESOURCE_EXHAUSTED: fell behind (resubscribe); UNAVAILABLE: the daemon stopped
//     if (batch->instance_id != last_instance) { /* a restart: clear the view, the snapshot rebuilds it */ }
//     for (const auto& e : batch->events) { ... }
//   }
//
// Thread safety: Next is called from one thread at a time; Cancel may be called from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "flexkv/block_key.h"
#include "flexkv/client.h"
#include "flexkv/status.h"

namespace flexkv {

struct KvBlockEvent {
  enum class Kind : uint8_t { kStored = 0, kRemoved = 1, kCleared = 2 };  // kCleared: every key of the domain in the tier
  enum class Tier : uint8_t { kDram = 0, kSsd = 1 };
  uint64_t seq = 0;  // per daemon instance, increasing; 0 in a snapshot
  Kind kind = Kind::kStored;
  Tier tier = Tier::kDram;
  BlockKey key;
  BlockKey parent;  // kStored: the parent key (zero: a prompt's first block)
  std::string model_namespace;
  uint32_t tokens_per_block = 0;  // the domain's (0: unknown)
  std::string cause;  // "store", "promoted", "pulled", "restored", "written_back", "evicted", "dropped", "domain_dropped"
  // Hybrid geometries (docs/hybrid.md): the component of the domain's geometry the entry belongs to (0: full attention;
  // vLLM's KV cache group index), its kind as vLLM's events name it ("full_attention", "mla_attention",
  // "sliding_window", "mamba"; empty: unknown) and a sliding window's tokens. A window or state entry has no parent.
  uint32_t component = 0;
  std::string kv_cache_spec_kind;
  uint32_t sliding_window_tokens = 0;
};

struct KvEventBatch {
  uint64_t instance_id = 0;      // random per daemon start: a new one means the daemon restarted
  uint64_t started_unix_ms = 0;
  bool snapshot = false;         // the events are the snapshot (kStored, seq 0)
  bool snapshot_end = false;     // the snapshot's last batch
  uint64_t snapshot_seq = 0;     // the snapshot holds every event up to this seq
  uint64_t head_seq = 0;         // the daemon's last seq when the batch was read
  uint64_t position = 0;         // every event up to this seq has been delivered (or is in the snapshot)
  std::vector<KvBlockEvent> events;
};

struct KvSubscribeOptions {
  uint32_t max_batch_events = 0;  // 0: the daemon's default (1024); at most 65536
  bool skip_snapshot = false;     // only what happens from now on
};

class KvEventSubscription {
 public:
  // Connects (ConnectOptions: socket, connect timeout) and subscribes. UNAVAILABLE when no daemon answers.
  static Result<std::unique_ptr<KvEventSubscription>> Open(const ConnectOptions& connect,
                                                           const KvSubscribeOptions& options);
  ~KvEventSubscription();  // cancels the stream
  KvEventSubscription(const KvEventSubscription&) = delete;
  KvEventSubscription& operator=(const KvEventSubscription&) = delete;

  // The next batch; blocks until there is one (the daemon sends one at least every second). Once the stream has
  // ended every call answers why: RESOURCE_EXHAUSTED (fell behind the daemon's event buffer; the message says by how
  // much: open a new subscription), UNAVAILABLE (the daemon stopped or restarted), CANCELLED (Cancel).
  Result<KvEventBatch> Next();
  // Ends the stream; a Next blocked in another thread returns CANCELLED.
  void Cancel();

 private:
  struct Impl;
  explicit KvEventSubscription(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace flexkv
