// See kv_event_stream.h.
#include "daemon/events/kv_event_stream.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>

namespace flexkv {

std::string_view KvTierName(KvTier tier) {
  switch (tier) {
    case KvTier::kDram: return "dram";
    case KvTier::kSsd: return "ssd";
  }
  return "unknown";
}

std::string_view KvEventKindName(KvEventKind kind) {
  switch (kind) {
    case KvEventKind::kStored: return "stored";
    case KvEventKind::kRemoved: return "removed";
    case KvEventKind::kCleared: return "cleared";
  }
  return "unknown";
}

std::string_view KvEventCauseName(KvEventCause cause) {
  switch (cause) {
    case KvEventCause::kUnknown: return "unknown";
    case KvEventCause::kStored: return "store";
    case KvEventCause::kPromoted: return "promoted";
    case KvEventCause::kPulled: return "pulled";
    case KvEventCause::kRestored: return "restored";
    case KvEventCause::kWrittenBack: return "written_back";
    case KvEventCause::kEvicted: return "evicted";
    case KvEventCause::kDropped: return "dropped";
    case KvEventCause::kDomainDropped: return "domain_dropped";
  }
  return "unknown";
}

KvEventStream::KvEventStream(size_t capacity, uint64_t instance_id)
    : instance_id_(instance_id), capacity_(std::bit_ceil(std::max<size_t>(capacity, 64))) {
  MutexLock lock(&mu_);
  ring_.resize(capacity_);
}

void KvEventStream::Append(KvEvent event) {
  if (!active()) return;
  MutexLock lock(&mu_);
  event.seq = next_seq_++;
  ring_[event.seq & (capacity_ - 1)] = event;
  if (waiting_) {
    waiting_ = false;
    appended_.notify_one();
  }
}

bool KvEventStream::WaitForEvents(std::optional<uint64_t> after_seq, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  MutexLock lock(&mu_);
  const auto arrived = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return after_seq.has_value() && next_seq_ - 1 > *after_seq;
  };
  while (!arrived() && !woken_ && !closed()) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) break;
    waiting_ = after_seq.has_value();
    mu_.WaitFor(&appended_, deadline - now);
  }
  waiting_ = false;
  woken_ = false;
  return arrived();
}

void KvEventStream::Wake() {
  MutexLock lock(&mu_);
  woken_ = true;
  appended_.notify_all();
}

uint64_t KvEventStream::last_seq() const {
  MutexLock lock(&mu_);
  return next_seq_ - 1;
}

uint16_t KvEventStream::InternDomain(std::string_view model_namespace, uint32_t tokens_per_block,
                                    std::vector<ComponentInfo> components) {
  MutexLock lock(&domains_mu_);
  const uint64_t hash = NamespaceHash(model_namespace);
  auto it = by_hash_.find(hash);
  if (it != by_hash_.end()) {
    DomainInfo& d = domains_[it->second];
    if (d.model_namespace == model_namespace) {
      if (tokens_per_block != 0) d.tokens_per_block = tokens_per_block;
      if (!components.empty()) d.components = std::move(components);
      return it->second;
    }
  }
  for (size_t i = 0; i < domains_.size(); ++i) {
    if (domains_[i].model_namespace == model_namespace) return static_cast<uint16_t>(i);
  }
  if (domains_.size() >= 0xffff) return 0xffff;  // never in practice: namespaces are few
  domains_.push_back(DomainInfo{std::string(model_namespace), tokens_per_block, std::move(components)});
  const auto id = static_cast<uint16_t>(domains_.size() - 1);
  by_hash_[hash] = id;
  return id;
}

uint16_t KvEventStream::DomainByHash(uint64_t namespace_hash) {
  {
    MutexLock lock(&domains_mu_);
    auto it = by_hash_.find(namespace_hash);
    if (it != by_hash_.end()) return it->second;
  }
  // Never attached since the start (an SSD block of an earlier run): named by its hash until it is.
  const std::string name = fmt::format("#{:016x}", namespace_hash);
  MutexLock lock(&domains_mu_);
  for (size_t i = 0; i < domains_.size(); ++i) {
    if (domains_[i].model_namespace == name) return static_cast<uint16_t>(i);
  }
  if (domains_.size() >= 0xffff) return 0xffff;
  domains_.push_back(DomainInfo{name, 0, {}});
  return static_cast<uint16_t>(domains_.size() - 1);
}

KvEventStream::DomainInfo KvEventStream::Domain(uint16_t id) const {
  MutexLock lock(&domains_mu_);
  if (id >= domains_.size()) return DomainInfo{};
  return domains_[id];
}

uint16_t KvEventStream::AddSource(std::function<void(SnapshotSink&)> visit) {
  sources_.push_back(std::move(visit));
  return static_cast<uint16_t>(sources_.size() - 1);
}

KvEventStream::Reader::Reader(KvEventStream* stream) : stream_(stream) {
  stream_->subscribers_.fetch_add(1, std::memory_order_acq_rel);
}

KvEventStream::Reader::~Reader() { stream_->subscribers_.fetch_sub(1, std::memory_order_acq_rel); }

void KvEventStream::Reader::StartAtHead() {
  marks_.clear();
  next_ = stream_->last_seq() + 1;
}

KvEventStream::Snapshot KvEventStream::Reader::TakeSnapshot() {
  // Each source marks the head while it holds the lock its appends happen under: its part of the snapshot holds
  // exactly its events up to that mark. Reading continues after the lowest mark, skipping each source's events up
  // to its own mark.
  struct Sink final : SnapshotSink {
    KvEventStream* stream;
    uint16_t source = 0;
    Snapshot* out;
    void Mark() override { out->marks[source] = stream->last_seq(); }
    void Add(KvTier tier, uint16_t domain, const BlockKey& key, const BlockKey& parent, uint8_t component) override {
      KvEvent e;
      e.component = component;
      e.key = key;
      e.parent = parent;
      e.domain = domain;
      e.source = source;
      e.kind = KvEventKind::kStored;
      e.tier = tier;
      out->blocks.push_back(e);
    }
  };
  Snapshot snap;
  const uint64_t before = stream_->last_seq();
  snap.marks.assign(stream_->sources_.size(), before);
  Sink sink;
  sink.stream = stream_;
  sink.out = &snap;
  for (size_t i = 0; i < stream_->sources_.size(); ++i) {
    sink.source = static_cast<uint16_t>(i);
    stream_->sources_[i](sink);
  }
  snap.seq = snap.marks.empty() ? before : *std::min_element(snap.marks.begin(), snap.marks.end());
  marks_ = snap.marks;
  next_ = snap.seq + 1;
  return snap;
}

KvEventStream::Reader::Result KvEventStream::Reader::Read(size_t max, std::vector<KvEvent>* out, uint64_t* behind) {
  return ReadInto(max, out, behind);
}

KvEventStream::Reader::Result KvEventStream::Reader::Read(size_t max, KvEventVector* out, uint64_t* behind) {
  return ReadInto(max, out, behind);
}

template <typename Out>
KvEventStream::Reader::Result KvEventStream::Reader::ReadInto(size_t max, Out* out, uint64_t* behind) {
  if (stream_->closed()) return Result::kClosed;
  // Copied out in chunks, the lock released in between: an appender (which holds its cache's lock) never waits for
  // more than one chunk's copy.
  constexpr size_t kChunk = 256;
  size_t n = 0;
  for (;;) {
    MutexLock lock(&stream_->mu_);
    const uint64_t head = stream_->next_seq_;  // one past the last event
    const uint64_t oldest = head > stream_->capacity_ ? head - stream_->capacity_ : 1;
    if (next_ < oldest) {
      if (behind != nullptr) *behind = head - next_;
      stream_->cut_off_.fetch_add(1, std::memory_order_relaxed);
      return Result::kOverrun;
    }
    size_t scanned = 0;
    for (; next_ < head && n < max && scanned < kChunk; ++next_, ++scanned) {
      const KvEvent& e = stream_->ring_[next_ & (stream_->capacity_ - 1)];
      if (e.source < marks_.size() && e.seq <= marks_[e.source]) continue;  // the snapshot holds it
      out->push_back(e);
      ++n;
    }
    if (next_ >= head || n >= max) return Result::kOk;
  }
}

}  // namespace flexkv
