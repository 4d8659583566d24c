// See kv_event_subscriptions.h. The wire order and the bounds (snapshot, then the events after it; a subscriber
// further behind than the ring or its queue is cut off with RESOURCE_EXHAUSTED; the watchdog) are those
// docs/kv_events.md describes; this file only decides which thread does the work.
#include "daemon/server/kv_event_subscriptions.h"

#include <fmt/format.h>
#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <map>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "common/clock.h"
#include "common/grpc_convert.h"
#include "common/invariant.h"
#include "common/log.h"
#include "common/mutex.h"

namespace flexkv {
namespace {

// A subscriber whose write has been blocked this long is cancelled when it is in its snapshot or the ring has
// overwritten what it had not read (docs/kv_events.md).
constexpr int64_t kStalledWriteMs = 10000;
// An idle stream sends an empty batch this often.
constexpr int64_t kIdleBatchMs = 1000;
// After a batch that was not full, events gather this long before the next one (fewer, larger reads of the ring).
constexpr int64_t kBatchingMs = 2;
// A batch also ends once it holds about this many bytes: one subscriber's batch in flight stays small whatever its
// max_batch_events and the namespaces' names.
constexpr size_t kMaxBatchBytes = 1 << 20;

class Refusal final : public grpc::ServerWriteReactor<v1::KvEventBatch> {
 public:
  explicit Refusal(grpc::Status status) { Finish(std::move(status)); }
  void OnDone() override { delete this; }
};

}  // namespace

// The subscriptions' bookkeeping and the one thread that feeds those waiting for events and watches stalled writes.
class KvEventSubscriptions::Feeder {
 public:
  Feeder(KvEventStream* events, KvSubscriptionLimits bounds, uint64_t started_ms, ErrorCounts* error_counts)
      : stream(events), limits(bounds), started_unix_ms(started_ms), errors(error_counts) {}

  // Counts a subscription of `uid`, or says which limit it would pass.
  Status Admit(uid_t uid) {
    MutexLock lock(&mu_);
    if (total_ >= limits.total) {
      return Status::ResourceExhausted(fmt::format(
          "this daemon serves at most {} KV event subscriptions at once (--kv-events-max-subscribers) and has {}; "
          "close one or ask the operator to raise the limit",
          limits.total, total_));
    }
    uint32_t& mine = per_uid_[uid];
    if (mine >= limits.per_uid) {
      return Status::ResourceExhausted(fmt::format(
          "uid {} has {} KV event subscriptions open; at most {} are allowed per uid "
          "(--kv-events-max-subscribers-per-uid): close one first (one subscription serves a whole router)",
          uid, mine, limits.per_uid));
    }
    ++mine;
    ++total_;
    return Status::Ok();
  }
  void Add(std::shared_ptr<Subscriber> s) {
    {
      MutexLock lock(&mu_);
      subs_.push_back(std::move(s));
    }
    stream->Wake();  // it takes its snapshot on the feeder
  }
  // The subscription ended (its reactor's OnDone).
  void Remove(const Subscriber* s, uid_t uid) {
    MutexLock lock(&mu_);
    for (size_t i = 0; i < subs_.size(); ++i) {
      if (subs_[i].get() == s) {
        subs_[i] = std::move(subs_.back());
        subs_.pop_back();
        break;
      }
    }
    if (auto it = per_uid_.find(uid); it != per_uid_.end() && --it->second == 0) per_uid_.erase(it);
    --total_;
    trim_due_.store(true, std::memory_order_relaxed);
  }
  size_t open() const {
    MutexLock lock(&mu_);
    return total_;
  }
  void Start();
  void Stop() {
    stop_.store(true);
    stream->Wake();
    if (thread_.joinable()) thread_.join();
  }

  KvEventStream* const stream;
  const KvSubscriptionLimits limits;
  const uint64_t started_unix_ms;
  ErrorCounts* const errors;

 private:
  void Run();

  mutable Mutex mu_;
  std::vector<std::shared_ptr<Subscriber>> subs_ ABSL_GUARDED_BY(mu_);
  std::map<uid_t, uint32_t> per_uid_ ABSL_GUARDED_BY(mu_);
  size_t total_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<bool> stop_{false};
  std::atomic<bool> trim_due_{false};  // a subscription ended: what it freed may go back to the system
  std::thread thread_;
};

// One SubscribeKvEvents call. Its state is touched under mu_ only; gRPC's operations (StartWrite, Finish,
// TryCancel) are started without it, since a reaction may run inline. It keeps itself alive until OnDone.
// Finish goes out only once no StartWrite or TryCancel is outstanding or about to be started: a call finished while
// another thread was between deciding a write and starting it would be freed under that StartWrite (gRPC ends the
// call, OnDone included, as soon as Finish finds no operation in flight). An end decided meanwhile waits in
// pending_finish_ and is sent by whichever of OnWriteDone and the issuing thread comes last.
class KvEventSubscriptions::Subscriber final : public grpc::ServerWriteReactor<v1::KvEventBatch> {
 public:
  Subscriber(std::shared_ptr<Feeder> feeder, grpc::CallbackServerContext* context, uid_t uid, size_t max_batch,
             bool skip_snapshot, ReadableFn readable)
      : feeder_(std::move(feeder)),
        stream_(feeder_->stream),
        context_(context),
        uid_(uid),
        max_batch_(max_batch),
        skip_snapshot_(skip_snapshot),
        readable_(std::move(readable)) {
    MutexLock lock(&mu_);
    reader_.emplace(stream_);  // events are appended from now on
  }

  void Start(std::shared_ptr<Subscriber> self) {
    {
      MutexLock lock(&mu_);
      self_ = self;
    }
    feeder_->Add(std::move(self));
  }

  // What the feeder asks a subscriber (`head`: the stream's last seq when it looked): its snapshot, its next batch
  // when it waits for events, the watchdog. Returns when it wants to be looked at again (monotonic ms), and whether
  // it waits for an event to come (nothing else to send).
  struct Due {
    int64_t at_ms = std::numeric_limits<int64_t>::max();
    bool waits_for_events = false;
  };
  Due Tick(int64_t now, uint64_t head) {
    Action action;
    Due due;
    {
      MutexLock lock(&mu_);
      if (finished_) return due;
      if (writing_) {
        action = WatchdogLocked(now);
        due.at_ms = std::min(write_started_ms_ + kStalledWriteMs, now + kIdleBatchMs);
      } else if (!started_ || stream_->closed()) {
        action = StepLocked(now, /*feeder=*/true);
      } else if (parked_) {
        const bool has_work = queue_.size() > head_ || reader_->position() < head;
        const int64_t at = has_work ? std::min(parked_since_ms_ + kBatchingMs, last_write_ms_ + kIdleBatchMs)
                                    : last_write_ms_ + kIdleBatchMs;
        if (now >= at) {
          action = StepLocked(now, /*feeder=*/true);
        } else {
          due.at_ms = at;
          due.waits_for_events = !has_work;
        }
      }
    }
    Perform(std::move(action));
    return due;
  }

  void OnWriteDone(bool ok) override {
    Action action;
    {
      MutexLock lock(&mu_);
      writing_ = false;
      if (finished_) {
        action = FinishIfIdleLocked();
      } else {
        action = ok ? StepLocked(MonotonicMs(), /*feeder=*/false)
                    : FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "the subscriber went away"));
      }
    }
    Perform(std::move(action));
  }

  void OnCancel() override {
    Action action;
    {
      MutexLock lock(&mu_);
      if (finished_) return;
      action = FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "the subscriber went away"));
    }
    Perform(std::move(action));
  }

  void OnDone() override {
    std::shared_ptr<Subscriber> self;
    {
      MutexLock lock(&mu_);
      self = std::move(self_);
    }
    feeder_->Remove(this, uid_);
    // `self` goes last: this object may end here (unless the feeder still looks at it).
  }

 private:
  struct Action {
    enum Kind { kNone, kWrite, kFinish, kCancel } kind = kNone;
    grpc::Status status;
    bool wake_feeder = false;
  };

  // Starts the gRPC operation `action` asks for. A StartWrite or TryCancel was counted in issuing_ when it was
  // decided (the call cannot end before it is started); once started, the end of the call, if one was decided
  // meanwhile and no write is left in flight, is sent from here.
  void Perform(Action action) {
    if (action.wake_feeder) stream_->Wake();
    switch (action.kind) {
      case Action::kNone: return;
      case Action::kFinish: Finish(std::move(action.status)); return;
      case Action::kWrite: StartWrite(&batch_); break;
      case Action::kCancel:
        // A call blocked in a write can only be cancelled: its write then completes (not ok) and OnWriteDone, or
        // the block below, sends the Finish that FinishLocked left pending.
        context_->TryCancel();
        break;
    }
    Action then;
    {
      MutexLock lock(&mu_);
      --issuing_;
      then = FinishIfIdleLocked();
    }
    if (then.kind == Action::kFinish) Finish(std::move(then.status));
  }

  // The pending end of the call, once nothing is in flight or about to be started (see the class comment).
  Action FinishIfIdleLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Action action;
    if (!pending_finish_ || writing_ || issuing_ > 0) return action;
    action.kind = Action::kFinish;
    action.status = std::move(*pending_finish_);
    pending_finish_.reset();
    return action;
  }

  // Ends the call with `status`, freeing what it held (its snapshot, its queue, its place in the ring's readers).
  // The Finish itself is sent now, or once the write in flight completes (FinishIfIdleLocked).
  Action FinishLocked(grpc::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    finished_ = true;
    if (status.error_code() != grpc::StatusCode::CANCELLED) {
      feeder_->errors->Add(static_cast<StatusCode>(status.error_code()));
    }
    KvEventVector().swap(snapshot_.blocks);
    KvEventVector().swap(queue_);
    head_ = 0;
    reader_.reset();
    pending_finish_ = std::move(status);
    return FinishIfIdleLocked();
  }

  Action WatchdogLocked(int64_t now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (now - write_started_ms_ < kStalledWriteMs) return {};
    const int64_t stalled_s = (now - write_started_ms_) / 1000;
    if (in_snapshot_) {
      log::Warning("events", "a KV event subscriber (uid {}) has not read for {} s in the middle of its snapshot: its "
                   "call is cancelled (a subscriber must keep reading; it may subscribe again)", uid_, stalled_s);
    } else if (stream_->last_seq() - write_position_ > stream_->capacity()) {
      log::Warning("events", "a KV event subscriber (uid {}) has not read for {} s and fell behind the event buffer: "
                   "its call is cancelled", uid_, stalled_s);
    } else {
      return {};
    }
    Action action = FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "the subscriber stopped reading"));
    FLEXKV_INVARIANT(action.kind == Action::kNone, "events", "a stalled write is in flight: the Finish waits for it");
    action.kind = Action::kCancel;
    ++issuing_;
    return action;
  }

  // The domain's name and block size, and whether this subscriber may see it; looked up once per domain.
  struct KnownDomain {
    KvEventStream::DomainInfo info;
    bool readable = false;
  };
  KnownDomain& DomainLocked(uint16_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = domains_.find(id);
    if (it == domains_.end()) {
      KnownDomain d{stream_->Domain(id), false};
      d.readable = readable_(d.info.model_namespace);
      it = domains_.emplace(id, std::move(d)).first;
    }
    return it->second;
  }

  // Drops the events from `from` on of the domains this subscriber may not see.
  void KeepReadableLocked(KvEventVector* events, size_t from) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    size_t kept = from;
    for (size_t i = from; i < events->size(); ++i) {
      if (DomainLocked((*events)[i].domain).readable) (*events)[kept++] = (*events)[i];
    }
    events->resize(kept);
  }

  void FillEventLocked(const KvEvent& e, v1::KvEvent* out, size_t* bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    out->set_seq(e.seq);
    out->set_kind(static_cast<v1::KvEvent::Kind>(e.kind));
    out->set_tier(static_cast<v1::KvEvent::Tier>(e.tier));
    out->set_key_lo(e.key.lo);
    out->set_key_hi(e.key.hi);
    out->set_parent_lo(e.parent.lo);
    out->set_parent_hi(e.parent.hi);
    KnownDomain& known = DomainLocked(e.domain);
    if (e.component >= known.info.components.size()) {
      known.info = stream_->Domain(e.domain);  // its geometry was not known yet when this stream first saw it
    }
    const KvEventStream::DomainInfo& d = known.info;
    out->set_model_namespace(d.model_namespace);
    out->set_tokens_per_block(d.tokens_per_block);
    out->set_component(e.component);
    if (e.component < d.components.size()) {
      out->set_kv_cache_spec_kind(d.components[e.component].spec_kind);
      out->set_sliding_window_tokens(d.components[e.component].sliding_window_tokens);
    }
    out->set_cause(static_cast<v1::KvEvent::Cause>(e.cause));
    *bytes += 64 + d.model_namespace.size();
  }

  void HeaderLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    batch_.Clear();
    batch_.set_instance_id(stream_->instance_id());
    batch_.set_started_unix_ms(feeder_->started_unix_ms);
  }

  Action WriteLocked(int64_t now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    writing_ = true;
    parked_ = false;
    write_started_ms_ = now;
    last_write_ms_ = now;
    write_position_ = reader_->position();
    ++issuing_;
    Action action;
    action.kind = Action::kWrite;
    return action;
  }

  // Waits for events or for its batching moment: the feeder looks at it from now on, so it is woken to take it into
  // account (to wait for the next event rather than for its next timer).
  Action ParkLocked(int64_t now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Action action;
    if (!parked_) {
      parked_ = true;
      parked_since_ms_ = now;
      action.wake_feeder = true;
    }
    return action;
  }

  // Reads what is new in the ring into the queue, keeping the events of the domains this subscriber may see. The
  // error that ends the call when it fell behind the ring or holds more than its limit, or the daemon stops.
  std::optional<grpc::Status> DrainLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    uint64_t behind = 0;
    const size_t held = queue_.size() - head_;
    // At most one event past the limit is read, so the limit is the most a subscriber ever holds (plus one).
    const size_t room = held > queue_limit_ ? 0 : queue_limit_ - held;
    const size_t before = queue_.size();
    const KvEventStream::Reader::Result r = reader_->Read(room + 1, &queue_, &behind);
    if (r == KvEventStream::Reader::Result::kClosed) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "the daemon is stopping; subscribe again once it is back (a new instance_id)");
    }
    if (r == KvEventStream::Reader::Result::kOverrun) {
      static log::RateLimited cut_off_log(10000);
      cut_off_log.Warning("events", "a KV event subscriber (uid {}) fell behind by {} events and was cut off", uid_,
                          behind + held);
      return ToGrpc(Status::ResourceExhausted(fmt::format(
          "KV event subscriber fell behind by {} events: the daemon keeps the last {} (--kv-events-buffer) and the "
          "events after seq {} are gone; resubscribe (the new stream starts with a snapshot), and read faster or ask "
          "the operator for a larger --kv-events-buffer",
          behind + held, stream_->capacity(), reader_->position())));
    }
    // The events of domains this subscriber may not read are dropped here: it never holds them.
    KeepReadableLocked(&queue_, before);
    if (queue_.size() - head_ > queue_limit_) {
      static log::RateLimited queue_log(10000);
      queue_log.Warning("events", "a KV event subscriber (uid {}) fell {} events behind (more than its snapshot and "
                        "the event buffer) and was cut off", uid_, queue_.size() - head_);
      stream_->CountCutOff();  // before the answer leaves: a subscriber that reads status after it sees the count
      return ToGrpc(Status::ResourceExhausted(fmt::format(
          "KV event subscriber fell behind by {} events: the daemon holds at most the snapshot's {} blocks plus "
          "--kv-events-buffer {} events for a subscriber; resubscribe (the new stream starts with a snapshot), and "
          "read faster or ask the operator for a larger --kv-events-buffer",
          queue_.size() - head_, queue_limit_ - stream_->capacity(), stream_->capacity())));
    }
    return std::nullopt;
  }

  // The next thing to do: the first batch, a snapshot batch, a batch of events, or waiting. `feeder`: called by the
  // feeder (which takes snapshots, and sends batches that are not full once events had time to gather) rather than
  // after a write.
  Action StepLocked(int64_t now, bool feeder) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || writing_) return {};
    if (stream_->closed()) {
      return FinishLocked(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                       "the daemon is stopping; subscribe again once it is back (a new instance_id)"));
    }
    if (!started_) {
      if (!feeder) return {};
      started_ = true;
      queue_limit_ = stream_->capacity();
      if (skip_snapshot_) {
        // No snapshot: a first empty batch says where the stream starts (nothing to replace a view with).
        reader_->StartAtHead();
        HeaderLocked();
        batch_.set_head_seq(reader_->position());
        batch_.set_position(reader_->position());
        sent_position_ = reader_->position();
        return WriteLocked(now);
      }
      snapshot_ = reader_->TakeSnapshot();
      KeepReadableLocked(&snapshot_.blocks, 0);
      queue_limit_ = snapshot_.blocks.size() + stream_->capacity();
      in_snapshot_ = true;
    }
    if (in_snapshot_) {
      if (snapshot_batches_ > 0) {
        // The events after the snapshot wait in the queue until its last batch is written: a subscriber applies the
        // snapshot, then them (the wire order docs/kv_events.md promises). Reading them meanwhile keeps the ring
        // from being overrun while a subscriber that keeps up takes a long snapshot.
        if (auto ended = DrainLocked()) return FinishLocked(std::move(*ended));
      }
      if (snapshot_batches_ == 0 || snapshot_next_ < snapshot_.blocks.size()) {
        HeaderLocked();
        batch_.set_snapshot(true);
        size_t bytes = 0;
        const size_t end = std::min(snapshot_.blocks.size(), snapshot_next_ + max_batch_);
        for (; snapshot_next_ < end && bytes < kMaxBatchBytes; ++snapshot_next_) {
          FillEventLocked(snapshot_.blocks[snapshot_next_], batch_.add_events(), &bytes);
        }
        batch_.set_snapshot_end(snapshot_next_ == snapshot_.blocks.size());
        batch_.set_snapshot_seq(snapshot_.seq);
        batch_.set_head_seq(snapshot_.seq);
        batch_.set_position(snapshot_.seq);
        ++snapshot_batches_;
        return WriteLocked(now);
      }
      // The last snapshot batch is written: its memory goes now, the events follow.
      in_snapshot_ = false;
      sent_position_ = snapshot_.seq;
      KvEventVector().swap(snapshot_.blocks);
    }
    if (auto ended = DrainLocked()) return FinishLocked(std::move(*ended));
    const size_t queued = queue_.size() - head_;
    const size_t n = std::min(max_batch_, queued);
    // A batch when there are events, when skipped events moved the position, and once a second when idle (the
    // subscriber sees that the stream is alive and where the head is). One that is not full waits for more events
    // first (the feeder sends it a moment later), so that the ring's lock is taken a few hundred times a second per
    // subscriber rather than once per event.
    const bool idle_due = now - last_write_ms_ >= kIdleBatchMs;
    const bool moved = reader_->position() != sent_position_;
    if (n == 0 && !moved && !idle_due) return ParkLocked(now);
    if (n < max_batch_ && !idle_due && (!feeder || now - parked_since_ms_ < kBatchingMs || !parked_)) {
      return ParkLocked(now);
    }
    HeaderLocked();
    size_t bytes = 0;
    size_t k = 0;
    for (; k < n && bytes < kMaxBatchBytes; ++k) FillEventLocked(queue_[head_ + k], batch_.add_events(), &bytes);
    // Every event up to the position has been written or is in the snapshot (or is of a domain this subscriber may
    // not see): the ring's position once the queue is empty, else the last event written.
    const uint64_t position = head_ + k == queue_.size() ? reader_->position() : queue_[head_ + k - 1].seq;
    batch_.set_head_seq(stream_->last_seq());
    batch_.set_position(position);
    head_ += k;
    if (head_ == queue_.size()) {
      queue_.clear();
      head_ = 0;
      if (queue_.capacity() * sizeof(KvEvent) > (4u << 20)) KvEventVector().swap(queue_);  // a burst's room goes back
    } else if (head_ >= 4096 && head_ * 2 >= queue_.size()) {
      queue_.erase(queue_.begin(), queue_.begin() + static_cast<std::ptrdiff_t>(head_));
      head_ = 0;
    }
    sent_position_ = position;
    return WriteLocked(now);
  }

  const std::shared_ptr<Feeder> feeder_;
  KvEventStream* const stream_;
  grpc::CallbackServerContext* const context_;
  const uid_t uid_;
  const size_t max_batch_;
  const bool skip_snapshot_;
  const ReadableFn readable_;

  Mutex mu_;
  std::shared_ptr<Subscriber> self_ ABSL_GUARDED_BY(mu_);  // until OnDone
  std::optional<KvEventStream::Reader> reader_ ABSL_GUARDED_BY(mu_);
  std::map<uint16_t, KnownDomain> domains_ ABSL_GUARDED_BY(mu_);
  v1::KvEventBatch batch_ ABSL_GUARDED_BY(mu_);  // the batch in flight (unchanged until its write is done)
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;     // a write was decided and has not completed (OnWriteDone)
  uint32_t issuing_ ABSL_GUARDED_BY(mu_) = 0;     // StartWrite / TryCancel decided, not yet started by their thread
  std::optional<grpc::Status> pending_finish_ ABSL_GUARDED_BY(mu_);  // the end decided, not yet sent
  bool parked_ ABSL_GUARDED_BY(mu_) = false;  // waits for events or for its batching moment; the feeder looks at it
  int64_t parked_since_ms_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t write_started_ms_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t last_write_ms_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t write_position_ ABSL_GUARDED_BY(mu_) = 0;  // the ring's read position when the write started
  // The snapshot while it is sent, and where it is.
  KvEventStream::Snapshot snapshot_ ABSL_GUARDED_BY(mu_);
  bool in_snapshot_ ABSL_GUARDED_BY(mu_) = false;
  size_t snapshot_next_ ABSL_GUARDED_BY(mu_) = 0;
  size_t snapshot_batches_ ABSL_GUARDED_BY(mu_) = 0;
  // Events read from the ring and not yet written, oldest first from queue_[head_]. What it holds is bounded: more
  // than the snapshot's size plus the ring's capacity means the subscriber reads slower than the events come, and
  // it is cut off as if it had fallen behind the ring.
  KvEventVector queue_ ABSL_GUARDED_BY(mu_);
  size_t head_ ABSL_GUARDED_BY(mu_) = 0;
  size_t queue_limit_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t sent_position_ ABSL_GUARDED_BY(mu_) = 0;  // the position of the last batch written
};

void KvEventSubscriptions::Feeder::Start() {
  thread_ = std::thread([this] { Run(); });
}

void KvEventSubscriptions::Feeder::Run() {
  std::vector<std::shared_ptr<Subscriber>> subs;
  int64_t last_trim_ms = 0;
  while (!stop_.load()) {
    const int64_t now = MonotonicMs();
    const uint64_t head = stream->last_seq();
    {
      MutexLock lock(&mu_);
      subs = subs_;
    }
    int64_t next = now + kIdleBatchMs;
    bool waits_for_events = false;
    for (const auto& s : subs) {
      const Subscriber::Due due = s->Tick(now, head);
      next = std::min(next, due.at_ms);
      waits_for_events = waits_for_events || due.waits_for_events;
    }
    subs.clear();  // a subscription that ended meanwhile goes here, not at the next turn
    // What ended subscriptions freed outside their own mappings (their batches, gRPC's buffers) sits in malloc's
    // free lists, often in the middle of a heap: give those pages back, at most once a second.
    if (trim_due_.load(std::memory_order_relaxed) && now - last_trim_ms >= 1000) {
      trim_due_.store(false, std::memory_order_relaxed);
      last_trim_ms = now;
      malloc_trim(0);
    }
    if (stop_.load()) break;
    if (stream->closed()) {  // the subscriptions end as their writes finish; the server cancels the rest
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    const int64_t wait_ms = next - MonotonicMs();
    if (wait_ms <= 0) continue;
    // Woken early by an event when a subscriber waits for one, by Wake() (a new subscriber, one with events left to
    // send) in any case.
    stream->WaitForEvents(waits_for_events ? std::optional<uint64_t>(head) : std::nullopt,
                          std::chrono::milliseconds(wait_ms));
  }
}

KvEventSubscriptions::KvEventSubscriptions(KvEventStream* stream, KvSubscriptionLimits limits,
                                           uint64_t started_unix_ms, ErrorCounts* errors)
    : limits_(limits), feeder_(std::make_shared<Feeder>(stream, limits, started_unix_ms, errors)) {
  feeder_->Start();
}

KvEventSubscriptions::~KvEventSubscriptions() { feeder_->Stop(); }

grpc::ServerWriteReactor<v1::KvEventBatch>* KvEventSubscriptions::Refuse(grpc::Status status) {
  return new Refusal(std::move(status));
}

size_t KvEventSubscriptions::open() const { return feeder_->open(); }

grpc::ServerWriteReactor<v1::KvEventBatch>* KvEventSubscriptions::Subscribe(grpc::CallbackServerContext* context,
                                                                           const v1::SubscribeKvEventsRequest& request,
                                                                           uid_t uid, ReadableFn readable) {
  if (request.max_batch_events() > 65536) {
    feeder_->errors->Add(StatusCode::kInvalidArgument);
    return Refuse(ToGrpc(Status::InvalidArgument(
        fmt::format("max_batch_events {}: expected 0 (1024) to 65536", request.max_batch_events()))));
  }
  Status admitted = feeder_->Admit(uid);
  if (!admitted.ok()) {
    static log::RateLimited refusal_log(10000);
    refusal_log.Warning("events", "a KV event subscription refused: {}", admitted.message());
    feeder_->errors->Add(admitted.code());
    return Refuse(ToGrpc(admitted));
  }
  const size_t max_batch = request.max_batch_events() == 0 ? 1024 : request.max_batch_events();
  auto s = std::make_shared<Subscriber>(feeder_, context, uid, max_batch, request.skip_snapshot(), std::move(readable));
  Subscriber* reactor = s.get();
  reactor->Start(std::move(s));
  return reactor;
}

}  // namespace flexkv
