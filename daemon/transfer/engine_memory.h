// EngineMemoryBackend: one kind of engine KV memory (host memfds, CUDA IPC/VMM, ...) behind one interface that
// declares what it serves, as NIXL's backends do. The data plane picks a backend by the memory kinds a
// registration needs and asks it only for the copy directions it declared. Adding a backend means adding its
// files and one EngineMemoryBackends::Add line in daemon/daemon.cc; no request handler changes.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "daemon/cache/pool_region.h"
#include "daemon/transfer/job_layers.h"
#include "daemon/transfer/kv_registration.h"
#include "daemon/transfer/launch_deadline.h"
#include "flexkv/geometry.h"
#include "flexkv/status.h"

namespace flexkv {

// Store copies engine blocks into pool slots; Load copies pool slots into engine blocks.
enum class CopyDirection : uint8_t { kToPool, kFromPool };
const char* CopyDirectionName(CopyDirection direction);

struct EngineMemoryCapabilities {
  std::vector<MemoryKind> memory_kinds;  // registrations this backend can open
  bool to_pool = false;                  // copies engine -> pool (Store)
  bool from_pool = false;                // copies pool -> engine (Load)
  // Reports each layer of a load as it lands. Without it the copy scheduler reports every layer when the whole
  // copy is done, so a layer-wise Load still works, only without overlap.
  bool layerwise = false;
  // A registration holds one TP rank's shard and a session needs tp_size of them; otherwise one registration
  // holds whole blocks.
  bool per_tp_rank = false;
  // Stores fill CopyJob::term_sums while they copy (common/block_checksum.h). Without it the copy scheduler
  // computes them from the pool slots after the copy, a second pass over the stored bytes.
  bool store_checksums = false;
  // Loads record an engine's CUDA interprocess events (OpenLayerEvents, CopyJob::layer_events) on the copy stream
  // right after each layer's copies, so the engine's stream waits on them with no CPU wake-up between layers.
  bool layer_events = false;

  bool Serves(MemoryKind kind) const;
  bool Copies(CopyDirection direction) const { return direction == CopyDirection::kToPool ? to_pool : from_pool; }
};

// A registration a backend opened: a session's KV buffers (or one TP rank's) mapped into the daemon. Shared by
// the session and every copy using it; the mapping goes when the last holder drops it.
class EngineKv {
 public:
  virtual ~EngineKv() = default;
  virtual uint32_t num_blocks() const = 0;  // block ids a request may name are below this
  virtual uint32_t tp_rank() const = 0;     // 0 for whole blocks
};

// One TP rank's per-layer interprocess events, opened in the daemon (cudaIpcOpenEventHandle) by the backend that
// declared `layer_events`; closed when the last holder (the session's set, a load recording them) drops it.
class LayerEvents {
 public:
  virtual ~LayerEvents() = default;
  virtual uint32_t tp_rank() const = 0;
  virtual uint32_t num_layers() const = 0;
};

// One copy between one registration and pool slots.
struct CopyJob {
  std::shared_ptr<EngineKv> kv;  // opened by the backend the job goes to
  CopyDirection direction = CopyDirection::kToPool;
  std::shared_ptr<const std::vector<uint32_t>> engine_blocks;  // engine block ids, each < kv->num_blocks()
  std::shared_ptr<const std::vector<SlotId>> slots;            // pool slots, same length
  PoolRegion pool;                                             // where the slots' bytes are
  // Stores by a backend that declared `store_checksums` (else null): one entry per slot, zeroed by the caller;
  // the backend adds the checksum term sum (ChecksumTermSum, unit index = byte offset in the slot / 16) of every
  // byte it wrote to that slot, before `done` runs. Jobs of different TP ranks have vectors of their own; the copy
  // scheduler adds them up.
  std::shared_ptr<std::vector<uint64_t>> term_sums;
  // Loads of a backend that declared `layerwise` only (else empty): runs once per layer as it lands, before done.
  std::function<void(uint32_t layer)> on_layer;
  // Loads of a backend that declared `layer_events` only (else null): the backend copies layer by layer and records
  // layer_events' event[layer] on its copy stream right after that layer's copies; once every layer's copies and
  // records are enqueued it calls `on_launched` (before `done`, exactly once, never when it failed before that).
  // The events' device must be the registration's (else `done` runs with FAILED_PRECONDITION, nothing copied).
  std::shared_ptr<LayerEvents> layer_events;
  std::function<void()> on_launched;
  // Loads of a backend that declared `layerwise` or `layer_events`: the layers this job copies (default: all). Its
  // on_layer reports only these, its events only these (at layer_events' index first_event + layer - begin).
  // Other backends get only whole jobs.
  JobLayers layers;
  // Loads with a launch deadline (else null): the backend calls Launch() right before this job (or each part it
  // splits it into) moves its first byte, on the thread that then copies, and on a refusal copies nothing of it and
  // ends with that error (`done`; `on_launched` and `on_layer` are not called for what it did not copy).
  std::shared_ptr<LaunchDeadline> launch_deadline;
  // Runs exactly once, on a backend thread (or inline when the job is refused at once), after the bytes are in
  // place or with the error. `copy_start_ns` (monotonic): when the copy began, or was handed to the device.
  std::function<void(Status, int64_t copy_start_ns)> done;
};

class EngineMemoryBackend {
 public:
  virtual ~EngineMemoryBackend() = default;

  // Short and stable ("host", "cuda"): Status lists it, errors name it.
  virtual std::string_view name() const = 0;
  virtual const EngineMemoryCapabilities& capabilities() const = 0;
  // Devices it copies with (GPU UUIDs); empty for host memory.
  virtual std::vector<std::string> devices() const { return {}; }

  // A pool region exists (a cache domain's pool, created or re-attached): make it reachable by this backend's
  // copies (e.g. register it for DMA). Called once per region - several pools (one per cache domain) may be
  // registered at once - before any copy of it. An error is kept by EngineMemoryBackends and refuses later
  // registrations of sessions whose pool it concerns.
  virtual Status RegisterPool(const PoolRegion& pool) = 0;
  // The region is about to be unmapped (an admin dropped its cache domain): undo exactly what RegisterPool(`pool`)
  // did (the region is identified by pool.base). Called only when no session of that domain exists and none of its
  // copies is in flight; copies of other regions may run meanwhile.
  virtual void UnregisterPool(const PoolRegion& /*pool*/) {}
  // Opens a registration whose memory kinds this backend declared, for a session of `geometry`. Errors name the
  // field that is wrong and what was expected. Thread-safe.
  virtual Result<std::shared_ptr<EngineKv>> Open(KvRegistration registration, const Geometry& geometry) = 0;
  // Opens one TP rank's layer events (only a backend that declared `layer_events`; the caller checked the counts
  // against the geometry). Errors name the GPU, the layer and what was expected. Thread-safe.
  virtual Result<std::shared_ptr<LayerEvents>> OpenLayerEvents(const LayerEventsRank& rank) {
    return Status::Unimplemented(fmt::format("the {} backend does not record CUDA layer events (rank {})", name(),
                                             rank.tp_rank));
  }
  // Runs `job` asynchronously; see CopyJob for the callbacks. Only directions the backend declared. Thread-safe.
  virtual void Copy(CopyJob job) = 0;
};

}  // namespace flexkv
