// PeerTable: gRPC's "fd:<n>" peer names map to the credentials the acceptor recorded.
#include <catch2/catch.hpp>

#include "daemon/server/peer_table.h"

TEST_CASE("peer names resolve by fd, unknown ones do not", "[unit]") {
  flexkv::PeerTable table;
  table.Add(7, flexkv::PeerCredentials{123, 1000, 1000, {27}});
  auto p = table.Find("fd:7");
  REQUIRE(p.has_value());
  CHECK(p->pid == 123);
  CHECK(p->InGroup(27));
  CHECK(p->InGroup(1000));
  CHECK_FALSE(p->InGroup(5));
  CHECK_FALSE(table.Find("fd:8").has_value());
  CHECK_FALSE(table.Find("ipv4:127.0.0.1:5").has_value());
  CHECK_FALSE(table.Find("fd:7x").has_value());
  CHECK_FALSE(table.Find("").has_value());
  table.Add(7, flexkv::PeerCredentials{456, 0, 0, {}});  // fd reused by a new connection
  CHECK(table.Find("fd:7")->pid == 456);
}
