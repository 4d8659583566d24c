// PoolGuard: a pool file truncated under its mapping is reported by the size check and, when touched, ends the
// process with the fatal line and exit code 75; a SIGBUS elsewhere still gets the default action.
#include "daemon/cache/pool_guard.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "daemon/cache/pool.h"
#include "tests/support/temp_dir.h"

using flexkv::Geometry;
using flexkv::Pool;
using flexkv::StatusCode;

namespace {

Geometry Small() { return flexkv::testing::TinyGeometry(); }

struct TempDir : flexkv::testing::TempDir {
  TempDir() : flexkv::testing::TempDir("flexkv-pool-guard-test") {}
};

// Runs `body` in a forked child with the fault handler installed and stderr sent to `stderr_path`; returns the
// child's wait status. The child never returns into Catch.
template <typename Body>
int InChild(const std::string& stderr_path, Body body) {
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    rlimit no_core{0, 0};
    setrlimit(RLIMIT_CORE, &no_core);
    const int fd = open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0 || dup2(fd, STDERR_FILENO) < 0) _exit(99);
    flexkv::InstallPoolFaultHandler();
    body();
    _exit(98);  // the body was expected to end the process
  }
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  return status;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

TEST_CASE("the size check reports a pool file that shrank under its mapping", "[unit][regression]") {
  TempDir dir;
  const std::string path = dir.path + "/pool";
  auto pool = Pool::Create(path, "ns", Small(), 192 * 10);
  REQUIRE(pool.ok());
  CHECK(flexkv::CheckWatchedPoolFile().ok());
  REQUIRE(truncate(path.c_str(), 4096) == 0);
  const flexkv::Status shrunk = flexkv::CheckWatchedPoolFile();
  CHECK(shrunk.code() == StatusCode::kDataLoss);
  CHECK_THAT(shrunk.message(), Catch::Contains("pool file " + path + " was truncated") &&
                                   Catch::Contains("it is 4096 bytes") && Catch::Contains("--discard-pool"));
  pool->reset();
  CHECK(flexkv::CheckWatchedPoolFile().ok());  // no pool, nothing to check
}

TEST_CASE("touching a truncated pool exits 75 with the pool file and the offset, not a bare SIGBUS",
          "[unit][regression]") {
  TempDir dir;
  const std::string path = dir.path + "/pool";
  auto pool = Pool::Create(path, "ns", Small(), 192 * 10);
  REQUIRE(pool.ok());
  uint8_t* last = (*pool)->SlotData(9) + 191;
  REQUIRE(truncate(path.c_str(), 4096) == 0);
  const std::string err = dir.path + "/stderr";
  const int status = InChild(err, [last] { *static_cast<volatile uint8_t*>(last) = 1; });
  const std::string log = ReadFile(err);
  INFO("child's stderr: " << log);
  CHECK_FALSE(WIFSIGNALED(status));
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == flexkv::kPoolLostExitCode);
  CHECK_THAT(log, Catch::Contains("FATAL pool: pool file " + path + " was truncated") &&
                      Catch::Contains("a copy touched byte ") && Catch::Contains("--discard-pool"));
}

TEST_CASE("a SIGBUS outside the pool still gets the default action (a core), not the pool's exit code",
          "[unit]") {
  TempDir dir;
  const int status = InChild(dir.path + "/stderr", [] { raise(SIGBUS); });
  REQUIRE(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGBUS);
}

TEST_CASE("every cache domain's pool is guarded: either of two pool files truncated is reported, and touching it "
          "ends the process",
          "[unit][regression]") {
  TempDir dir;
  const std::string first_path = dir.path + "/pool", second_path = dir.path + "/pool.1";
  auto first = Pool::Create(first_path, "a", Small(), 192 * 10);
  REQUIRE(first.ok());
  auto second = Pool::Create(second_path, "b", Small(), 192 * 10);
  REQUIRE(second.ok());
  CHECK(flexkv::CheckWatchedPoolFile().ok());
  REQUIRE(truncate(first_path.c_str(), 4096) == 0);  // the older watch is still checked
  CHECK_THAT(flexkv::CheckWatchedPoolFile().message(), Catch::Contains("pool file " + first_path + " was truncated"));
  uint8_t* last = (*first)->SlotData(9) + 191;
  const std::string err = dir.path + "/stderr";
  const int status = InChild(err, [last] { *static_cast<volatile uint8_t*>(last) = 1; });
  const std::string log = ReadFile(err);
  INFO("child's stderr: " << log);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == flexkv::kPoolLostExitCode);
  CHECK_THAT(log, Catch::Contains("FATAL pool: pool file " + first_path + " was truncated"));
  first->reset();  // dropped: only the second is checked now
  CHECK(flexkv::CheckWatchedPoolFile().ok());
  REQUIRE(truncate(second_path.c_str(), 4096) == 0);
  CHECK_THAT(flexkv::CheckWatchedPoolFile().message(), Catch::Contains("pool file " + second_path + " was truncated"));
  second->reset();
  CHECK(flexkv::CheckWatchedPoolFile().ok());
}
