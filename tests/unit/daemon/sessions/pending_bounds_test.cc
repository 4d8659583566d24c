// Pending-session bounds (issue 13, item 4 "Attach flood"): sessions granted by Attach that have not opened their
// channel are bounded per uid and in total, the fd reserve refuses Attach, and the refusal log is rate-limited.
#include <sys/resource.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "common/log.h"
#include "daemon/config/config.h"
#include "daemon/sessions/session_registry.h"

using flexkv::PeerCredentials;
using flexkv::SessionIdentity;
using flexkv::SessionLimits;
using flexkv::SessionRegistry;
using flexkv::StatusCode;

namespace {

// A peer of `uid` that is this process (pidfd_open needs a live pid).
PeerCredentials Peer(uid_t uid) {
  PeerCredentials p;
  p.pid = getpid();
  p.uid = uid;
  p.gid = getgid();
  return p;
}

SessionIdentity Identity() {
  SessionIdentity id;
  id.client_name = "flood";
  id.model_namespace = "ns";
  id.geometry = flexkv::Llama3_8B();
  return id;
}

}  // namespace

TEST_CASE("pending sessions are bounded per uid: RESOURCE_EXHAUSTED names the limit, the count and what to do",
          "[unit][sessions][attach_flood]") {
  SessionRegistry reg(SessionLimits{.attach_timeout_ms = 60000, .max_pending_per_uid = 3, .max_pending_total = 100,
                                    .fd_reserve = 0});
  REQUIRE(reg.Start().ok());
  for (int i = 0; i < 3; ++i) REQUIRE(reg.Open(Identity(), Peer(1000), flexkv::SessionAccess{}).ok());
  auto refused = reg.Open(Identity(), Peer(1000), flexkv::SessionAccess{});
  REQUIRE(refused.status().code() == StatusCode::kResourceExhausted);
  const std::string m = refused.status().message();
  INFO(m);
  CHECK(m.find("uid 1000 already has 3 sessions") != std::string::npos);
  CHECK(m.find("limit 3 per uid") != std::string::npos);
  CHECK(m.find("--max-pending-sessions-per-uid") != std::string::npos);
  CHECK(m.find("open the channel") != std::string::npos);
  // Another uid is not held back by the first one's pending sessions.
  CHECK(reg.Open(Identity(), Peer(1001), flexkv::SessionAccess{}).ok());
  CHECK(reg.Count() == 4);
}

TEST_CASE("pending sessions are bounded in total across uids", "[unit][sessions][attach_flood]") {
  SessionRegistry reg(SessionLimits{.attach_timeout_ms = 60000, .max_pending_per_uid = 10, .max_pending_total = 4,
                                    .fd_reserve = 0});
  REQUIRE(reg.Start().ok());
  for (uid_t uid = 2000; uid < 2004; ++uid) REQUIRE(reg.Open(Identity(), Peer(uid), flexkv::SessionAccess{}).ok());
  auto refused = reg.Open(Identity(), Peer(2004), flexkv::SessionAccess{});
  REQUIRE(refused.status().code() == StatusCode::kResourceExhausted);
  CHECK(refused.status().message().find("limit 4, --max-pending-sessions") != std::string::npos);
  CHECK(refused.status().message().find("uid 2004 holds 0") != std::string::npos);
}

TEST_CASE("zero disables a pending-session bound", "[unit][sessions][attach_flood]") {
  SessionRegistry reg(SessionLimits{.attach_timeout_ms = 60000, .max_pending_per_uid = 0, .max_pending_total = 0,
                                    .fd_reserve = 0});
  REQUIRE(reg.Start().ok());
  for (int i = 0; i < 100; ++i) REQUIRE(reg.Open(Identity(), Peer(1000), flexkv::SessionAccess{}).ok());
}

TEST_CASE("Attach is refused while fewer fds than the reserve are free", "[unit][sessions][attach_flood]") {
  rlimit limit{};
  REQUIRE(getrlimit(RLIMIT_NOFILE, &limit) == 0);
  if (limit.rlim_cur == RLIM_INFINITY) {
    WARN("RLIMIT_NOFILE is unlimited: there is no reserve to fall under");
    return;
  }
  SessionRegistry reg(SessionLimits{.attach_timeout_ms = 60000, .max_pending_per_uid = 0, .max_pending_total = 0,
                                    .fd_reserve = static_cast<size_t>(limit.rlim_cur)});
  REQUIRE(reg.Start().ok());
  auto refused = reg.Open(Identity(), Peer(1000), flexkv::SessionAccess{});
  REQUIRE(refused.status().code() == StatusCode::kResourceExhausted);
  CHECK(refused.status().message().find("--fd-reserve") != std::string::npos);
  CHECK(reg.Count() == 0);
}

TEST_CASE("a rate-limited log line passes once per interval and counts what it suppressed", "[unit][log]") {
  flexkv::log::RateLimited limited(/*interval_ms=*/3600 * 1000);
  CHECK(limited.Write(flexkv::log::Level::kWarning, "test", "first"));
  for (int i = 0; i < 5; ++i) CHECK_FALSE(limited.Write(flexkv::log::Level::kWarning, "test", "again"));
  CHECK(limited.suppressed() == 5);
  flexkv::log::RateLimited every_time(/*interval_ms=*/0);
  CHECK(every_time.Write(flexkv::log::Level::kWarning, "test", "one"));
  CHECK(every_time.Write(flexkv::log::Level::kWarning, "test", "two"));
  CHECK(every_time.suppressed() == 0);
}

TEST_CASE("the pending-session bounds and the fd reserve are flags with node-sized defaults",
          "[unit][config][attach_flood]") {
  auto parse = [](std::vector<std::string> args) {
    args.insert(args.begin(), "flexkvd");
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    return flexkv::ParseDaemonArgs(static_cast<int>(argv.size()), argv.data());
  };
  auto defaults = parse({});
  REQUIRE(defaults.config);
  CHECK(defaults.config->max_pending_sessions_per_uid == 64);
  CHECK(defaults.config->max_pending_sessions == 1024);
  CHECK(defaults.config->fd_reserve == 256);
  auto set = parse({"--max-pending-sessions-per-uid", "8", "--max-pending-sessions", "100", "--fd-reserve", "0"});
  REQUIRE(set.config);
  CHECK(set.config->max_pending_sessions_per_uid == 8);
  CHECK(set.config->max_pending_sessions == 100);
  CHECK(set.config->fd_reserve == 0);
  CHECK(parse({"--max-pending-sessions", "-1"}).exit_code == 2);
}
