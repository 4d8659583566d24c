// PinLease: whether a session's process still renews its pins (docs/protocol.md "Pins"). The client's library
// writes a heartbeat into the session's ring header; the daemon never trusts the value, only that it changed, and
// times renewals by its own clock, so a client writing a far-future value renews once, not forever.
// Not thread-safe: the ring poller owns each session's lease.
#pragma once

#include <cstdint>

namespace flexkv {

class PinLease {
 public:
  // A lease of `lease_ns` (0: it never runs out), renewed at `now_ns` (monotonic).
  PinLease(int64_t lease_ns, int64_t now_ns) : lease_ns_(lease_ns), renewed_ns_(now_ns) {}

  // The heartbeat as read (once) from the ring header at `now_ns`: a value other than the last one seen renews.
  void Observe(uint64_t heartbeat, int64_t now_ns) {
    if (heartbeat != seen_) {
      seen_ = heartbeat;
      renewed_ns_ = now_ns;
    }
  }
  // A request taken off the session's ring at `now_ns`: the process runs, which renews too.
  void Renew(int64_t now_ns) { renewed_ns_ = now_ns; }
  // No renewal for longer than the lease.
  bool Expired(int64_t now_ns) const { return lease_ns_ > 0 && now_ns - renewed_ns_ > lease_ns_; }
  // How long since the last renewal.
  int64_t SilentNs(int64_t now_ns) const { return now_ns - renewed_ns_; }

 private:
  const int64_t lease_ns_;
  int64_t renewed_ns_;
  uint64_t seen_ = 0;  // a fresh header holds 0
};

}  // namespace flexkv
