// See status_proto.h.
#include "daemon/server/status_proto.h"

#include <algorithm>

#include "common/clock.h"

namespace flexkv {

void FillCluster(const ClusterTierStatus& c, v1::ClusterStatus* out) {
  out->set_state(c.state);
  out->set_node_id(c.node_id);
  out->set_epoch(c.epoch);
  out->set_endpoint(c.endpoint);
  for (const ClusterMember& m : c.members) {
    v1::ClusterMember* member = out->add_members();
    member->set_node_id(m.node_id);
    member->set_epoch(m.epoch);
    member->set_endpoint(m.endpoint);
    member->set_self(m.self);
  }
  out->set_published_keys(c.published_keys);
  out->set_publish_queue(c.publish_queue);
  out->set_publish_failures(c.publish_failures);
  out->set_rejoins(c.rejoins);
  out->set_prefetches(c.prefetches);
  out->set_pulls_ok(c.pulls_ok);
  out->set_pulls_failed(c.pulls_failed);
  out->set_pulled_blocks(c.pulled_blocks);
  out->set_pulled_bytes(c.pulled_bytes);
  out->set_verify_failures(c.verify_failures);
  out->set_pulls_in_flight(c.pulls_in_flight);
  out->set_lookups_served(c.lookups_served);
  out->set_blocks_offered(c.blocks_offered);
  out->set_peer_reads_ok(c.transport.gets_ok);
  out->set_peer_reads_failed(c.transport.gets_failed);
  out->set_peer_read_deadlines(c.transport.deadlines);
  out->set_connections_accepted(c.transport.connections_accepted);
  out->set_connections_rejected(c.transport.connections_rejected);
  out->set_auth_failures(c.transport.auth_failures);
  out->set_replies_dropped(c.transport.replies_dropped);
  out->set_directory_unauthenticated(c.directory_unauthenticated);
  out->set_requests_refused(c.transport.requests_refused);
  for (const std::string& t : c.transports_in_use) out->add_transports(t);
  for (const std::string& d : c.rdma_devices) out->add_rdma_devices(d);
  out->set_last_error(c.last_error);
}

void FillTier(const SsdTierStatus& t, v1::TierStatus* out) {
  out->set_name("ssd");
  out->set_state(t.state);
  out->set_capacity_blocks(t.capacity_blocks);
  out->set_used_blocks(t.used_blocks);
  out->set_capacity_bytes(t.capacity_bytes);
  out->set_block_bytes(t.block_bytes);
  out->set_promoted_blocks(t.promoted_blocks);
  out->set_promotion_requests(t.promotion_requests);
  out->set_promotion_refused_blocks(t.promotion_refused_blocks);
  out->set_promotion_failed_blocks(t.promotion_failed_blocks);
  out->set_written_back_blocks(t.written_back_blocks);
  out->set_writeback_refused_blocks(t.writeback_refused_blocks);
  out->set_writeback_failed_blocks(t.writeback_failed_blocks);
  out->set_evicted_written_blocks(t.evicted_written_blocks);
  out->set_evicted_unwritten_blocks(t.evicted_unwritten_blocks);
  out->set_store_waits(t.store_waits);
  out->set_store_wait_expired(t.store_wait_expired);
  out->set_evicted_blocks(t.store.evictions);
  out->set_reads_in_flight(t.reads_in_flight);
  out->set_writes_in_flight(t.writes_in_flight);
  out->set_read_bytes_per_s(t.read_bytes_per_s);
  out->set_write_bytes_per_s(t.write_bytes_per_s);
  out->set_read_bytes(t.store.read_bytes);
  out->set_write_bytes(t.store.write_bytes);
  out->set_read_errors(t.store.read_errors);
  out->set_write_errors(t.store.write_errors);
  out->set_data_loss_blocks(t.store.data_loss_blocks);
  out->set_refused(t.store.refused);
  out->set_rebuild_s(t.rebuild.seconds);
  out->set_rebuilt_blocks(t.rebuild.blocks);
  out->set_rebuild_corrupt_headers(t.rebuild.corrupt_headers);
  out->set_rebuild_truncated(t.rebuild.truncated);
  for (const SsdStore::FileInfo& f : t.files) {
    v1::TierFile* file = out->add_files();
    file->set_path(f.path);
    file->set_filesystem(f.filesystem);
    file->set_direct_io(f.direct);
    file->set_slots(f.slots);
  }
  for (const std::string& note : t.notes) out->add_notes(note);
}

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
