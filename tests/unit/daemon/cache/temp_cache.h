// TempCache: a Cache on a pool file in a fresh directory (under /dev/shm when there is one), removed at the end.
// For unit tests of the cache and of what sits on it (DRAM tier, copy scheduler).
#pragma once

#include <stdlib.h>

#include <catch2/catch.hpp>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "common/block_checksum.h"
#include "daemon/cache/cache.h"

namespace flexkv::testing {

// 2 layers x K/V x 16 tokens x 1 head x 32 dims x bf16: 4 KiB blocks.
inline Geometry SmallGeometry() {
  Geometry g;
  g.tokens_per_block = 16;
  g.num_layers = 2;
  g.kv_planes = 2;
  g.kv_heads_per_rank = 1;
  g.head_dim = 32;
  g.dtype_bytes = 2;
  g.tp_size = 1;
  return g;
}

// A hybrid geometry of tiny blocks: FULL 4 tokens x 1 layer x K/V x 1 head x 8 dims x bf16 = 128 B; a sliding
// window of 8 tokens (2 blocks) of the same shape; a state of 64 B per layer.
inline Geometry TinyHybrid() {
  Geometry g;
  g.tokens_per_block = 4;
  g.num_layers = 1;
  g.kv_planes = 2;
  g.kv_heads_per_rank = 1;
  g.head_dim = 8;
  g.dtype_bytes = 2;
  g.tp_size = 1;
  ComponentSpec swa;
  swa.kind = ComponentKind::kSlidingWindow;
  swa.num_layers = 1;
  swa.kv_planes = 2;
  swa.kv_heads_per_rank = 1;
  swa.head_dim = 8;
  swa.dtype_bytes = 2;
  swa.window_tokens = 8;
  ComponentSpec state;
  state.kind = ComponentKind::kState;
  state.num_layers = 1;
  state.state_bytes_per_layer = 64;
  g.components = {swa, state};
  return g;
}

// Stores `keys` (from the root) in `cache` as a Store does: reserve, fill each slot with bytes of its own, commit with
// the content checksums. Every key must be reserved (REQUIRE).
inline void StoreBlocks(Cache& cache, const std::vector<BlockKey>& keys) {
  PrefixIndex::Reservation r = cache.Reserve(kRootParent, keys);
  REQUIRE(r.slots.size() == keys.size());
  std::vector<uint64_t> sums;
  for (SlotId s : r.slots) {
    uint8_t* bytes = cache.SlotData(s);
    for (uint64_t i = 0; i < cache.block_bytes(); ++i) bytes[i] = static_cast<uint8_t>(i + s);
    sums.push_back(BlockChecksum(bytes, cache.block_bytes()));
  }
  cache.Commit(kRootParent, keys, 0, r.slots, sums);
}

class TempCache {
 public:
  explicit TempCache(uint64_t pool_bytes = 64 * 4096, PoolSplit split = {})
      : dir_(MakeDir()), pool_bytes_(pool_bytes), split_(split) {
    Reopen();
  }
  ~TempCache() {
    cache_.reset();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  TempCache(const TempCache&) = delete;
  TempCache& operator=(const TempCache&) = delete;

  // A new Cache on the same pool path (what a restarted daemon does); the caller then calls RecoverPool.
  void Reopen() {
    cache_.reset();
    cache_ = std::make_unique<Cache>(pool_bytes_, dir_ + "/pool", split_);
  }
  Cache& cache() { return *cache_; }
  const std::string& dir() const { return dir_; }

 private:
  static std::string MakeDir() {
    std::string tmpl = (std::filesystem::exists("/dev/shm") ? "/dev/shm" : "/tmp") + std::string("/flexkv-unit-XXXXXX");
    REQUIRE(mkdtemp(tmpl.data()) != nullptr);
    return tmpl;
  }

  const std::string dir_;
  const uint64_t pool_bytes_;
  const PoolSplit split_;
  std::unique_ptr<Cache> cache_;
};

}  // namespace flexkv::testing
