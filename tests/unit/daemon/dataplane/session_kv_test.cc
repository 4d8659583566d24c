// SessionKv: a session's KV registrations - one of whole blocks, or one per TP rank - and the refusals of a
// repeated, out-of-range or mixed registration; which registrations a copy goes to (MLA stores: rank 0 only).
#include <catch2/catch.hpp>

#include <memory>
#include <string>

#include "daemon/dataplane/session_kv.h"
#include "daemon/transfer/host/host_kv.h"
#include "tests/unit/daemon/transfer/fake_engine_memory.h"

using flexkv::CopyDirection;
using flexkv::CopyRequest;
using flexkv::EngineMemoryBackends;
using flexkv::GpuKvDescription;
using flexkv::HostKvMemory;
using flexkv::KvRegistration;
using flexkv::MemoryKind;
using flexkv::SessionKv;
using flexkv::StatusCode;
using flexkv::testing::Caps;
using flexkv::testing::FakeEngineMemory;

namespace {

flexkv::Geometry Tp2(bool mla) {
  flexkv::Geometry g = mla ? flexkv::Geometry{} : flexkv::Llama3_8B();
  if (mla) {
    g.tokens_per_block = 16;
    g.num_layers = 4;
    g.kv_planes = 1;
    g.kv_heads_per_rank = 1;
    g.head_dim = 576;
    g.dtype_bytes = 2;
  }
  g.tp_size = 2;
  return g;
}

KvRegistration Gpu(uint32_t rank, uint32_t blocks) {
  GpuKvDescription d;
  d.tp_rank = rank;
  d.num_blocks = blocks;
  d.regions.push_back({std::string(64, 'h'), 0, 1, {}});
  return KvRegistration{std::move(d)};
}

struct Backends {
  Backends() {
    auto h = std::make_unique<FakeEngineMemory>("host", Caps({MemoryKind::kHostMemfd}));
    auto g = std::make_unique<FakeEngineMemory>("gpu", Caps({MemoryKind::kCudaIpc}, true, /*per_tp_rank=*/true));
    host = h.get();
    gpu = g.get();
    set.Add(std::move(h));
    set.Add(std::move(g));
  }
  EngineMemoryBackends set;
  FakeEngineMemory* host;
  FakeEngineMemory* gpu;
};

}  // namespace

TEST_CASE("session kv: whole blocks register once - the block count and bytes follow", "[unit][dataplane]") {
  Backends b;
  const flexkv::Geometry g = flexkv::Llama3_8B();
  SessionKv kv(7, g);
  std::string missing;
  CHECK(kv.RegisteredBlocks(&missing) == 0);
  CHECK_THAT(missing, Catch::Contains("RegisterKv"));
  auto bytes = kv.Register(b.set, KvRegistration{HostKvMemory{{}, flexkv::KvLayout::kBlockFirst, 12}});
  REQUIRE(bytes.ok());
  CHECK(*bytes == flexkv::KvBytesRequired(g, 12));
  CHECK(kv.RegisteredBlocks(&missing) == 12);
  auto again = kv.Register(b.set, KvRegistration{HostKvMemory{{}, flexkv::KvLayout::kBlockFirst, 12}});
  CHECK(again.status().code() == StatusCode::kAlreadyExists);
  CHECK(b.host->opens == 1);  // refused before the backend did any work
  auto gpu = kv.Register(b.set, Gpu(0, 12));
  CHECK(gpu.status().code() == StatusCode::kAlreadyExists);
  CHECK_THAT(gpu.status().message(), Catch::Contains("host KV buffers already"));

  CopyRequest copy;
  copy.direction = CopyDirection::kToPool;
  kv.FillTargets(&copy);
  CHECK(copy.backend == b.host);
  CHECK(copy.targets.size() == 1);
}

TEST_CASE("session kv: per-rank registrations need every rank - the fewest blocks count", "[unit][dataplane]") {
  Backends b;
  SessionKv kv(8, Tp2(/*mla=*/false));
  REQUIRE(kv.Register(b.set, Gpu(1, 20)).ok());
  std::string missing;
  CHECK(kv.RegisteredBlocks(&missing) == 0);
  CHECK_THAT(missing, Catch::Contains("tp rank 0 of 2"));
  CHECK(kv.Register(b.set, Gpu(1, 20)).status().code() == StatusCode::kAlreadyExists);
  auto past = kv.Register(b.set, Gpu(2, 20));
  CHECK(past.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(past.status().message(), Catch::Contains("tp_rank 2 is not below tp_size 2"));
  REQUIRE(kv.Register(b.set, Gpu(0, 16)).ok());
  CHECK(kv.RegisteredBlocks(&missing) == 16);
  auto host = kv.Register(b.set, KvRegistration{HostKvMemory{{}, flexkv::KvLayout::kBlockFirst, 4}});
  CHECK(host.status().code() == StatusCode::kAlreadyExists);

  CopyRequest store;
  store.direction = CopyDirection::kToPool;
  kv.FillTargets(&store);
  CHECK(store.backend == b.gpu);
  CHECK(store.targets.size() == 2);  // K/V: every rank stores its shard
}

TEST_CASE("session kv: MLA KV is stored from rank 0 only and loaded into every rank", "[unit][dataplane]") {
  Backends b;
  SessionKv kv(9, Tp2(/*mla=*/true));
  REQUIRE(kv.Register(b.set, Gpu(0, 8)).ok());
  REQUIRE(kv.Register(b.set, Gpu(1, 8)).ok());
  CopyRequest store;
  store.direction = CopyDirection::kToPool;
  kv.FillTargets(&store);
  REQUIRE(store.targets.size() == 1);
  CHECK(store.targets[0]->tp_rank() == 0);
  CopyRequest load;
  load.direction = CopyDirection::kFromPool;
  kv.FillTargets(&load);
  CHECK(load.targets.size() == 2);
}

TEST_CASE("session kv: a backend's Open refusal is the answer, and nothing is kept", "[unit][dataplane]") {
  Backends b;
  b.host->open_status = flexkv::Status::FailedPrecondition("the KV memfd is not sealed with F_SEAL_SHRINK");
  SessionKv kv(10, flexkv::Llama3_8B());
  auto refused = kv.Register(b.set, KvRegistration{HostKvMemory{{}, flexkv::KvLayout::kBlockFirst, 4}});
  CHECK(refused.status().code() == StatusCode::kFailedPrecondition);
  std::string missing;
  CHECK(kv.RegisteredBlocks(&missing) == 0);
  b.host->open_status = flexkv::Status::Ok();
  CHECK(kv.Register(b.set, KvRegistration{HostKvMemory{{}, flexkv::KvLayout::kBlockFirst, 4}}).ok());
}

TEST_CASE("session kv: memory no backend serves is refused before anything opens", "[unit][dataplane]") {
  EngineMemoryBackends none;
  none.Add(std::make_unique<FakeEngineMemory>("host", Caps({MemoryKind::kHostMemfd})));
  SessionKv kv(11, Tp2(false));
  auto refused = kv.Register(none, Gpu(0, 4));
  CHECK(refused.status().code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(refused.status().message(), Catch::Contains("cuda_ipc"));
}
