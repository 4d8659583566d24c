// flexkvctl top: a live view of one flexkvd, refreshed from successive GetStatus / ListSessions snapshots; plain
// ANSI (cursor home, erase) so it works over ssh in any terminal, no curses.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "flexkv/client.h"

namespace flexkvctl {

// What the daemon said at one moment.
struct TopSnapshot {
  flexkv::DaemonStatus status;
  std::vector<flexkv::SessionEntry> sessions;  // the caller's own sessions unless it is an admin
  std::chrono::steady_clock::time_point taken;
};

// One frame: rates (hit ratio, GB/s per direction, requests/s, cluster pulls) are over `before` .. `now`; levels
// (pool and tier fill, sessions, queue depths) are `now`'s. Lines end in '\n' only; `max_sessions` rows of the
// session table at most. Pure.
std::string RenderTopFrame(const TopSnapshot& before, const TopSnapshot& now, size_t max_sessions = 20);

struct TopOptions {
  double interval_s = 1.0;
  uint64_t iterations = 0;  // frames to print, then exit 0; 0: until q, Ctrl-C or SIGTERM
};

// Runs top against `client`. With stdout a terminal, each frame redraws the screen (cursor home, erase to end;
// the cursor hidden meanwhile) and, with stdin a terminal, 'q' ends it (stdin is put in non-canonical, no-echo
// mode); otherwise frames are printed one after another, separated by a blank line. SIGINT, SIGTERM and SIGHUP end
// it too. The terminal is restored on every way out. Returns the process exit code: 0, or 1 when the daemon stops
// answering (the message on stderr). Not thread-safe: installs signal handlers for its duration.
int RunTop(flexkv::Client& client, const TopOptions& options);

}  // namespace flexkvctl
