// Who may write and read a namespace's blocks, with engines of two uids (setpriv): by default only the uid that
// created the namespace stores (others match and load), also after a restart; a config ACL names the writers and
// readers instead. Needs root to run clients as other uids; without it the tests only warn.
#include <signal.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "flexkv/client.h"
#include "tests/support/process.h"

using namespace std::chrono_literals;
using flexkv::testing::ChildProcess;
using flexkv::testing::DaemonUnderTest;
using flexkv::testing::TestClientPath;

namespace {

constexpr uid_t kCreator = 65534;  // nobody
constexpr uid_t kOther = 1;        // daemon
constexpr gid_t kNogroup = 65534;  // both clients' primary group, the socket's group
constexpr gid_t kDaemonGroup = 1;

// A test client as `uid` (primary group nogroup, supplementary `groups`) running `steps`; 2 layers keep it fast.
ChildProcess ClientAs(uid_t uid, const DaemonUnderTest& d, const std::vector<std::string>& steps,
                      const std::vector<gid_t>& groups = {}) {
  std::vector<std::string> argv = {"/usr/bin/setpriv", "--reuid=" + std::to_string(uid),
                                   "--regid=" + std::to_string(kNogroup)};
  if (groups.empty()) {
    argv.push_back("--clear-groups");
  } else {
    std::string list;
    for (gid_t g : groups) list += (list.empty() ? "" : ",") + std::to_string(g);
    argv.push_back("--groups=" + list);
  }
  for (const std::string& a : {TestClientPath(), std::string("--socket"), d.socket(), std::string("--name"),
                               "uid-" + std::to_string(uid), std::string("--layers"), std::string("2")}) {
    argv.push_back(a);
  }
  for (const auto& s : steps) {
    argv.push_back("--do");
    argv.push_back(s);
  }
  return ChildProcess::Spawn(argv);
}

std::vector<std::string> Lines(ChildProcess p) {
  std::vector<std::string> out;
  while (auto line = p.ReadLine(30s)) out.push_back(*line);
  return out;
}

// A TOML config file, removed at scope exit.
struct ConfigFile {
  std::string path;
  explicit ConfigFile(const std::string& text) {
    char tmpl[] = "/tmp/flexkvd-acl-test-XXXXXX";
    const int fd = mkstemp(tmpl);
    REQUIRE(fd >= 0);
    close(fd);
    path = tmpl;
    std::ofstream(path) << text;
  }
  ~ConfigFile() { unlink(path.c_str()); }
};

uint64_t IndexBlocks(const DaemonUnderTest& d) {
  auto c = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
  REQUIRE(c.ok());
  auto s = (*c)->GetStatus();
  REQUIRE(s.ok());
  return s->index_blocks;
}

bool CanSwitchUids() {
  if (geteuid() == 0) return true;
  WARN("not root: clients of other uids cannot be started, the namespace access tests do nothing");
  return false;
}

}  // namespace

TEST_CASE("another uid's Store is refused in a namespace it did not create, its match and load work",
          "[integration][security]") {
  if (!CanSwitchUids()) return;
  DaemonUnderTest d({"--pool-size", "64MiB", "--socket-group", "nogroup"});
  REQUIRE(d.WaitReady());
  auto creator = Lines(ClientAs(kCreator, d, {"store:7:16"}));
  REQUIRE(creator.size() == 2);
  CHECK(creator[1] == "STORED 0 16 OK");
  // The attack: bytes of its own under the keys of a prompt (seed 9) the creator's engine will look up.
  auto other = Lines(ClientAs(kOther, d, {"store:9:4", "load:7:16", "store:7:16"}));
  REQUIRE(other.size() == 4);
  CHECK(other[1] == "STORED 0 0 PERMISSION_DENIED");
  CHECK(other[2] == "LOADED 16 16 1 OK");  // reads the creator's blocks, byte-exact
  CHECK(other[3] == "STORED 0 0 PERMISSION_DENIED");
  auto victim = Lines(ClientAs(kCreator, d, {"load:9:4"}));
  REQUIRE(victim.size() == 2);
  CHECK(victim[1] == "LOADED 0 0 1 OK");  // nothing planted
  CHECK(IndexBlocks(d) == 16);
  // The daemon says once, at Attach, that the session is read-only.
  CHECK_THAT(d.process().Stderr(), Catch::Contains("uid 1 dp_rank 0 tp_rank 0 namespace 'test-model' (read-only"));
  // Admins (the daemon's own uid, root here) may always store.
  auto admin =
      Lines(ChildProcess::Spawn({TestClientPath(), "--socket", d.socket(), "--layers", "2", "--do", "store:11:2"}));
  REQUIRE(admin.size() == 2);
  CHECK(admin[1] == "STORED 0 2 OK");
}

TEST_CASE("the namespace's creator survives a daemon restart: another uid attaching first still cannot store",
          "[integration][security]") {
  if (!CanSwitchUids()) return;
  const std::vector<std::string> args = {"--pool-size", "64MiB", "--socket-group", "nogroup"};
  std::optional<DaemonUnderTest> d;
  d.emplace(args);
  REQUIRE(d->WaitReady());
  const std::string dir = d->dir();
  REQUIRE(Lines(ClientAs(kCreator, *d, {"store:7:8"})).at(1) == "STORED 0 8 OK");
  d->process().Signal(SIGTERM);
  REQUIRE(d->process().Wait(20s).has_value());
  DaemonUnderTest restarted(args, dir);
  REQUIRE(restarted.WaitReady());
  auto other = Lines(ClientAs(kOther, restarted, {"store:8:4", "load:7:8"}));
  REQUIRE(other.size() == 3);
  CHECK(other[1] == "STORED 0 0 PERMISSION_DENIED");
  CHECK(other[2] == "LOADED 8 8 1 OK");
  auto creator = Lines(ClientAs(kCreator, restarted, {"store:8:4"}));
  REQUIRE(creator.size() == 2);
  CHECK(creator[1] == "STORED 0 4 OK");
  CHECK_THAT(restarted.process().Stderr(), Catch::Contains("created by uid 65534"));
}

TEST_CASE("a config ACL's writers may store and nobody else may, whoever created the namespace",
          "[integration][security]") {
  if (!CanSwitchUids()) return;
  ConfigFile config(
      "socket-group = \"nogroup\"\n"
      "[namespace.\"test-model\"]\n"
      "writers = [\"daemon\"]\n");
  DaemonUnderTest d({"--pool-size", "64MiB", "--config", config.path});
  REQUIRE(d.WaitReady());
  auto first = Lines(ClientAs(kCreator, d, {"store:7:4"}));  // attaches first: creates the domain
  REQUIRE(first.size() == 2);
  CHECK(first[1] == "STORED 0 0 PERMISSION_DENIED");
  auto writer = Lines(ClientAs(kOther, d, {"store:7:4"}));
  REQUIRE(writer.size() == 2);
  CHECK(writer[1] == "STORED 0 4 OK");
  auto reader = Lines(ClientAs(kCreator, d, {"load:7:4"}));  // no readers list: everyone who may connect reads
  REQUIRE(reader.size() == 2);
  CHECK(reader[1] == "LOADED 4 4 1 OK");
}

TEST_CASE("a config ACL's group entry matches a supplementary group of the peer", "[integration][security]") {
  if (!CanSwitchUids()) return;
  ConfigFile config(
      "[namespace.\"test-model\"]\n"
      "writers = [\"group:daemon\"]\n");
  DaemonUnderTest d({"--pool-size", "64MiB", "--socket-group", "nogroup", "--config", config.path});
  REQUIRE(d.WaitReady());
  auto outside = Lines(ClientAs(kCreator, d, {"store:7:4"}));
  REQUIRE(outside.size() == 2);
  CHECK(outside[1] == "STORED 0 0 PERMISSION_DENIED");
  auto member = Lines(ClientAs(kCreator, d, {"store:7:4"}, {kDaemonGroup}));
  REQUIRE(member.size() == 2);
  CHECK(member[1] == "STORED 0 4 OK");
}

TEST_CASE("a config ACL's readers refuse Attach to everyone else", "[integration][security]") {
  if (!CanSwitchUids()) return;
  ConfigFile config(
      "[namespace.\"test-model\"]\n"
      "writers = []\n"
      "readers = [\"daemon\"]\n");
  DaemonUnderTest d({"--pool-size", "64MiB", "--socket-group", "nogroup", "--config", config.path});
  REQUIRE(d.WaitReady());
  auto refused = Lines(ClientAs(kCreator, d, {"load:7:4"}));
  REQUIRE(refused.size() == 1);
  CHECK_THAT(refused[0], Catch::StartsWith("ERROR PERMISSION_DENIED uid 65534 (pid ") &&
                             Catch::Contains("may not use namespace 'test-model': its readers are [daemon] and its "
                                             "writers [] (--config " + config.path + " line 1)"));
  // A reader that is no writer (writers = []: admins only) attaches, loads and cannot store.
  auto reader = Lines(ClientAs(kOther, d, {"load:7:4", "store:7:4"}));
  REQUIRE(reader.size() == 3);
  CHECK(reader[1] == "LOADED 0 0 1 OK");
  CHECK(reader[2] == "STORED 0 0 PERMISSION_DENIED");
  CHECK(IndexBlocks(d) == 0);
}
