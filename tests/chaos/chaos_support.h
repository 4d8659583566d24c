// Chaos test fixtures: engine processes (flexkv-test-client), the daemon's resources read from /proc (fds,
// memfd mappings, private RSS) for leak checks, and the run's figures. Included by chaos_test.cc only.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "flexkv/client.h"
#include "tests/support/process.h"

namespace flexkv::testing::chaos {

using namespace std::chrono_literals;
using flexkv::testing::ChildProcess;
using flexkv::testing::NowMs;
using flexkv::testing::TestClientPath;

// Figures of the whole run, printed by the last test case.
struct Figures {
  uint64_t iterations = 0;    // victim and daemon-kill rounds, stopped-client and exhaustion scenarios
  uint64_t client_kills = 0;  // kill -9 of engine processes
  uint64_t daemon_kills = 0;  // kill -9 of flexkvd, each followed by a restart on the same pool
  uint64_t leaks = 0;         // leaked sessions, pins, slots, fds, mappings or memory found
  int64_t max_reclaim_ms = 0;       // kill -9 of a client -> its session gone (under load)
  int64_t max_pins_back_ms = 0;     // kill -9 of a pin holder -> session gone and pool pinned_blocks back to 0
  int64_t max_restart_ms = 0;       // flexkvd spawn -> socket accepting on a re-attached pool
  int64_t started_ms = NowMs();
};

inline const std::vector<std::string> kSmallGeometry = {"--layers", "2"};  // 128 KiB blocks
inline constexpr uint64_t kBlockBytes = 128 * 1024;

inline ChildProcess Client(const std::string& socket, const std::string& name, const std::vector<std::string>& steps,
                    uint32_t kv_blocks = 64) {
  std::vector<std::string> argv = {TestClientPath(), "--socket", socket, "--name", name, "--kv-blocks",
                                   std::to_string(kv_blocks)};
  argv.insert(argv.end(), kSmallGeometry.begin(), kSmallGeometry.end());
  for (const auto& s : steps) {
    argv.push_back("--do");
    argv.push_back(s);
  }
  return ChildProcess::Spawn(argv);
}

inline std::vector<std::string> Lines(ChildProcess& p, std::chrono::milliseconds timeout = 30s) {
  std::vector<std::string> out;
  while (auto line = p.ReadLine(timeout)) out.push_back(*line);
  return out;
}

inline std::unique_ptr<flexkv::Client> Observer(const std::string& socket) {
  auto c = flexkv::Client::Connect({socket, 5000ms, 10000ms});
  REQUIRE(c.ok());
  return std::move(*c);
}

inline bool StartsWith(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// A survivor's line is fine when it is ATTACHED, a whole OK load (bytes equal, loaded == hits) or an OK store.
inline bool SurvivorLineOk(const std::string& line) {
  unsigned a = 0, b = 0, eq = 0;
  char st[32] = {};
  if (StartsWith(line, "ATTACHED")) return true;
  if (std::sscanf(line.c_str(), "LOADED %u %u %u %31s", &a, &b, &eq, st) == 4) {
    return a == b && eq == 1 && std::string(st) == "OK";
  }
  if (std::sscanf(line.c_str(), "STORED %u %u %31s", &a, &b, st) == 3) return std::string(st) == "OK";
  return false;
}

// --- the daemon's resources, from /proc ---
inline int FdCount(pid_t pid) {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd")) ++n;
  return n;
}
// Private resident memory (statm resident - shared), KiB: the pool and the rings are shared mappings, so pool
// pages touched by stores do not count, while a heap leak does.
inline int64_t PrivateRssKiB(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/statm");
  int64_t size = 0, resident = 0, shared = 0;
  in >> size >> resident >> shared;
  return (resident - shared) * (sysconf(_SC_PAGESIZE) / 1024);
}
// Mappings of memfds (session rings, registered KV buffers): one leaked per leaked session.
inline int MemfdMappings(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/maps");
  std::string line;
  int n = 0;
  while (std::getline(in, line)) n += line.find("/memfd:") != std::string::npos ? 1 : 0;
  return n;
}

struct Snapshot {
  int fds = 0, memfd_maps = 0;
  int64_t private_kib = 0;
  uint64_t used = 0, index = 0, pinned = 0;
  uint32_t sessions = 0;
};
inline Snapshot Take(flexkv::Client& observer, pid_t pid) {
  auto st = observer.GetStatus();
  REQUIRE(st.ok());
  return {FdCount(pid), MemfdMappings(pid), PrivateRssKiB(pid), st->pool.used_blocks, st->index_blocks,
          st->pool.pinned_blocks, st->sessions};
}
inline std::string Show(const Snapshot& s) {
  std::ostringstream o;
  o << "fds " << s.fds << ", memfd mappings " << s.memfd_maps << ", private RSS " << s.private_kib << " KiB, used "
    << s.used << ", index " << s.index << ", pinned " << s.pinned << ", sessions " << s.sessions;
  return o.str();
}

// Waits until `pid` has no session listed (and, with `pins_zero`, the pool has no pins). Returns ms, or -1.
inline int64_t WaitSessionGone(flexkv::Client& observer, pid_t pid, int64_t since_ms, bool pins_zero,
                        int64_t limit_ms = 5000) {
  while (NowMs() - since_ms < limit_ms) {
    auto sessions = observer.ListSessions();
    REQUIRE(sessions.ok());
    bool listed = false;
    for (const auto& s : *sessions) listed |= s.pid == static_cast<uint32_t>(pid);
    if (!listed && pins_zero) {
      auto st = observer.GetStatus();
      REQUIRE(st.ok());
      listed = st->pool.pinned_blocks != 0;
    }
    if (!listed) return NowMs() - since_ms;
    std::this_thread::sleep_for(200us);
  }
  return -1;
}

inline std::string MakeDir() {
  char tmpl[] = "/tmp/flexkvd-chaos-XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  chmod(tmpl, 0755);
  return tmpl;
}

}  // namespace flexkv::testing::chaos
