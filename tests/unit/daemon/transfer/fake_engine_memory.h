// FakeEngineMemory: an engine-memory backend for unit tests. It declares what the test says, opens any
// registration as a FakeKv, and keeps copy jobs until the test finishes them (Finish), so a test decides the
// order, the errors and the layer progress. Not thread-safe: one test thread drives it.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "daemon/transfer/engine_memory.h"

namespace flexkv::testing {

class FakeKv final : public EngineKv {
 public:
  FakeKv(uint32_t blocks, uint32_t rank) : blocks_(blocks), rank_(rank) {}
  uint32_t num_blocks() const override { return blocks_; }
  uint32_t tp_rank() const override { return rank_; }

 private:
  uint32_t blocks_, rank_;
};

// Layer events of one TP rank, for a backend that declared layer_events; records nothing.
class FakeLayerEvents final : public LayerEvents {
 public:
  FakeLayerEvents(uint32_t rank, uint32_t layers) : rank_(rank), layers_(layers) {}
  uint32_t tp_rank() const override { return rank_; }
  uint32_t num_layers() const override { return layers_; }

 private:
  uint32_t rank_, layers_;
};

class FakeEngineMemory final : public EngineMemoryBackend {
 public:
  FakeEngineMemory(std::string name, EngineMemoryCapabilities caps) : name_(std::move(name)), caps_(std::move(caps)) {}

  std::string_view name() const override { return name_; }
  const EngineMemoryCapabilities& capabilities() const override { return caps_; }
  // Before any copy: change what the backend declares.
  EngineMemoryCapabilities& mutable_capabilities() { return caps_; }
  Status RegisterPool(const PoolRegion& pool) override {
    ++pool_registrations;
    registered_pool = pool;
    return pool_status;
  }
  void UnregisterPool(const PoolRegion& pool) override { unregistered_pools.push_back(pool.base); }
  Result<std::shared_ptr<EngineKv>> Open(KvRegistration registration, const Geometry& /*geometry*/) override {
    ++opens;
    if (!open_status.ok()) return open_status;
    return std::shared_ptr<EngineKv>(std::make_shared<FakeKv>(registration.num_blocks(), registration.tp_rank()));
  }
  void Copy(CopyJob job) override { jobs.push_back(std::move(job)); }

  // Finishes job `i`: reports `layers` layers (when the job asked for layer progress), then done.
  void Finish(size_t i, Status status, int64_t start_ns, uint32_t layers = 0) {
    for (uint32_t l = 0; l < layers && jobs[i].on_layer; ++l) jobs[i].on_layer(l);
    jobs[i].done(std::move(status), start_ns);
  }

  Status pool_status;
  Status open_status;
  int pool_registrations = 0;
  int opens = 0;
  PoolRegion registered_pool;
  std::vector<const uint8_t*> unregistered_pools;  // UnregisterPool's regions, by base
  std::vector<CopyJob> jobs;

 private:
  std::string name_;
  EngineMemoryCapabilities caps_;
};

inline EngineMemoryCapabilities Caps(std::vector<MemoryKind> kinds, bool layerwise = false, bool per_tp_rank = false) {
  EngineMemoryCapabilities caps;
  caps.memory_kinds = std::move(kinds);
  caps.to_pool = true;
  caps.from_pool = true;
  caps.layerwise = layerwise;
  caps.per_tp_rank = per_tp_rank;
  return caps;
}

}  // namespace flexkv::testing
