// Issue 13 item 3: a pool file truncated under a running flexkvd. The daemon exits with a clear fatal message and
// code 75 (not a bare SIGBUS), and a restart never serves the blocks whose bytes went with the file's tail.
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <string>
#include <vector>

#include "tests/support/process.h"

using namespace std::chrono_literals;
using flexkv::testing::ChildProcess;
using flexkv::testing::DaemonUnderTest;

namespace {

constexpr int kPoolLostExitCode = 75;  // daemon/cache/pool_guard.h; docs/operations.md

ChildProcess Client(const DaemonUnderTest& d, const std::vector<std::string>& steps) {
  return flexkv::testing::SpawnTestClient(d.socket(), "truncation", {"--kv-blocks", "64", "--layers", "2"}, steps);
}

std::vector<std::string> Lines(ChildProcess& p, std::chrono::milliseconds timeout = 30s) { return p.ReadLines(timeout); }

}  // namespace

TEST_CASE("a pool file truncated under a running daemon: fatal message and exit 75, not a bare SIGBUS, and a restart "
          "serves none of its blocks",
          "[integration][regression]") {
  char tmpl[] = "/tmp/flexkvd-test-XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  const std::string dir = tmpl;
  const std::string pool = dir + "/pool";
  {
    DaemonUnderTest d({"--pool-size", "64MiB"}, dir);
    REQUIRE(d.WaitReady());
    ChildProcess writer = Client(d, {"store:11:32"});
    REQUIRE(Lines(writer).at(1) == "STORED 0 32 OK");

    // Only the header is left: the slot table and every block's bytes are gone.
    REQUIRE(truncate(pool.c_str(), 4096) == 0);
    // Loads and stores touch the lost bytes: the daemon must go, whichever of its checks sees it first.
    ChildProcess reader = Client(d, {"load:11:32", "store:12:32", "load:11:32"});
    const std::optional<int> status = d.process().Wait(20s);
    REQUIRE(status.has_value());
    const std::string log = d.process().Stderr();
    INFO("flexkvd's log:\n" << log);
    CHECK_FALSE(WIFSIGNALED(*status));
    REQUIRE(WIFEXITED(*status));
    CHECK(WEXITSTATUS(*status) == kPoolLostExitCode);
    CHECK_THAT(log, Catch::Contains("FATAL") && Catch::Contains("pool file " + pool + " was truncated") &&
                        Catch::Contains("--discard-pool"));
  }

  // The short file is refused at start, with the reason and the way out: none of its blocks is re-attached.
  auto refused = flexkv::testing::RunCommand({flexkv::testing::FlexkvdPath(), "--socket", dir + "/flexkvd.sock",
                                              "--pool-path", pool, "--pool-size", "64MiB"});
  CHECK(refused.exit_code == 1);
  CHECK_THAT(refused.output, Catch::Contains("truncated") && Catch::Contains("--discard-pool"));

  {
    DaemonUnderTest d({"--pool-size", "64MiB", "--discard-pool"}, dir);
    REQUIRE(d.WaitReady());
    ChildProcess reader = Client(d, {"load:11:32"});
    CHECK(Lines(reader).at(1) == "LOADED 0 0 1 OK");
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("a pool file truncated under an idle daemon: its size check ends it with the fatal message and exit 75",
          "[integration][regression]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  ChildProcess writer = Client(d, {"store:21:8"});
  REQUIRE(Lines(writer).at(1) == "STORED 0 8 OK");
  // No request follows: nothing faults, only the main loop's check can see it.
  REQUIRE(truncate((d.dir() + "/pool").c_str(), 4096) == 0);
  const std::optional<int> status = d.process().Wait(20s);
  REQUIRE(status.has_value());
  const std::string log = d.process().Stderr();
  INFO("flexkvd's log:\n" << log);
  REQUIRE(WIFEXITED(*status));
  CHECK(WEXITSTATUS(*status) == kPoolLostExitCode);
  CHECK_THAT(log, Catch::Contains("ERROR daemon: FATAL pool file " + d.dir() + "/pool was truncated") &&
                      Catch::Contains("it is 4096 bytes"));
}
