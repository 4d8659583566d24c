// EngineMemoryBackends: a registration goes to the backend that declared its memory kinds; one nobody declared is
// refused naming the kinds and what each backend serves; a backend whose pool registration failed refuses with
// that error. Also the host backend's declaration and its refusal of another memory kind.
#include <catch2/catch.hpp>

#include <memory>
#include <vector>

#include "daemon/transfer/engine_memory_backends.h"
#include "daemon/transfer/host/host_backend.h"
#include "tests/unit/daemon/transfer/fake_engine_memory.h"

using flexkv::EngineMemoryBackends;
using flexkv::KvRegistration;
using flexkv::MemoryKind;
using flexkv::StatusCode;
using flexkv::testing::Caps;
using flexkv::testing::FakeEngineMemory;

TEST_CASE("engine memory: the backend that declared every kind a registration needs is chosen", "[unit][transfer]") {
  EngineMemoryBackends backends;
  auto host = std::make_unique<FakeEngineMemory>("host", Caps({MemoryKind::kHostMemfd}));
  auto ipc_only = std::make_unique<FakeEngineMemory>("ipc", Caps({MemoryKind::kCudaIpc}));
  auto cuda = std::make_unique<FakeEngineMemory>("cuda", Caps({MemoryKind::kCudaIpc, MemoryKind::kCudaVmm}));
  const auto* host_p = host.get();
  const auto* ipc_p = ipc_only.get();
  const auto* cuda_p = cuda.get();
  backends.Add(std::move(host));
  backends.Add(std::move(ipc_only));
  backends.Add(std::move(cuda));

  const std::vector<MemoryKind> host_kinds{MemoryKind::kHostMemfd};
  auto chosen = backends.Select(host_kinds);
  REQUIRE(chosen.ok());
  CHECK(*chosen == host_p);
  const std::vector<MemoryKind> ipc_kinds{MemoryKind::kCudaIpc};
  chosen = backends.Select(ipc_kinds);
  REQUIRE(chosen.ok());
  CHECK(*chosen == ipc_p);  // the first that serves it
  const std::vector<MemoryKind> mixed{MemoryKind::kCudaIpc, MemoryKind::kCudaVmm};
  chosen = backends.Select(mixed);
  REQUIRE(chosen.ok());
  CHECK(*chosen == cuda_p);  // only one declared both
  CHECK(backends.List().size() == 3);
}

TEST_CASE("engine memory: memory no backend declared is refused, naming it and what runs", "[unit][transfer]") {
  EngineMemoryBackends backends;
  backends.Add(std::make_unique<FakeEngineMemory>("host", Caps({MemoryKind::kHostMemfd})));
  const std::vector<MemoryKind> vmm{MemoryKind::kCudaVmm};
  auto chosen = backends.Select(vmm);
  REQUIRE_FALSE(chosen.ok());
  CHECK(chosen.status().code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(chosen.status().message(), Catch::Contains("cuda_vmm") && Catch::Contains("host (host_memfd)"));
}

TEST_CASE("engine memory: the pool is registered with every backend once - a failure refuses that backend only",
          "[unit][transfer]") {
  EngineMemoryBackends backends;
  auto host = std::make_unique<FakeEngineMemory>("host", Caps({MemoryKind::kHostMemfd}));
  auto gpu = std::make_unique<FakeEngineMemory>("gpu", Caps({MemoryKind::kCudaIpc}));
  gpu->pool_status = flexkv::Status::Internal("cudaHostRegister: out of memory");
  auto* host_p = host.get();
  auto* gpu_p = gpu.get();
  backends.Add(std::move(host));
  backends.Add(std::move(gpu));
  flexkv::PoolRegion pool{reinterpret_cast<uint8_t*>(4096), 8192, 4096, 2};
  // The gpu backend's failure is answered (a growing pool gives such a region back), and again for the same region.
  CHECK(backends.RegisterPool(pool).code() == flexkv::StatusCode::kInternal);
  CHECK(backends.RegisterPool(pool).code() == flexkv::StatusCode::kInternal);
  CHECK(host_p->pool_registrations == 1);
  CHECK(gpu_p->pool_registrations == 1);
  CHECK(host_p->registered_pool.bytes == 8192);
  const std::vector<MemoryKind> ipc{MemoryKind::kCudaIpc};
  auto refused = backends.Select(ipc);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == StatusCode::kInternal);
  CHECK_THAT(refused.status().message(), Catch::Contains("cudaHostRegister"));
  const std::vector<MemoryKind> host_kinds{MemoryKind::kHostMemfd};
  CHECK(backends.Select(host_kinds).ok());
}

TEST_CASE("engine memory: a registration names the kinds it needs", "[unit][transfer]") {
  KvRegistration host{flexkv::HostKvMemory{}};
  CHECK(host.Kinds() == std::vector<MemoryKind>{MemoryKind::kHostMemfd});
  flexkv::GpuKvDescription gpu;
  gpu.tp_rank = 1;
  gpu.num_blocks = 9;
  gpu.regions.push_back(flexkv::GpuKvRegion{std::string(64, 'h'), 0, 1, {}});
  CHECK(KvRegistration{gpu}.Kinds() == std::vector<MemoryKind>{MemoryKind::kCudaIpc});
  gpu.regions.push_back(flexkv::GpuKvRegion{"", 0, 1, {{1, 2 << 20}}});
  KvRegistration mixed{gpu};
  CHECK(mixed.Kinds() == std::vector<MemoryKind>{MemoryKind::kCudaIpc, MemoryKind::kCudaVmm});
  CHECK(mixed.tp_rank() == 1);
  CHECK(mixed.num_blocks() == 9);
}

TEST_CASE("engine memory: the host backend declares host memfds, both directions, whole blocks", "[unit][transfer]") {
  flexkv::HostBackend host(/*copy_threads=*/1);
  CHECK(host.name() == "host");
  const flexkv::EngineMemoryCapabilities& caps = host.capabilities();
  CHECK(caps.Serves(MemoryKind::kHostMemfd));
  CHECK_FALSE(caps.Serves(MemoryKind::kCudaIpc));
  CHECK(caps.Copies(flexkv::CopyDirection::kToPool));
  CHECK(caps.Copies(flexkv::CopyDirection::kFromPool));
  CHECK_FALSE(caps.layerwise);
  CHECK_FALSE(caps.per_tp_rank);
  auto opened = host.Open(KvRegistration{flexkv::GpuKvDescription{}}, flexkv::Geometry{});
  CHECK(opened.status().code() == StatusCode::kInternal);
}

TEST_CASE("engine memory: several pools are registered - a failed one refuses only the sessions of its domain",
          "[unit][transfer]") {
  EngineMemoryBackends backends;
  auto gpu = std::make_unique<FakeEngineMemory>("gpu", Caps({MemoryKind::kCudaIpc}));
  auto* gpu_p = gpu.get();
  backends.Add(std::move(gpu));
  auto* a_base = reinterpret_cast<uint8_t*>(1 << 20);
  auto* b_base = reinterpret_cast<uint8_t*>(4 << 20);
  const flexkv::PoolRegion a{a_base, 8192, 4096, 2}, b{b_base, 8192, 4096, 2};
  CHECK(backends.RegisterPool(a).ok());
  gpu_p->pool_status = flexkv::Status::Internal("cudaHostRegister: out of memory");
  const flexkv::Status failed = backends.RegisterPool(b);
  CHECK(failed.code() == flexkv::StatusCode::kInternal);
  CHECK_THAT(failed.message(), Catch::Contains("gpu") && Catch::Contains("out of memory"));
  CHECK(gpu_p->pool_registrations == 2);
  const std::vector<MemoryKind> ipc{MemoryKind::kCudaIpc};
  CHECK(backends.Select(ipc, a_base).ok());
  CHECK(backends.Select(ipc, a_base + 4096).ok());  // a sub-pool inside a's region
  auto refused = backends.Select(ipc, b_base + 4096);
  REQUIRE_FALSE(refused.ok());
  CHECK_THAT(refused.status().message(), Catch::Contains("cudaHostRegister"));
  CHECK_FALSE(backends.Select(ipc).ok());  // any pool

  // Unregistering undoes exactly that region: b (never registered) is not handed to the backend, a is.
  backends.UnregisterPool(b);
  CHECK(gpu_p->unregistered_pools.empty());
  CHECK(backends.Select(ipc).ok());
  backends.UnregisterPool(a);
  CHECK(gpu_p->unregistered_pools == std::vector<const uint8_t*>{a_base});
  backends.UnregisterPool(a);  // once only
  CHECK(gpu_p->unregistered_pools.size() == 1);
}
