// CudaBackend: the daemon side of GPU KV caches. Opens engines' GPU buffers from CUDA IPC handles, maps
// each GPU by UUID (never by an index that depends on CUDA_VISIBLE_DEVICES), registers the host pool for
// DMA, and runs gather/scatter copies on one load and one store worker per GPU (separate streams, so loads
// and stores overlap). Exists only in builds with a CUDA toolkit and on machines with a GPU. The data plane reaches
// it through the engine-memory interface (CudaEngineMemory, cuda_engine_memory.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "daemon/cache/pool_region.h"
#include "daemon/transfer/job_layers.h"
#include "daemon/transfer/kv_registration.h"
#include "daemon/transfer/launch_deadline.h"
#include "flexkv/geometry.h"
#include "flexkv/status.h"

namespace flexkv {

class GpuKv;  // an opened registration; closes its IPC / VMM mappings when the last copy using it is done
// One TP rank's per-layer CUDA interprocess events opened from the engine's handles (cudaIpcOpenEventHandle);
// destroyed (closed) when the last holder - the session's set, a load recording them - drops it.
class GpuLayerEvents;

// How the backend moves bytes per direction (--load-path, --store-path, --copy-staging-mib).
struct CudaCopyPaths {
  bool load_copy_engine = false;   // loads by cudaMemcpyBatchAsync over chunks instead of the kernels
  bool store_copy_engine = false;  // stores likewise
  // The kernel paths stage whole-slot copies through this much GPU memory per GPU and direction (kv_copy.h
  // StagedCopy: the kernels pack or unpack, the copy engine moves one copy per slot or slot run), allocated at the first copy
  // that can use it; requests that cannot be staged (layer-wise loads, rank parts of slots larger than half
  // of it) and every copy when it is 0 or cannot be allocated take the kernels alone.
  uint64_t staging_bytes = 64ull << 20;
};

class CudaBackend {
 public:
  // nullptr when this build has no CUDA or no GPU is visible (the reason is logged).
  static std::unique_ptr<CudaBackend> Create(const CudaCopyPaths& paths);
  virtual ~CudaBackend() = default;

  virtual std::vector<std::string> DeviceUuids() const = 0;
  // Registers [base, base+bytes) for DMA on every GPU (cudaHostRegister in chunks of at most 64 GiB, each a whole
  // number of `slot_bytes` slots): a region of a pool (the cache announces each grant of each sub-pool as one).
  // Many regions may be registered at once; a second call for a registered base does nothing. Pinning runs without
  // the backend's lock, so copies of other regions go on meanwhile. On an error nothing of this region stays
  // registered.
  virtual Status RegisterPool(uint8_t* base, uint64_t bytes, uint64_t slot_bytes = 1) = 0;
  // Unregisters exactly the chunks RegisterPool(base, ...) registered (no copy of that region may be in flight;
  // copies of other regions go on). Nothing for a base that is not registered.
  virtual void UnregisterPool(uint8_t* base) = 0;
  // Opens a registration; validates sizes against the geometry and layout. For a hybrid model `geometry` is the
  // copy geometry of the registration's component (Geometry::Component): a state component's is one plane of
  // state_bytes_per_layer per layer and block (snapshot), sharded over TP like K/V.
  virtual Result<std::shared_ptr<GpuKv>> Open(const GpuKvDescription& description, const Geometry& geometry) = 0;

  // Copies blocks between one rank's GPU buffers and pool slots, asynchronously; `done` runs on a backend
  // thread once the bytes are in place (or with the error). `pool` is the sub-pool the slot ids index (its base,
  // slot size and slot count: a hybrid model's components each have their own); it must lie inside one registered
  // region with slots of at least the registration's block bytes, every slot id below pool.slots and every block
  // id below the registration's blocks, else `done` runs at once, on the caller's thread, with
  // FAILED_PRECONDITION (the sub-pool, a slot) or INVALID_ARGUMENT (a block id), and nothing is copied.
  // `on_layer` (optional, loads) runs as each layer
  // lands, for layer-wise loads. `term_sums` (stores; null or empty for none, else one entry per slot): before
  // `done`, entry i gets the checksum term sum of the bytes written to slots[i] added to it
  // (common/block_checksum.h), computed by the gather kernel as it copies, or, on the copy-engine path, by a
  // kernel reading the GPU blocks at the same time as the copy.
  // `events` (optional, loads only): record events[layer] on the copy stream right after each layer's copies, then
  // call `on_launched` once every layer is enqueued and recorded (not when it failed before); `done` as above. The
  // events must be on the registration's GPU (else FAILED_PRECONDITION at once, nothing copied). `layers` (loads with
  // on_layer or events only; default all): the layers copied, events recorded at layers.first_event onwards; with
  // layers.more_follow the worker goes on to the next job without waiting for this one (done still after it landed).
  virtual void Copy(std::shared_ptr<GpuKv> kv, bool to_host, const PoolRegion& pool, std::vector<uint32_t> gpu_blocks,
                    std::vector<uint32_t> slots, std::shared_ptr<std::vector<uint64_t>> term_sums,
                    std::function<void(uint32_t layer)> on_layer, std::function<void(Status)> done,
                    std::shared_ptr<GpuLayerEvents> events = nullptr, std::function<void()> on_launched = nullptr,
                    std::shared_ptr<LaunchDeadline> launch_deadline = nullptr, JobLayers layers = {}) = 0;
  // Opens one TP rank's layer events from their IPC handles on the GPU the UUID names: NOT_FOUND for a GPU this
  // daemon does not see, INVALID_ARGUMENT naming the layer whose handle cudaIpcOpenEventHandle refuses (not an
  // interprocess event, or of a process that is gone). Whatever was opened is closed again on an error.
  virtual Result<std::shared_ptr<GpuLayerEvents>> OpenLayerEvents(const LayerEventsRank& rank) = 0;
};

// Facts about an opened registration the data plane checks requests against.
uint32_t GpuKvNumBlocks(const GpuKv& kv);
uint32_t GpuKvTpRank(const GpuKv& kv);
uint32_t GpuLayerEventsCount(const GpuLayerEvents& events);
uint32_t GpuLayerEventsTpRank(const GpuLayerEvents& events);

}  // namespace flexkv
