// Who may write and read a namespace's blocks, with engines of two uids (setpriv): by default only the uid that
// created the namespace stores (others match and load), also after a restart; a config ACL names the writers and
// readers instead. Needs root to run clients as other uids; without it the tests only warn.
#include <fcntl.h>
#include <grp.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "flexkv/client.h"
#include "tests/support/process.h"
#include "tests/support/temp_dir.h"
#include "tests/support/raw_protocol.h"

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
struct ConfigFile : flexkv::testing::TempFile {
  explicit ConfigFile(const std::string& text) : TempFile(text, "flexkvd-acl-test") {}
};

uint64_t IndexBlocks(const DaemonUnderTest& d) {
  auto c = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
  REQUIRE(c.ok());
  auto s = (*c)->GetStatus();
  REQUIRE(s.ok());
  return s->index_blocks;
}

// A child forked at construction (before this process starts gRPC), which waits for its input, then runs `body` as
// `uid` (primary group nogroup) and sends back what it returns.
class ForkedAs {
 public:
  ForkedAs(uid_t uid, const std::function<std::string(const std::string&)>& body) {
    REQUIRE(pipe2(to_child_, O_CLOEXEC) == 0);
    REQUIRE(pipe2(from_child_, O_CLOEXEC) == 0);
    pid_ = fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      alarm(20);  // never hangs the test
      close(to_child_[1]);
      close(from_child_[0]);
      const std::string input = ReadAll(to_child_[0], '\0');
      const gid_t group = kNogroup;
      if (setgroups(1, &group) != 0 || setresgid(kNogroup, kNogroup, kNogroup) != 0 || setresuid(uid, uid, uid) != 0) {
        _exit(10);
      }
      const std::string out = body(input);
      (void)!write(from_child_[1], out.data(), out.size());
      _exit(0);
    }
    close(to_child_[0]);
    close(from_child_[1]);
  }
  ~ForkedAs() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  std::string Run(const std::string& input) {
    // NUL-terminated: another child forked later holds this pipe's write end too, so no EOF comes.
    REQUIRE(write(to_child_[1], input.c_str(), input.size() + 1) == static_cast<ssize_t>(input.size() + 1));
    close(to_child_[1]);
    const std::string out = ReadAll(from_child_[0]);
    close(from_child_[0]);
    int status = 0;
    REQUIRE(waitpid(pid_, &status, 0) == pid_);
    pid_ = -1;
    INFO("child exit status " << status);
    REQUIRE(WIFEXITED(status));
    REQUIRE(WEXITSTATUS(status) == 0);
    return out;
  }

 private:
  // Reads up to EOF, or up to `end` (not included).
  static std::string ReadAll(int fd, std::optional<char> end = std::nullopt) {
    std::string out;
    char c;
    while (read(fd, &c, 1) == 1) {
      if (end && c == *end) break;
      out.push_back(c);
    }
    return out;
  }
  int to_child_[2] = {-1, -1};
  int from_child_[2] = {-1, -1};
  pid_t pid_ = -1;
};

flexkv::Geometry SmallGeometry() {
  flexkv::Geometry g = flexkv::Llama3_8B();
  g.num_layers = 2;
  return g;
}

// In a ForkedAs child: input "<socket>\n<session id>\n<token hex>"; calls the gRPC Match with that session's token,
// then Attach of its own; returns "<Match code> <Attach code> <read_only>".
std::string MatchThenAttach(const std::string& input) {
  std::istringstream in(input);
  std::string socket, id, hex, token;
  std::getline(in, socket);
  std::getline(in, id);
  std::getline(in, hex);
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    token.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  auto stub = flexkv::testing::ControlStub(socket);
  flexkv::v1::MatchRequest req;
  req.set_session_id(std::stoull(id));
  req.set_session_token(token);
  req.set_keys(std::string(16, '\x01'));
  flexkv::v1::MatchResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 10s);
  const grpc::Status match = stub->Match(&ctx, req, &resp);
  flexkv::v1::AttachResponse attached;
  const grpc::Status attach = flexkv::testing::TryRawAttach(*stub, "forked", "test-model", SmallGeometry(), &attached);
  return std::to_string(static_cast<int>(match.error_code())) + " " +
         std::to_string(static_cast<int>(attach.error_code())) + " " + (attached.read_only() ? "1" : "0");
}

bool CanSwitchUids() {
  if (geteuid() == 0) return true;
  WARN("not root: clients of other uids cannot be started, the namespace access tests do nothing; skipped");
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

TEST_CASE("a uid that attached first and left without storing does not keep the namespace from its engines",
          "[integration][security][regression]") {
  // Before the fix the first uid to attach stayed the namespace's creator while the daemon ran, blocks or not:
  // every engine of the real owner attached read-only and could not store until a restart.
  if (!CanSwitchUids()) return;
  DaemonUnderTest d({"--pool-size", "64MiB", "--socket-group", "nogroup"});
  REQUIRE(d.WaitReady());
  REQUIRE(Lines(ClientAs(kOther, d, {"load:7:1"})).size() == 2);  // attaches, stores nothing, leaves
  auto owner = Lines(ClientAs(kCreator, d, {"store:7:4"}));
  REQUIRE(owner.size() == 2);
  CHECK(owner[1] == "STORED 0 4 OK");
  // Now it holds blocks: the squatter coming back is a reader only.
  auto back = Lines(ClientAs(kOther, d, {"store:9:2"}));
  REQUIRE(back.size() == 2);
  CHECK(back[1] == "STORED 0 0 PERMISSION_DENIED");
  CHECK_THAT(d.process().Stderr(), Catch::Contains("its creator uid 1 is replaced by"));
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

TEST_CASE("the gRPC Match and Attach follow the reader rule, a reader that may not write attaches read-only",
          "[integration][security]") {
  if (!CanSwitchUids()) return;
  ForkedAs outsider(kCreator, MatchThenAttach);  // not a reader
  ForkedAs reader(kOther, MatchThenAttach);      // a reader, no writer
  ConfigFile config(
      "[namespace.\"test-model\"]\n"
      "writers = []\n"
      "readers = [\"daemon\"]\n");
  DaemonUnderTest d({"--pool-size", "64MiB", "--socket-group", "nogroup", "--config", config.path});
  REQUIRE(d.WaitReady());
  auto stub = flexkv::testing::ControlStub(d.socket());
  flexkv::v1::AttachResponse admin;
  REQUIRE(flexkv::testing::TryRawAttach(*stub, "admin", "test-model", SmallGeometry(), &admin).ok());
  CHECK_FALSE(admin.read_only());
  std::ostringstream input;
  input << d.socket() << "\n" << admin.session_id() << "\n";
  for (unsigned char ch : admin.session_token()) {
    char hex[3];
    std::snprintf(hex, sizeof(hex), "%02x", ch);
    input << hex;
  }
  const std::string denied = std::to_string(static_cast<int>(grpc::StatusCode::PERMISSION_DENIED));
  CHECK(outsider.Run(input.str()) == denied + " " + denied + " 0");  // the admin's token does not make it a reader
  CHECK(reader.Run(input.str()) == "0 0 1");
}

// Issue 29 item 5: the namespace's creator uid lived only in the DRAM pool file. After a reboot (pool file gone, the
// SSD tier's blocks kept) the first uid to attach became the owner, stored over the owner's prompt and made the
// owner read-only. The SSD tier now keeps the owner with the blocks (DIR/flexkv-owners) and restores it at start.
TEST_CASE("the namespace's owner survives a reboot with its SSD blocks: another uid attaching first cannot store",
          "[integration][security][ssd_tier]") {
  if (!CanSwitchUids()) return;
  // A disk directory (O_DIRECT, not tmpfs) for the socket, the pool file and the SSD tier.
  char tmpl[] = "/var/tmp/flexkv-owner-it-XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  struct RemoveAll {
    std::string p;
    ~RemoveAll() {
      std::error_code ec;
      std::filesystem::remove_all(p, ec);
    }
  } cleanup{tmpl};
  const std::string dir = tmpl;
  const std::string ssd = dir + "/ssd";
  const std::string record = ssd + "/flexkv-owners";
  std::filesystem::permissions(dir, std::filesystem::perms(0755));
  std::filesystem::create_directories(ssd);
  const std::vector<std::string> args = {"--pool-size", "8MiB",  "--socket-group",       "nogroup", "--ssd-path",
                                         ssd,           "--ssd-size", "32MiB", "--ssd-write-policy=all"};
  const auto written_back = [](const DaemonUnderTest& d) -> uint64_t {
    auto c = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
    REQUIRE(c.ok());
    auto s = (*c)->GetStatus();
    REQUIRE(s.ok());
    REQUIRE(s->tiers.size() == 1);
    return s->tiers[0].counters.at("written_back_blocks");
  };
  {
    DaemonUnderTest d(args, dir);
    REQUIRE(d.WaitReady());
    REQUIRE(Lines(ClientAs(kCreator, d, {"store:7:8"})).at(1) == "STORED 0 8 OK");
    for (int i = 0; i < 500 && written_back(d) < 8; ++i) std::this_thread::sleep_for(20ms);
    REQUIRE(written_back(d) == 8);
    d.process().Signal(SIGKILL);
    REQUIRE(d.process().Wait(20s).has_value());
  }
  {
    std::ifstream in(record);
    std::stringstream text;
    text << in.rdbuf();
    INFO(text.str());
    CHECK_THAT(text.str(), Catch::StartsWith("flexkv-owners 1\n") && Catch::Contains("\nowner 65534 test-model\n"));
  }
  REQUIRE(std::filesystem::remove(dir + "/pool"));  // the reboot: /dev/shm is gone, the SSD is not
  {
    DaemonUnderTest d(args, dir);
    REQUIRE(d.WaitReady());
    // Another uid attaches first: it may read the owner's prompt (from SSD), not store anything.
    auto other = Lines(ClientAs(kOther, d, {"store:7:8", "store:9:4", "load:7:8"}));
    REQUIRE(other.size() == 4);
    CHECK(other[1] == "STORED 0 0 PERMISSION_DENIED");
    CHECK(other[2] == "STORED 0 0 PERMISSION_DENIED");
    CHECK(other[3] == "LOADED 8 8 1 OK");
    // The owner still may.
    auto owner = Lines(ClientAs(kCreator, d, {"store:9:4", "load:7:8", "load:9:4"}));
    REQUIRE(owner.size() == 4);
    CHECK(owner[1] == "STORED 0 4 OK");
    CHECK(owner[2] == "LOADED 8 8 1 OK");
    CHECK(owner[3] == "LOADED 4 4 1 OK");
    CHECK_THAT(d.process().Stderr(), Catch::Contains("namespace owners restored from the SSD tier: 1 namespace"));
    d.process().Signal(SIGTERM);
    REQUIRE(d.process().Wait(20s).has_value());
  }
  // A damaged record is ignored with a warning naming it, never a crash (the namespace then has no recorded owner).
  {
    std::fstream f(record, std::ios::in | std::ios::out | std::ios::binary);
    REQUIRE(f.good());
    f.seekp(22);
    f.put('X');
  }
  DaemonUnderTest d(args, dir);
  REQUIRE(d.WaitReady());
  auto reader = Lines(ClientAs(kCreator, d, {"load:7:8"}));
  REQUIRE(reader.size() == 2);
  CHECK(reader[1] == "LOADED 8 8 1 OK");
  CHECK_THAT(d.process().Stderr(),
             Catch::Contains("namespace owners record " + record + " is ignored: its checksum does not match"));
}
