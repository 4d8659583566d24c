// See engine_memory_backends.h.
#include "daemon/transfer/engine_memory_backends.h"

#include <fmt/format.h>

#include "common/log.h"

namespace flexkv {

void EngineMemoryBackends::Add(std::unique_ptr<EngineMemoryBackend> backend) {
  MutexLock lock(&mu_);
  entries_.push_back(Entry{std::move(backend), {}});
}

Result<EngineMemoryBackend*> EngineMemoryBackends::Select(std::span<const MemoryKind> kinds,
                                                          const uint8_t* pool_base) const {
  MutexLock lock(&mu_);
  for (const Entry& e : entries_) {
    const EngineMemoryCapabilities& caps = e.backend->capabilities();
    if (!std::all_of(kinds.begin(), kinds.end(), [&](MemoryKind k) { return caps.Serves(k); })) continue;
    for (const auto& [base, registered] : e.pools) {
      const auto& [region, status] = registered;
      const bool concerns =
          pool_base == nullptr || (pool_base >= region.base && pool_base < region.base + region.bytes);
      if (concerns && !status.ok()) return status;
    }
    return e.backend.get();
  }
  std::string wanted, running;
  for (MemoryKind k : kinds) wanted += fmt::format("{}{}", wanted.empty() ? "" : " + ", MemoryKindName(k));
  for (const Entry& e : entries_) {
    std::string served;
    for (MemoryKind k : e.backend->capabilities().memory_kinds) {
      served += fmt::format("{}{}", served.empty() ? "" : ", ", MemoryKindName(k));
    }
    running += fmt::format("{}{} ({})", running.empty() ? "" : "; ", e.backend->name(), served);
  }
  return Status::FailedPrecondition(fmt::format(
      "no engine-memory backend of this flexkvd serves {} memory; it runs: {} (the cuda backend is absent when no GPU "
      "is visible or the build has no CUDA)",
      wanted, running.empty() ? "none" : running));
}

Status EngineMemoryBackends::RegisterPool(const PoolRegion& pool) {
  // Registering pins every page (seconds for a grant of GiBs): not under mu_, which an engine's RegisterKv (Select)
  // takes. The entries are fixed once the daemon started (Add), and one grant is registered by one thread at a time.
  Status first = Status::Ok();
  std::vector<EngineMemoryBackend*> todo;
  {
    MutexLock lock(&mu_);
    for (Entry& e : entries_) {
      if (auto it = e.pools.find(pool.base); it != e.pools.end()) {
        if (first.ok()) first = it->second.second;
        continue;
      }
      todo.push_back(e.backend.get());
    }
  }
  std::vector<Status> results;
  for (EngineMemoryBackend* backend : todo) {
    Status status = backend->RegisterPool(pool);
    if (!status.ok()) {
      log::Warning("transfer", "{}; the {} backend's copies of the pool region at {} ({} bytes) will be refused",
                   status.message(), backend->name(), static_cast<const void*>(pool.base), pool.bytes);
      if (first.ok()) first = status.WithContext(fmt::format("the {} backend", backend->name()));
    }
    results.push_back(std::move(status));
  }
  MutexLock lock(&mu_);
  for (size_t i = 0; i < todo.size(); ++i) {
    for (Entry& e : entries_) {
      if (e.backend.get() == todo[i]) e.pools.emplace(pool.base, std::make_pair(pool, results[i]));
    }
  }
  return first;
}

void EngineMemoryBackends::UnregisterPool(const PoolRegion& pool) {
  MutexLock lock(&mu_);
  for (Entry& e : entries_) {
    auto it = e.pools.find(pool.base);
    if (it == e.pools.end()) continue;
    if (it->second.second.ok()) e.backend->UnregisterPool(it->second.first);
    e.pools.erase(it);
  }
}

Result<EngineMemoryBackend*> EngineMemoryBackends::SelectLayerEvents() const {
  MutexLock lock(&mu_);
  std::string have;
  for (const Entry& e : entries_) {
    if (e.backend->capabilities().layer_events) return e.backend.get();
    have += (have.empty() ? "" : ", ") + std::string(e.backend->name());
  }
  return Status::FailedPrecondition(fmt::format(
      "no backend of this flexkvd records CUDA layer events (backends: {}); expected the cuda backend (a GPU visible "
      "to flexkvd, a build with CUDA): load with progress completions (layer-wise) instead",
      have.empty() ? "none" : have));
}

std::vector<const EngineMemoryBackend*> EngineMemoryBackends::List() const {
  MutexLock lock(&mu_);
  std::vector<const EngineMemoryBackend*> list;
  for (const Entry& e : entries_) list.push_back(e.backend.get());
  return list;
}

}  // namespace flexkv
