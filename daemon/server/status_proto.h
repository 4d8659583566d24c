// GetStatus's converters: the daemon's parts' status structs into their flexkv.v1 messages (docs/operations.md
// "What each status field means" says what each field means).
#pragma once

#include <cstdint>

#include "daemon/cache/cache.h"
#include "daemon/cache/cache_set.h"
#include "daemon/tiers/cluster/cluster_tier.h"
#include "daemon/tiers/ssd/ssd_tier.h"
#include "flexkv/v1/control.grpc.pb.h"

namespace flexkv {

// The cluster tier's status (GetStatusResponse.cluster).
void FillCluster(const ClusterTierStatus& c, v1::ClusterStatus* out);
// The SSD tier's status (one GetStatusResponse.tiers entry, named "ssd").
void FillTier(const SsdTierStatus& t, v1::TierStatus* out);
// A domain's pool preparation (Cache::Preparation): preparation, active_bytes, target_bytes, prepare_ms and
// first_serve_ms of its PoolStatus.
void FillPreparation(const Cache::Preparation& p, v1::PoolStatus* pool);
// One domain's pool (GetStatus fills the totals by adding these up) and counters.
void FillPool(const CacheDomain::View& view, const Cache::Stats& stats, uint64_t budget_bytes, v1::PoolStatus* pool);
void FillCounters(const CounterValues& c, uint64_t evicted, v1::Counters* out);

}  // namespace flexkv
