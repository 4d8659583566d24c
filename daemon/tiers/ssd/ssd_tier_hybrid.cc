// SsdTier: promotion of a hybrid domain's pieces - FULL blocks, window and state entries - from SSD, keeping the hit
// rule across the tiers (docs/ssd.md, "Hybrid domains"); see ssd_tier.h. Write-back needs nothing of its own: the
// cache hands out every component's entries with their component (Cache::TakeWriteBack) and the mover writes each
// under SsdBlockId{key, domain, component}.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <optional>
#include <vector>

#include "common/log.h"
#include "daemon/cache/cache.h"
#include "daemon/tiers/ssd/ssd_tier.h"

namespace flexkv {

namespace {

// A hybrid promotion in flight: the cache's reservation, and what each piece's read answered (flat, component by
// component: piece i of component c is at offset[c] + i).
struct HybridJob {
  Cache* cache = nullptr;
  std::vector<BlockKey> keys;        // the match's keys (the reservation's indexes refer to them)
  Cache::HybridPromotion plan;
  std::vector<size_t> offset;        // [component] its first piece in ok / sums
  // 0: not ended, Cache::kPieceVerified, Cache::kPieceRewritten (from an older release's slot order), 2: failed or
  // not read
  std::unique_ptr<std::atomic<uint8_t>[]> ok;
  std::vector<uint64_t> sums;        // each piece's content checksum (from its SSD entry)
  std::atomic<size_t> remaining{0};  // reads not ended, plus one while they are being issued
  std::atomic<size_t> lost{0};       // pieces that failed verification (dropped from SSD)
  SsdTier::PromotionDone done;
};

log::RateLimited& HybridPromotionErrorLog() {
  static log::RateLimited limited(10000);
  return limited;
}

}  // namespace

uint64_t LargestSlotBytes(const Geometry& geometry, size_t* component) {
  uint64_t largest = 0;
  for (size_t c = 0; c < geometry.component_count(); ++c) {
    const uint64_t bytes = geometry.Component(c).host_block_bytes();
    if (bytes > largest) {
      largest = bytes;
      if (component != nullptr) *component = c;
    }
  }
  return largest;
}

bool SsdTier::PromoteHybrid(Cache& cache, std::span<const BlockKey> keys, PromotionDone done, bool* wait,
                            int attempts) {
  const uint64_t generation = cache.generation();
  const SsdDomain domain = DomainOf(cache);
  const CacheDomain::View view = cache.Domain();
  if (!view.geometry) return false;
  const Geometry& g = *view.geometry;
  // A sharded geometry's pieces an older release wrote in the layer-major slot order: under its geometry string.
  const std::optional<SsdDomain> old_order = SsdDomain::OfLayerMajor(view.model_namespace, g);
  const size_t components = g.component_count();
  std::vector<uint64_t> slot_bytes(components);
  for (size_t c = 0; c < components; ++c) slot_bytes[c] = g.Component(c).host_block_bytes();
  // Asked under the cache's lock: whether SSD holds keys[j] of component c, the right size, and (FULL) under the key
  // before it.
  const auto on_next = [&](size_t c, size_t j) {
    std::optional<SsdEntry> e = store_->Lookup(SsdBlockId{keys[j], domain, static_cast<uint32_t>(c)});
    if (!e && old_order) e = store_->Lookup(SsdBlockId{keys[j], *old_order, static_cast<uint32_t>(c)});
    if (!e || e->payload_bytes != slot_bytes[c]) return false;
    return c != 0 || e->parent == (j == 0 ? kRootParent : keys[j - 1]);
  };
  auto job = std::make_shared<HybridJob>();
  job->plan = cache.ReservePromotion(keys, on_next);
  const size_t pieces = job->plan.pieces();
  if (job->plan.end == 0) {
    if (job->plan.wait_for_write_back) {
      *wait = true;
      return false;
    }
    if (job->plan.refused > 0) {
      promotion_requests_.fetch_add(1, std::memory_order_relaxed);
      promotion_refused_.fetch_add(job->plan.refused, std::memory_order_relaxed);
    }
    return false;
  }
  job->cache = &cache;
  job->keys.assign(keys.begin(), keys.end());
  job->offset.assign(components + 1, 0);
  for (size_t c = 0; c < components; ++c) job->offset[c + 1] = job->offset[c] + job->plan.slots[c].size();
  job->ok.reset(new std::atomic<uint8_t>[pieces]);
  for (size_t i = 0; i < pieces; ++i) job->ok[i].store(0, std::memory_order_relaxed);
  job->sums.assign(pieces, 0);
  const auto finish = [this, attempts](const std::shared_ptr<HybridJob>& p) {
    std::vector<std::vector<uint8_t>> ok(p->plan.slots.size());
    std::vector<std::vector<uint64_t>> sums(p->plan.slots.size());
    for (size_t c = 0; c < p->plan.slots.size(); ++c) {
      for (size_t i = p->offset[c]; i < p->offset[c + 1]; ++i) {
        ok[c].push_back(p->ok[i].load(std::memory_order_acquire));
        sums[c].push_back(p->sums[i]);
      }
    }
    const size_t committed = p->cache->CommitPromoted(p->keys, p->plan, ok, sums);
    promoted_.fetch_add(committed, std::memory_order_relaxed);
    size_t rewritten = 0;  // read, checked and rewritten (a FULL piece after a failed one is given back all the same)
    for (const auto& component : ok) rewritten += std::count(component.begin(), component.end(), Cache::kPieceRewritten);
    rewritten_promotions_.fetch_add(rewritten, std::memory_order_relaxed);
    PromotionDone d = std::move(p->done);
    // A piece that failed is gone from SSD now, so the end it was planned for does not hold: the longest end that
    // still does (a shorter one, with its own window and state) is promoted next. Each attempt drops at least one
    // entry from SSD; the attempts are bounded all the same.
    if (p->lost.load(std::memory_order_acquire) > 0 && attempts > 1 && !stopping_.load(std::memory_order_acquire)) {
      auto again = std::make_shared<PromotionDone>(d);
      bool waits = false;  // a shorter end that would evict unwritten pieces is not promoted: the match ends here
      if (PromoteHybrid(*p->cache, p->keys, [again, committed](size_t more) { (*again)(committed + more); }, &waits,
                        attempts - 1)) {
        return;
      }
    }
    d(committed);
  };
  // Gives every reserved slot and pinned piece back, reading nothing.
  const auto give_back = [&cache, &job] {
    std::vector<std::vector<uint8_t>> none(job->plan.slots.size());
    std::vector<std::vector<uint64_t>> sums(job->plan.slots.size());
    for (size_t c = 0; c < job->plan.slots.size(); ++c) {
      none[c].assign(job->plan.slots[c].size(), 2);
      sums[c].assign(job->plan.slots[c].size(), 0);
    }
    cache.CommitPromoted(job->keys, job->plan, none, sums);
  };
  if (cache.generation() != generation || pieces == 0) {  // dropped and replaced since DomainOf: not its blocks
    give_back();
    return false;
  }
  promotion_requests_.fetch_add(1, std::memory_order_relaxed);
  idle_cv_.notify_one();  // the reservation may have evicted: the mover refills the cold end
  job->done = std::move(done);
  // Every read is issued before any may complete the job: one extra count, dropped at the end of issuing.
  job->remaining.store(pieces + 1, std::memory_order_relaxed);
  size_t issued = 0;
  for (size_t c = 0; c < components; ++c) {
    for (size_t i = 0; i < job->plan.slots[c].size(); ++i) {
      const size_t piece = job->offset[c] + i;
      const SlotId slot = job->plan.slots[c][i];
      SsdBlockId id{job->plan.keys[c][i], domain, static_cast<uint32_t>(c)};
      std::optional<SsdEntry> entry = store_->Lookup(id);
      bool layer_major = false;
      if (!entry && old_order) {
        id.domain = *old_order;
        entry = store_->Lookup(id);
        layer_major = entry.has_value();
      }
      Status accepted = Status::NotFound("gone from SSD since the match looked");
      if (entry) {
        job->sums[piece] = entry->content_checksum;
        reads_in_flight_.fetch_add(1, std::memory_order_relaxed);
        accepted = store_->Read(
            id, std::span<uint8_t>(cache.SlotData(slot), cache.SlotBytes(slot)),
            [this, job, piece, finish, id, slot, sum = entry->content_checksum, layer_major](Status s) {
              reads_in_flight_.fetch_sub(1, std::memory_order_relaxed);
              // The bytes passed the store's XXH3 (they are what was written); they must also be what the DRAM pool
              // stored: a piece corrupted in DRAM before its write-back must not come back through SSD. One of an
              // older release's layer-major order is checked and rewritten in today's in one pass (the slot is
              // reserved: no one reads it yet), and committed with its new checksum.
              std::optional<uint64_t> rewritten;
              if (s.ok() && layer_major) rewritten = job->cache->RewriteReservedInSlotOrder(slot, sum);
              if (s.ok() && (layer_major ? !rewritten.has_value() : !job->cache->ContentMatches(slot, sum))) {
                store_->Erase(id);
                s = Status::DataLoss(fmt::format("{} read from SSD does not match the content checksum it was stored "
                                                 "with (corrupted before it was written back); dropped",
                                                 id.ToString()));
              }
              if (rewritten) job->sums[piece] = *rewritten;  // read by the commit only once every read has ended
              if (!s.ok()) {
                promotion_failed_.fetch_add(1, std::memory_order_relaxed);
                job->lost.fetch_add(1, std::memory_order_relaxed);
                HybridPromotionErrorLog().Warning(
                    "ssd", "promotion: {}; the match ends where this piece is needed", s.ToString());
              }
              job->ok[piece].store(!s.ok() ? 2 : rewritten ? Cache::kPieceRewritten : Cache::kPieceVerified,
                                   std::memory_order_release);
              if (job->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) finish(job);
            });
        if (!accepted.ok()) reads_in_flight_.fetch_sub(1, std::memory_order_relaxed);
      }
      if (accepted.ok()) {
        ++issued;
        continue;
      }
      // Not read (queue full, or gone from SSD): its slot is given back at the commit, the match ends before it.
      promotion_refused_.fetch_add(1, std::memory_order_relaxed);
      job->ok[piece].store(2, std::memory_order_release);
      job->remaining.fetch_sub(1, std::memory_order_acq_rel);  // never the last: the extra count is held
    }
  }
  if (job->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    // Every read ended (or none was issued) before this: the commit runs here.
    if (issued == 0) {
      give_back();
      return false;  // nothing was read: the caller answers from DRAM, `done` is not called
    }
    finish(job);
  }
  return true;
}

}  // namespace flexkv
