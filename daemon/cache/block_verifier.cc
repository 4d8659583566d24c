// See block_verifier.h.
#include "daemon/cache/block_verifier.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <system_error>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "common/log.h"
#include "common/units.h"

namespace flexkv {
namespace {

// A batch is checked without the cache's lock and settled under it in one go.
constexpr uint64_t kBatchBytes = 64ULL << 20;
constexpr size_t kMaxBatchBlocks = 4096;
// Slots a scrub pins at once: few, so that a serving node keeps nearly all of its pool evictable.
constexpr SlotId kScrubSlotsPerRange = 256;

// One line per failed block would let a damaged pool flood the log.
log::RateLimited& FailureLog() {
  static log::RateLimited limited(1000);
  return limited;
}

double Seconds(int64_t ns) { return static_cast<double>(ns) / 1e9; }

}  // namespace

BlockVerifier::BlockVerifier(Cache* cache, unsigned threads)
    : cache_(cache),
      threads_(threads != 0 ? threads : std::clamp(std::thread::hardware_concurrency() / 2, 1u, 8u)) {}

BlockVerifier::~BlockVerifier() {
  stop_.store(true, std::memory_order_relaxed);
  if (restart_thread_.joinable()) restart_thread_.join();
}

void BlockVerifier::StartRestartVerification() {
  restart_thread_ = std::thread([this] { VerifyRestored(); });
}

void BlockVerifier::VerifyRestored() {
  // A re-attached pool's grants are registered for DMA in the background (Cache::SetPrepareInBackground): its
  // blocks are served - verified - only after that, so that no load reaches a grant the copy engines cannot.
  while (!stop_.load(std::memory_order_relaxed) && cache_->preparation().preparing) {
    (void)cache_->WaitForPreparation(std::chrono::milliseconds(200));
  }
  const std::vector<Pool::Committed> restored = cache_->TakeUnverified();
  if (restored.empty()) return;
  struct EndVerification {
    Cache* cache;
    ~EndVerification() { cache->EndVerification(); }
  } end_verification{cache_};
  const uint64_t block_bytes = cache_->block_bytes();
  const size_t per_batch = std::clamp<size_t>(kBatchBytes / std::max<uint64_t>(block_bytes, 1), 1, kMaxBatchBlocks);
  const int64_t start = NowNs();
  uint64_t failed_total = 0, dropped_total = 0, bytes_checked = 0;
  size_t done = 0;
  std::vector<SlotId> passed, failed;
  std::vector<Pool::Committed> batch;
  std::vector<uint8_t> verdict;  // per block of the batch: 1 passed, 2 failed, 0 not decided (an error checking it)
  std::atomic<uint64_t> rewritten_atomic{0}, rewritten_bytes_atomic{0};
  std::atomic<bool> check_error{false};
  // Checks batch[b, e): a block of an older release's slot order is checked and rewritten in today's in one pass,
  // before it can be served. Blocks are in distinct slots that nothing else touches meanwhile (KeepUnverified).
  // A block whose check throws (no memory for a rewrite's scratch) is left undecided: unverified, never served, checked
  // again at the next start; the run stops after its batch.
  const auto check = [&](size_t b, size_t e) noexcept {
    for (size_t i = b; i < e; ++i) {
      const Pool::Committed& c = batch[i];
      try {
        const bool matches =
            c.layer_major ? cache_->RewriteInSlotOrder(c) : cache_->ContentMatches(c.slot, c.content_checksum);
        verdict[i] = matches ? 1 : 2;
        if (matches && c.layer_major) {
          rewritten_atomic.fetch_add(1, std::memory_order_relaxed);
          rewritten_bytes_atomic.fetch_add(cache_->SlotBytes(c.slot), std::memory_order_relaxed);
        }
      } catch (const std::exception&) {
        check_error.store(true, std::memory_order_relaxed);
        return;
      }
    }
  };
  for (size_t begin = 0; begin < restored.size() && !stop_.load(std::memory_order_relaxed); begin += per_batch) {
    const size_t end = std::min(restored.size(), begin + per_batch);
    passed.clear();
    failed.clear();
    batch.assign(restored.begin() + static_cast<ptrdiff_t>(begin), restored.begin() + static_cast<ptrdiff_t>(end));
    // Only this thread settles unverified blocks, so those still unverified now stay so until FinishChecks:
    // nothing matches, pins, evicts or reuses their slots, and their bytes hold still.
    cache_->KeepUnverified(&batch);
    verdict.assign(batch.size(), 0);
    const size_t workers = std::min<size_t>(threads_, batch.size());
    if (workers <= 1) {
      check(0, batch.size());
    } else {
      struct Helpers {  // joined whatever happens below
        std::vector<std::thread> threads;
        ~Helpers() {
          for (auto& t : threads) {
            if (t.joinable()) t.join();
          }
        }
      } helpers;
      helpers.threads.reserve(workers - 1);
      const size_t per = (batch.size() + workers - 1) / workers;
      for (size_t w = 1; w < workers; ++w) {
        const size_t b = w * per, e = std::min(batch.size(), b + per);
        if (b >= e) continue;
        try {
          helpers.threads.emplace_back(check, b, e);
        } catch (const std::system_error&) {  // no thread to be had: this one checks that part too
          check(b, e);
        }
      }
      check(0, std::min(batch.size(), per));
    }
    for (size_t i = 0; i < batch.size(); ++i) {
      const Pool::Committed& c = batch[i];
      if (verdict[i] == 0) continue;  // undecided: stays unverified (checked at the next start)
      bytes_checked += cache_->SlotBytes(c.slot);  // a hybrid pool's slots differ in size by component
      if (verdict[i] == 1) {
        passed.push_back(c.slot);
      } else {
        failed.push_back(c.slot);
        FailureLog().Warning("verify", "block in slot {} (key {}) changed while flexkvd was stopped: dropped", c.slot,
                             c.key.ToHex());
      }
    }
    dropped_total += cache_->FinishChecks(passed, {}, failed);
    failed_total += failed.size();
    done = end;
    if (check_error.load(std::memory_order_relaxed)) {
      log::Warning("verify", "the restart check ran out of memory (a rewrite's buffer): it stops here, the blocks it did "
                   "not decide are not served until the next start checks them");
      break;
    }
  }
  const uint64_t rewritten = rewritten_atomic.load(), bytes_rewritten = rewritten_bytes_atomic.load();
  const std::string summary = fmt::format(
      "{} of {} restored blocks checked in {:.2f} s ({}/s, {} thread{}): {} failed their content checksum and were "
      "dropped with their descendants ({} blocks in all){}",
      done, restored.size(), Seconds(NowNs() - start),
      FormatByteSize(static_cast<uint64_t>(static_cast<double>(bytes_checked) /
                                           std::max(1e-9, Seconds(NowNs() - start)))),
      threads_, threads_ == 1 ? "" : "s",
      failed_total, dropped_total,
      rewritten == 0 ? std::string()
                     : fmt::format("; {} blocks ({}) of an older release's layer-major slot order rewritten in "
                                   "today's rank-major order", rewritten, FormatByteSize(bytes_rewritten)));
  if (failed_total > 0) {
    log::Warning("verify", "{}", summary);
  } else {
    log::Info("verify", "{}{}", summary, done < restored.size() ? " (stopped early: the rest is checked next start)" : "");
  }
}

Result<ScrubReport> BlockVerifier::Scrub(const ScrubOptions& options) {
  if (!cache_->has_pool()) return Status::FailedPrecondition("the pool does not exist yet: nothing to scrub");
  if (scrubbing_.exchange(true)) return Status(StatusCode::kAborted, "a scrub is already running; wait for it to finish");
  const SlotId capacity = cache_->slot_id_end();  // every slot id (a resized pool's active ones are fewer)
  ScrubReport report;
  const int64_t start = NowNs();
  std::vector<SlotId> pinned, failed;
  bool cancelled = false, dropped = false;
  const uint64_t generation = cache_->generation();  // capacity and block size are this pool's
  for (SlotId begin = 0; begin < capacity; begin += kScrubSlotsPerRange) {
    if (stop_.load(std::memory_order_relaxed) || (options.cancelled && options.cancelled())) {
      cancelled = true;
      break;
    }
    if (cache_->generation() != generation) {  // an admin dropped the domain between two ranges
      dropped = true;
      break;
    }
    const std::vector<Cache::CheckTarget> targets =
        cache_->PinForCheck(begin, static_cast<SlotId>(std::min<uint64_t>(capacity, uint64_t{begin} + kScrubSlotsPerRange)));
    pinned.clear();
    failed.clear();
    for (const Cache::CheckTarget& t : targets) {
      pinned.push_back(t.slot);
      const bool ok = t.content_checksum.has_value() && cache_->ContentMatches(t.slot, *t.content_checksum);
      if (!ok) {
        failed.push_back(t.slot);
        FailureLog().Warning("scrub", "block in slot {} failed its {}: dropped", t.slot,
                             t.content_checksum ? "content checksum" : "slot entry checksum");
      }
      report.bytes += cache_->SlotBytes(t.slot);
    }
    report.checked_blocks += targets.size();
    report.failed_blocks += failed.size();
    report.dropped_blocks += cache_->FinishChecks({}, pinned, failed);
    if (options.max_bytes_per_s != 0) {
      // Unpinned, sleep until the bytes read so far fit the rate, in slices so that a cancel ends it soon.
      const int64_t due = start + static_cast<int64_t>(static_cast<double>(report.bytes) * 1e9 /
                                                       static_cast<double>(options.max_bytes_per_s));
      for (int64_t now = NowNs(); now < due && !stop_.load(std::memory_order_relaxed) &&
                                  !(options.cancelled && options.cancelled());
           now = NowNs()) {
        std::this_thread::sleep_for(std::chrono::nanoseconds(std::min<int64_t>(due - now, 100'000'000)));
      }
    }
  }
  report.seconds = Seconds(NowNs() - start);
  const std::string summary =
      fmt::format("scrub {} {} blocks ({}) in {:.2f} s: {} failed, {} dropped with their descendants",
                  cancelled ? "cancelled after checking" : "checked", report.checked_blocks,
                  FormatByteSize(report.bytes), report.seconds, report.failed_blocks, report.dropped_blocks);
  if (report.failed_blocks > 0) {
    log::Warning("scrub", "{}", summary);
  } else {
    log::Info("scrub", "{}", summary);
  }
  scrubbing_.store(false);
  if (cancelled) return Status::Cancelled(summary);
  if (dropped) return Status(StatusCode::kAborted, "the cache domain was dropped during the scrub; " + summary);
  return report;
}

}  // namespace flexkv
