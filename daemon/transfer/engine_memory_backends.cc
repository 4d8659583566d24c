// See engine_memory_backends.h.
#include "daemon/transfer/engine_memory_backends.h"

#include <fmt/format.h>

#include "common/log.h"

namespace flexkv {

void EngineMemoryBackends::Add(std::unique_ptr<EngineMemoryBackend> backend) {
  MutexLock lock(&mu_);
  entries_.push_back(Entry{std::move(backend), false, Status::Ok()});
}

Result<EngineMemoryBackend*> EngineMemoryBackends::Select(std::span<const MemoryKind> kinds) const {
  MutexLock lock(&mu_);
  for (const Entry& e : entries_) {
    const EngineMemoryCapabilities& caps = e.backend->capabilities();
    if (!std::all_of(kinds.begin(), kinds.end(), [&](MemoryKind k) { return caps.Serves(k); })) continue;
    if (!e.pool_status.ok()) return e.pool_status;
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

void EngineMemoryBackends::RegisterPool(const PoolRegion& pool) {
  MutexLock lock(&mu_);
  for (Entry& e : entries_) {
    if (e.pool_registered) continue;
    e.pool_registered = true;
    e.pool_status = e.backend->RegisterPool(pool);
    if (!e.pool_status.ok()) {
      log::Warning("transfer", "{}; sessions of the {} backend will be refused", e.pool_status.message(),
                   e.backend->name());
    }
  }
}

void EngineMemoryBackends::UnregisterPool() {
  MutexLock lock(&mu_);
  for (Entry& e : entries_) {
    if (!e.pool_registered) continue;
    if (e.pool_status.ok()) e.backend->UnregisterPool();
    e.pool_registered = false;
    e.pool_status = Status::Ok();
  }
}

std::vector<const EngineMemoryBackend*> EngineMemoryBackends::List() const {
  MutexLock lock(&mu_);
  std::vector<const EngineMemoryBackend*> list;
  for (const Entry& e : entries_) list.push_back(e.backend.get());
  return list;
}

}  // namespace flexkv
