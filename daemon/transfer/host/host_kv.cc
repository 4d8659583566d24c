// See host_kv.h.
#include "daemon/transfer/host/host_kv.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include "common/block_checksum.h"
#include "common/uds.h"
#include "common/checksum_copy.h"

namespace flexkv {

uint64_t KvBytesRequired(const Geometry& g, uint32_t num_blocks) {
  return uint64_t{num_blocks} * g.num_layers * g.kv_planes * g.chunk_bytes_per_rank();
}

Result<std::shared_ptr<HostKv>> HostKv::Map(UniqueFd memfd, const Geometry& g, KvLayout layout, uint32_t num_blocks) {
  if (g.tp_size > 1 && !g.is_mla()) {
    return Status::Unimplemented(fmt::format(
        "the host backend stores whole blocks from one process; tp_size {} with K/V planes needs per-rank shards "
        "(CUDA backend)", g.tp_size));
  }
  if (!IsKnownKvLayout(layout)) {
    return Status::InvalidArgument(
        fmt::format("layout {} is unknown; expected {}", static_cast<uint32_t>(layout), KvLayoutsAccepted()));
  }
  if (num_blocks == 0) return Status::InvalidArgument("num_blocks is 0; expected the number of KV blocks the buffers hold");
  const int seals = fcntl(memfd.get(), F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    return Status::FailedPrecondition(
        "the KV memfd is not sealed with F_SEAL_SHRINK; expected memfd_create(MFD_ALLOW_SEALING) + F_ADD_SEALS so the "
        "daemon's mapping cannot be truncated under it");
  }
  struct stat st {};
  if (fstat(memfd.get(), &st) != 0) return Status::Internal(fmt::format("fstat: {}", ErrnoText(errno)));
  const uint64_t need = KvBytesRequired(g, num_blocks);
  if (static_cast<uint64_t>(st.st_size) < need) {
    return Status::InvalidArgument(fmt::format("the KV memfd has {} bytes; {} blocks in this layout need {}", st.st_size,
                                               num_blocks, need));
  }
  void* p = mmap(nullptr, need, PROT_READ | PROT_WRITE, MAP_SHARED, memfd.get(), 0);
  if (p == MAP_FAILED) return Status::ResourceExhausted(fmt::format("mmap of the KV memfd: {}", ErrnoText(errno)));
  auto kv = std::shared_ptr<HostKv>(new HostKv());
  kv->memfd_ = std::move(memfd);
  kv->base_ = static_cast<uint8_t*>(p);
  kv->bytes_ = need;
  kv->geometry_ = g;
  kv->layout_ = layout;
  kv->num_blocks_ = num_blocks;
  FLEXKV_RETURN_IF_ERROR(kv->CheckPopulated());
  return kv;
}

Status HostKv::CheckPopulated() const {
  struct stat st {};
  if (fstat(memfd_.get(), &st) != 0) return Status::Internal(fmt::format("fstat of the KV memfd: {}", ErrnoText(errno)));
  const uint64_t allocated = static_cast<uint64_t>(st.st_blocks) * 512;
  if (allocated < static_cast<uint64_t>(st.st_size)) {
    return Status::FailedPrecondition(fmt::format(
        "the KV memfd has {} of its {} bytes allocated; expected every page allocated (write the buffer or "
        "fallocate it before registering, and do not punch holes in it): flexkvd does not fault in memory on a "
        "client's behalf",
        allocated, st.st_size));
  }
  return Status::Ok();
}

HostKv::~HostKv() {
  if (base_ != nullptr) munmap(base_, bytes_);
}

namespace {

// Calls fn(client_offset, slot_offset, bytes) for each contiguous run of one block.
template <typename Fn>
void ForEachRun(const Geometry& g, KvLayout layout, uint32_t num_blocks, uint32_t block, Fn&& fn) {
  const uint64_t chunk = g.chunk_bytes_per_rank();
  const uint64_t L = g.num_layers, P = g.kv_planes, B = num_blocks, b = block;
  switch (layout) {
    case KvLayout::kBlockFirst:
      fn(b * L * P * chunk, 0, L * P * chunk);
      return;
    case KvLayout::kLayerBlock:
    case KvLayout::kLayerBlockRegions:  // one memfd: the per-layer regions back to back, which is LAYER_BLOCK
      for (uint64_t l = 0; l < L; ++l) fn((l * B + b) * P * chunk, l * P * chunk, P * chunk);
      return;
    case KvLayout::kLayerFirst:
      for (uint64_t l = 0; l < L; ++l) {
        for (uint64_t p = 0; p < P; ++p) fn(((l * P + p) * B + b) * chunk, (l * P + p) * chunk, chunk);
      }
      return;
  }
}

}  // namespace

uint64_t HostKv::CopyToSlot(uint32_t block, uint8_t* slot) const {
  uint64_t sum = 0;
  // Runs are whole chunks, multiples of 16 bytes (Geometry), so each starts on a checksum unit.
  ForEachRun(geometry_, layout_, num_blocks_, block, [&](uint64_t src, uint64_t dst, uint64_t n) {
    sum += CopyRunWithChecksum(slot + dst, base_ + src, n, static_cast<uint32_t>(dst / kChecksumUnitBytes));
  });
  return sum;
}

void HostKv::CopyFromSlot(const uint8_t* slot, uint32_t block) const {
  ForEachRun(geometry_, layout_, num_blocks_, block,
             [&](uint64_t dst, uint64_t src, uint64_t n) { std::memcpy(base_ + dst, slot + src, n); });
}

}  // namespace flexkv
