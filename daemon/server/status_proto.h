// GetStatus's converters: the daemon's parts' status structs into their flexkv.v1 messages (each tier has its own:
// CacheTier::ReportStatus) (docs/operations.md
// "What each status field means" says what each field means).
#pragma once

#include <cstdint>

#include "daemon/cache/cache.h"
#include "daemon/cache/cache_set.h"
#include "flexkv/v1/control.grpc.pb.h"

namespace flexkv {

// A domain's pool preparation (Cache::Preparation): preparation, active_bytes, target_bytes, prepare_ms and
// first_serve_ms of its PoolStatus.
void FillPreparation(const Cache::Preparation& p, v1::PoolStatus* pool);
// One domain's pool (GetStatus fills the totals by adding these up) and counters.
void FillPool(const CacheDomain::View& view, const Cache::Stats& stats, uint64_t budget_bytes, v1::PoolStatus* pool);
void FillCounters(const CounterValues& c, uint64_t evicted, v1::Counters* out);

}  // namespace flexkv
