// The host backend's layout math: KvBytesRequired, and which client bytes make up block b in each layout. The
// expected offsets are written out independently from docs/protocol.md's layouts, not from host_kv.cc.
#include "common/block_checksum.h"
#include "daemon/transfer/host/host_kv.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <vector>

#include "common/mapped_region.h"
#include "tests/support/temp_dir.h"

using flexkv::Geometry;
using flexkv::HostKv;
using flexkv::KvLayout;
using flexkv::MappedRegion;
using flexkv::StatusCode;
using flexkv::UniqueFd;

namespace {

Geometry Small() { return flexkv::testing::TinyGeometry(); }

UniqueFd SealedMemfd(uint64_t bytes, bool seal = true) {
  UniqueFd fd(memfd_create("host-kv-test", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  REQUIRE(fd);
  REQUIRE(ftruncate(fd.get(), static_cast<off_t>(bytes)) == 0);
  REQUIRE(fallocate(fd.get(), 0, 0, static_cast<off_t>(bytes)) == 0);
  if (seal) REQUIRE(fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK) == 0);
  return fd;
}

// Offset of (layer, plane, block) in the client's buffer, per layout.
uint64_t ClientOffset(KvLayout layout, const Geometry& g, uint32_t blocks, uint64_t l, uint64_t p, uint64_t b) {
  const uint64_t chunk = g.chunk_bytes_per_rank(), L = g.num_layers, P = g.kv_planes, B = blocks;
  switch (layout) {
    case KvLayout::kLayerFirst: return ((l * P + p) * B + b) * chunk;  // [layer][plane][block][chunk]
    case KvLayout::kBlockFirst: return ((b * L + l) * P + p) * chunk;  // [block][layer][plane][chunk]
    case KvLayout::kLayerBlock: return ((l * B + b) * P + p) * chunk;  // [layer][block][plane][chunk]
    // one region per layer, [block][plane][chunk] in each, the regions back to back in the memfd
    case KvLayout::kLayerBlockRegions: return l * B * P * chunk + (b * P + p) * chunk;
  }
  return 0;
}

}  // namespace

TEST_CASE("KvBytesRequired is blocks x layers x planes x chunk bytes", "[unit]") {
  const Geometry g = Small();
  REQUIRE(g.chunk_bytes_per_rank() == 32);
  CHECK(flexkv::KvBytesRequired(g, 1) == 3 * 2 * 32);
  CHECK(flexkv::KvBytesRequired(g, 10) == 10 * 3 * 2 * 32);
  CHECK(flexkv::KvBytesRequired(g, 0) == 0);
  // 64-bit: a large pool does not wrap at 4 GiB.
  Geometry big = flexkv::Llama3_8B();
  CHECK(flexkv::KvBytesRequired(big, 100000) == uint64_t{100000} * big.num_layers * big.kv_planes * big.chunk_bytes_per_rank());
}

TEST_CASE("a block copies to its slot as [layer][plane][chunk] from each layout, and back", "[unit]") {
  const Geometry g = Small();
  constexpr uint32_t kBlocks = 5;
  const uint64_t bytes = flexkv::KvBytesRequired(g, kBlocks);
  const uint64_t chunk = g.chunk_bytes_per_rank();
  for (KvLayout layout :
       {KvLayout::kLayerFirst, KvLayout::kBlockFirst, KvLayout::kLayerBlock, KvLayout::kLayerBlockRegions}) {
    INFO("layout " << static_cast<uint32_t>(layout));
    UniqueFd fd = SealedMemfd(bytes);
    auto view = MappedRegion::Shared("the test KV memfd", fd.get(), bytes);
    REQUIRE(view.ok());
    for (uint64_t i = 0; i < bytes; ++i) view->bytes()[i] = static_cast<uint8_t>(i * 7 + 3);
    auto kv = HostKv::Map(std::move(fd), g, layout, kBlocks);
    REQUIRE(kv.ok());
    CHECK((*kv)->num_blocks() == kBlocks);
    const uint32_t block = 3;
    std::vector<uint8_t> slot(g.host_block_bytes());
    REQUIRE(slot.size() == g.num_layers * g.kv_planes * chunk);
    const uint64_t term_sum = (*kv)->CopyToSlot(block, slot.data());
    CHECK(term_sum == flexkv::ChecksumTermSum(slot.data(), slot.size(), 0));  // summed while copying
    for (uint64_t l = 0; l < g.num_layers; ++l) {
      for (uint64_t p = 0; p < g.kv_planes; ++p) {
        const uint64_t from = ClientOffset(layout, g, kBlocks, l, p, block);
        CHECK(std::memcmp(slot.data() + (l * g.kv_planes + p) * chunk, view->bytes() + from, chunk) == 0);
      }
    }
    // Back into block 1: exactly block 1's chunks change.
    std::vector<uint8_t> before(view->bytes(), view->bytes() + bytes);
    std::fill(slot.begin(), slot.end(), uint8_t{0xEE});
    (*kv)->CopyFromSlot(slot.data(), 1);
    std::vector<bool> in_block(bytes, false);
    for (uint64_t l = 0; l < g.num_layers; ++l) {
      for (uint64_t p = 0; p < g.kv_planes; ++p) {
        const uint64_t at = ClientOffset(layout, g, kBlocks, l, p, 1);
        for (uint64_t i = 0; i < chunk; ++i) in_block[at + i] = true;
      }
    }
    size_t wrong = 0;
    for (uint64_t i = 0; i < bytes; ++i) wrong += view->bytes()[i] != (in_block[i] ? uint8_t{0xEE} : before[i]);
    CHECK(wrong == 0);
  }
}

TEST_CASE("HostKv refuses an unsealed memfd, a short one and zero blocks, saying which", "[unit]") {
  const Geometry g = Small();
  const uint64_t bytes = flexkv::KvBytesRequired(g, 4);
  auto unsealed = HostKv::Map(SealedMemfd(bytes, false), g, KvLayout::kBlockFirst, 4);
  CHECK(unsealed.status().code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(unsealed.status().message(), Catch::Contains("F_SEAL_SHRINK"));
  auto short_fd = HostKv::Map(SealedMemfd(bytes - 1), g, KvLayout::kBlockFirst, 4);
  CHECK(short_fd.status().code() == StatusCode::kInvalidArgument);
  auto none = HostKv::Map(SealedMemfd(bytes), g, KvLayout::kBlockFirst, 0);
  CHECK(none.status().code() == StatusCode::kInvalidArgument);
  auto unknown = HostKv::Map(SealedMemfd(bytes), g, static_cast<KvLayout>(9), 4);
  CHECK(unknown.status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("HostKv refuses a sparse memfd, and one punched after registration, naming the allocated bytes", "[unit]") {
  const Geometry g = Small();
  constexpr uint32_t kBlocks = 64;
  const uint64_t bytes = flexkv::KvBytesRequired(g, kBlocks);
  UniqueFd sparse(memfd_create("host-kv-sparse", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  REQUIRE(ftruncate(sparse.get(), static_cast<off_t>(bytes)) == 0);
  REQUIRE(fcntl(sparse.get(), F_ADD_SEALS, F_SEAL_SHRINK) == 0);
  auto refused = HostKv::Map(std::move(sparse), g, KvLayout::kBlockFirst, kBlocks);
  CHECK(refused.status().code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(refused.status().message(), Catch::Contains("0 of its " + std::to_string(bytes) + " bytes allocated"));

  UniqueFd fd = SealedMemfd(bytes);
  const int raw = fd.get();
  auto kv = HostKv::Map(std::move(fd), g, KvLayout::kBlockFirst, kBlocks);
  REQUIRE(kv.ok());
  CHECK((*kv)->CheckPopulated().ok());
  REQUIRE(fallocate(raw, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096) == 0);  // the HostKv keeps the fd
  const flexkv::Status punched = (*kv)->CheckPopulated();
  CHECK(punched.code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(punched.message(), Catch::Contains("do not punch holes"));
}
