// KvRegistration: what an engine sends to register its KV buffers (RegisterKv), before any backend opened it.
// Untrusted: the backend that opens it validates every field against the session's geometry.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "common/unique_fd.h"
#include "flexkv/geometry.h"

namespace flexkv {

// The kinds of engine memory a backend may serve; a registration needs one or more of them.
enum class MemoryKind : uint8_t {
  kHostMemfd,  // host memory in a sealed memfd shared with the daemon
  kCudaIpc,    // cudaMalloc memory named by CUDA IPC handles
  kCudaVmm,    // cuMem/VMM physical allocations passed as shareable fds
};
const char* MemoryKindName(MemoryKind kind);

// Host KV buffers: one process's whole blocks in a memfd sealed against shrinking.
struct HostKvMemory {
  UniqueFd memfd;
  KvLayout layout = KvLayout::kBlockFirst;
  uint32_t num_blocks = 0;
};

// One TP rank's GPU KV buffers as a client described them. A region is either cudaMalloc memory named by a
// CUDA IPC handle, or cuMem/VMM memory: physical allocations (shareable fds the client offered) that the
// daemon maps back to back.
struct GpuKvVmmAllocation {
  uint32_t fd_tag = 0;  // key into GpuKvDescription::vmm_fds
  uint64_t bytes = 0;   // the allocation's whole size
};
struct GpuKvRegion {
  std::string ipc_handle;  // cudaIpcMemHandle_t, 64 bytes; empty for a VMM region
  uint64_t offset = 0;     // of the region inside the allocation the handle names (VMM: the first allocation)
  uint64_t bytes = 0;
  std::vector<GpuKvVmmAllocation> vmm_allocations;  // VMM only, in address order
};
struct GpuKvDescription {
  std::string gpu_uuid;              // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
  KvLayout layout = KvLayout::kLayerFirst;
  uint32_t num_blocks = 0;
  uint32_t tp_rank = 0;
  std::vector<GpuKvRegion> regions;  // LAYER_FIRST, LAYER_BLOCK_REGIONS: one per layer; otherwise one
  // The fds of the VMM allocations, by tag (taken from the session's offered fds). Open imports each once;
  // they are closed when the description goes.
  std::map<uint32_t, std::shared_ptr<UniqueFd>> vmm_fds;
};

// One TP rank's CUDA layer events as the engine exported them (RegisterLayerEvents): per layer, the bytes of a
// cudaIpcEventHandle_t of an event the engine created with cudaEventInterprocess | cudaEventDisableTiming on the
// GPU named by UUID. Untrusted: the data plane checks the counts against the geometry, the backend opens them.
struct LayerEventsRank {
  std::string gpu_uuid;
  uint32_t tp_rank = 0;
  std::vector<std::string> handles;  // one per layer, 64 bytes each
};

struct KvRegistration {
  std::variant<HostKvMemory, GpuKvDescription> memory;
  // The geometry component these buffers hold (docs/hybrid.md); backends open them for that component's copy
  // geometry (Geometry::Component). 0 for a full-attention session.
  uint32_t component = 0;

  // The memory kinds a backend must have declared to open this registration (a GPU registration may mix IPC
  // and VMM regions).
  std::vector<MemoryKind> Kinds() const;
  // The TP rank whose shard this is (0 for whole blocks).
  uint32_t tp_rank() const;
  uint32_t num_blocks() const;
};

}  // namespace flexkv
