// See ssd_tier.h. Over 700 lines: the mover (write-back, the deferred open, rates), FULL promotion and the
// promotions waiting for the write-back share the tier's lock, counters and stop protocol kept here; the hybrid
// promotion (ssd_tier_hybrid.cc) and the status and metrics (ssd_tier_report.cc) are split out already.
#include "daemon/tiers/ssd/ssd_tier.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <xxhash.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <set>

#include "common/clock.h"
#include "common/log.h"
#include "common/unique_fd.h"
#include "common/units.h"
#include "daemon/cache/cache.h"
#include "daemon/cache/cache_set.h"

namespace flexkv {

namespace {

// What the KV event stream is told of a store event (`restored`: found on disk when the store opened).
TierBlockEvent TierEventOf(SsdStore::BlockEventKind kind, bool restored, const SsdEntry& e) {
  TierBlockEvent ev;
  ev.key = e.id.key;
  ev.namespace_hash = e.id.domain.namespace_hash;
  ev.component = static_cast<uint8_t>(e.id.component);
  switch (kind) {
    case SsdStore::BlockEventKind::kWritten:
      ev.kind = TierBlockEvent::kStored;
      ev.parent = e.parent;
      ev.cause = restored ? TierBlockEvent::kRestored : TierBlockEvent::kWrittenBack;
      break;
    case SsdStore::BlockEventKind::kEvicted:
      ev.kind = TierBlockEvent::kRemoved;
      ev.cause = TierBlockEvent::kEvicted;
      break;
    case SsdStore::BlockEventKind::kDropped:
      ev.kind = TierBlockEvent::kRemoved;
      ev.cause = TierBlockEvent::kDropped;
      break;
  }
  return ev;
}

// A match's run of SSD blocks being promoted: their DRAM slots (pending) and what each read answered.
struct Promotion {
  Cache* cache = nullptr;
  BlockKey parent;                  // of run[0]
  std::vector<BlockKey> run;        // the keys after the DRAM prefix that SSD holds, as given to Reserve
  size_t first = 0;                 // run index of slots[0] (Reserve's `cached`)
  std::vector<SlotId> slots;        // pending DRAM slots, one per read issued
  std::vector<uint64_t> checksums;  // their content checksums (from the SSD entries)
  // Per run key: SSD holds it in the layer-major slot order of an older release (under that release's geometry
  // string); its bytes are rewritten in today's order once read and checked, with the checksum in `rewritten`.
  std::vector<uint8_t> layer_major;
  std::unique_ptr<std::atomic<uint64_t>[]> rewritten;  // per read issued; 0: not rewritten
  std::unique_ptr<std::atomic<uint8_t>[]> ok;
  std::atomic<size_t> remaining{0};
  SsdTier::PromotionDone done;
};

log::RateLimited& WriteErrorLog() {
  static log::RateLimited limited(60000);
  return limited;
}

log::RateLimited& PromotionErrorLog() {
  static log::RateLimited limited(10000);
  return limited;
}

}  // namespace

uint64_t SsdFoundPayloadCapacity(const std::vector<std::string>& paths) {
  uint64_t found = 0;
  for (const std::string& dir : paths) {
    const std::string path = dir + (dir.ends_with('/') ? "" : "/") + kSsdFileName;
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) continue;
    alignas(kSsdAlign) std::array<uint8_t, kSsdHeaderSector> sector{};
    if (::pread(fd.get(), sector.data(), sector.size(), 0) != static_cast<ssize_t>(sector.size())) continue;
    const SsdDecodedFile file = DecodeFileHeader(std::span<const uint8_t, kSsdHeaderSector>(sector));
    if (file.kind == SsdSectorKind::kValid) found = std::max(found, file.header.payload_capacity);
  }
  return found;
}

SsdTier::SsdTier(SsdTierOptions options, CacheSet* caches)
    : options_(std::move(options)), caches_(caches), owners_(options_.store.paths) {}

Result<std::unique_ptr<SsdTier>> SsdTier::Create(SsdTierOptions options, CacheSet* caches) {
  if (options.store.paths.empty()) return Status::InvalidArgument("--ssd-path: at least one directory is needed");
  if (options.store.size_bytes == 0) {
    return Status::InvalidArgument("--ssd-size is needed with --ssd-path (bytes on disk over all paths, e.g. 2TiB)");
  }
  if (!(options.writeback_window > 0 && options.writeback_window <= 1)) {
    return Status::InvalidArgument(
        fmt::format("--ssd-writeback-window {} is out of range; expected a share of the DRAM pool in (0, 1], e.g. 0.25",
                    options.writeback_window));
  }
  std::unique_ptr<SsdTier> tier(new SsdTier(std::move(options), caches));
  // The owners first: they must be known before the daemon admits any Attach (a damaged record is ignored, logged).
  tier->owners_.Load();
  // The largest slot of the pools re-attached at start (every component's), and what the block files were made for.
  uint64_t needed = 0;
  for (size_t i = 0; i < caches->max_domains(); ++i) {
    const Cache& c = caches->cache(i);
    const CacheDomain::View v = c.Domain();
    if (c.has_pool() && v.geometry) needed = std::max(needed, LargestSlotBytes(*v.geometry));
  }
  // Block files there decide the slot size: a domain with larger blocks stays in DRAM (a note in status), as it
  // would while running; refusing the start over it would turn a routine restart into an outage.
  const uint64_t found = SsdFoundPayloadCapacity(tier->options_.store.paths);
  const uint64_t capacity = found > 0 ? found : needed;
  if (capacity > 0) {
    FLEXKV_RETURN_IF_ERROR(tier->OpenStore(capacity));
    return tier;
  }
  tier->PruneOwners();  // no block file: no block on SSD, so no owner to keep
  // The block size is not known until the first pool: check now what can be checked, so that a bad --ssd-path
  // stops the start instead of showing up later.
  const SsdStoreOptions& o = tier->options_.store;
  for (const std::string& dir : o.paths) {
    std::string warning;
    FLEXKV_RETURN_IF_ERROR(SsdPreflight(dir, o.size_bytes / o.paths.size(), o.allow_buffered, &warning));
    if (!warning.empty()) log::Warning("ssd", "{}", warning);
  }
  return tier;
}

Status SsdTier::OpenStore(uint64_t payload_capacity) {
  SsdStoreOptions o = options_.store;
  o.payload_capacity = payload_capacity;
  auto store = SsdStore::Open(o);
  if (!store.ok()) {
    MutexLock lock(&mu_);
    state_ = "failed: " + store.status().ToString();
    return store.status();
  }
  // The store logged what it found; the files say how they are accessed.
  for (const SsdStore::FileInfo& f : (*store)->files()) {
    log::Info("ssd", "SSD tier: {}: {} slots of {} on {}, {}{}", f.path, f.slots, FormatByteSize(payload_capacity),
              f.filesystem,
              f.direct ? "direct I/O" : "BUFFERED I/O (--ssd-allow-buffered): slower, and the page cache holds copies",
              options_.write_all ? "; every stored block is written" : "; the cold end is written");
  }
  {
    // A snapshot taken before this saw no store; the blocks found on disk reach its subscribers as events.
    MutexLock events(&events_mu_);
    store_ = std::move(*store);
    if (block_observer_) {
      ListenToStoreLocked();
      store_->SnapshotBlocks([] {}, [this](const SsdEntry& e) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        block_observer_(TierEventOf(SsdStore::BlockEventKind::kWritten, true, e));
      });
    }
  }
  for (size_t i = 0; i < caches_->max_domains(); ++i) {
    caches_->cache(i).AttachNextTier(options_.write_all, options_.store_wait_ms, /*hybrid=*/true);
  }
  {
    MutexLock lock(&mu_);
    state_ = "serving";
    last_sample_ms_ = MonotonicMs();
  }
  store_ready_.store(true, std::memory_order_release);
  PruneOwners();
  return Status::Ok();
}

void SsdTier::PruneOwners() {
  std::set<uint64_t> held;  // namespace hashes with a block on SSD
  if (store_ready_.load(std::memory_order_acquire)) {
    store_->SnapshotBlocks([] {}, [&held](const SsdEntry& e) { held.insert(e.id.domain.namespace_hash); });
  }
  const Status pruned = owners_.Retain([&held](std::string_view ns) { return held.contains(XXH3_64bits(ns.data(), ns.size())); });
  if (!pruned.ok()) log::Warning("ssd", "{}", pruned.ToString());
}

std::optional<uid_t> SsdTier::RecordedOwner(std::string_view model_namespace) const {
  return owners_.OwnerOf(model_namespace);
}

bool SsdTier::RecordOwner(const Cache& cache, std::vector<std::string>* notes) {
  const uint64_t generation = cache.generation();
  {
    MutexLock lock(&mu_);
    auto it = owner_recorded_.find(&cache);
    if (it != owner_recorded_.end() && it->second == generation) return true;
  }
  const CacheDomain::View v = cache.Domain();
  if (!v.creator_uid) return true;  // not fixed yet: nothing of it to write either
  {
    MutexLock lock(&mu_);
    if (MonotonicMs() < owner_retry_ms_) {  // a failing directory is not hammered: once a second
      notes->push_back(fmt::format("namespace '{}': its owner cannot be recorded in the SSD directory (see the log); "
                                   "its blocks stay in DRAM", v.model_namespace));
      return false;
    }
  }
  const Result<uid_t> owner = owners_.Record(v.model_namespace, *v.creator_uid);
  if (!owner.ok()) {
    {
      MutexLock lock(&mu_);
      owner_retry_ms_ = MonotonicMs() + 1000;
    }
    static log::RateLimited failed(60000);
    failed.Warning("ssd", "namespace '{}': {}; its blocks stay in DRAM until its owner is recorded with them",
                   v.model_namespace, owner.status().ToString());
    notes->push_back(fmt::format("namespace '{}': its owner cannot be recorded in the SSD directory ({}); its blocks "
                                 "stay in DRAM", v.model_namespace, owner.status().message()));
    return false;
  }
  if (*owner != *v.creator_uid) {
    log::Warning("ssd", "namespace '{}': its pool was created by uid {}, but the SSD tier records uid {} as its owner "
                 "(with its blocks there); uid {} stays the owner for the next Attach. Remove {} in the --ssd-path "
                 "directories to hand it over",
                 v.model_namespace, *v.creator_uid, *owner, *owner, kSsdOwnersFileName);
  }
  MutexLock lock(&mu_);
  owner_recorded_[&cache] = generation;
  return true;
}

SsdTier::~SsdTier() { Stop(); }

void SsdTier::Start() {
  if (mover_.joinable()) return;
  if (!open()) log::Info("ssd", "SSD tier: block files are created when the first pool fixes the block size");
  mover_ = std::thread([this] {
    while (!stopping_.load(std::memory_order_acquire)) {
      const size_t written = MoveRound();
      RetryWaitingPromotions();
      SampleRates();
      if (written == 0) {
        IdleWait(std::chrono::milliseconds(options_.mover_idle_ms));
      }
    }
  });
}

void SsdTier::Stop() {
  {
    MutexLock lock(&mu_);
    stop_requested_ = true;
  }
  stopping_.store(true, std::memory_order_seq_cst);
  idle_cv_.notify_all();
  if (mover_.joinable()) mover_.join();
  // Promotions waiting for the write-back are answered from DRAM (none is queued after stop_requested_).
  RetryWaitingPromotions();
  // A Promote that saw stopping_ false may still be issuing reads: wait for it to return (its reads are then
  // accepted, and WaitIdle waits for them).
  while (promoting_.load(std::memory_order_seq_cst) > 0) std::this_thread::yield();
  if (store_ready_.load(std::memory_order_acquire)) store_->WaitIdle();
}

void SsdTier::SetBlockObserver(BlockObserver observer) {
  MutexLock events(&events_mu_);
  block_observer_ = std::move(observer);
  if (store_) ListenToStoreLocked();  // opened at Create: its blocks are in any snapshot from now on
}

void SsdTier::ListenToStoreLocked() {
  BlockObserver observer = block_observer_;
  store_->SetEventListener([observer](SsdStore::BlockEventKind kind, const SsdEntry& e) {
    if (observer) observer(TierEventOf(kind, false, e));
  });
}

void SsdTier::SnapshotBlocks(const std::function<void()>& mark,
                             const std::function<void(const TierBlockEvent&)>& each) const {
  MutexLock events(&events_mu_);
  if (!store_) {
    mark();
    return;
  }
  store_->SnapshotBlocks(mark, [&each](const SsdEntry& e) {
    each(TierEventOf(SsdStore::BlockEventKind::kWritten, false, e));
  });
}

SsdDomain SsdTier::DomainOf(const Cache& cache) {
  const uint64_t generation = cache.generation();
  {
    MutexLock lock(&mu_);
    auto it = domains_.find(&cache);
    if (it != domains_.end() && it->second.first == generation) return it->second.second;
  }
  const CacheDomain::View v = cache.Domain();
  const SsdDomain domain = v.geometry ? SsdDomain::Of(v.model_namespace, *v.geometry) : SsdDomain{};
  MutexLock lock(&mu_);
  domains_[&cache] = {generation, domain};
  return domain;
}

bool SsdTier::Eligible(const Cache& cache) const {
  if (!cache.has_pool() || !store_ready_.load(std::memory_order_acquire)) return false;
  const CacheDomain::View v = cache.Domain();
  return v.geometry && LargestSlotBytes(*v.geometry) <= store_->payload_capacity();
}

size_t SsdTier::MoveRound() {
  if (!store_ready_.load(std::memory_order_acquire)) {
    {
      MutexLock lock(&mu_);
      if (state_.starts_with("failed")) return 0;  // logged once; the operator restarts after fixing it
    }
    uint64_t needed = 0;
    for (size_t i = 0; i < caches_->max_domains(); ++i) {
      const Cache& c = caches_->cache(i);
      const CacheDomain::View v = c.Domain();
      if (c.has_pool() && v.geometry) needed = std::max(needed, LargestSlotBytes(*v.geometry));
    }
    if (needed == 0) return 0;
    if (Status opened = OpenStore(needed); !opened.ok()) {
      log::Error("ssd", "SSD tier off: {}; the cache runs from DRAM alone until flexkvd is restarted with this fixed",
                 opened.ToString());
      return 0;
    }
  }
  size_t written = 0;
  bool failed = false;
  std::vector<std::string> notes;
  for (size_t i = 0; i < caches_->max_domains() && !stopping_.load(std::memory_order_acquire); ++i) {
    Cache& c = caches_->cache(i);
    if (!c.has_pool()) continue;
    if (!Eligible(c)) {
      const CacheDomain::View v = c.Domain();
      if (v.geometry) {
        size_t component = 0;
        const uint64_t largest = LargestSlotBytes(*v.geometry, &component);
        notes.push_back(fmt::format(
            "namespace '{}': {} of {} do not fit the SSD slots of {} (the block files were made for another "
            "model); its blocks stay in DRAM. Move the files away or use --ssd-on-mismatch=discard at the next start",
            v.model_namespace,
            component == 0 ? std::string("blocks")
                           : fmt::format("component {} ({}) slots", component,
                                         ComponentKindName(v.geometry->component_kind(component))),
            FormatByteSize(largest), FormatByteSize(store_->payload_capacity())));
      }
      c.SetWriteBackServed(false);  // never written here: its stores must not wait for a write-back
      continue;
    }
    const auto window = static_cast<size_t>(std::max(1.0, options_.writeback_window * c.capacity_slots()));
    // At most a quarter of the pool pinned for writes at a time: stores must still find slots to evict.
    const uint64_t cap = std::max<uint64_t>(1, c.capacity_slots() / 4);
    const uint64_t writing = c.write_back_stats().writing;
    if (writing >= cap) continue;
    const size_t batch = std::min<size_t>(options_.writeback_batch, cap - writing);
    const uint64_t generation = c.generation();
    if (!RecordOwner(c, &notes)) {
      c.SetWriteBackServed(false);  // its blocks stay in DRAM until the owner is recorded: no store waits for them
      continue;
    }
    c.SetWriteBackServed(true);
    const SsdDomain domain = DomainOf(c);
    if (std::vector<Cache::NextTierKey> touched = c.TakeTouched(); !touched.empty()) {
      std::vector<SsdBlockId> ids;
      ids.reserve(touched.size());
      for (const Cache::NextTierKey& k : touched) ids.push_back(SsdBlockId{k.key, domain, k.component});
      store_->Touch(ids);
    }
    std::vector<Cache::WriteBackBlock> blocks =
        c.TakeWriteBack(batch, window, [this, &domain](const BlockKey& key, uint32_t component) {
          return store_->Lookup(SsdBlockId{key, domain, component}).has_value();
        });
    if (blocks.empty()) continue;
    if (c.generation() != generation) {  // dropped and replaced since DomainOf (the pins make that impossible now)
      for (const Cache::WriteBackBlock& b : blocks) c.EndWriteBack(b, false);
      continue;
    }
    for (size_t j = 0; j < blocks.size(); ++j) {
      const Cache::WriteBackBlock b = blocks[j];
      const std::span<const uint8_t> payload(c.SlotData(b.slot), c.SlotBytes(b.slot));
      writes_in_flight_.fetch_add(1, std::memory_order_relaxed);
      Cache* cache = &c;
      const Status accepted = store_->Write(
          SsdBlockId{b.key, domain, b.component}, b.parent, payload, b.content_checksum, [this, cache, b](Status s) {
            writes_in_flight_.fetch_sub(1, std::memory_order_relaxed);
            if (s.ok()) {
              written_back_.fetch_add(1, std::memory_order_relaxed);
            } else {
              writeback_failed_.fetch_add(1, std::memory_order_relaxed);
              WriteErrorLog().Warning("ssd", "write-back failed, the block stays in DRAM only: {}", s.ToString());
            }
            cache->EndWriteBack(b, s.ok());
          });
      if (accepted.ok()) {
        ++written;
        continue;
      }
      writes_in_flight_.fetch_sub(1, std::memory_order_relaxed);
      if (accepted.code() == StatusCode::kAlreadyExists) {  // on SSD already (or being written by another round)
        c.EndWriteBack(b, true);
        continue;
      }
      // Queue full (or closing): the rest waits for a later round, unwritten.
      writeback_refused_.fetch_add(blocks.size() - j, std::memory_order_relaxed);
      for (size_t k = j; k < blocks.size(); ++k) c.EndWriteBack(blocks[k], false);
      if (accepted.code() != StatusCode::kResourceExhausted) failed = true;
      break;
    }
  }
  {
    MutexLock lock(&mu_);
    notes_ = std::move(notes);
  }
  // Stores wait for the write-back only while it succeeds: a write that fails turns that off until writes complete
  // again without a new failure.
  const uint64_t failures_now = writeback_failed_.load(std::memory_order_relaxed);
  const uint64_t ok_now = written_back_.load(std::memory_order_relaxed);
  bool healthy = write_back_healthy_;
  if (failed || failures_now != failures_seen_) {
    healthy = false;
  } else if (ok_now != ok_seen_) {
    healthy = true;
  }
  ok_seen_ = ok_now;
  if (healthy != write_back_healthy_) {
    write_back_healthy_ = healthy;
    for (size_t i = 0; i < caches_->max_domains(); ++i) caches_->cache(i).SetWriteBackHealthy(healthy);
    if (!healthy) log::Warning("ssd", "SSD writes fail: stores no longer wait for the write-back (blocks DRAM evicts "
                                      "unwritten are lost from the node, counted in evicted_unwritten_blocks)");
  }
  failures_seen_ = failures_now;
  if (failed || writeback_failed_.load(std::memory_order_relaxed) > 0) {
    // A drive that fails writes (full, I/O errors) is not hammered: at most a round a second from then on.
    static thread_local uint64_t seen_failures = 0;
    const uint64_t now_failures = writeback_failed_.load(std::memory_order_relaxed);
    if (failed || now_failures != seen_failures) {
      seen_failures = now_failures;
      IdleWait(std::chrono::seconds(1));
    }
  }
  return written;
}

void SsdTier::SampleRates() {
  if (!store_ready_.load(std::memory_order_acquire)) return;
  const int64_t now = MonotonicMs();
  MutexLock lock(&mu_);
  if (now - last_sample_ms_ < 1000) return;
  const SsdStoreStats s = store_->stats();
  const double dt = static_cast<double>(now - last_sample_ms_) / 1000.0;
  read_rate_ = static_cast<double>(s.read_bytes - last_read_bytes_) / dt;
  write_rate_ = static_cast<double>(s.write_bytes - last_write_bytes_) / dt;
  last_read_bytes_ = s.read_bytes;
  last_write_bytes_ = s.write_bytes;
  last_sample_ms_ = now;
}

bool SsdTier::Promote(Cache& cache, std::span<const BlockKey> keys, size_t dram_hit, PromotionDone done) {
  promoting_.fetch_add(1, std::memory_order_seq_cst);
  struct Leave {
    std::atomic<uint32_t>& n;
    ~Leave() { n.fetch_sub(1, std::memory_order_seq_cst); }
  } leave{promoting_};
  if (stopping_.load(std::memory_order_seq_cst) || dram_hit >= keys.size() || !Eligible(cache)) return false;
  bool wait = false;
  if (StartPromotion(cache, keys, dram_hit, done, /*partial=*/false, &wait)) return true;
  if (!wait) return false;
  // It could go on only by evicting what SSD does not hold yet: it waits for the write-back, as a store does
  // (the mover retries it when a write completed, or every 10 ms: RetryWaitingPromotions); past the wait it takes
  // what fits (FULL) or nothing (hybrid).
  const int64_t wait_ms = cache.StoreWaitMs();
  MutexLock lock(&mu_);
  if (stop_requested_ || wait_ms <= 0) return false;
  waiting_promotions_.push_back(WaitingPromotion{&cache, cache.generation(), std::vector<BlockKey>(keys.begin(), keys.end()),
                                                 std::move(done), MonotonicMs() + wait_ms});
  promotion_waits_.fetch_add(1, std::memory_order_relaxed);
  idle_cv_.notify_one();
  return true;
}

void SsdTier::RetryWaitingPromotions() {
  const int64_t now = MonotonicMs();
  std::vector<WaitingPromotion> waiting;
  {
    MutexLock lock(&mu_);
    if (waiting_promotions_.empty()) return;
    // Room comes mostly from writes that completed; a pin let go (an engine's load ended) is found within 10 ms.
    const uint64_t written = written_back_.load(std::memory_order_relaxed);
    const bool due = stop_requested_ || written != written_at_retry_ || now >= next_retry_ms_ ||
                     std::any_of(waiting_promotions_.begin(), waiting_promotions_.end(),
                                 [now](const WaitingPromotion& w) { return now >= w.deadline_ms; });
    if (!due) return;
    written_at_retry_ = written;
    next_retry_ms_ = now + 10;
    waiting.swap(waiting_promotions_);
  }
  std::vector<WaitingPromotion> still;
  for (WaitingPromotion& w : waiting) {
    const bool stopping = stopping_.load(std::memory_order_acquire);
    const bool expired = now >= w.deadline_ms;
    bool wait = false;
    size_t dram_hit = w.keys.size();
    if (!stopping && w.cache->generation() == w.generation && Eligible(*w.cache)) {
      dram_hit = w.cache->Match(w.keys, /*pin=*/false, nullptr);
    }
    // Past its deadline a FULL promotion takes the part that fits without an unwritten eviction; a hybrid one (all
    // or none) is answered from DRAM. Either way no block SSD does not hold is evicted for a read.
    if (dram_hit < w.keys.size() && StartPromotion(*w.cache, w.keys, dram_hit, w.done, /*partial=*/expired, &wait)) {
      if (expired) promotion_wait_expired_.fetch_add(1, std::memory_order_relaxed);
      continue;  // reads in flight: w.done's copy runs when they end
    }
    if (wait && !expired && !stopping) {
      still.push_back(std::move(w));
      continue;
    }
    // Counted where the wait ran out with the promotion still due (not: the prefix came to DRAM, the domain went).
    if ((wait || expired) && dram_hit < w.keys.size()) promotion_wait_expired_.fetch_add(1, std::memory_order_relaxed);
    w.done(0);  // nothing promoted: the match goes on from DRAM
  }
  if (still.empty()) return;
  MutexLock lock(&mu_);
  for (WaitingPromotion& w : still) waiting_promotions_.push_back(std::move(w));
}

bool SsdTier::StartPromotion(Cache& cache, std::span<const BlockKey> keys, size_t dram_hit, PromotionDone done,
                             bool partial, bool* wait) {
  if (const CacheDomain::View v = cache.Domain(); v.geometry && v.geometry->is_hybrid()) {
    return PromoteHybrid(cache, keys, std::move(done), wait);  // ssd_tier_hybrid.cc
  }
  const uint64_t generation = cache.generation();
  const SsdDomain domain = DomainOf(cache);
  // A sharded geometry's blocks an older release wrote in the layer-major order: found under its geometry string.
  const std::optional<SsdDomain> old_order = [&] {
    const CacheDomain::View v = cache.Domain();
    return v.geometry ? SsdDomain::OfLayerMajor(v.model_namespace, *v.geometry) : std::nullopt;
  }();
  const uint64_t block_bytes = cache.block_bytes();
  // The run of blocks SSD holds right after the DRAM prefix, each under the previous one.
  auto job = std::make_shared<Promotion>();
  job->cache = &cache;
  job->parent = dram_hit == 0 ? kRootParent : keys[dram_hit - 1];
  std::vector<uint64_t> sums;
  BlockKey expected_parent = job->parent;
  for (size_t i = dram_hit; i < keys.size(); ++i) {
    std::optional<SsdEntry> e = store_->Lookup(SsdBlockId{keys[i], domain, 0});
    bool layer_major = false;
    if (!e && old_order) {
      e = store_->Lookup(SsdBlockId{keys[i], *old_order, 0});
      layer_major = e.has_value();
    }
    if (!e || e->parent != expected_parent || e->payload_bytes != block_bytes) break;
    job->run.push_back(keys[i]);
    job->layer_major.push_back(layer_major ? 1 : 0);
    sums.push_back(e->content_checksum);
    expected_parent = keys[i];
  }
  if (job->run.empty()) return false;
  // While the write-back serves, only blocks SSD holds are evicted for a promotion (Cache::Reserve's may_wait).
  const PrefixIndex::Reservation r = cache.Reserve(job->parent, job->run, /*may_wait=*/true);
  const size_t wanted = job->run.size() - std::min(r.cached, job->run.size());
  // Short of room with only unwritten blocks (or blocks being written) left to evict: wait for the write-back, unless
  // past the wait or nothing the write-back does can help (pins alone stand in the way): then what fits is promoted.
  if (r.dirty_only && !partial && cache.WriteBackMayMakeRoom()) {
    cache.Abort(r.slots);  // what it evicted was on SSD: nothing lost
    *wait = true;
    return false;
  }
  promotion_requests_.fetch_add(1, std::memory_order_relaxed);
  if (r.slots.empty()) {
    // The parent left DRAM meanwhile, or no slot is free or evictable, or another store got there first.
    promotion_refused_.fetch_add(wanted, std::memory_order_relaxed);
    return false;
  }
  if (cache.generation() != generation) {  // the domain was dropped and replaced since DomainOf: not its blocks
    cache.Abort(r.slots);
    return false;
  }
  idle_cv_.notify_one();  // the reservation may have evicted: the mover refills the cold end
  job->first = r.cached;
  job->ok.reset(new std::atomic<uint8_t>[r.slots.size()]);
  job->rewritten.reset(new std::atomic<uint64_t>[r.slots.size()]);
  for (size_t i = 0; i < r.slots.size(); ++i) {
    job->ok[i].store(0, std::memory_order_relaxed);
    job->rewritten[i].store(0, std::memory_order_relaxed);
  }
  job->done = std::move(done);
  // Every read is issued before any may complete the job: one extra count, dropped at the end of issuing.
  job->remaining.store(r.slots.size() + 1, std::memory_order_relaxed);
  const auto finish = [this](const std::shared_ptr<Promotion>& p) {
    size_t ok = 0;
    while (ok < p->slots.size() && p->ok[ok].load(std::memory_order_acquire) == 1) ++ok;
    const std::span<const SlotId> slots(p->slots);
    if (ok > 0) {
      // Blocks rewritten from an older release's order commit with their new checksum, and are not on SSD in
      // today's order: they are written back like any new block (their old copies age out of the SSD).
      std::vector<uint64_t> checksums(p->checksums.begin(), p->checksums.begin() + static_cast<ptrdiff_t>(ok));
      std::vector<SlotId> on_ssd;
      for (size_t i = 0; i < ok; ++i) {
        const uint64_t rewritten = p->rewritten[i].load(std::memory_order_acquire);
        if (rewritten != 0) {
          checksums[i] = rewritten;
        } else {
          on_ssd.push_back(slots[i]);
        }
      }
      p->cache->Commit(p->parent, p->run, p->first, slots.first(ok), checksums, Cache::BlockEvent::kPromoted);
      p->cache->MarkOnNextTier(on_ssd);
      if (on_ssd.size() < ok) rewritten_promotions_.fetch_add(ok - on_ssd.size(), std::memory_order_relaxed);
    }
    if (ok < slots.size()) p->cache->Abort(slots.subspan(ok));
    promoted_.fetch_add(ok, std::memory_order_relaxed);
    PromotionDone d = std::move(p->done);
    d(ok);
  };
  size_t issued = 0;
  for (; issued < r.slots.size(); ++issued) {
    const SlotId slot = r.slots[issued];
    const size_t k = job->first + issued;
    job->slots.push_back(slot);
    job->checksums.push_back(sums[k]);
    reads_in_flight_.fetch_add(1, std::memory_order_relaxed);
    const SsdDomain read_domain = job->layer_major[k] != 0 ? *old_order : domain;
    const Status accepted = store_->Read(
        SsdBlockId{job->run[k], read_domain, 0}, std::span<uint8_t>(cache.SlotData(slot), cache.SlotBytes(slot)),
        [this, job, issued, finish, domain = read_domain, slot, sum = sums[k], key = job->run[k],
         layer_major = job->layer_major[k] != 0](Status s) {
          reads_in_flight_.fetch_sub(1, std::memory_order_relaxed);
          // The bytes passed the store's XXH3 (they are what was written); they must also be the block the DRAM
          // pool stored: a block corrupted in DRAM before its write-back must not come back through SSD.
          // (slot, sum and key by value: the issuing thread may still be growing job's vectors.)
          // An older release's slot order: checked in the order it was written and rewritten in today's in one pass
          // (the slot is reserved: no one reads it yet), committed with the new checksum.
          std::optional<uint64_t> rewritten;
          if (s.ok() && layer_major) rewritten = job->cache->RewriteReservedInSlotOrder(slot, sum);
          if (s.ok() && (layer_major ? !rewritten.has_value() : !job->cache->ContentMatches(slot, sum))) {
            const SsdBlockId id{key, domain, 0};
            store_->Erase(id);
            s = Status::DataLoss(fmt::format("{} read from SSD does not match the content checksum it was stored with "
                                             "(corrupted before it was written back); dropped", id.ToString()));
          }
          if (rewritten) job->rewritten[issued].store(*rewritten, std::memory_order_release);
          if (!s.ok()) {
            promotion_failed_.fetch_add(1, std::memory_order_relaxed);
            PromotionErrorLog().Warning("ssd", "promotion: {}; the match ends before this block", s.ToString());
          }
          job->ok[issued].store(s.ok() ? 1 : 2, std::memory_order_release);
          if (job->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) finish(job);
        });
    if (!accepted.ok()) {
      reads_in_flight_.fetch_sub(1, std::memory_order_relaxed);
      job->slots.pop_back();
      job->checksums.pop_back();
      break;
    }
  }
  if (issued < r.slots.size()) {
    // Not issued (queue full, or gone from SSD since Lookup): no I/O into these slots, give them back now.
    promotion_refused_.fetch_add(r.slots.size() - issued, std::memory_order_relaxed);
    cache.Abort(std::span<const SlotId>(r.slots).subspan(issued));
  }
  if (issued == 0) return false;  // nothing in flight: the caller answers from DRAM
  // The reads not issued never count down: drop them and the extra count together.
  const size_t uncounted = r.slots.size() - issued + 1;
  if (job->remaining.fetch_sub(uncounted, std::memory_order_acq_rel) == uncounted) finish(job);
  return true;
}

SsdTierStatus SsdTier::GetStatus() const {
  SsdTierStatus s;
  {
    MutexLock lock(&mu_);
    s.state = state_;
    s.notes = notes_;
    s.read_bytes_per_s = read_rate_;
    s.write_bytes_per_s = write_rate_;
  }
  if (store_ready_.load(std::memory_order_acquire)) {
    s.store = store_->stats();
    s.rebuild = store_->rebuild_report();
    s.files = store_->files();
    s.capacity_blocks = store_->capacity_slots();
    s.used_blocks = s.store.blocks;
    s.capacity_bytes = store_->capacity_slots() * store_->slot_stride();
    s.block_bytes = store_->payload_capacity();
  }
  s.promoted_blocks = promoted_.load(std::memory_order_relaxed);
  s.promotion_requests = promotion_requests_.load(std::memory_order_relaxed);
  s.promotion_refused_blocks = promotion_refused_.load(std::memory_order_relaxed);
  s.promotion_waits = promotion_waits_.load(std::memory_order_relaxed);
  s.promotion_wait_expired = promotion_wait_expired_.load(std::memory_order_relaxed);
  s.promotion_failed_blocks = promotion_failed_.load(std::memory_order_relaxed);
  s.promoted_layer_major_blocks = rewritten_promotions_.load(std::memory_order_relaxed);
  s.written_back_blocks = written_back_.load(std::memory_order_relaxed);
  s.writeback_refused_blocks = writeback_refused_.load(std::memory_order_relaxed);
  s.writeback_failed_blocks = writeback_failed_.load(std::memory_order_relaxed);
  s.reads_in_flight = reads_in_flight_.load(std::memory_order_relaxed);
  s.writes_in_flight = writes_in_flight_.load(std::memory_order_relaxed);
  for (size_t i = 0; i < caches_->max_domains(); ++i) {
    const Cache::WriteBackStats w = caches_->cache(i).write_back_stats();
    s.evicted_written_blocks += w.evicted_written;
    s.evicted_unwritten_blocks += w.evicted_unwritten;
    s.store_waits += w.store_waits;
    s.store_wait_expired += w.store_wait_expired;
  }
  return s;
}

void SsdTier::IdleWait(std::chrono::milliseconds d) {
  const auto end = std::chrono::steady_clock::now() + d;
  MutexLock lock(&mu_);
  while (!stop_requested_) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= end) break;
    mu_.WaitFor(&idle_cv_, end - now);
  }
}

}  // namespace flexkv
