// BlockVerifier: checks pool blocks' bytes against the content checksums in their slot entries: the blocks a
// restarted daemon restored (in the background, before any of them is served) and, when an admin asks, every
// committed block (Scrub). A block that fails is dropped with its descendants, never served again, and counted
// in data_loss_blocks.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>

#include "daemon/cache/cache.h"
#include "flexkv/status.h"

namespace flexkv {

struct ScrubOptions {
  uint64_t max_bytes_per_s = 0;  // 0: as fast as one thread reads
  std::function<bool()> cancelled;  // optional: polled between ranges; true ends the scrub early (CANCELLED)
};

struct ScrubReport {
  uint64_t checked_blocks = 0;
  uint64_t failed_blocks = 0;   // bytes or slot entry did not match: counted in data_loss_blocks
  uint64_t dropped_blocks = 0;  // taken out of the cache: the failed ones and their descendants
  uint64_t bytes = 0;           // read and checked
  double seconds = 0;
};

class BlockVerifier {
 public:
  // `cache` outlives the verifier. `threads`: how many check a restart's batches (each block is read by one of them;
  // the blocks are settled in their order all the same); 0 picks half the cores, 1 to 8.
  explicit BlockVerifier(Cache* cache, unsigned threads = 0);
  // Stops the background verification; blocks it did not reach keep their slot entries and are checked at the
  // next start.
  ~BlockVerifier();
  BlockVerifier(const BlockVerifier&) = delete;
  BlockVerifier& operator=(const BlockVerifier&) = delete;

  // Starts a thread that checks the blocks Cache::RecoverPool restored, parents first and in batches (each batch's
  // blocks read by `threads` threads): a block becomes matchable once it passes, one that fails is dropped with its
  // descendants. A block of an older release's layer-major slot order is rewritten as it is checked. Logs one
  // summary line when done. Returns at once; call once, after RecoverPool.
  void StartRestartVerification();
  // The same check, on the calling thread (what the background thread runs).
  void VerifyRestored();
  // Checks every committed block on the calling thread, one range of slots at a time, each block pinned while
  // its bytes are read (so no store reuses its slot meanwhile), at most `options.max_bytes_per_s`. Failed
  // blocks are dropped. One scrub at a time: ABORTED while another runs; FAILED_PRECONDITION before the pool
  // exists. Thread-safe.
  Result<ScrubReport> Scrub(const ScrubOptions& options);

 private:
  Cache* const cache_;
  const unsigned threads_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> scrubbing_{false};
  std::thread restart_thread_;
};

}  // namespace flexkv
