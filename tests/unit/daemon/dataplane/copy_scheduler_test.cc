// CopyScheduler over a fake backend: fan-out to every target, one done with the first error and the earliest
// start, layer progress (per layer once every target has it; emulated for backends without layer-wise copies),
// refusal of a direction the backend did not declare, and WaitIdle.
#include <catch2/catch.hpp>

#include <memory>
#include <thread>
#include <vector>

#include "common/block_checksum.h"
#include "daemon/dataplane/copy_scheduler.h"
#include "tests/unit/daemon/cache/temp_cache.h"
#include "tests/unit/daemon/transfer/fake_engine_memory.h"

using flexkv::CopyDirection;
using flexkv::CopyRequest;
using flexkv::MemoryKind;
using flexkv::Status;
using flexkv::StatusCode;
using flexkv::testing::Caps;
using flexkv::testing::FakeEngineMemory;
using flexkv::testing::FakeKv;
using flexkv::testing::SmallGeometry;
using flexkv::testing::TempCache;

namespace {

struct Outcome {
  int done_calls = 0;
  Status status;
  int64_t start_ns = 0;
  std::vector<uint32_t> layers;
};

CopyRequest Request(const flexkv::DramTier* tier, FakeEngineMemory* backend, size_t targets, CopyDirection direction,
                    Outcome* out) {
  CopyRequest r;
  r.tier = tier;
  r.backend = backend;
  for (size_t i = 0; i < targets; ++i) r.targets.push_back(std::make_shared<FakeKv>(16, static_cast<uint32_t>(i)));
  r.direction = direction;
  r.engine_blocks = std::make_shared<const std::vector<uint32_t>>(std::vector<uint32_t>{3, 4});
  r.slots = std::make_shared<const std::vector<flexkv::SlotId>>(std::vector<flexkv::SlotId>{10, 11});
  r.num_layers = 2;
  r.done = [out](Status st, int64_t start) {
    ++out->done_calls;
    out->status = st;
    out->start_ns = start;
  };
  return r;
}

struct Fixture {
  Fixture() {
    REQUIRE(cache.cache().RecoverPool(false).ok());
    REQUIRE(cache.cache().Admit("ns", SmallGeometry()).ok());
  }
  TempCache cache;
  flexkv::DramTier tier{&cache.cache()};
};

}  // namespace

TEST_CASE("copy scheduler: every target gets the blocks - done runs once, with the earliest start", "[unit][dataplane]") {
  Fixture f;
  flexkv::CopyScheduler scheduler;
  FakeEngineMemory backend("fake", Caps({MemoryKind::kHostMemfd}));
  Outcome out;
  scheduler.Submit(Request(&f.tier, &backend, 3, CopyDirection::kToPool, &out));
  REQUIRE(backend.jobs.size() == 3);
  for (const auto& job : backend.jobs) {
    CHECK(job.direction == CopyDirection::kToPool);
    CHECK(*job.engine_blocks == std::vector<uint32_t>{3, 4});
    CHECK(job.pool.base == f.cache.cache().SlotData(0));
    CHECK_FALSE(job.on_layer);  // a store asks for no layer progress
  }
  CHECK(scheduler.in_flight() == 1);
  backend.Finish(1, Status::Ok(), 300);
  backend.Finish(0, Status::Ok(), 200);
  CHECK(out.done_calls == 0);
  backend.Finish(2, Status::Ok(), 250);
  CHECK(out.done_calls == 1);
  CHECK(out.status.ok());
  CHECK(out.start_ns == 200);
  CHECK(scheduler.in_flight() == 0);
}

TEST_CASE("copy scheduler: the first error is the answer", "[unit][dataplane]") {
  Fixture f;
  flexkv::CopyScheduler scheduler;
  FakeEngineMemory backend("fake", Caps({MemoryKind::kHostMemfd}));
  Outcome out;
  scheduler.Submit(Request(&f.tier, &backend, 3, CopyDirection::kFromPool, &out));
  backend.Finish(0, Status::Ok(), 1);
  backend.Finish(1, Status::Internal("rank 1 failed"), 1);
  backend.Finish(2, Status::DataLoss("rank 2 failed"), 1);
  REQUIRE(out.done_calls == 1);
  CHECK(out.status.code() == StatusCode::kInternal);
  CHECK(out.status.message() == "rank 1 failed");
}

TEST_CASE("copy scheduler: a layer-wise backend's layer is reported once every target has it", "[unit][dataplane]") {
  Fixture f;
  flexkv::CopyScheduler scheduler;
  FakeEngineMemory backend("fake", Caps({MemoryKind::kCudaIpc}, /*layerwise=*/true, /*per_tp_rank=*/true));
  Outcome out;
  CopyRequest r = Request(&f.tier, &backend, 2, CopyDirection::kFromPool, &out);
  r.layer_done = [&out](uint32_t layer) { out.layers.push_back(layer); };
  scheduler.Submit(std::move(r));
  REQUIRE(backend.jobs.size() == 2);
  REQUIRE(backend.jobs[0].on_layer);
  backend.jobs[0].on_layer(0);
  CHECK(out.layers.empty());
  backend.jobs[1].on_layer(0);
  CHECK(out.layers == std::vector<uint32_t>{0});
  backend.jobs[1].on_layer(1);
  backend.jobs[0].on_layer(1);
  CHECK(out.layers == std::vector<uint32_t>{0, 1});
  backend.jobs[0].done(Status::Ok(), 5);
  backend.jobs[1].done(Status::Ok(), 6);
  CHECK(out.done_calls == 1);
  CHECK(out.layers.size() == 2);
}

TEST_CASE("copy scheduler: without layer-wise copies every layer is reported when the copy is done, before done",
          "[unit][dataplane]") {
  Fixture f;
  flexkv::CopyScheduler scheduler;
  FakeEngineMemory backend("fake", Caps({MemoryKind::kHostMemfd}));
  Outcome out;
  CopyRequest r = Request(&f.tier, &backend, 1, CopyDirection::kFromPool, &out);
  r.layer_done = [&out](uint32_t layer) {
    CHECK(out.done_calls == 0);
    out.layers.push_back(layer);
  };
  scheduler.Submit(std::move(r));
  REQUIRE(backend.jobs.size() == 1);
  CHECK_FALSE(backend.jobs[0].on_layer);  // never asked of a backend that did not declare it
  backend.Finish(0, Status::Ok(), 1);
  CHECK(out.layers == std::vector<uint32_t>{0, 1});
  CHECK(out.done_calls == 1);
}

TEST_CASE("copy scheduler: a copy of a layer range goes to the jobs and reports only its layers", "[unit][dataplane]") {
  Fixture f;
  flexkv::CopyScheduler scheduler;
  // A backend that records layer events but reports no layers itself: the range's layers are reported at the end.
  flexkv::EngineMemoryCapabilities caps = Caps({MemoryKind::kCudaIpc});
  caps.layer_events = true;
  FakeEngineMemory backend("fake", caps);
  Outcome out;
  CopyRequest r = Request(&f.tier, &backend, 2, CopyDirection::kFromPool, &out);
  r.layers = flexkv::JobLayers{1, 2, 7, /*more_follow=*/true};
  r.layer_done = [&out](uint32_t layer) { out.layers.push_back(layer); };
  scheduler.Submit(std::move(r));
  REQUIRE(backend.jobs.size() == 2);
  for (const auto& job : backend.jobs) {
    CHECK(job.layers.begin == 1);
    CHECK(job.layers.end == 2);
    CHECK(job.layers.first_event == 7);
    CHECK(job.layers.more_follow);
  }
  backend.Finish(0, Status::Ok(), 1);
  backend.Finish(1, Status::Ok(), 1);
  CHECK(out.layers == std::vector<uint32_t>{1});
  CHECK(out.status.ok());
}

TEST_CASE("copy scheduler: a layer range is refused where the backend copies whole jobs, or outside the layers",
          "[unit][dataplane]") {
  Fixture f;
  flexkv::CopyScheduler scheduler;
  FakeEngineMemory whole("fake", Caps({MemoryKind::kHostMemfd}));
  Outcome out;
  CopyRequest r = Request(&f.tier, &whole, 1, CopyDirection::kFromPool, &out);
  r.layers = flexkv::JobLayers{0, 1};
  scheduler.Submit(std::move(r));
  CHECK(whole.jobs.empty());
  CHECK(out.status.code() == StatusCode::kInternal);
  CHECK(out.status.message().find("copies whole jobs only") != std::string::npos);
  FakeEngineMemory layered("fake", Caps({MemoryKind::kCudaIpc}, /*layerwise=*/true));
  Outcome beyond;
  CopyRequest past = Request(&f.tier, &layered, 1, CopyDirection::kFromPool, &beyond);
  past.layers = flexkv::JobLayers{1, 3};  // the copy has 2 layers
  scheduler.Submit(std::move(past));
  CHECK(layered.jobs.empty());
  CHECK(beyond.status.code() == StatusCode::kInternal);
  CHECK(beyond.status.message().find("layers [1, 3) of a copy of 2 layers") != std::string::npos);
}

TEST_CASE("copy scheduler: a failed copy reports no emulated layers", "[unit][dataplane]") {
  Fixture f;
  flexkv::CopyScheduler scheduler;
  FakeEngineMemory backend("fake", Caps({MemoryKind::kHostMemfd}));
  Outcome out;
  CopyRequest r = Request(&f.tier, &backend, 1, CopyDirection::kFromPool, &out);
  r.layer_done = [&out](uint32_t layer) { out.layers.push_back(layer); };
  scheduler.Submit(std::move(r));
  backend.Finish(0, Status::Internal("boom"), 1);
  CHECK(out.layers.empty());
  CHECK(out.status.code() == StatusCode::kInternal);
}

TEST_CASE("copy scheduler: a direction the backend did not declare is refused, and the backend never asked",
          "[unit][dataplane]") {
  Fixture f;
  flexkv::CopyScheduler scheduler;
  auto caps = Caps({MemoryKind::kHostMemfd});
  caps.from_pool = false;
  FakeEngineMemory backend("storeonly", caps);
  Outcome out;
  scheduler.Submit(Request(&f.tier, &backend, 1, CopyDirection::kFromPool, &out));
  CHECK(backend.jobs.empty());
  REQUIRE(out.done_calls == 1);
  CHECK(out.status.code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(out.status.message(), Catch::Contains("storeonly") && Catch::Contains("did not declare"));
  CHECK(scheduler.in_flight() == 0);
}

TEST_CASE("copy scheduler: no targets or no pool is refused through done", "[unit][dataplane]") {
  FakeEngineMemory backend("fake", Caps({MemoryKind::kHostMemfd}));
  {
    Fixture f;
    flexkv::CopyScheduler scheduler;
    Outcome out;
    scheduler.Submit(Request(&f.tier, &backend, 0, CopyDirection::kToPool, &out));
    CHECK(out.status.code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(out.status.message(), Catch::Contains("RegisterKv"));
  }
  TempCache empty;
  REQUIRE(empty.cache().RecoverPool(false).ok());
  flexkv::DramTier tier(&empty.cache());
  flexkv::CopyScheduler scheduler;
  Outcome out;
  scheduler.Submit(Request(&tier, &backend, 1, CopyDirection::kToPool, &out));
  CHECK(out.status.code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(out.status.message(), Catch::Contains("pool does not exist"));
}

TEST_CASE("copy scheduler: WaitIdle returns once the copies in flight are done", "[unit][dataplane]") {
  Fixture f;
  flexkv::CopyScheduler scheduler;
  FakeEngineMemory backend("fake", Caps({MemoryKind::kHostMemfd}));
  Outcome out;
  scheduler.Submit(Request(&f.tier, &backend, 1, CopyDirection::kToPool, &out));
  std::thread finisher([&] { backend.Finish(0, Status::Ok(), 1); });
  scheduler.WaitIdle();
  finisher.join();
  CHECK(out.done_calls == 1);
  CHECK(scheduler.in_flight() == 0);
}

TEST_CASE("copy scheduler: a store's checksums add up the TP parts' term sums of a backend with store_checksums",
          "[unit][dataplane][checksum]") {
  Fixture f;
  flexkv::CopyScheduler scheduler;
  flexkv::EngineMemoryCapabilities caps = Caps({MemoryKind::kCudaIpc}, false, /*per_tp_rank=*/true);
  caps.store_checksums = true;
  FakeEngineMemory backend("fake", caps);
  Outcome out;
  CopyRequest r = Request(&f.tier, &backend, 2, CopyDirection::kToPool, &out);
  auto checksums = std::make_shared<std::vector<uint64_t>>();
  r.checksums = checksums;
  scheduler.Submit(std::move(r));
  REQUIRE(backend.jobs.size() == 2);
  const uint64_t block_bytes = f.cache.cache().block_bytes();
  // Each rank writes its half of both blocks and adds the term sums of what it wrote to its own, zeroed vector.
  for (size_t rank = 0; rank < 2; ++rank) {
    auto& job = backend.jobs[rank];
    REQUIRE(job.term_sums != nullptr);
    CHECK(*job.term_sums == std::vector<uint64_t>{0, 0});
    for (size_t b = 0; b < 2; ++b) {
      uint8_t* half = job.pool.SlotData((*job.slots)[b]) + rank * block_bytes / 2;
      for (uint64_t i = 0; i < block_bytes / 2; ++i) half[i] = static_cast<uint8_t>(i * 7 + rank * 31 + b);
      (*job.term_sums)[b] += flexkv::ChecksumTermSum(half, block_bytes / 2,
                                                     static_cast<uint32_t>(rank * block_bytes / 2 / 16));
    }
  }
  CHECK(backend.jobs[0].term_sums != backend.jobs[1].term_sums);
  backend.Finish(0, Status::Ok(), 100);
  CHECK(checksums->empty());
  backend.Finish(1, Status::Ok(), 100);
  REQUIRE(out.done_calls == 1);
  REQUIRE(checksums->size() == 2);
  for (size_t b = 0; b < 2; ++b) {
    const uint8_t* slot = f.cache.cache().SlotData(b == 0 ? 10 : 11);
    CHECK((*checksums)[b] == flexkv::BlockChecksum(slot, block_bytes));
  }
}

TEST_CASE("copy scheduler: a backend without store_checksums gets no term sums - the checksums come from the "
          "stored slots",
          "[unit][dataplane][checksum]") {
  Fixture f;
  flexkv::CopyScheduler scheduler;
  FakeEngineMemory backend("fake", Caps({MemoryKind::kHostMemfd}));
  Outcome out;
  CopyRequest r = Request(&f.tier, &backend, 1, CopyDirection::kToPool, &out);
  auto checksums = std::make_shared<std::vector<uint64_t>>();
  r.checksums = checksums;
  scheduler.Submit(std::move(r));
  REQUIRE(backend.jobs.size() == 1);
  CHECK(backend.jobs[0].term_sums == nullptr);
  const uint64_t block_bytes = f.cache.cache().block_bytes();
  for (flexkv::SlotId s : {10u, 11u}) {
    uint8_t* slot = f.cache.cache().SlotData(s);
    for (uint64_t i = 0; i < block_bytes; ++i) slot[i] = static_cast<uint8_t>(i ^ s);
  }
  backend.Finish(0, Status::Ok(), 100);
  REQUIRE(out.done_calls == 1);
  REQUIRE(checksums->size() == 2);
  CHECK((*checksums)[0] == flexkv::BlockChecksum(f.cache.cache().SlotData(10), block_bytes));
  CHECK((*checksums)[1] == flexkv::BlockChecksum(f.cache.cache().SlotData(11), block_bytes));
  CHECK((*checksums)[0] != (*checksums)[1]);

  SECTION("a failed store leaves them unset") {
    Outcome failed;
    CopyRequest r2 = Request(&f.tier, &backend, 1, CopyDirection::kToPool, &failed);
    auto none = std::make_shared<std::vector<uint64_t>>();
    r2.checksums = none;
    scheduler.Submit(std::move(r2));
    backend.Finish(1, Status::Internal("copy failed"), 100);
    CHECK(failed.done_calls == 1);
    CHECK(none->empty());
  }
}
