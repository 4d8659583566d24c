// KvEventStream: the daemon's KV event stream (issue 20, docs/kv_events.md). Every block that becomes matchable
// in a tier or leaves it is appended as one event with a per-daemon sequence number; subscribers (the gRPC
// SubscribeKvEvents call, the ZMQ publisher) read it from a bounded ring at their own pace and start with a
// snapshot of every key per tier that is consistent with the sequence number they continue from.
//
// The data path only appends: O(1), one short lock that readers hold only to copy events out, at most 256 at a time
// (never while doing I/O), and nothing at all while no one is subscribed. A reader that falls further behind than the ring holds is
// cut off (Read answers kOverrun with how far behind it was); it resubscribes and gets a fresh snapshot.
// Thread-safe.
#pragma once

#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"
#include "flexkv/block_key.h"

namespace flexkv {

enum class KvTier : uint8_t { kDram = 0, kSsd = 1 };
enum class KvEventKind : uint8_t {
  kStored = 0,   // the key became matchable in the tier
  kRemoved = 1,  // the key left the tier
  kCleared = 2,  // every key of the domain left the tier (a dropped domain); key and parent are zero
};
// Why, where the daemon knows it (docs/kv_events.md).
enum class KvEventCause : uint8_t {
  kUnknown = 0,
  kStored = 1,         // an engine's Store (DRAM)
  kPromoted = 2,       // read back from SSD into DRAM for a match
  kPulled = 3,         // pulled from a peer (cluster tier)
  kRestored = 4,       // restored at start and verified (DRAM), or found on SSD at open
  kWrittenBack = 5,    // demoted: written from DRAM to SSD
  kEvicted = 6,        // evicted to make room
  kDropped = 7,        // dropped: failed its checksum, or erased
  kDomainDropped = 8,  // an admin dropped the domain
};
std::string_view KvTierName(KvTier tier);
std::string_view KvEventKindName(KvEventKind kind);
std::string_view KvEventCauseName(KvEventCause cause);

struct KvEvent {
  uint64_t seq = 0;     // 1, 2, ... per daemon instance; 0 in a snapshot
  BlockKey key;
  BlockKey parent;      // zero: a prompt's first block, or unknown (removals)
  uint16_t domain = 0;  // KvEventStream::Domain(id)
  uint16_t source = 0;  // which part appended it (snapshot bookkeeping)
  KvEventKind kind = KvEventKind::kStored;
  KvTier tier = KvTier::kDram;
  KvEventCause cause = KvEventCause::kUnknown;
  // The component of a hybrid geometry (docs/hybrid.md): 0 FULL, else its window or state entry (vLLM's KV cache
  // group index); DomainInfo::components says what kind it is.
  uint8_t component = 0;
};

// An allocator whose large blocks (64 KiB and more) are anonymous mappings of their own, unmapped when freed: the
// memory a subscriber held for its snapshot and its queue goes back to the system the moment its stream ends, instead
// of staying in malloc's heap (where a freed large vector usually stays: glibc raises its mmap threshold to the size
// of the largest mapping freed, so that the next vectors come from the heap and are never returned).
template <typename T>
struct PageBackedAllocator {
  using value_type = T;
  PageBackedAllocator() = default;
  template <typename U>
  PageBackedAllocator(const PageBackedAllocator<U>& /*other*/) {}  // NOLINT: converting, as allocators are
  static constexpr size_t kMappedBytes = 64 << 10;
  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes < kMappedBytes) return std::allocator<T>().allocate(n);
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes < kMappedBytes) return std::allocator<T>().deallocate(p, n);
    munmap(p, bytes);
  }
  template <typename U>
  bool operator==(const PageBackedAllocator<U>& /*other*/) const { return true; }
};
using KvEventVector = std::vector<KvEvent, PageBackedAllocator<KvEvent>>;

class KvEventStream {
 public:
  // `capacity`: events the ring holds (rounded up to a power of two, at least 64). `instance_id`: this daemon
  // instance (random per start; subscribers see a restart as a new id).
  KvEventStream(size_t capacity, uint64_t instance_id);
  KvEventStream(const KvEventStream&) = delete;
  KvEventStream& operator=(const KvEventStream&) = delete;

  uint64_t instance_id() const { return instance_id_; }
  size_t capacity() const { return capacity_; }

  // --- Appending (the data path) ---
  // Whether anyone is subscribed; Append is a no-op otherwise. Sources call Append under the lock that orders their
  // own events (see AddSource), so that a snapshot taken under that lock is consistent with the sequence numbers.
  bool active() const { return subscribers_.load(std::memory_order_relaxed) > 0; }
  void Append(KvEvent event);  // assigns event.seq

  // --- Waiting (the gRPC subscriptions' feeder thread) ---
  // Blocks until an event after `after_seq` was appended (nullopt: events do not end the wait), Wake() was called,
  // the stream closed, or `timeout` passed, whichever comes first. True when events after `after_seq` exist. An Append
  // wakes a waiter for events at most once per wait (a flag it reads under the ring's lock it holds anyway): appends
  // stay O(1) while no one waits for events, and cost one notification per wait when someone does.
  bool WaitForEvents(std::optional<uint64_t> after_seq, std::chrono::milliseconds timeout);
  // Ends the waits now (a new subscriber, or one with events left to send, wants the feeder to look).
  void Wake();

  // Domains: an id per (namespace) seen, for the events' `domain`. Cheap after the first call per name.
  // One component of the domain's geometry, as vLLM's KV events name its KV cache group.
  struct ComponentInfo {
    std::string spec_kind;               // "full_attention", "mla_attention", "sliding_window", "mamba"
    uint32_t sliding_window_tokens = 0;  // "sliding_window": its window; 0 otherwise
  };
  struct DomainInfo {
    std::string model_namespace;
    uint32_t tokens_per_block = 0;  // 0: unknown (an SSD block of a domain not attached since the start)
    std::vector<ComponentInfo> components;  // empty: unknown
  };
  // `components` (when not empty) replaces what is known of the namespace's components (a dropped domain's namespace
  // may come back with another geometry).
  uint16_t InternDomain(std::string_view model_namespace, uint32_t tokens_per_block,
                        std::vector<ComponentInfo> components = {});
  // The id of the domain whose namespace hashes (XXH3-64, SsdDomain) to `namespace_hash`; a name "#<hex>" when the
  // namespace was never seen.
  uint16_t DomainByHash(uint64_t namespace_hash);
  DomainInfo Domain(uint16_t id) const;

  // --- Snapshot sources ---
  // A part whose keys a snapshot lists: `visit` takes the lock its appends happen under, calls sink.Mark() while it
  // holds it, then sink.Add() for each key it holds now. Register every source before anyone subscribes. Returns
  // the source id its events carry.
  class SnapshotSink {
   public:
    virtual ~SnapshotSink() = default;
    virtual void Mark() = 0;
    virtual void Add(KvTier tier, uint16_t domain, const BlockKey& key, const BlockKey& parent,
                     uint8_t component = 0) = 0;
  };
  uint16_t AddSource(std::function<void(SnapshotSink&)> visit);

  // --- Reading ---
  struct Snapshot {
    uint64_t seq = 0;             // the snapshot holds every event up to here; reading continues after it
    std::vector<uint64_t> marks;  // per source: the last seq its part of the snapshot holds
    KvEventVector blocks;         // kStored, seq 0
  };
  // A subscription: counts as a subscriber while it lives (appends happen from its construction on).
  class Reader {
   public:
    explicit Reader(KvEventStream* stream);
    ~Reader();
    Reader(const Reader&) = delete;
    Reader& operator=(const Reader&) = delete;
    // Takes a snapshot and positions the reader after it.
    Snapshot TakeSnapshot();
    // Positions the reader at the head without a snapshot (what comes from now on).
    void StartAtHead();
    enum class Result { kOk, kOverrun, kClosed };
    // Appends up to `max` events after the reader's position to `out` (events a snapshot already holds are skipped)
    // and moves on. kOverrun: the events after the position were overwritten; `*behind` says how many were lost.
    Result Read(size_t max, std::vector<KvEvent>* out, uint64_t* behind);
    Result Read(size_t max, KvEventVector* out, uint64_t* behind);
    uint64_t position() const { return next_ - 1; }  // the last seq consumed (or skipped)

   private:
    template <typename Out>
    Result ReadInto(size_t max, Out* out, uint64_t* behind);
    KvEventStream* stream_;
    uint64_t next_ = 1;
    std::vector<uint64_t> marks_;
  };

  uint64_t last_seq() const;
  uint32_t subscribers() const { return subscribers_.load(std::memory_order_relaxed); }
  uint64_t cut_off() const { return cut_off_.load(std::memory_order_relaxed); }
  // Counts a subscriber cut off for a reason the ring does not see (it holds more than its limit); a Reader that
  // fell behind the ring is counted by Read.
  void CountCutOff() { cut_off_.fetch_add(1, std::memory_order_relaxed); }
  // Readers from now on answer kClosed (the daemon stops).
  void Close() {
    closed_.store(true, std::memory_order_release);
    Wake();
  }
  bool closed() const { return closed_.load(std::memory_order_acquire); }

 private:
  const uint64_t instance_id_;
  const size_t capacity_;  // a power of two
  std::atomic<uint32_t> subscribers_{0};
  std::atomic<uint64_t> cut_off_{0};
  std::atomic<bool> closed_{false};
  mutable Mutex mu_;  // the ring: appends and copies out, nothing else
  std::vector<KvEvent> ring_ ABSL_GUARDED_BY(mu_);
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 1;
  std::condition_variable appended_;           // WaitForEvents, with mu_
  bool waiting_ ABSL_GUARDED_BY(mu_) = false;  // a WaitForEvents for events wants the next Append to notify
  bool woken_ ABSL_GUARDED_BY(mu_) = false;    // Wake() since the last wait began
  mutable Mutex domains_mu_;
  std::vector<DomainInfo> domains_ ABSL_GUARDED_BY(domains_mu_);
  std::unordered_map<uint64_t, uint16_t> by_hash_ ABSL_GUARDED_BY(domains_mu_);
  std::vector<std::function<void(SnapshotSink&)>> sources_;  // set before the first subscriber
};

}  // namespace flexkv
