// The unix-socket helpers: fds passed with SCM_RIGHTS arrive owned and working, errors keep their causes apart.
#include "common/uds.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <string>
#include <vector>

using flexkv::ConnectUnix;
using flexkv::RecvWithFds;
using flexkv::SendWithFds;
using flexkv::StatusCode;
using flexkv::UniqueFd;

namespace {

struct SocketPair {
  UniqueFd a, b;
  SocketPair() {
    int sv[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    a.reset(sv[0]);
    b.reset(sv[1]);
  }
};

struct Pipe {
  UniqueFd read, write;
  Pipe() {
    int p[2];
    REQUIRE(pipe2(p, O_CLOEXEC) == 0);
    read.reset(p[0]);
    write.reset(p[1]);
  }
};

std::string TempDir() {
  char tmpl[] = "/tmp/flexkv-uds-test-XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  return tmpl;
}

}  // namespace

TEST_CASE("fds sent with SCM_RIGHTS arrive as working, close-on-exec descriptors", "[unit]") {
  SocketPair s;
  Pipe p1, p2;
  const int sent[] = {p1.write.get(), p2.write.get()};
  const char payload[] = "hello";
  REQUIRE(SendWithFds(s.a.get(), payload, sizeof(payload), sent).ok());
  char got[sizeof(payload)] = {};
  std::vector<UniqueFd> fds;
  REQUIRE(RecvWithFds(s.b.get(), got, sizeof(got), &fds).ok());
  CHECK(std::string(got) == "hello");
  REQUIRE(fds.size() == 2);
  for (const UniqueFd& fd : fds) CHECK((fcntl(fd.get(), F_GETFD) & FD_CLOEXEC) != 0);
  // The received fd is the same pipe: a byte written through it comes out of the original read end.
  REQUIRE(write(fds[1].get(), "x", 1) == 1);
  char c = 0;
  REQUIRE(read(p2.read.get(), &c, 1) == 1);
  CHECK(c == 'x');
}

TEST_CASE("received fds are closed when the caller does not want them", "[unit]") {
  SocketPair s;
  Pipe p;
  const int sent[] = {p.write.get()};
  REQUIRE(SendWithFds(s.a.get(), "z", 1, sent).ok());
  p.write.reset();  // now the only write end left is the one in flight
  char got = 0;
  REQUIRE(RecvWithFds(s.b.get(), &got, 1, nullptr).ok());
  char c;
  CHECK(read(p.read.get(), &c, 1) == 0);  // EOF: the received copy was closed
}

TEST_CASE("more than 8 fds in one message is refused before sending", "[unit]") {
  SocketPair s;
  std::vector<int> nine(9, s.a.get());
  auto st = SendWithFds(s.a.get(), "x", 1, nine);
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(st.message(), Catch::Contains("at most 8"));
}

TEST_CASE("RecvWithFds: EOF is UNAVAILABLE, an expired receive timeout is DEADLINE_EXCEEDED", "[unit]") {
  {
    SocketPair s;
    timeval tv{0, 1000};
    REQUIRE(setsockopt(s.b.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) == 0);
    char buf[4];
    CHECK(RecvWithFds(s.b.get(), buf, sizeof(buf), nullptr).code() == StatusCode::kDeadlineExceeded);
  }
  {
    SocketPair s;
    REQUIRE(SendWithFds(s.a.get(), "ab", 2).ok());
    s.a.reset();
    char buf[4];
    auto st = RecvWithFds(s.b.get(), buf, sizeof(buf), nullptr);  // 2 of 4 bytes, then EOF
    CHECK(st.code() == StatusCode::kUnavailable);
    CHECK_THAT(st.message(), Catch::Contains("closed"));
  }
}

TEST_CASE("the peer credentials of a socketpair are this process's", "[unit]") {
  SocketPair s;
  auto peer = flexkv::GetPeerCredentials(s.b.get());
  REQUIRE(peer.ok());
  CHECK(peer->pid == getpid());
  CHECK(peer->uid == getuid());
  CHECK(peer->gid == getgid());
  CHECK(peer->InGroup(getgid()));
}

TEST_CASE("ConnectUnix tells no socket, nobody listening and a bad path apart", "[unit]") {
  const std::string dir = TempDir();
  const std::string path = dir + "/s";
  CHECK(ConnectUnix(path).status().code() == StatusCode::kNotFound);
  CHECK(ConnectUnix("").status().code() == StatusCode::kInvalidArgument);
  CHECK(ConnectUnix(std::string(200, 'x')).status().code() == StatusCode::kInvalidArgument);
  {
    UniqueFd bound(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
    REQUIRE(bind(bound.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0);
    auto refused = ConnectUnix(path);  // bound but not listening
    CHECK(refused.status().code() == StatusCode::kUnavailable);
    CHECK_THAT(refused.status().message(), Catch::Contains(path));
    REQUIRE(listen(bound.get(), 1) == 0);
    CHECK(ConnectUnix(path).ok());
  }
  unlink(path.c_str());
  rmdir(dir.c_str());
}
