// SsdTier's own status message and metric families (CacheTier::ReportStatus, CollectMetrics); docs/operations.md
// lists them.
#include "daemon/tiers/ssd/ssd_tier.h"

#include "flexkv/v1/control.pb.h"

namespace flexkv {

void SsdTier::ReportStatus(v1::GetStatusResponse* status) const {
  const SsdTierStatus t = GetStatus();
  v1::TierStatus* out = status->add_tiers();
  out->set_name(std::string(name()));
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
  out->set_promotion_waits(t.promotion_waits);
  out->set_promotion_wait_expired(t.promotion_wait_expired);
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


void SsdTier::CollectMetrics(MetricFamilies* out) const {
  const SsdTierStatus t = GetStatus();
  AddGauge(out, "flexkv_ssd_up", "1 while the SSD tier serves (its store is open), else 0", t.state == "serving" ? 1 : 0);
  AddGauge(out, "flexkv_ssd_capacity_blocks", "Block slots of the SSD tier", static_cast<double>(t.capacity_blocks));
  AddGauge(out, "flexkv_ssd_capacity_bytes", "Bytes on disk of the SSD tier's block files", static_cast<double>(t.capacity_bytes));
  AddGauge(out, "flexkv_ssd_blocks", "Blocks the SSD tier holds", static_cast<double>(t.used_blocks));
  AddGauge(out, "flexkv_ssd_reads_in_flight", "SSD reads (promotions) in flight", static_cast<double>(t.reads_in_flight));
  AddGauge(out, "flexkv_ssd_writes_in_flight", "SSD writes (write-backs) in flight", static_cast<double>(t.writes_in_flight));
  AddGauge(out, "flexkv_ssd_rebuild_seconds", "How long opening the SSD tier took at start (reading every slot header)",
        t.rebuild.seconds);
  AddCounter(out, "flexkv_ssd_promoted_blocks_total", "Blocks read from SSD into DRAM for a match (SSD hits)", t.promoted_blocks);
  AddCounter(out, "flexkv_ssd_promotion_refused_blocks_total",
          "Blocks a match found on SSD but could not promote (queue full, no DRAM slot)", t.promotion_refused_blocks);
  AddCounter(out, "flexkv_ssd_promotion_failed_blocks_total", "Promotions whose read failed or did not verify",
          t.promotion_failed_blocks);
  AddCounter(out, "flexkv_ssd_promoted_layer_major_blocks_total",
          "Promoted blocks an older release wrote in the layer-major slot order, rewritten in today's (TP > 1 pools)",
          t.promoted_layer_major_blocks);
  AddCounter(out, "flexkv_ssd_written_back_blocks_total", "Blocks written to SSD",
          t.written_back_blocks);
  AddCounter(out, "flexkv_ssd_writeback_refused_blocks_total", "Write-backs the SSD queue refused (retried later)",
          t.writeback_refused_blocks);
  AddCounter(out, "flexkv_ssd_writeback_failed_blocks_total", "Write-backs that failed (I/O error, disk full)",
          t.writeback_failed_blocks);
  AddCounter(out, "flexkv_ssd_evicted_written_blocks_total", "DRAM evictions of blocks the SSD tier holds",
          t.evicted_written_blocks);
  AddCounter(out, "flexkv_ssd_evicted_unwritten_blocks_total",
          "DRAM evictions of blocks not written to SSD yet (write-back behind): lost from the node",
          t.evicted_unwritten_blocks);
  AddCounter(out, "flexkv_ssd_store_waits_total",
          "Engine stores that waited for the write-back instead of evicting blocks SSD did not hold yet",
          t.store_waits);
  AddCounter(out, "flexkv_ssd_store_wait_expired_total",
          "Engine stores whose wait for the write-back ran out (--ssd-store-wait): they evicted unwritten blocks",
          t.store_wait_expired);
  AddCounter(out, "flexkv_ssd_promotion_waits_total",
          "Promotions that waited for the write-back instead of evicting blocks SSD did not hold yet",
          t.promotion_waits);
  AddCounter(out, "flexkv_ssd_promotion_wait_expired_total",
          "Promotions whose wait for the write-back ran out (--ssd-store-wait): what fitted, or nothing, was promoted",
          t.promotion_wait_expired);
  AddCounter(out, "flexkv_ssd_evicted_blocks_total", "Blocks overwritten on SSD to make room", t.store.evictions);
  AddCounter(out, "flexkv_ssd_read_bytes_total", "Bytes read from SSD (verified)", t.store.read_bytes);
  AddCounter(out, "flexkv_ssd_write_bytes_total", "Bytes written to SSD", t.store.write_bytes);
  AddCounter(out, "flexkv_ssd_read_errors_total", "SSD reads the drive failed (EIO, truncated file)", t.store.read_errors);
  AddCounter(out, "flexkv_ssd_write_errors_total", "SSD writes that failed", t.store.write_errors);
  AddCounter(out, "flexkv_ssd_data_loss_blocks_total", "SSD blocks dropped because a read failed or did not verify",
          t.store.data_loss_blocks);
}

}  // namespace flexkv
