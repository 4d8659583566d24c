// Process plumbing shared by the multi-process benches: see bench_process.h.
#include "bench_process.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <thread>

#include "tests/support/spawn.h"

namespace flexkv::bench {

std::string SelfExe() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string() : p.string();
}

void Emit(std::string_view line) {
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fflush(stdout);
}

std::optional<StartBarrier> StartBarrier::Create() {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    std::fprintf(stderr, "flexkv-bench: pipe2: %s\n", std::strerror(errno));
    return std::nullopt;
  }
  return StartBarrier(fds[0], fds[1]);
}

void AwaitBarrier(int fd) {
  char buf[64];
  for (;;) {
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n == 0) return;
    if (n < 0 && errno != EINTR) return;
  }
}

std::string SampleLine(std::string_view head, const std::vector<int64_t>& samples) {
  std::string line = fmt::format("{} {}", head, samples.size());
  line.reserve(line.size() + samples.size() * 8 + 1);
  for (int64_t v : samples) fmt::format_to(std::back_inserter(line), " {}", v);
  line += '\n';
  return line;
}

std::vector<int64_t> ParseSamples(const char* text, size_t n) {
  std::vector<int64_t> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    char* next = nullptr;
    const long long v = std::strtoll(text, &next, 10);
    if (next == text) break;
    out.push_back(v);
    text = next;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Child

std::optional<std::string> Child::ReadLine(std::chrono::milliseconds timeout) {
  const int64_t deadline = NowNs() + timeout.count() * 1000000;
  for (;;) {
    const size_t nl = buf.find('\n');
    if (nl != std::string::npos) {
      std::string line = buf.substr(0, nl);
      buf.erase(0, nl + 1);
      return line;
    }
    const int64_t left_ms = (deadline - NowNs()) / 1000000;
    if (left_ms <= 0 || !out) return std::nullopt;
    pollfd pfd{out.get(), POLLIN, 0};
    if (poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left_ms, 1000))) <= 0) continue;
    char chunk[65536];
    const ssize_t n = read(out.get(), chunk, sizeof(chunk));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      out.reset();
      return std::nullopt;
    }
    buf.append(chunk, static_cast<size_t>(n));
  }
}

int Child::Wait() {
  int status = 0;
  if (pid > 0) {
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    pid = -1;
  }
  out.reset();
  return status;
}

void Child::Kill() {
  if (pid > 0) {
    kill(pid, SIGKILL);
    while (waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
    }
    pid = -1;
  }
  out.reset();
}

std::optional<Child> Spawn(const std::vector<std::string>& argv, const std::vector<std::pair<int, int>>& dups,
                           const std::string& stdout_path) {
  int pipefd[2] = {-1, -1};
  if (stdout_path.empty() && pipe2(pipefd, O_CLOEXEC) != 0) {
    std::fprintf(stderr, "flexkv-bench: pipe2: %s\n", std::strerror(errno));
    return std::nullopt;
  }
  UniqueFd read_end(pipefd[0]), write_end(pipefd[1]);
  std::vector<flexkv::testing::ChildFd> fds;
  if (stdout_path.empty()) {
    fds.push_back({STDOUT_FILENO, write_end.get(), "", 0});
  } else {
    fds.push_back({STDOUT_FILENO, -1, stdout_path, O_WRONLY | O_CREAT | O_TRUNC});
    fds.push_back({STDERR_FILENO, STDOUT_FILENO, "", 0});
  }
  for (const auto& [from, to] : dups) fds.push_back({to, from, "", 0});
  Child child;
  auto pid = flexkv::testing::SpawnChild(argv, fds);
  if (!pid.ok()) {
    std::fprintf(stderr, "flexkv-bench: %s\n", pid.status().message().c_str());
    return std::nullopt;
  }
  child.pid = *pid;
  child.out = std::move(read_end);
  return child;
}

// ---------------------------------------------------------------------------------------------------------------
// OwnDaemon

namespace {

// The pid of the live OwnDaemon, for the signal handler; -1 when there is none.
volatile sig_atomic_t g_own_daemon_pid = -1;

extern "C" void StopOwnDaemonAndExit(int sig) {
  if (g_own_daemon_pid > 0) kill(static_cast<pid_t>(g_own_daemon_pid), SIGTERM);
  _exit(128 + sig);
}

}  // namespace

std::unique_ptr<OwnDaemon> OwnDaemon::Start(std::string dir_template, const std::vector<std::string>& args) {
  if (g_own_daemon_pid > 0) {
    std::fprintf(stderr, "flexkv-bench: internal error: a second OwnDaemon while flexkvd %d runs\n",
                 static_cast<int>(g_own_daemon_pid));
    std::abort();
  }
  const std::string self = SelfExe();
  if (self.empty()) {
    std::fprintf(stderr, "flexkv-bench: cannot resolve /proc/self/exe\n");
    return nullptr;
  }
  if (mkdtemp(dir_template.data()) == nullptr) {
    std::fprintf(stderr, "flexkv-bench: mkdtemp %s: %s\n", dir_template.c_str(), std::strerror(errno));
    return nullptr;
  }
  std::unique_ptr<OwnDaemon> d(new OwnDaemon());
  d->dir_ = dir_template;
  chmod(d->dir_.c_str(), 0755);
  d->socket_ = d->dir_ + "/flexkvd.sock";
  d->log_ = d->dir_ + "/flexkvd.log";
  std::vector<std::string> argv = {std::filesystem::path(self).parent_path() / "flexkvd",
                                   "--socket",
                                   d->socket_,
                                   "--pool-path",
                                   d->dir_ + "/pool",
                                   "--log-level",
                                   "warning"};
  argv.insert(argv.end(), args.begin(), args.end());
  std::signal(SIGINT, StopOwnDaemonAndExit);
  std::signal(SIGTERM, StopOwnDaemonAndExit);
  std::signal(SIGHUP, StopOwnDaemonAndExit);
  auto child = Spawn(argv, {}, d->log_);
  if (!child) return nullptr;
  d->pid_ = child->pid;
  g_own_daemon_pid = d->pid_;
  return d;
}

OwnDaemon::~OwnDaemon() {
  if (pid_ > 0) {
    g_own_daemon_pid = -1;
    kill(pid_, SIGTERM);
    int status = 0;
    const int64_t deadline = NowNs() + 15LL * 1000000000;
    while (waitpid(pid_, &status, WNOHANG) == 0) {
      if (NowNs() > deadline) {
        std::fprintf(stderr, "flexkv-bench: flexkvd (pid %d) ignored SIGTERM for 15 s; killing it\n", pid_);
        kill(pid_, SIGKILL);
        waitpid(pid_, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  if (!dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
}

void OwnDaemon::DumpLog() const {
  std::FILE* f = std::fopen(log_.c_str(), "r");
  if (f == nullptr) return;
  std::string text;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, n);
  std::fclose(f);
  if (text.size() > 4000) text.erase(0, text.size() - 4000);
  std::fprintf(stderr, "flexkv-bench: end of the flexkvd log:\n%s\n", text.c_str());
}

// ---------------------------------------------------------------------------------------------------------------
// Percentiles

Percentiles Summarize(std::vector<int64_t> samples_ns) {
  Percentiles p;
  p.n = samples_ns.size();
  if (samples_ns.empty()) return p;
  std::sort(samples_ns.begin(), samples_ns.end());
  auto at = [&](double q) {
    const size_t i = std::min(samples_ns.size() - 1, static_cast<size_t>(q * static_cast<double>(samples_ns.size())));
    return static_cast<double>(samples_ns[i]) / 1e3;
  };
  double sum = 0;
  for (int64_t v : samples_ns) sum += static_cast<double>(v);
  p.p50_us = at(0.50);
  p.p99_us = at(0.99);
  p.p999_us = at(0.999);
  p.mean_us = sum / static_cast<double>(samples_ns.size()) / 1e3;
  return p;
}

}  // namespace flexkv::bench
