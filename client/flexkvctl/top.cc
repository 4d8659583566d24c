// flexkvctl top; see top.h.
#include "top.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <map>
#include <optional>

namespace flexkvctl {
namespace {

uint64_t Counter(const std::map<std::string, uint64_t>& counters, const char* name) {
  const auto it = counters.find(name);
  return it == counters.end() ? 0 : it->second;
}

// The increase of a counter per second; a counter that went down (a daemon restarted between snapshots) gives 0.
double PerSecond(uint64_t before, uint64_t now, double seconds) {
  return now >= before && seconds > 0 ? static_cast<double>(now - before) / seconds : 0.0;
}

std::string Percent(uint64_t part, uint64_t whole) {
  return whole == 0 ? std::string("-")
                    : fmt::format("{:.1f}%", 100.0 * static_cast<double>(part) / static_cast<double>(whole));
}

std::string Fill(uint64_t used, uint64_t capacity) {
  return fmt::format("{}/{} blocks ({})", used, capacity, Percent(used, capacity));
}

std::string UtcNow() {
  const time_t t = time(nullptr);
  tm utc{};
  gmtime_r(&t, &utc);
  return fmt::format("{:04}-{:02}-{:02} {:02}:{:02}:{:02} UTC", utc.tm_year + 1900, utc.tm_mon + 1, utc.tm_mday,
                     utc.tm_hour, utc.tm_min, utc.tm_sec);
}

volatile sig_atomic_t g_stop = 0;
int g_wake_fd = -1;  // the write end of the self-pipe poll() waits on

void OnStopSignal(int) {
  g_stop = 1;
  const char byte = 0;
  ssize_t ignored = ::write(g_wake_fd, &byte, 1);
  (void)ignored;
}

// The terminal as top found it, put back on destruction: stdin's mode, the cursor, the signal handlers.
class TerminalGuard {
 public:
  TerminalGuard(bool redraw, bool keys) : redraw_(redraw) {
    if (pipe2(wake_, O_CLOEXEC | O_NONBLOCK) == 0) g_wake_fd = wake_[1];
    struct sigaction sa {};
    sa.sa_handler = OnStopSignal;
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < kSignals.size(); ++i) sigaction(kSignals[i], &sa, &old_actions_[i]);
    if (keys && tcgetattr(STDIN_FILENO, &saved_) == 0) {
      termios raw = saved_;
      raw.c_lflag &= ~static_cast<tcflag_t>(ICANON | ECHO);
      raw.c_cc[VMIN] = 0;
      raw.c_cc[VTIME] = 0;
      restore_termios_ = tcsetattr(STDIN_FILENO, TCSANOW, &raw) == 0;
    }
    if (redraw_) Write("\x1b[?25l\x1b[H\x1b[2J");  // hide the cursor, clear once
  }
  TerminalGuard(const TerminalGuard&) = delete;
  TerminalGuard& operator=(const TerminalGuard&) = delete;
  ~TerminalGuard() {
    if (redraw_) Write("\x1b[?25h\n");  // the cursor back, below the last frame
    if (restore_termios_) tcsetattr(STDIN_FILENO, TCSANOW, &saved_);
    for (size_t i = 0; i < kSignals.size(); ++i) sigaction(kSignals[i], &old_actions_[i], nullptr);
    g_wake_fd = -1;
    for (int fd : wake_) {
      if (fd >= 0) close(fd);
    }
  }
  int wake_fd() const { return wake_[0]; }
  static void Write(std::string_view text) {
    std::fflush(stdout);
    ssize_t ignored = ::write(STDOUT_FILENO, text.data(), text.size());
    (void)ignored;
  }

 private:
  static constexpr std::array<int, 3> kSignals = {SIGINT, SIGTERM, SIGHUP};
  const bool redraw_;
  int wake_[2] = {-1, -1};
  std::array<struct sigaction, 3> old_actions_{};
  termios saved_{};
  bool restore_termios_ = false;
};

// Waits up to `timeout_ms` for a stop: a signal, or 'q' / 'Q' / Ctrl-D on stdin when `keys`. True to stop.
bool WaitForStop(int wake_fd, bool keys, int64_t timeout_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    if (g_stop) return true;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd fds[2] = {{wake_fd, POLLIN, 0}, {STDIN_FILENO, POLLIN, 0}};
    const int n = poll(fds, keys ? 2 : 1, static_cast<int>(left.count()));
    if (n < 0 && errno != EINTR) return false;
    if (n > 0 && keys && (fds[1].revents & (POLLIN | POLLHUP)) != 0) {
      char buf[64];
      const ssize_t got = read(STDIN_FILENO, buf, sizeof(buf));
      if (got == 0) return true;  // stdin closed
      for (ssize_t i = 0; i < got; ++i) {
        if (buf[i] == 'q' || buf[i] == 'Q' || buf[i] == 4) return true;
      }
    }
  }
}

std::optional<TopSnapshot> Take(flexkv::Client& client, flexkv::Status* error) {
  TopSnapshot s;
  auto status = client.GetStatus();
  if (!status.ok()) {
    *error = status.status();
    return std::nullopt;
  }
  s.status = std::move(*status);
  auto sessions = client.ListSessions();
  if (sessions.ok()) s.sessions = std::move(*sessions);  // best effort: the counters matter more
  s.taken = std::chrono::steady_clock::now();
  return s;
}

// `frame` with each line cut to `columns` bytes (0: as is) and erased to its end, for a redraw in place.
std::string ForTerminal(const std::string& frame, size_t columns) {
  std::string out = "\x1b[H";
  size_t start = 0;
  while (start < frame.size()) {
    size_t end = frame.find('\n', start);
    if (end == std::string::npos) end = frame.size();
    size_t len = end - start;
    if (columns > 0) len = std::min(len, columns);
    out.append(frame, start, len);
    out += "\x1b[K\n";
    start = end + 1;
  }
  out += "\x1b[J";
  return out;
}

size_t TerminalColumns() {
  winsize ws{};
  return ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 ? ws.ws_col : 0;
}

}  // namespace

std::string RenderTopFrame(const TopSnapshot& before, const TopSnapshot& now, size_t max_sessions) {
  const double seconds = std::chrono::duration<double>(now.taken - before.taken).count();
  const flexkv::DaemonStatus& b = before.status;
  const flexkv::DaemonStatus& s = now.status;
  const auto rate = [&](const char* name) { return PerSecond(Counter(b.counters, name), Counter(s.counters, name), seconds); };
  std::string out;
  out += fmt::format("flexkvd {} (pid {}) {}, up {} s    {}, every {:.1f} s\n", s.version, s.pid, s.state, s.uptime_s,
                     UtcNow(), seconds);

  const uint64_t hits = Counter(s.counters, "hit_blocks"), asked = Counter(s.counters, "match_blocks");
  const uint64_t hits_now = hits >= Counter(b.counters, "hit_blocks") ? hits - Counter(b.counters, "hit_blocks") : 0;
  const uint64_t asked_now =
      asked >= Counter(b.counters, "match_blocks") ? asked - Counter(b.counters, "match_blocks") : 0;
  out += fmt::format("hit ratio   {} now ({}/{} blocks), {} since start ({}/{} blocks)\n", Percent(hits_now, asked_now),
                     hits_now, asked_now, Percent(hits, asked), hits, asked);
  out += fmt::format("GB/s        load {:.3f} (pool to engines), store {:.3f} (engines to pool)\n",
                     rate("bytes_loaded") / 1e9, rate("bytes_stored") / 1e9);
  out += fmt::format("requests/s  match {:.1f}, load {:.1f} blocks, store {:.1f} blocks, evicted {:.1f} blocks, errors "
                     "{:.1f}\n",
                     rate("match_requests"), rate("load_blocks"), rate("store_blocks"), rate("evicted_blocks"),
                     rate("errors"));
  if (s.pool.block_bytes == 0) {
    out += fmt::format("pool        budget {} bytes; no domain yet (no session has attached)\n", s.pool.budget_bytes);
  } else {
    out += fmt::format("pool        {} of {} bytes; {} pinned{}; {} indexed\n",
                       Fill(s.pool.used_blocks, s.pool.capacity_blocks), s.pool.block_bytes, s.pool.pinned_blocks,
                       s.pool.unverified_blocks > 0 ? fmt::format(", {} verifying", s.pool.unverified_blocks) : "",
                       s.index_blocks);
  }
  if (s.domains.size() > 1) {
    for (const auto& d : s.domains) {
      out += fmt::format("  domain {}: {}; {} session(s)\n", d.model_namespace,
                         Fill(d.pool.used_blocks, d.pool.capacity_blocks), d.sessions);
    }
  }
  for (const auto& t : s.tiers) {
    out += fmt::format("tier {:<7}{}: {}; read {:.1f} MB/s, write {:.1f} MB/s; queue {} reads, {} writes\n", t.name,
                       t.state, Fill(t.used_blocks, t.capacity_blocks), t.read_bytes_per_s / 1e6,
                       t.write_bytes_per_s / 1e6, Counter(t.counters, "reads_in_flight"),
                       Counter(t.counters, "writes_in_flight"));
  }
  if (s.cluster) {
    const auto& c = *s.cluster;
    const auto& bc = b.cluster ? b.cluster->counters : std::map<std::string, uint64_t>{};
    const auto crate = [&](const char* name) { return PerSecond(Counter(bc, name), Counter(c.counters, name), seconds); };
    out += fmt::format("cluster     {}: {} members; pulls {:.1f}/s ok, {:.1f}/s failed, {:.3f} GB/s pulled; queue {} "
                       "pulls, {} to publish\n",
                       c.state, c.members.size(), crate("pulls_ok"), crate("pulls_failed"), crate("pulled_bytes") / 1e9,
                       Counter(c.counters, "pulls_in_flight"), Counter(c.counters, "publish_queue"));
  }
  uint64_t in_flight = 0, pinned = 0;
  for (const auto& e : now.sessions) {
    in_flight += e.inflight_requests;
    pinned += e.pinned_blocks;
  }
  out += fmt::format("sessions    {} attached; queue {} requests in flight, {} blocks pinned (sessions you may see: {})\n",
                     s.sessions, in_flight, pinned, now.sessions.size());
  if (!now.sessions.empty()) {
    out += fmt::format("\n{:>16}  {:<20} {:>8} {:>4} {:>4}  {:<10} {:>7} {:>8}  {}\n", "ID", "NAME", "PID", "DP", "TP",
                       "STATE", "PINNED", "INFLIGHT", "NAMESPACE");
    std::vector<const flexkv::SessionEntry*> rows;
    for (const auto& e : now.sessions) rows.push_back(&e);
    // The busiest first, as top sorts by CPU.
    std::stable_sort(rows.begin(), rows.end(), [](const auto* x, const auto* y) {
      return x->inflight_requests != y->inflight_requests ? x->inflight_requests > y->inflight_requests
                                                          : x->pinned_blocks > y->pinned_blocks;
    });
    for (size_t i = 0; i < rows.size() && i < max_sessions; ++i) {
      const auto& e = *rows[i];
      out += fmt::format("{:>16}  {:<20} {:>8} {:>4} {:>4}  {:<10} {:>7} {:>8}  {}\n", e.session_id,
                         e.client_name.empty() ? "-" : e.client_name, e.pid, e.dp_rank, e.tp_rank, e.state,
                         e.pinned_blocks, e.inflight_requests, e.model_namespace);
    }
    if (rows.size() > max_sessions) out += fmt::format("  ... {} more\n", rows.size() - max_sessions);
  }
  return out;
}

int RunTop(flexkv::Client& client, const TopOptions& options) {
  const bool redraw = isatty(STDOUT_FILENO) == 1;
  const bool keys = redraw && isatty(STDIN_FILENO) == 1;
  flexkv::Status error;
  std::optional<TopSnapshot> before = Take(client, &error);
  if (!before) {
    std::fprintf(stderr, "flexkvctl: %s\n", error.ToString().c_str());
    return 1;
  }
  TerminalGuard terminal(redraw, keys);
  if (redraw) TerminalGuard::Write(ForTerminal("waiting for the second snapshot (q to quit)...\n", 0));
  const auto interval_ms = static_cast<int64_t>(options.interval_s * 1000);
  for (uint64_t frame = 0; options.iterations == 0 || frame < options.iterations; ++frame) {
    if (WaitForStop(terminal.wake_fd(), keys, interval_ms)) break;
    std::optional<TopSnapshot> now = Take(client, &error);
    if (!now) {
      if (redraw) TerminalGuard::Write("\n");
      std::fprintf(stderr, "flexkvctl: the daemon stopped answering: %s\n", error.ToString().c_str());
      return 1;
    }
    const std::string text = RenderTopFrame(*before, *now);
    if (redraw) {
      TerminalGuard::Write(ForTerminal(text + (keys ? "\n(q to quit)\n" : ""), TerminalColumns()));
    } else {
      std::fputs(((frame > 0 ? "\n" : "") + text).c_str(), stdout);
      std::fflush(stdout);
    }
    before = std::move(now);
  }
  return 0;
}

}  // namespace flexkvctl
