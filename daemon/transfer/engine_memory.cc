// The small parts of engine_memory.h and kv_registration.h: names, declared capabilities, registration facts.
#include "daemon/transfer/engine_memory.h"

#include <algorithm>

namespace flexkv {

const char* MemoryKindName(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHostMemfd: return "host_memfd";
    case MemoryKind::kCudaIpc: return "cuda_ipc";
    case MemoryKind::kCudaVmm: return "cuda_vmm";
  }
  return "unknown";
}

const char* CopyDirectionName(CopyDirection direction) {
  return direction == CopyDirection::kToPool ? "engine -> pool (store)" : "pool -> engine (load)";
}

bool EngineMemoryCapabilities::Serves(MemoryKind kind) const {
  return std::find(memory_kinds.begin(), memory_kinds.end(), kind) != memory_kinds.end();
}

std::vector<MemoryKind> KvRegistration::Kinds() const {
  if (std::holds_alternative<HostKvMemory>(memory)) return {MemoryKind::kHostMemfd};
  const auto& gpu = std::get<GpuKvDescription>(memory);
  bool ipc = false, vmm = false;
  for (const GpuKvRegion& r : gpu.regions) (r.vmm_allocations.empty() ? ipc : vmm) = true;
  std::vector<MemoryKind> kinds;
  if (ipc || !vmm) kinds.push_back(MemoryKind::kCudaIpc);  // no regions at all: the backend's Open says what is missing
  if (vmm) kinds.push_back(MemoryKind::kCudaVmm);
  return kinds;
}

uint32_t KvRegistration::tp_rank() const {
  if (const auto* gpu = std::get_if<GpuKvDescription>(&memory)) return gpu->tp_rank;
  return 0;
}

uint32_t KvRegistration::num_blocks() const {
  if (const auto* gpu = std::get_if<GpuKvDescription>(&memory)) return gpu->num_blocks;
  return std::get<HostKvMemory>(memory).num_blocks;
}

}  // namespace flexkv
