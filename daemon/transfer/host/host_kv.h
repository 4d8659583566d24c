// HostKv: an engine's KV buffers in host memory shared with the daemon (opened by the host backend,
// host_backend.h), and the copies between one of its blocks and a pool slot. The pool stores a block BLOCKFIRST and contiguous:
// [layer][plane][chunk]. The client's buffers are one memfd in any layout: the per-layer layouts (LAYER_FIRST,
// LAYER_BLOCK_REGIONS) have their layers' regions back to back in it (so LAYER_BLOCK_REGIONS is LAYER_BLOCK's bytes).
#pragma once

#include <cstdint>
#include <memory>

#include "common/unique_fd.h"
#include "daemon/transfer/engine_memory.h"
#include "flexkv/geometry.h"
#include "flexkv/status.h"

namespace flexkv {

// Bytes `layout` needs for `num_blocks` blocks of `g` on one TP rank.
uint64_t KvBytesRequired(const Geometry& g, uint32_t num_blocks);

class HostKv final : public EngineKv {
 public:
  // Maps a client's memfd. Refuses (INVALID_ARGUMENT / FAILED_PRECONDITION, naming what is wrong) a memfd
  // that is not sealed against shrinking, is smaller than the layout needs, is not populated (CheckPopulated),
  // or a geometry this backend cannot serve (TP > 1 for K/V: per-rank shards arrive with the CUDA backend).
  static Result<std::shared_ptr<HostKv>> Map(UniqueFd memfd, const Geometry& g, KvLayout layout, uint32_t num_blocks);
  ~HostKv() override;
  HostKv(const HostKv&) = delete;
  HostKv& operator=(const HostKv&) = delete;

  uint32_t num_blocks() const override { return num_blocks_; }
  uint32_t tp_rank() const override { return 0; }  // whole blocks
  // The client pays for its KV memory: every page of the memfd must be allocated (written or fallocate'd),
  // at registration and before each copy, so the daemon never faults a page in on a client's behalf (which
  // would charge the client's memory to the daemon's cgroup: a 1 GiB sparse buffer would grow the daemon by
  // 1 GiB). FAILED_PRECONDITION naming the allocated and expected bytes otherwise. One fstat; thread-safe.
  // What a client can still move onto the daemon is bounded by its own registered bytes: pages punched
  // between this check and the copy.
  Status CheckPopulated() const;
  // Copies block `block` (< num_blocks) into / out of a pool slot of host_block_bytes(). CopyToSlot returns
  // the checksum term sum of the bytes it wrote (common/block_checksum.h), computed in the same pass.
  uint64_t CopyToSlot(uint32_t block, uint8_t* slot) const;
  void CopyFromSlot(const uint8_t* slot, uint32_t block) const;

 private:
  HostKv() = default;
  UniqueFd memfd_;  // kept for CheckPopulated
  uint8_t* base_ = nullptr;
  uint64_t bytes_ = 0;
  Geometry geometry_;
  KvLayout layout_ = KvLayout::kBlockFirst;
  uint32_t num_blocks_ = 0;
};

}  // namespace flexkv
