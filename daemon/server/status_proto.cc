// See status_proto.h.
#include "daemon/server/status_proto.h"

#include <algorithm>

#include "common/clock.h"

namespace flexkv {

void FillPreparation(const Cache::Preparation& p, v1::PoolStatus* pool) {
  pool->set_active_bytes(p.ready_bytes);
  if (p.preparing) {
    pool->set_preparation("preparing");
    pool->set_target_bytes(p.target_bytes);
  } else if (!p.error.ok()) {
    pool->set_preparation("failed: " + p.error.ToString());
  }
  if (p.started_ms != 0) {
    pool->set_prepare_ms(
        std::max<uint64_t>(1, static_cast<uint64_t>((p.done_ms != 0 ? p.done_ms : MonotonicMs()) - p.started_ms)));
  }
  // 0 means "not served yet": a pool served within the millisecond it was asked for reports 1.
  if (p.served_ms != 0) pool->set_first_serve_ms(std::max<uint64_t>(1, static_cast<uint64_t>(p.served_ms - p.started_ms)));
}

void FillPool(const CacheDomain::View& view, const Cache::Stats& stats, uint64_t budget_bytes, v1::PoolStatus* pool) {
  pool->set_block_bytes(view.block_bytes);
  pool->set_capacity_blocks(stats.capacity);
  pool->set_used_blocks(stats.used);
  pool->set_pinned_blocks(stats.pinned);
  pool->set_backing(stats.backing);
  pool->set_budget_bytes(budget_bytes);
  pool->set_unverified_blocks(stats.unverified);
  for (const Cache::ComponentStats& cs : stats.components) {
    v1::ComponentPoolStatus* out = pool->add_components();
    out->set_kind(static_cast<v1::ComponentKind>(cs.kind));
    out->set_slot_bytes(cs.slot_bytes);
    out->set_capacity(cs.capacity);
    out->set_used(cs.used);
    out->set_pinned(cs.pinned);
    out->set_evicted(cs.evicted);
    out->set_unanchored(cs.unanchored);
  }
}

void FillCounters(const CounterValues& c, uint64_t evicted, v1::Counters* out) {
  out->set_match_requests(c.match_requests);
  out->set_match_blocks(c.match_blocks);
  out->set_hit_blocks(c.hit_blocks);
  out->set_load_blocks(c.load_blocks);
  out->set_store_blocks(c.store_blocks);
  out->set_evicted_blocks(evicted);
  out->set_bytes_loaded(c.bytes_loaded);
  out->set_bytes_stored(c.bytes_stored);
  out->set_data_loss_blocks(c.data_loss_blocks);
}


}  // namespace flexkv
