// Security: seals on the shared mappings hold, the pool and socket have the documented modes, a session's
// token is its own. Block ids, offsets and lengths outside what a session registered are refused: see
// ring_validation_test.cc ("malformed ring descriptors get error completions; ..."), not repeated here.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <grp.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "common/session_channel.h"
#include "common/uds.h"
#include "common/unique_fd.h"
#include "flexkv/client.h"
#include "flexkv/v1/control.grpc.pb.h"
#include "tests/support/process.h"
#include "tests/support/raw_protocol.h"

using namespace std::chrono_literals;
using flexkv::UniqueFd;
using flexkv::testing::DaemonUnderTest;
using flexkv::testing::ControlStub;
using flexkv::testing::RawGrant;

namespace {

constexpr char kNamespace[] = "security";

RawGrant RawAttach(flexkv::v1::Control::Stub& stub, const std::string& name) {
  flexkv::Geometry g = flexkv::Llama3_8B();
  g.num_layers = 2;
  return flexkv::testing::RawAttach(stub, name, kNamespace, g);
}

std::string WrongToken(const std::string& token) {
  std::string t = token;
  t[0] = static_cast<char>(t[0] ^ 0x5A);
  return t;
}

}  // namespace

TEST_CASE("a client cannot grow or shrink the ring memfd the daemon maps (seals hold)", "[integration][security]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  auto stub = ControlStub(d.socket());
  const RawGrant grant = RawAttach(*stub, "sealed");
  UniqueFd channel;
  std::vector<UniqueFd> fds;
  const auto reply = flexkv::testing::RawHello(d.socket(), grant.session_id, grant.token, &channel, &fds);
  INFO(reply.message);
  REQUIRE(reply.status_code == 0);
  REQUIRE(fds.size() == 2);
  const int ring = fds[0].get();
  struct stat st {};
  REQUIRE(fstat(ring, &st) == 0);
  REQUIRE(st.st_size > 0);
  const int seals = fcntl(ring, F_GET_SEALS);
  CHECK((seals & F_SEAL_GROW) != 0);
  CHECK((seals & F_SEAL_SHRINK) != 0);
  CHECK((seals & F_SEAL_SEAL) != 0);  // nor can it change the seals (e.g. remove or add any)
  errno = 0;
  CHECK(ftruncate(ring, st.st_size + 4096) == -1);
  CHECK(errno == EPERM);
  errno = 0;
  CHECK(ftruncate(ring, st.st_size / 2) == -1);
  CHECK(errno == EPERM);
  errno = 0;
  CHECK(ftruncate(ring, 0) == -1);
  CHECK(errno == EPERM);
  errno = 0;
  CHECK(fcntl(ring, F_ADD_SEALS, F_SEAL_WRITE) == -1);
  CHECK(errno == EPERM);
  errno = 0;
  CHECK(fallocate(ring, 0, st.st_size, 4096) == -1);  // growing by fallocate is refused too
  CHECK(errno == EPERM);
  struct stat after {};
  REQUIRE(fstat(ring, &after) == 0);
  CHECK(after.st_size == st.st_size);
  // The daemon is fine and still serving.
  auto c = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
  REQUIRE(c.ok());
  auto status = (*c)->GetStatus();
  REQUIRE(status.ok());
  CHECK(status->state == "serving");
}

TEST_CASE("the pool file is 0600 and the socket 0660, as documented", "[integration][security]") {
  DaemonUnderTest d({"--pool-size", "64MiB"});
  REQUIRE(d.WaitReady());
  auto stub = ControlStub(d.socket());
  (void)RawAttach(*stub, "first");  // the first Attach creates the pool file
  struct stat pool {}, sock {};
  REQUIRE(stat((d.dir() + "/pool").c_str(), &pool) == 0);
  REQUIRE(stat(d.socket().c_str(), &sock) == 0);
  CHECK((pool.st_mode & 07777) == 0600);
  CHECK(S_ISSOCK(sock.st_mode));
  CHECK((sock.st_mode & 07777) == 0660);
}

TEST_CASE("one session cannot use another's token: channel, RegisterKv and Detach are refused",
          "[integration][security]") {
  // The unprivileged peer (uid 65534) is forked before this process uses gRPC, and makes its own calls.
  const bool can_drop = geteuid() == 0;
  int to_child[2], from_child[2];
  // O_CLOEXEC: the daemon spawned below must not hold the pipes open.
  REQUIRE(pipe2(to_child, O_CLOEXEC) == 0);
  REQUIRE(pipe2(from_child, O_CLOEXEC) == 0);
  pid_t child = -1;
  if (can_drop) {
    child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      alarm(20);  // never hangs the test
      close(to_child[1]);
      close(from_child[0]);
      char buf[512] = {};
      size_t got = 0;
      ssize_t n;
      while ((n = read(to_child[0], buf + got, sizeof(buf) - 1 - got)) > 0) got += static_cast<size_t>(n);
      // buf: "<socket>\n<session_id>\n<token hex>"
      std::string text(buf, got), socket, id_text, hex;
      std::istringstream in(text);
      std::getline(in, socket);
      std::getline(in, id_text);
      std::getline(in, hex);
      std::string token;
      for (size_t i = 0; i + 1 < hex.size(); i += 2) token.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
      const gid_t nogroup = 65534;
      if (setgroups(1, &nogroup) != 0 || setresgid(65534, 65534, 65534) != 0 || setresuid(65534, 65534, 65534) != 0) {
        _exit(10);
      }
      auto stub = ControlStub(socket);
      flexkv::v1::DetachRequest req;
      req.set_session_id(std::stoull(id_text));
      req.set_session_token(token);
      flexkv::v1::DetachResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + 10s);
      grpc::Status st = stub->Detach(&ctx, req, &resp);
      const std::string out = std::to_string(static_cast<int>(st.error_code())) + " " + st.error_message();
      (void)!write(from_child[1], out.data(), out.size());
      _exit(0);
    }
  }
  close(to_child[0]);
  close(from_child[1]);
  // The socket group is nogroup, so the unprivileged peer can reach it.
  DaemonUnderTest d({"--pool-size", "64MiB", "--socket-group", "nogroup"});
  REQUIRE(d.WaitReady());
  auto stub = ControlStub(d.socket());
  const RawGrant a = RawAttach(*stub, "A");
  const RawGrant b = RawAttach(*stub, "B");
  {  // B cannot open A's rings with its own (or any wrong) token.
    UniqueFd channel;
    std::vector<UniqueFd> fds;
    const auto reply = flexkv::testing::RawHello(d.socket(), a.session_id, b.token, &channel, &fds);
    INFO(reply.message);
    CHECK(reply.status_code == static_cast<uint32_t>(flexkv::StatusCode::kPermissionDenied));
    CHECK(fds.empty());
  }
  {  // RegisterKv with A's id and a wrong token: PERMISSION_DENIED.
    flexkv::v1::RegisterKvRequest req;
    req.set_session_id(a.session_id);
    req.set_session_token(WrongToken(a.token));
    req.set_layout(flexkv::v1::KV_LAYOUT_BLOCK_FIRST);
    req.set_num_blocks(8);
    req.mutable_host()->set_fd_tag(1);
    req.mutable_host()->set_bytes(8 * 128 * 1024);
    flexkv::v1::RegisterKvResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 10s);
    grpc::Status st = stub->RegisterKv(&ctx, req, &resp);
    INFO(st.error_message());
    CHECK(st.error_code() == grpc::StatusCode::PERMISSION_DENIED);
  }
  if (can_drop) {  // Detach of A by an unprivileged peer holding B's token: PERMISSION_DENIED; A survives.
    std::ostringstream msg;
    msg << d.socket() << "\n" << a.session_id << "\n";
    for (unsigned char ch : b.token) {
      char hex[3];
      std::snprintf(hex, sizeof(hex), "%02x", ch);
      msg << hex;
    }
    const std::string text = msg.str();
    REQUIRE(write(to_child[1], text.data(), text.size()) == static_cast<ssize_t>(text.size()));
    close(to_child[1]);
    std::string answer;
    char buf[512];
    ssize_t n;
    while ((n = read(from_child[0], buf, sizeof(buf))) > 0) answer.append(buf, static_cast<size_t>(n));
    int status = 0;
    REQUIRE(waitpid(child, &status, 0) == child);
    INFO("unprivileged Detach: " << answer);
    REQUIRE(WIFEXITED(status));
    REQUIRE(WEXITSTATUS(status) == 0);
    CHECK(answer.rfind(std::to_string(static_cast<int>(grpc::StatusCode::PERMISSION_DENIED)) + " ", 0) == 0);
  } else {
    close(to_child[1]);
    WARN("not root: cannot make an unprivileged peer for Detach with a wrong token; that part skipped");
  }
  close(from_child[0]);
  auto c = flexkv::Client::Connect({d.socket(), 5000ms, 10000ms});
  REQUIRE(c.ok());
  auto sessions = (*c)->ListSessions();
  REQUIRE(sessions.ok());
  bool a_alive = false;
  for (const auto& s : *sessions) a_alive |= s.session_id == a.session_id;
  CHECK(a_alive);  // attaching still (no channel yet), but nobody else ended it
}
