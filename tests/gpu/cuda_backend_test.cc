// The CUDA engine-memory backend's stores (daemon/transfer/cuda/cuda_engine_memory.h) through its public
// interface, in one process: a cuMem/VMM KV cache exported as an fd and opened by the backend, stores by the
// kernels (staging whole slots for the copy engine, and alone) and by the copy engine that fill CopyJob::term_sums.
// Without a visible GPU (CI) every case warns and passes.
#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "common/block_checksum.h"
#include "common/mapped_region.h"
#include "daemon/transfer/cuda/cuda_engine_memory.h"
#include "tests/gpu/gpu_test_support.h"

using flexkv::gpu_test::RunCopy;
using flexkv::gpu_test::VmmAllocation;

TEST_CASE("CUDA backend stores add each slot's checksum term sums: staged, by the kernels alone, by the copy engine", "[gpu]") {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(std::random_device{}());
  flexkv::Geometry g;
  g.num_layers = 3;
  g.kv_planes = 2;
  g.kv_heads_per_rank = 1;
  g.head_dim = 65;  // 2080-byte chunks: 130 units, not a whole round of the kernel
  const uint64_t chunk = g.chunk_bytes_per_rank(), block_bytes = g.host_block_bytes();
  const uint32_t num_blocks = 4700, slots = 4700;  // over the backend's first 4096-pair buffers
  REQUIRE(chunk / flexkv::kChecksumUnitBytes % 256 != 0);

  // The kernels staging whole slots for the copy engine (the default), the kernels alone, the copy engine.
  const flexkv::CudaCopyPaths staged{}, kernels_alone{false, false, 0}, copy_engine_paths{false, true};
  for (const flexkv::CudaCopyPaths& paths : {staged, kernels_alone, copy_engine_paths}) {
    CAPTURE(paths.store_copy_engine, paths.staging_bytes);
    auto map = flexkv::MappedRegion::Anonymous("the test pool", slots * block_bytes);
    REQUIRE(map.ok());
    const flexkv::PoolRegion pool{map->bytes(), slots * block_bytes, block_bytes, slots};
    VmmAllocation gpu(num_blocks * block_bytes);
    std::vector<uint8_t> blocks_host(num_blocks * block_bytes);  // BLOCKFIRST: block b is one contiguous run
    for (size_t i = 0; i + 8 <= blocks_host.size(); i += 8) {
      const uint64_t r = rng();
      std::memcpy(blocks_host.data() + i, &r, 8);
    }
    REQUIRE(cudaMemcpy(gpu.data(), blocks_host.data(), blocks_host.size(), cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);  // the backend's streams do not wait for the legacy stream

    auto backend = flexkv::CudaEngineMemory::Create(paths);
    REQUIRE(backend != nullptr);
    CHECK(backend->capabilities().store_checksums);
    REQUIRE(backend->RegisterPool(pool).ok());
    flexkv::GpuKvDescription d;
    d.gpu_uuid = backend->devices().at(0);
    d.layout = flexkv::KvLayout::kBlockFirst;
    d.num_blocks = num_blocks;
    d.regions.push_back({"", 0, num_blocks * block_bytes, {{7, gpu.bytes()}}});
    d.vmm_fds[7] = std::make_shared<flexkv::UniqueFd>(gpu.ExportFd());
    auto kv = backend->Open(flexkv::KvRegistration{std::move(d)}, g);
    INFO(kv.status().ToString());
    REQUIRE(kv.ok());

    for (uint32_t count : {uint32_t{37}, uint32_t{4500}}) {
      CAPTURE(count);
      std::vector<uint32_t> ids(num_blocks), to(slots);
      std::iota(ids.begin(), ids.end(), 0u);
      std::iota(to.begin(), to.end(), 0u);
      std::shuffle(ids.begin(), ids.end(), rng);
      std::shuffle(to.begin(), to.end(), rng);
      ids.resize(count);
      to.resize(count);
      std::memset(map->bytes(), 0xA5, pool.bytes);
      flexkv::CopyJob job;
      job.kv = *kv;
      job.direction = flexkv::CopyDirection::kToPool;
      job.engine_blocks = std::make_shared<const std::vector<uint32_t>>(ids);
      job.slots = std::make_shared<const std::vector<uint32_t>>(to);
      job.pool = pool;
      job.term_sums = std::make_shared<std::vector<uint64_t>>(count, 0);
      auto sums = job.term_sums;
      const flexkv::Status st = RunCopy(*backend, std::move(job));
      INFO(st.ToString());
      REQUIRE(st.ok());
      for (uint32_t i = 0; i < count; ++i) {
        CAPTURE(i);
        const uint8_t* slot = pool.SlotData(to[i]);
        REQUIRE(std::memcmp(slot, blocks_host.data() + ids[i] * block_bytes, block_bytes) == 0);
        REQUIRE(flexkv::FinishBlockChecksum((*sums)[i], block_bytes) == flexkv::BlockChecksum(slot, block_bytes));
      }
    }

    // Without term_sums the store copies as before; a term_sums of the wrong length is refused.
    const std::vector<uint32_t> ids{3, 1, 4}, to{10, 11, 12};
    std::memset(map->bytes(), 0xA5, pool.bytes);
    flexkv::CopyJob plain;
    plain.kv = *kv;
    plain.engine_blocks = std::make_shared<const std::vector<uint32_t>>(ids);
    plain.slots = std::make_shared<const std::vector<uint32_t>>(to);
    plain.pool = pool;
    flexkv::CopyJob wrong = plain;
    REQUIRE(RunCopy(*backend, std::move(plain)).ok());
    for (size_t i = 0; i < ids.size(); ++i)
      REQUIRE(std::memcmp(pool.SlotData(to[i]), blocks_host.data() + ids[i] * block_bytes, block_bytes) == 0);
    wrong.term_sums = std::make_shared<std::vector<uint64_t>>(2, 0);
    const flexkv::Status refused = RunCopy(*backend, std::move(wrong));
    CHECK(refused.code() == flexkv::StatusCode::kInternal);
  }  // destroyed in reverse order: the registration, the backend (unregisters the pool), the allocation, the pool
}
