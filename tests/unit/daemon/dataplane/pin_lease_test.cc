// PinLease: a session's pins stay while its heartbeat changes or it submits, and lapse after the lease without
// either; the heartbeat's value is never trusted, only its change, timed by the daemon's clock.
#include "daemon/dataplane/pin_lease.h"

#include <catch2/catch.hpp>
#include <cstdint>

using flexkv::PinLease;

namespace {
constexpr int64_t kMs = 1000000;
}  // namespace

TEST_CASE("pin lease: runs out after the lease without a heartbeat, not before", "[unit][dataplane]") {
  PinLease lease(1000 * kMs, 0);
  lease.Observe(0, 500 * kMs);  // a fresh header: 0, nothing changed
  CHECK_FALSE(lease.Expired(1000 * kMs));
  lease.Observe(0, 1001 * kMs);
  CHECK(lease.Expired(1001 * kMs));
  CHECK(lease.SilentNs(1001 * kMs) == 1001 * kMs);
}

TEST_CASE("pin lease: a heartbeat that changes renews it, one that stays the same does not", "[unit][dataplane]") {
  PinLease lease(1000 * kMs, 0);
  lease.Observe(7, 900 * kMs);
  CHECK_FALSE(lease.Expired(1800 * kMs));
  lease.Observe(7, 1800 * kMs);  // the same value again: the process stopped writing
  CHECK(lease.Expired(1901 * kMs));
  lease.Observe(8, 1950 * kMs);  // it runs again
  CHECK_FALSE(lease.Expired(1950 * kMs));
}

TEST_CASE("pin lease: a far-future heartbeat renews once, never forever", "[unit][dataplane]") {
  PinLease lease(1000 * kMs, 0);
  lease.Observe(UINT64_MAX, 100 * kMs);
  lease.Observe(UINT64_MAX, 600 * kMs);
  CHECK_FALSE(lease.Expired(1100 * kMs));
  CHECK(lease.Expired(1101 * kMs));
}

TEST_CASE("pin lease: a request taken off the ring renews it", "[unit][dataplane]") {
  PinLease lease(1000 * kMs, 0);
  lease.Renew(800 * kMs);
  CHECK_FALSE(lease.Expired(1700 * kMs));
  CHECK(lease.Expired(1801 * kMs));
}

TEST_CASE("pin lease: a lease of 0 never runs out", "[unit][dataplane]") {
  PinLease lease(0, 0);
  CHECK_FALSE(lease.Expired(INT64_MAX / 2));
}
