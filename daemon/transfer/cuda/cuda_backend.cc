// CUDA backend; see cuda_backend.h. Everything below the #if needs a CUDA toolkit.
#include "daemon/transfer/cuda/cuda_backend.h"

#include "common/log.h"

#if FLEXKV_HAVE_CUDA

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <thread>

#include "common/cuda_driver.h"
#include "common/mutex.h"
#include "daemon/transfer/cuda/copy_worker.h"
#include "daemon/transfer/cuda/cuda_kv.h"
#include "daemon/transfer/cuda/gpu_kv_layout.h"
#include "daemon/transfer/cuda/kv_copy.h"

namespace flexkv {
namespace {

std::string UuidString(const cudaUUID_t& u) {
  const auto* b = reinterpret_cast<const unsigned char*>(u.bytes);
  std::string hex;
  for (int i = 0; i < 16; ++i) hex += fmt::format("{:02x}", b[i]);
  return fmt::format("GPU-{}-{}-{}-{}-{}", hex.substr(0, 8), hex.substr(8, 4), hex.substr(12, 4), hex.substr(16, 4),
                     hex.substr(20, 12));
}

}  // namespace

uint32_t GpuKvNumBlocks(const GpuKv& kv) { return kv.description.num_blocks; }
uint32_t GpuKvTpRank(const GpuKv& kv) { return kv.description.tp_rank; }
uint32_t GpuLayerEventsCount(const GpuLayerEvents& e) { return static_cast<uint32_t>(e.events.size()); }
uint32_t GpuLayerEventsTpRank(const GpuLayerEvents& e) { return e.tp_rank; }

namespace {

class CudaBackendImpl final : public CudaBackend {
 public:
  Status Init() {
    int count = 0;
    FLEXKV_CUDA_TRY(cudaGetDeviceCount(&count));
    // The driver API is reached through the runtime, so flexkvd does not link libcuda (absent on machines
    // without a GPU, where the daemon must still start with the host backend).
    if (!CudaDriver::Get().complete) log::Warning("cuda", "the CUDA driver lacks cuMem entry points: VMM KV caches are refused");
    for (int d = 0; d < count; ++d) {
      cudaDeviceProp prop{};
      FLEXKV_CUDA_TRY(cudaGetDeviceProperties(&prop, d));
      uuids_.push_back(UuidString(prop.uuid));
      log::Info("cuda", "device {}: {} {}", d, prop.name, uuids_.back());
    }
    return Status::Ok();
  }

  std::vector<std::string> DeviceUuids() const override { return uuids_; }

  Status RegisterPool(uint8_t* base, uint64_t bytes, uint64_t slot_bytes) override {
    if (base == nullptr || bytes == 0) {
      return Status::InvalidArgument(fmt::format("pool range [{}, +{}); expected a mapped, non-empty range",
                                                 static_cast<const void*>(base), bytes));
    }
    {
      MutexLock lock(&mu_);
      if (pools_.contains(base)) return Status::Ok();
      if (registering_.contains(base)) {
        return Status::Unavailable(fmt::format("the pool region at {} is being registered by another call; retry",
                                               static_cast<const void*>(base)));
      }
      registering_.insert(base);
    }
    // cudaHostRegister pins every page (seconds for a large grant): not under mu_, which every copy's check takes.
    // Chunks of at most 64 GiB, a whole number of slots each, so that no slot straddles two registrations.
    const uint64_t align = std::max<uint64_t>(slot_bytes, 1);
    const uint64_t max_chunk = std::max<uint64_t>((64ULL << 30) / align, 1) * align;
    RegisteredPool pool{bytes, max_chunk, {}};
    Status failed = Status::Ok();
    for (uint64_t off = 0; off < bytes; off += max_chunk) {
      const uint64_t n = std::min(max_chunk, bytes - off);
      const cudaError_t e = cudaHostRegister(base + off, n, cudaHostRegisterPortable | cudaHostRegisterMapped);
      if (e != cudaSuccess) {
        for (uint8_t* chunk : pool.chunks) cudaHostUnregister(chunk);
        failed = CudaError(e, "cudaHostRegister(pool)", __FILE__, __LINE__);
        break;
      }
      pool.chunks.push_back(base + off);
    }
    MutexLock lock(&mu_);
    registering_.erase(base);
    if (!failed.ok()) return failed;
    pools_.emplace(base, std::move(pool));
    if (loads_.empty()) {  // the workers start with the first pool and stay (other pools' copies may be running)
      for (int d = 0; d < static_cast<int>(uuids_.size()); ++d) {
        loads_.push_back(std::make_unique<CopyWorker>(d, false, paths_.load_copy_engine, paths_.staging_bytes));
        stores_.push_back(std::make_unique<CopyWorker>(d, true, paths_.store_copy_engine, paths_.staging_bytes));
      }
    }
    log::Debug("cuda", "pool region at {} registered for DMA on {} GPU(s): {} bytes", static_cast<const void*>(base),
               uuids_.size(), bytes);
    return Status::Ok();
  }

  void UnregisterPool(uint8_t* base) override {
    RegisteredPool pool;
    {
      // Out of the map first: from here no copy's check finds it (no copy of its slots is in flight: the cache
      // releases a region only when none of its slots is pinned or pending).
      MutexLock lock(&mu_);
      auto it = pools_.find(base);
      if (it == pools_.end()) return;
      pool = std::move(it->second);
      pools_.erase(it);
    }
    for (uint8_t* chunk : pool.chunks) cudaHostUnregister(chunk);
    log::Debug("cuda", "pool region at {} unregistered", static_cast<const void*>(base));
  }

  Result<std::shared_ptr<GpuKv>> Open(const GpuKvDescription& d, const Geometry& g) override {
    int device = -1;
    for (int i = 0; i < static_cast<int>(uuids_.size()); ++i) {
      if (uuids_[i] == d.gpu_uuid) device = i;
    }
    if (device < 0) {
      std::string known;
      for (const auto& u : uuids_) known += (known.empty() ? "" : ", ") + u;
      return Status::NotFound(fmt::format("gpu_uuid {} is not a GPU this daemon sees ({})", d.gpu_uuid, known));
    }
    auto plan = PlanGpuKvLayout(d, g);  // layout, num_blocks, tp_rank, region count and sizes
    if (!plan.ok()) return plan.status();
    const uint64_t L = g.num_layers;
    auto kv = std::make_shared<GpuKv>();
    kv->device = device;
    kv->geometry = g;
    kv->description = d;
    kv->description.vmm_fds.clear();  // imported below; the fds are not needed after Open
    FLEXKV_CUDA_TRY(cudaSetDevice(device));
    std::map<uint32_t, CUmemGenericAllocationHandle> imported;  // fd tag → handle, released when Open returns
    struct ReleaseImported {
      std::map<uint32_t, CUmemGenericAllocationHandle>& handles;
      ~ReleaseImported() {
        for (const auto& [tag, h] : handles) CudaDriver::Get().mem_release(h);
      }
    } release_imported{imported};
    std::vector<uint64_t> region_start;  // device address of each region's first byte
    for (size_t r = 0; r < d.regions.size(); ++r) {
      const GpuKvRegion& region = d.regions[r];
      auto base = region.vmm_allocations.empty() ? OpenIpcRegion(*kv, region, r) : MapVmmRegion(*kv, d, region, r, imported);
      if (!base.ok()) return base.status();
      region_start.push_back(*base + region.offset);
    }
    for (uint64_t l = 0; l < L; ++l) {
      kv->layer_base_host.push_back(region_start[plan->layer_region[l]] + plan->layer_offset[l]);
    }
    FLEXKV_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&kv->layer_base_dev), sizeof(uint64_t) * L));
    FLEXKV_CUDA_TRY(cudaMemcpy(kv->layer_base_dev, kv->layer_base_host.data(), sizeof(uint64_t) * L, cudaMemcpyHostToDevice));
    kv->view.layer_base = kv->layer_base_dev;
    kv->view.num_layers = g.num_layers;
    kv->view.num_planes = g.kv_planes;
    kv->view.chunk_bytes = g.chunk_bytes_per_rank();
    kv->view.plane_stride = plan->plane_stride;
    kv->view.block_stride = plan->block_stride;
    kv->view.layers_in_one_allocation = plan->layers_in_one_allocation;
    log::Info("cuda", "opened GPU KV of tp rank {} on {} (device {}): {} blocks, {}, {} region(s)", d.tp_rank,
              d.gpu_uuid, device, d.num_blocks, KvLayoutName(d.layout), d.regions.size());
    return kv;
  }

  // Opens (once per allocation) the cudaMalloc allocation an IPC handle names; returns the base address the
  // region's offset is relative to, after checking [offset, offset + bytes) lies inside the allocation.
  Result<uint64_t> OpenIpcRegion(GpuKv& kv, const GpuKvRegion& region, size_t r) {
    if (region.ipc_handle.size() != sizeof(cudaIpcMemHandle_t)) {
      return Status::InvalidArgument(fmt::format("region {}: ipc_handle has {} bytes; expected {} (or VMM allocations)", r,
                                                 region.ipc_handle.size(), sizeof(cudaIpcMemHandle_t)));
    }
    void*& base = kv.opened[region.ipc_handle];
    if (base == nullptr) {
      cudaIpcMemHandle_t h;
      std::memcpy(&h, region.ipc_handle.data(), sizeof(h));
      const cudaError_t e = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess);
      if (e != cudaSuccess) {
        kv.opened.erase(region.ipc_handle);
        return Status::InvalidArgument(fmt::format("region {}: cudaIpcOpenMemHandle: {}", r, cudaGetErrorString(e)));
      }
    }
    CUdeviceptr alloc_base = 0;
    size_t alloc_size = 0;
    const CudaDriver& drv = CudaDriver::Get();
    if (drv.mem_get_address_range == nullptr ||
        drv.mem_get_address_range(&alloc_base, &alloc_size, reinterpret_cast<CUdeviceptr>(base)) != CUDA_SUCCESS ||
        region.offset > alloc_size || region.bytes > alloc_size - region.offset) {
      return Status::OutOfRange(fmt::format("region {}: [{}, +{}) exceeds the {}-byte allocation its handle names", r,
                                            region.offset, region.bytes, alloc_size));
    }
    return reinterpret_cast<uint64_t>(base);
  }

  // Maps a VMM region: imports each allocation's fd (once per Open, shared across regions), reserves one
  // address range for the region's allocations and maps them back to back, readable and writable by the
  // registration's device. Returns the range's base; the mapping is undone when `kv` goes.
  Result<uint64_t> MapVmmRegion(GpuKv& kv, const GpuKvDescription& d, const GpuKvRegion& region, size_t r,
                                std::map<uint32_t, CUmemGenericAllocationHandle>& imported) {
    const CudaDriver& drv = CudaDriver::Get();
    if (!drv.complete) {
      return Status::Unimplemented(fmt::format("region {}: this CUDA driver lacks the cuMem entry points VMM memory needs", r));
    }
    if (!region.ipc_handle.empty()) {
      return Status::InvalidArgument(fmt::format("region {} has both an ipc_handle and VMM allocations; expected one", r));
    }
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = kv.device;
    size_t granule = 0;
    if (drv.mem_get_allocation_granularity(&granule, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS || granule == 0) {
      granule = 2ULL << 20;
    }
    uint64_t total = 0;
    std::set<uint32_t> seen;
    for (const GpuKvVmmAllocation& a : region.vmm_allocations) {
      if (a.bytes == 0 || a.bytes % granule != 0 || a.bytes > (1ULL << 40) || total + a.bytes > (1ULL << 42)) {
        return Status::InvalidArgument(fmt::format("region {}: VMM allocation of {} bytes (span so far {}); expected a "
                                                   "multiple of the {}-byte granularity, at most 1 TiB each and 4 TiB in all",
                                                   r, a.bytes, total, granule));
      }
      if (!seen.insert(a.fd_tag).second) {
        return Status::InvalidArgument(fmt::format("region {}: VMM allocation tag {} appears twice; expected each "
                                                   "allocation once, in address order", r, a.fd_tag));
      }
      total += a.bytes;
    }
    if (region.offset > total || region.bytes > total - region.offset) {
      return Status::OutOfRange(fmt::format("region {}: [{}, +{}) exceeds the {} bytes of its {} VMM allocation(s)", r,
                                            region.offset, region.bytes, total, region.vmm_allocations.size()));
    }
    // The allocations must cover the region exactly: none wholly before it, none wholly after it.
    const uint64_t first = region.vmm_allocations.front().bytes, last = region.vmm_allocations.back().bytes;
    if (region.offset >= first || total - last >= region.offset + region.bytes) {
      return Status::InvalidArgument(fmt::format("region {}: its {} VMM allocation(s) ({} bytes) reach beyond [{}, +{}); "
                                                 "expected exactly the allocations that back the region", r,
                                                 region.vmm_allocations.size(), total, region.offset, region.bytes));
    }
    GpuKv::VmmSpan& span = kv.vmm_spans.emplace_back();
    CUresult e = drv.mem_address_reserve(&span.base, total, 0, 0, 0);
    if (e != CUDA_SUCCESS) {
      span.base = 0;
      return Status::ResourceExhausted(fmt::format("region {}: cuMemAddressReserve of {} bytes: {}", r, total, drv.ErrorText(e)));
    }
    span.reserved = total;
    CUdeviceptr at = span.base;
    for (size_t i = 0; i < region.vmm_allocations.size(); ++i) {
      const GpuKvVmmAllocation& a = region.vmm_allocations[i];
      auto handle = imported.find(a.fd_tag);
      if (handle == imported.end()) {
        auto fd = d.vmm_fds.find(a.fd_tag);
        if (fd == d.vmm_fds.end() || !*fd->second) {
          return Status::InvalidArgument(fmt::format("region {}: no fd was offered for VMM allocation tag {}", r, a.fd_tag));
        }
        CUmemGenericAllocationHandle h = 0;
        e = drv.mem_import_from_shareable_handle(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(fd->second->get())),
                                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        if (e != CUDA_SUCCESS) {
          return Status::InvalidArgument(fmt::format(
              "region {}: cuMemImportFromShareableHandle of allocation tag {}: {} (expected an fd from "
              "cuMemExportToShareableHandle with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)", r, a.fd_tag, drv.ErrorText(e)));
        }
        handle = imported.emplace(a.fd_tag, h).first;
      }
      e = drv.mem_map(at, a.bytes, 0, handle->second, 0);
      if (e != CUDA_SUCCESS) {
        return Status::InvalidArgument(fmt::format("region {}: cuMemMap of allocation {} ({} bytes, tag {}): {} (is `bytes` "
                                                   "the allocation's whole size?)", r, i, a.bytes, a.fd_tag, drv.ErrorText(e)));
      }
      span.mapped.emplace_back(at, a.bytes);
      at += a.bytes;
    }
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = kv.device;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    e = drv.mem_set_access(span.base, total, &access, 1);
    if (e != CUDA_SUCCESS) {
      return Status::InvalidArgument(fmt::format("region {}: cuMemSetAccess for device {}: {} (are the allocations on "
                                                 "the GPU the registration names?)", r, kv.device, drv.ErrorText(e)));
    }
    return static_cast<uint64_t>(span.base);
  }

  void Copy(std::shared_ptr<GpuKv> kv, bool to_host, const PoolRegion& pool, std::vector<uint32_t> gpu_blocks,
            std::vector<uint32_t> slots, std::shared_ptr<std::vector<uint64_t>> term_sums,
            std::function<void(uint32_t)> on_layer, std::function<void(Status)> done,
            std::shared_ptr<GpuLayerEvents> events, std::function<void()> on_launched,
            std::shared_ptr<LaunchDeadline> launch_deadline, JobLayers layers) override {
    CopyWorker* w = nullptr;
    Status checked = Status::Ok();
    std::vector<uint8_t> follows;
    {
      MutexLock lock(&mu_);
      if (pools_.empty()) {
        checked = Status::FailedPrecondition("the pool is not registered for DMA");
      } else {
        checked = CheckJob(*kv, pool, gpu_blocks, slots, &follows);
        w = (to_host ? stores_ : loads_)[static_cast<size_t>(kv->device)].get();
      }
    }
    if (checked.ok() && events != nullptr && (to_host || events->device != kv->device)) {
      checked = Status::FailedPrecondition(fmt::format(
          "the layer events of tp rank {} are on {} but its KV buffers on {}; expected events created on the GPU "
          "that holds the rank's KV buffers (and a load: stores record no events)",
          events->tp_rank, uuids_[static_cast<size_t>(events->device)], kv->description.gpu_uuid));
    }
    if (!checked.ok()) return done(std::move(checked));
    w->Submit({std::move(kv), pool, std::move(gpu_blocks), std::move(slots), std::move(follows), std::move(term_sums),
               std::move(on_layer), std::move(done), std::move(events), std::move(on_launched),
               std::move(launch_deadline), layers});
  }

  Result<std::shared_ptr<GpuLayerEvents>> OpenLayerEvents(const LayerEventsRank& rank) override {
    int device = -1;
    for (int i = 0; i < static_cast<int>(uuids_.size()); ++i) {
      if (uuids_[i] == rank.gpu_uuid) device = i;
    }
    if (device < 0) {
      std::string known;
      for (const auto& u : uuids_) known += (known.empty() ? "" : ", ") + u;
      return Status::NotFound(fmt::format("gpu_uuid {} is not a GPU this daemon sees ({})", rank.gpu_uuid, known));
    }
    FLEXKV_CUDA_TRY(cudaSetDevice(device));
    auto opened = std::make_shared<GpuLayerEvents>(device, rank.tp_rank);
    opened->events.reserve(rank.handles.size());
    for (size_t l = 0; l < rank.handles.size(); ++l) {
      if (rank.handles[l].size() != sizeof(cudaIpcEventHandle_t)) {
        return Status::InvalidArgument(fmt::format("the handle of layer {} has {} bytes; expected {}", l,
                                                   rank.handles[l].size(), sizeof(cudaIpcEventHandle_t)));
      }
      cudaIpcEventHandle_t h;
      std::memcpy(&h, rank.handles[l].data(), sizeof(h));
      cudaEvent_t e = nullptr;
      const cudaError_t err = cudaIpcOpenEventHandle(&e, h);
      if (err != cudaSuccess) {
        return Status::InvalidArgument(fmt::format(
            "cudaIpcOpenEventHandle of layer {} on {}: {}; expected the handle (cudaIpcGetEventHandle) of an event "
            "created with cudaEventInterprocess | cudaEventDisableTiming by a live process on that GPU",
            l, rank.gpu_uuid, cudaGetErrorString(err)));
      }
      opened->events.push_back(e);  // closed by ~GpuLayerEvents, also when a later layer fails
    }
    return opened;
  }

  // The cudaHostRegister chunk that holds all of [at, at + bytes) - an identity for "one DMA registration" - or
  // null when no registered region holds it.
  const uint8_t* RegisteredChunk(const uint8_t* at, uint64_t bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = pools_.upper_bound(at);  // the region at or below `at` is the only one that can hold it
    if (at == nullptr || it == pools_.begin()) return nullptr;
    --it;
    const auto offset = static_cast<uint64_t>(at - it->first);
    if (offset > it->second.bytes || bytes > it->second.bytes - offset) return nullptr;
    // Chunks are whole slots of the region's sub-pool, so a slot of it lies in one; the last byte's chunk decides
    // for anything else (a copy never spans two: such a range is not merged with its neighbours either).
    const uint64_t chunk = it->second.chunk_bytes;
    const uint64_t first = offset / chunk, last = (offset + std::max<uint64_t>(bytes, 1) - 1) / chunk;
    return first == last ? it->first + first * chunk : nullptr;
  }

  // Every slot the job copies lies inside a region registered for DMA (a pool is registered grant by grant, so
  // one sub-pool may span several regions, and a slot beyond the active grants is in none), its slots hold a block
  // of the registration's geometry, its slot ids are below the sub-pool's slots and its block ids below the
  // registration's blocks. Nothing outside the registered pool and the registration's buffers is ever handed to
  // the device. `follows` receives kv_copy.h's slot-run marks: entry i is 1 where slots[i] is slots[i - 1] + 1 in the
  // same cudaHostRegister chunk (one copy may move both), else 0.
  Status CheckJob(const GpuKv& kv, const PoolRegion& pool, const std::vector<uint32_t>& gpu_blocks,
                  const std::vector<uint32_t>& slots, std::vector<uint8_t>* follows) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const uint64_t need = kv.geometry.host_block_bytes();
    const auto begin = reinterpret_cast<uintptr_t>(pool.base);
    if (pool.slot_bytes < need || pool.slot_bytes % 16 != 0 || begin % 16 != 0) {
      return Status::FailedPrecondition(fmt::format(
          "the copy's sub-pool has {}-byte slots at {}; expected 16-byte aligned slots of at least the {} bytes of "
          "one block of {}",
          pool.slot_bytes, static_cast<const void*>(pool.base), need, kv.geometry.ToString()));
    }
    if (gpu_blocks.size() != slots.size()) {
      return Status::InvalidArgument(
          fmt::format("{} GPU blocks and {} slots; expected one slot per block", gpu_blocks.size(), slots.size()));
    }
    follows->assign(slots.size(), 0);
    const uint8_t* last_chunk = nullptr;
    for (size_t i = 0; i < slots.size(); ++i) {
      if (slots[i] >= pool.slots) {
        return Status::FailedPrecondition(
            fmt::format("slot {} (entry {}) is not below the sub-pool's {} slots", slots[i], i, pool.slots));
      }
      const uint8_t* chunk = RegisteredChunk(pool.SlotData(slots[i]), pool.slot_bytes);
      if (chunk == nullptr) {
        return Status::FailedPrecondition(fmt::format(
            "slot {} (entry {}) of the sub-pool at {} ({} bytes each) is not inside a region registered for DMA ({} "
            "registered)",
            slots[i], i, static_cast<const void*>(pool.base), pool.slot_bytes, pools_.size()));
      }
      (*follows)[i] = i > 0 && slots[i] == slots[i - 1] + 1 && chunk == last_chunk;
      last_chunk = chunk;
      if (gpu_blocks[i] >= kv.description.num_blocks) {
        return Status::InvalidArgument(fmt::format("GPU block {} (entry {}) is not below the registration's {} blocks",
                                                   gpu_blocks[i], i, kv.description.num_blocks));
      }
    }
    return Status::Ok();
  }

  void SetPaths(const CudaCopyPaths& paths) { paths_ = paths; }

  ~CudaBackendImpl() override {
    loads_.clear();  // joins the workers: no copy runs past this point
    stores_.clear();
    for (const auto& [base, pool] : pools_) {
      for (uint8_t* chunk : pool.chunks) cudaHostUnregister(chunk);
    }
  }

 private:
  std::vector<std::string> uuids_;
  Mutex mu_;
  // A region RegisterPool registered: its size and the chunks cudaHostRegister took (what UnregisterPool undoes).
  struct RegisteredPool {
    uint64_t bytes = 0;
    uint64_t chunk_bytes = 0;  // each chunk's size (the last may be shorter), from the region's base
    std::vector<uint8_t*> chunks;
  };
  // By base; every job's sub-pool lies inside one of them.
  std::map<const uint8_t*, RegisteredPool> pools_ ABSL_GUARDED_BY(mu_);
  std::set<const uint8_t*> registering_ ABSL_GUARDED_BY(mu_);  // regions being registered, outside mu_
  CudaCopyPaths paths_;
  std::vector<std::unique_ptr<CopyWorker>> loads_ ABSL_GUARDED_BY(mu_), stores_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<CudaBackend> CudaBackend::Create(const CudaCopyPaths& paths) {
  auto b = std::make_unique<CudaBackendImpl>();
  Status s = b->Init();
  if (!s.ok()) {
    log::Info("cuda", "no CUDA backend (no usable GPU): {}; host backend only", s.message());
    return nullptr;
  }
  if (b->DeviceUuids().empty()) {
    log::Info("cuda", "no CUDA backend: no GPU visible");
    return nullptr;
  }
  b->SetPaths(paths);
  return b;
}

}  // namespace flexkv

#else  // !FLEXKV_HAVE_CUDA

namespace flexkv {

class GpuKv {
 public:
  GpuKvDescription description;
};
uint32_t GpuKvNumBlocks(const GpuKv& kv) { return kv.description.num_blocks; }
uint32_t GpuKvTpRank(const GpuKv& kv) { return kv.description.tp_rank; }
class GpuLayerEvents {
 public:
  uint32_t tp_rank = 0, layers = 0;
};
uint32_t GpuLayerEventsCount(const GpuLayerEvents& e) { return e.layers; }
uint32_t GpuLayerEventsTpRank(const GpuLayerEvents& e) { return e.tp_rank; }

std::unique_ptr<CudaBackend> CudaBackend::Create(const CudaCopyPaths&) {
  log::Info("cuda", "this build has no CUDA backend (no toolkit at build time): host backend only");
  return nullptr;
}

}  // namespace flexkv

#endif
