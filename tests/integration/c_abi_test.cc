// The C ABI (flexkv/c.h) as a binding sees it: its version and struct sizes, and what flexkv_wait /
// flexkv_try_wait answer for tickets that have no result coming.
#include <signal.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <string>

#include "common/version.h"
#include "flexkv/c.h"
#include "tests/support/process.h"

using flexkv::testing::DaemonUnderTest;

namespace {

flexkv_geometry SmallGeometry() {
  // Llama-3-8B per-rank shape with 2 layers (128 KiB blocks).
  return flexkv_geometry{16, 2, 2, 8, 128, 2, 1};
}

flexkv_block_key OneKey(int32_t seed) {
  int32_t tokens[16];
  for (int i = 0; i < 16; ++i) tokens[i] = seed * 1000 + i;
  flexkv_block_key key{};
  size_t count = 0;
  REQUIRE(flexkv_compute_block_keys("llama3-8b", 9, tokens, 16, 16, &key, 1, &count) == FLEXKV_OK);
  REQUIRE(count == 1);
  return key;
}

}  // namespace

TEST_CASE("the C ABI reports its version, its structs' sizes and the release version", "[integration]") {
  CHECK(flexkv_abi_version() == FLEXKV_ABI_VERSION);
  CHECK(flexkv_struct_size("flexkv_geometry") == sizeof(flexkv_geometry));
  CHECK(flexkv_struct_size("flexkv_daemon_status") == sizeof(flexkv_daemon_status));
  CHECK(flexkv_struct_size("flexkv_block_key") == sizeof(flexkv_block_key));
  CHECK(flexkv_struct_size("flexkv_op_result") == sizeof(flexkv_op_result));
  CHECK(flexkv_struct_size("flexkv_ticket") == sizeof(flexkv_ticket));
  CHECK(flexkv_struct_size("flexkv_nonsense") == 0);
  CHECK(flexkv_struct_size(nullptr) == 0);
  CHECK(std::string(flexkv_version()) == flexkv::kVersion);
  CHECK(std::string(flexkv_version()) == FLEXKV_RELEASE_VERSION);
}

TEST_CASE("C ABI: an old session's ticket is FAILED_PRECONDITION, a taken one NOT_FOUND, not yet DEADLINE_EXCEEDED",
          "[integration]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  flexkv_client* c = nullptr;
  REQUIRE(flexkv_connect(d.socket().c_str(), 5000, &c, nullptr, 0) == FLEXKV_OK);
  const flexkv_geometry g = SmallGeometry();
  uint64_t sid = 0;
  REQUIRE(flexkv_attach(c, "c-abi", "llama3-8b", 0, 0, &g, &sid) == FLEXKV_OK);
  const flexkv_block_key key = OneKey(1);

  flexkv_ticket first{};
  REQUIRE(flexkv_match(c, &key, 1, 0, &first) == FLEXKV_OK);
  CHECK(first.id == 1);
  CHECK(first.generation != 0);
  flexkv_op_result out{};
  REQUIRE(flexkv_wait(c, first, 10000000, &out) == FLEXKV_OK);
  CHECK(out.status_code == FLEXKV_OK);
  CHECK(flexkv_wait(c, first, 0, &out) == FLEXKV_NOT_FOUND);
  CHECK_THAT(flexkv_last_error(), Catch::Contains("already taken"));
  CHECK(flexkv_try_wait(c, first, &out) == FLEXKV_NOT_FOUND);

  flexkv_ticket pending{};
  d.process().Signal(SIGSTOP);  // the daemon reads nothing: the request stays in flight (or, should a poller
                                // thread still run, ends: both are answers of this session)
  REQUIRE(flexkv_match(c, &key, 1, 0, &pending) == FLEXKV_OK);
  const int early = flexkv_try_wait(c, pending, &out);
  CHECK((early == FLEXKV_DEADLINE_EXCEEDED || early == FLEXKV_OK));
  d.process().Signal(SIGCONT);
  if (early != FLEXKV_OK) REQUIRE(flexkv_wait(c, pending, 10000000, &out) == FLEXKV_OK);

  flexkv_ticket stale{};
  REQUIRE(flexkv_match(c, &key, 1, 0, &stale) == FLEXKV_OK);
  REQUIRE(flexkv_detach(c) == FLEXKV_OK);
  CHECK(flexkv_try_wait(c, stale, &out) == FLEXKV_FAILED_PRECONDITION);
  REQUIRE(flexkv_attach(c, "c-abi", "llama3-8b", 0, 0, &g, &sid) == FLEXKV_OK);
  flexkv_ticket fresh{};
  REQUIRE(flexkv_match(c, &key, 1, 0, &fresh) == FLEXKV_OK);
  CHECK(fresh.generation > stale.generation);
  CHECK(flexkv_wait(c, stale, 1000000, &out) == FLEXKV_FAILED_PRECONDITION);
  CHECK_THAT(flexkv_last_error(), Catch::Contains("generation"));
  uint32_t landed = 0;
  CHECK(flexkv_wait_layers(c, stale, 1, 0, &landed) == FLEXKV_FAILED_PRECONDITION);
  REQUIRE(flexkv_wait(c, fresh, 10000000, &out) == FLEXKV_OK);
  CHECK(out.status_code == FLEXKV_OK);
  flexkv_close(c);
}
