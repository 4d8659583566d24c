// SessionRegistry: tokens guard sessions, and every way a session ends (detach, attach timeout, process exit,
// channel hang-up, daemon stop) runs the end callback once with the reason.
#include "daemon/sessions/session_registry.h"

#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "common/version.h"

using flexkv::PeerCredentials;
using flexkv::SessionIdentity;
using flexkv::SessionRegistry;
using flexkv::StatusCode;
using flexkv::UniqueFd;
using namespace std::chrono_literals;

namespace {

// Records end callbacks; Await blocks until session `id` has ended (a bound only against a hang, not a timing
// assertion: every path here ends within one reaper turn of 100 ms).
class Ends {
 public:
  void Record(uint64_t id, const std::string& reason) {
    std::lock_guard lock(mu_);
    reasons_[id] = reason;
    ++count_[id];
    cv_.notify_all();
  }
  std::string Await(uint64_t id) {
    std::unique_lock lock(mu_);
    REQUIRE(cv_.wait_for(lock, 30s, [&] { return reasons_.count(id) != 0; }));
    return reasons_[id];
  }
  int Count(uint64_t id) {
    std::lock_guard lock(mu_);
    return count_[id];
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, std::string> reasons_;
  std::map<uint64_t, int> count_;
};

PeerCredentials Me() {
  PeerCredentials p;
  p.pid = getpid();
  p.uid = getuid();
  p.gid = getgid();
  return p;
}

SessionIdentity Identity(const std::string& name) {
  SessionIdentity id;
  id.client_name = name;
  id.model_namespace = "ns";
  id.geometry = flexkv::Llama3_8B();
  return id;
}

std::span<const uint8_t> TokenOf(const SessionRegistry::Grant& g) { return g.token; }

}  // namespace

TEST_CASE("a session is reached only with its token, an admin may close any", "[unit]") {
  SessionRegistry reg(60000);
  Ends ends;
  reg.SetEndCallback([&](uint64_t id, const std::string& why) { ends.Record(id, why); });
  REQUIRE(reg.Start().ok());
  auto a = reg.Open(Identity("a"), Me(), flexkv::SessionAccess{});
  auto b = reg.Open(Identity("b"), Me(), flexkv::SessionAccess{});
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(a->session_id != b->session_id);
  CHECK(reg.Count() == 2);
  CHECK(reg.Authenticate(a->session_id, TokenOf(*a)).ok());
  CHECK(reg.Authenticate(a->session_id, TokenOf(*b)).code() == StatusCode::kPermissionDenied);
  CHECK(reg.Authenticate(a->session_id, {}).code() == StatusCode::kPermissionDenied);
  CHECK(reg.Authenticate(12345, TokenOf(*a)).code() == StatusCode::kNotFound);
  auto list = reg.List();
  REQUIRE(list.size() == 2);
  for (const auto& s : list) {
    CHECK_FALSE(s.channel_open);
    CHECK(s.peer.pid == getpid());
  }

  CHECK(reg.Close(a->session_id, TokenOf(*b), false).code() == StatusCode::kPermissionDenied);
  REQUIRE(reg.Close(a->session_id, TokenOf(*a), false).ok());
  CHECK(ends.Await(a->session_id) == "detached");
  CHECK(reg.Close(a->session_id, TokenOf(*a), false).code() == StatusCode::kNotFound);
  REQUIRE(reg.Close(b->session_id, {}, true).ok());
  CHECK(ends.Await(b->session_id) == "detached");
  CHECK(reg.Count() == 0);
  CHECK(ends.Count(a->session_id) == 1);
}

TEST_CASE("a session that never opens its channel ends after the attach timeout", "[unit]") {
  SessionRegistry reg(1);
  Ends ends;
  reg.SetEndCallback([&](uint64_t id, const std::string& why) { ends.Record(id, why); });
  REQUIRE(reg.Start().ok());
  auto s = reg.Open(Identity("slow"), Me(), flexkv::SessionAccess{});
  REQUIRE(s.ok());
  CHECK_THAT(ends.Await(s->session_id), Catch::Contains("never opened its session channel"));
  CHECK(reg.Count() == 0);
}

TEST_CASE("a session ends when the process that attached exits", "[unit]") {
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    pause();
    _exit(0);
  }
  SessionRegistry reg(60000);
  Ends ends;
  reg.SetEndCallback([&](uint64_t id, const std::string& why) { ends.Record(id, why); });
  REQUIRE(reg.Start().ok());
  PeerCredentials peer = Me();
  peer.pid = child;
  auto s = reg.Open(Identity("engine"), peer, flexkv::SessionAccess{});
  REQUIRE(s.ok());
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  CHECK(ends.Await(s->session_id) == "process exited");
}

TEST_CASE("the channel hello is checked, answered, and the channel's hang-up ends the session", "[unit]") {
  SessionRegistry reg(60000);
  Ends ends;
  reg.SetEndCallback([&](uint64_t id, const std::string& why) { ends.Record(id, why); });
  int opened = 0;
  reg.SetChannelOpenCallback(
      [&](uint64_t, const flexkv::SessionIdentity&,
          const flexkv::SessionAccess&) -> flexkv::Result<std::vector<UniqueFd>> {
        ++opened;
        return std::vector<UniqueFd>{};
      });
  REQUIRE(reg.Start().ok());
  auto s = reg.Open(Identity("engine"), Me(), flexkv::SessionAccess{});
  REQUIRE(s.ok());

  auto hello_with = [&](const uint8_t* token) {
    int sv[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    UniqueFd client(sv[0]), daemon_end(sv[1]);
    flexkv::SessionHello hello{};
    std::memcpy(hello.magic, flexkv::kSessionChannelMagic, 4);
    hello.protocol_version = flexkv::kProtocolVersion;
    hello.session_id = s->session_id;
    std::memcpy(hello.token, token, flexkv::kSessionTokenBytes);
    REQUIRE(write(client.get(), &hello, sizeof(hello)) == static_cast<ssize_t>(sizeof(hello)));
    reg.AdoptChannel(std::move(daemon_end), Me());
    flexkv::SessionHelloReply reply{};
    REQUIRE(flexkv::RecvWithFds(client.get(), &reply, sizeof(reply), nullptr).ok());
    return std::make_pair(std::move(client), static_cast<StatusCode>(reply.status_code));
  };

  uint8_t wrong[flexkv::kSessionTokenBytes] = {};
  CHECK(hello_with(wrong).second == StatusCode::kPermissionDenied);
  CHECK(opened == 0);
  auto [channel, code] = hello_with(s->token.data());
  CHECK(code == StatusCode::kOk);
  CHECK(opened == 1);
  REQUIRE(reg.List().size() == 1);
  CHECK(reg.List()[0].channel_open);
  CHECK(hello_with(s->token.data()).second == StatusCode::kAlreadyExists);
  CHECK(reg.TakeOfferedFd(s->session_id, s->token, 7).status().code() == StatusCode::kNotFound);

  channel.reset();
  CHECK(ends.Await(s->session_id) == "session channel closed");
}

TEST_CASE("Stop ends every session with the reason daemon stopping", "[unit]") {
  SessionRegistry reg(60000);
  Ends ends;
  reg.SetEndCallback([&](uint64_t id, const std::string& why) { ends.Record(id, why); });
  REQUIRE(reg.Start().ok());
  auto a = reg.Open(Identity("a"), Me(), flexkv::SessionAccess{});
  auto b = reg.Open(Identity("b"), Me(), flexkv::SessionAccess{});
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  reg.Stop();
  CHECK(ends.Await(a->session_id) == "daemon stopping");
  CHECK(ends.Await(b->session_id) == "daemon stopping");
  CHECK(reg.Count() == 0);
  reg.Stop();  // idempotent
}
