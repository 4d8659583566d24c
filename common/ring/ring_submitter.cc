// See ring_submitter.h.
#include "common/ring/ring_submitter.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/uds.h"

namespace flexkv::ring {

Result<std::unique_ptr<RingSubmitter>> RingSubmitter::Map(UniqueFd ring_memfd, UniqueFd doorbell,
                                                          WaitPolicy policy) {
  struct stat st {};
  if (fstat(ring_memfd.get(), &st) != 0 || static_cast<uint64_t>(st.st_size) < sizeof(RingHeader)) {
    return Status::Internal("the daemon's ring memfd is too small for a ring header");
  }
  const auto bytes = static_cast<uint64_t>(st.st_size);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, ring_memfd.get(), 0);
  if (p == MAP_FAILED) return Status::ResourceExhausted(fmt::format("mmap rings: {}", ErrnoText(errno)));
  RingMapping mapping(static_cast<uint8_t*>(p), bytes);
  const RingHeader& h = *mapping.header();
  const RingGeometry rg{h.submit_entries, h.completion_entries, h.arena_bytes};
  if (h.magic != kRingMagic || h.layout_version < kMinRingLayoutVersion || h.layout_version > kRingLayoutVersion ||
      h.submit_entries == 0 ||
      (h.submit_entries & (h.submit_entries - 1)) != 0 || h.completion_entries == 0 ||
      (h.completion_entries & (h.completion_entries - 1)) != 0 || h.submit_offset != rg.submit_offset() ||
      h.completion_offset != rg.completion_offset() || h.arena_offset != rg.arena_offset() ||
      rg.total_bytes() > bytes) {
    return Status::FailedPrecondition(fmt::format(
        "the daemon's ring layout (magic 0x{:x}, version {}) is not what this libflexkv speaks (versions {}..{})",
        h.magic, h.layout_version, kMinRingLayoutVersion, kRingLayoutVersion));
  }
  std::unique_ptr<RingSubmitter> r(new RingSubmitter(std::move(mapping), std::move(doorbell), policy));
  return r;
}

RingSubmitter::RingSubmitter(RingMapping mapping, UniqueFd doorbell, WaitPolicy policy)
    : mapping_(std::move(mapping)), doorbell_(std::move(doorbell)), policy_(policy) {
  const RingHeader& h = *header();
  submit_entries_ = h.submit_entries;
  completion_entries_ = h.completion_entries;
  arena_bytes_ = h.arena_bytes;
  pin_lease_ms_ = h.pin_lease_ms;
  layout_version_ = h.layout_version;
  submit_tail_ = h.submit_tail.value.load(std::memory_order_acquire);
  completion_head_ = h.completion_head.value.load(std::memory_order_acquire);
}

bool RingSubmitter::Push(const SubmitDescriptor& d) {
  RingHeader* h = header();
  const uint32_t head = h->submit_head.value.load(std::memory_order_acquire);
  if (submit_tail_ - head >= submit_entries_) return false;
  auto* ring = reinterpret_cast<SubmitDescriptor*>(mapping_.base() + h->submit_offset);
  ring[submit_tail_ & (submit_entries_ - 1)] = d;
  ++submit_tail_;
  // Pairs with RingConsumer::Park (flag store, then tail load): both seq_cst, so either the daemon's re-check
  // sees this submission or this load sees the flag and the doorbell wakes the daemon.
  h->submit_tail.value.store(submit_tail_, std::memory_order_seq_cst);
  if (h->daemon_parked.value.load(std::memory_order_seq_cst) != 0) {
    const uint64_t one = 1;
    ssize_t ignored = write(doorbell_.get(), &one, sizeof(one));
    (void)ignored;
  }
  return true;
}

}  // namespace flexkv::ring
