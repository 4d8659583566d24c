// Test support; see process.h.
#include "tests/support/process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <utility>

#include "tests/support/spawn.h"

namespace flexkv::testing {

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

namespace {

// The build's paths, unless the environment names others (e.g. binaries bundled for the GPU machine).
std::string BinaryPath(const char* env, const char* built) {
  const char* v = std::getenv(env);
  return v != nullptr && *v != '\0' ? v : built;
}

}  // namespace

std::string FlexkvdPath() { return BinaryPath("FLEXKV_TEST_FLEXKVD", FLEXKV_TEST_FLEXKVD); }
std::string FlexkvctlPath() { return BinaryPath("FLEXKV_TEST_FLEXKVCTL", FLEXKV_TEST_FLEXKVCTL); }
std::string TestClientPath() { return BinaryPath("FLEXKV_TEST_CLIENT", FLEXKV_TEST_CLIENT); }

ChildProcess ChildProcess::Spawn(const std::vector<std::string>& argv, const std::vector<std::string>& env) {
  int pipefd[2];
  if (pipe2(pipefd, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
  static int counter = 0;
  ChildProcess child;
  child.stderr_path_ = "/tmp/flexkv-test-stderr-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
  auto pid = SpawnChild(argv,
                        {{STDOUT_FILENO, pipefd[1], "", 0},
                         {STDERR_FILENO, -1, child.stderr_path_, O_WRONLY | O_CREAT | O_TRUNC}},
                        env);
  close(pipefd[1]);
  if (!pid.ok()) {
    close(pipefd[0]);
    throw std::runtime_error(pid.status().message());
  }
  child.pid_ = *pid;
  child.stdout_fd_ = pipefd[0];
  return child;
}

ChildProcess::ChildProcess(ChildProcess&& other) noexcept
    : pid_(std::exchange(other.pid_, -1)),
      stdout_fd_(std::exchange(other.stdout_fd_, -1)),
      buffer_(std::move(other.buffer_)),
      stderr_path_(std::move(other.stderr_path_)) {}

namespace {

// Sanitizer builds: a report in a child's stderr (the daemon, a test client, flexkvctl) fails the test
// run, whether or not the test looked at the child's exit status. Every sanitizer's report has "<Name>Sanitizer:"
// in its first or SUMMARY line ("ERROR: AddressSanitizer:", "ERROR: LeakSanitizer:", "WARNING: ThreadSanitizer:",
// "SUMMARY: UndefinedBehaviorSanitizer:"). Called from a destructor, so it cannot throw: prints and exits.
void FailOnSanitizerReport(const std::string& stderr_path) {
  std::ifstream in(stderr_path);
  if (!in) return;
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  if (text.find("Sanitizer:") == std::string::npos) return;
  std::fprintf(stderr, "\n==== sanitizer report in a child process's stderr (%s) ====\n%s\n==== end ====\n",
               stderr_path.c_str(), text.c_str());
  std::fflush(stderr);
  unlink(stderr_path.c_str());
  std::_Exit(86);
}

}  // namespace

ChildProcess::~ChildProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  if (stdout_fd_ >= 0) close(stdout_fd_);
  if (!stderr_path_.empty()) {
    FailOnSanitizerReport(stderr_path_);
    unlink(stderr_path_.c_str());
  }
}

std::vector<std::string> ChildProcess::ReadLines(std::chrono::milliseconds timeout) {
  std::vector<std::string> out;
  while (auto line = ReadLine(timeout)) out.push_back(*line);
  return out;
}

ChildProcess SpawnTestClient(const std::string& socket, const std::string& name, const std::vector<std::string>& args,
                             const std::vector<std::string>& steps) {
  std::vector<std::string> argv = {TestClientPath(), "--socket", socket, "--name", name};
  argv.insert(argv.end(), args.begin(), args.end());
  for (const auto& step : steps) {
    argv.push_back("--do");
    argv.push_back(step);
  }
  return ChildProcess::Spawn(argv);
}

std::optional<std::string> ChildProcess::ReadLine(std::chrono::milliseconds timeout) {
  const int64_t deadline = NowMs() + timeout.count();
  for (;;) {
    const size_t nl = buffer_.find('\n');
    if (nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      return line;
    }
    const int64_t left = deadline - NowMs();
    if (left <= 0 || stdout_fd_ < 0) return std::nullopt;
    pollfd pfd{stdout_fd_, POLLIN, 0};
    if (poll(&pfd, 1, static_cast<int>(left)) <= 0) continue;
    char buf[4096];
    const ssize_t n = read(stdout_fd_, buf, sizeof(buf));
    if (n <= 0) return std::nullopt;
    buffer_.append(buf, static_cast<size_t>(n));
  }
}

std::optional<std::string> ChildProcess::WaitForLine(const std::string& prefix, std::chrono::milliseconds timeout) {
  const int64_t deadline = NowMs() + timeout.count();
  while (NowMs() < deadline) {
    auto line = ReadLine(std::chrono::milliseconds(deadline - NowMs()));
    if (!line) return std::nullopt;
    if (line->rfind(prefix, 0) == 0) return line;
  }
  return std::nullopt;
}

void ChildProcess::Signal(int sig) {
  if (pid_ > 0) kill(pid_, sig);
}

std::optional<int> ChildProcess::Wait(std::chrono::milliseconds timeout) {
  if (pid_ <= 0) return std::nullopt;
  const int64_t deadline = NowMs() + timeout.count();
  for (;;) {
    int status = 0;
    const pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      pid_ = -1;
      return status;
    }
    if (NowMs() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

std::string ChildProcess::Stderr() const {
  std::ifstream in(stderr_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

CommandResult RunCommand(const std::vector<std::string>& argv, std::chrono::milliseconds timeout) {
  ChildProcess child = ChildProcess::Spawn(argv);
  std::string out;
  while (auto line = child.ReadLine(timeout)) out += *line + "\n";
  auto status = child.Wait(timeout);
  out += child.Stderr();
  if (!status) return {-1, out + "\n(timed out)"};
  return {WIFEXITED(*status) ? WEXITSTATUS(*status) : 128 + WTERMSIG(*status), out};
}

DaemonUnderTest::DaemonUnderTest(std::vector<std::string> extra_args, std::string dir, std::vector<std::string> launcher)
    : dir_(std::move(dir)) {
  if (dir_.empty()) {
    char tmpl[] = "/tmp/flexkvd-test-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) throw std::runtime_error("mkdtemp failed");
    dir_ = tmpl;
    chmod(dir_.c_str(), 0755);
    own_dir_ = true;
  }
  socket_ = dir_ + "/flexkvd.sock";
  std::vector<std::string> argv = std::move(launcher);
  argv.insert(argv.end(), {FlexkvdPath(), "--socket", socket_});
  if (std::find(extra_args.begin(), extra_args.end(), "--pool-path") == extra_args.end()) {
    argv.push_back("--pool-path");
    argv.push_back(dir_ + "/pool");
  }
  for (auto& a : extra_args) argv.push_back(std::move(a));
  process_.emplace(ChildProcess::Spawn(argv));
}

bool DaemonUnderTest::WaitReady(std::chrono::milliseconds timeout) {
  const int64_t deadline = NowMs() + timeout.count();
  while (NowMs() < deadline) {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, socket_.c_str(), sizeof(addr.sun_path) - 1);
    const int rc = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    close(fd);
    if (rc == 0) return true;
    int status;
    if (waitpid(process_->pid(), &status, WNOHANG) == process_->pid()) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

DaemonUnderTest::~DaemonUnderTest() {
  // A daemon still running is stopped the way an operator would (SIGTERM, falling back to SIGKILL), so that in
  // sanitizer builds its exit-time checks (LeakSanitizer) run and their reports reach the check above.
  if (process_ && process_->pid() > 0) {
    process_->Signal(SIGTERM);
    process_->Signal(SIGCONT);  // a test may have left it stopped
    process_->Wait(std::chrono::seconds(20));
  }
  process_.reset();
  if (own_dir_) {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
}

}  // namespace flexkv::testing
