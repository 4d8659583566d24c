// See session_kv.h.
#include "daemon/dataplane/session_kv.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/log.h"
#include "daemon/transfer/host/host_kv.h"

namespace flexkv {

Status SessionKv::CheckFreeLocked(const EngineMemoryBackend& backend, uint32_t tp_rank) const {
  if (!backend.capabilities().per_tp_rank) {
    if (backend_ != nullptr) return Status::AlreadyExists(fmt::format("session {} already registered its KV buffers", session_id_));
    return Status::Ok();
  }
  if (backend_ != nullptr && backend_ != &backend) {
    return Status::AlreadyExists(fmt::format("session {} registered {} KV buffers already", session_id_, backend_->name()));
  }
  if (tp_rank >= geometry_.tp_size) {
    return Status::InvalidArgument(fmt::format("tp_rank {} is not below tp_size {}", tp_rank, geometry_.tp_size));
  }
  if (tp_rank < registrations_.size() && registrations_[tp_rank]) {
    return Status::AlreadyExists(fmt::format("tp rank {} of session {} is registered already", tp_rank, session_id_));
  }
  return Status::Ok();
}

Result<uint64_t> SessionKv::Register(EngineMemoryBackends& backends, KvRegistration registration,
                                     const uint8_t* pool_base) {
  const std::vector<MemoryKind> kinds = registration.Kinds();
  Result<EngineMemoryBackend*> selected = backends.Select(kinds, pool_base);
  if (!selected.ok()) return selected.status();
  EngineMemoryBackend& backend = **selected;
  const uint32_t tp_rank = registration.tp_rank();
  const uint32_t num_blocks = registration.num_blocks();
  // Refusals that need no backend work come first (Open maps memory: a repeated registration must not redo it).
  {
    MutexLock lock(&mu_);
    FLEXKV_RETURN_IF_ERROR(CheckFreeLocked(backend, tp_rank));
  }
  auto opened = backend.Open(std::move(registration), geometry_);
  if (!opened.ok()) return opened.status();
  MutexLock lock(&mu_);
  FLEXKV_RETURN_IF_ERROR(CheckFreeLocked(backend, tp_rank));  // again: another registration may have won meanwhile
  backend_ = &backend;
  if (backend.capabilities().per_tp_rank) {
    if (registrations_.empty()) registrations_.resize(geometry_.tp_size);
    registrations_[tp_rank] = std::move(*opened);
  } else {
    registrations_.assign(1, std::move(*opened));
  }
  log::Info("dataplane", "session {} registered {} KV: {} blocks (tp rank {})", session_id_, backend.name(), num_blocks,
            tp_rank);
  return KvBytesRequired(geometry_, num_blocks);
}

uint32_t SessionKv::RegisteredBlocks(std::string* missing) const {
  MutexLock lock(&mu_);
  if (registrations_.empty()) {
    *missing = "no KV buffers registered (RegisterKv)";
    return 0;
  }
  uint32_t blocks = UINT32_MAX;
  for (size_t r = 0; r < registrations_.size(); ++r) {
    if (!registrations_[r]) {
      *missing = fmt::format("tp rank {} of {} has not registered its {} KV buffers", r, registrations_.size(),
                             backend_->name());
      return 0;
    }
    blocks = std::min(blocks, registrations_[r]->num_blocks());
  }
  return blocks;
}

void SessionKv::FillTargets(CopyRequest* request) const {
  MutexLock lock(&mu_);
  request->backend = backend_;
  request->targets = registrations_;
  const bool sharded = backend_ != nullptr && backend_->capabilities().per_tp_rank;
  if (sharded && request->direction == CopyDirection::kToPool && geometry_.is_mla() && request->targets.size() > 1) {
    request->targets.resize(1);
  }
}

}  // namespace flexkv
