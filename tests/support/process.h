// Test support: child processes (the daemon, test clients, flexkvctl) with captured output, and a
// running flexkvd in a private temporary directory.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace flexkv::testing {

// Whether this test binary (and so the daemon it starts, built alike) carries a sanitizer (ASan, TSan): such a build
// runs several times slower, so a test's time bound (a restart served within 2 s) is scaled by kSlowdown, never
// loosened for the plain build; and ASan keeps freed memory in a quarantine, so memory given back is checked only
// without it.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kUnderSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr bool kUnderSanitizer = true;
#else
inline constexpr bool kUnderSanitizer = false;
#endif
#else
inline constexpr bool kUnderSanitizer = false;
#endif
inline constexpr int kSlowdown = kUnderSanitizer ? 5 : 1;

// A spawned process. stdout is a pipe the test reads lines from; stderr goes to a file.
class ChildProcess {
 public:
  // `argv[0]` is a path. Environment is inherited plus `env` ("K=V").
  static ChildProcess Spawn(const std::vector<std::string>& argv, const std::vector<std::string>& env = {});
  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&&) = delete;
  ~ChildProcess();  // SIGKILLs and reaps a child still running; exits the test on a sanitizer report in its stderr

  pid_t pid() const { return pid_; }
  // Next line of stdout (without newline), or nullopt on EOF/timeout.
  std::optional<std::string> ReadLine(std::chrono::milliseconds timeout);
  // Every line up to EOF, or up to a wait of `timeout` for the next one.
  std::vector<std::string> ReadLines(std::chrono::milliseconds timeout);
  // Waits for a line starting with `prefix`; returns it.
  std::optional<std::string> WaitForLine(const std::string& prefix, std::chrono::milliseconds timeout);
  void Signal(int sig);
  // Exit status as from waitpid (use WIFEXITED etc.), or nullopt on timeout.
  std::optional<int> Wait(std::chrono::milliseconds timeout);
  std::string Stderr() const;

 private:
  ChildProcess() = default;
  pid_t pid_ = -1;
  int stdout_fd_ = -1;
  std::string buffer_;
  std::string stderr_path_;
};

// Runs a command to completion; returns {exit code, stdout+stderr}.
struct CommandResult {
  int exit_code;
  std::string output;
};
CommandResult RunCommand(const std::vector<std::string>& argv, std::chrono::milliseconds timeout = std::chrono::seconds(20));

// A flexkvd on a socket in a fresh temporary directory (mode 0755, so other uids can reach the socket);
// its pool is there too unless `extra_args` names a --pool-path.
class DaemonUnderTest {
 public:
  // `launcher`: a command the daemon runs under, e.g. {"/usr/sbin/ip", "netns", "exec", "ns1"} (it must exec
  // flexkvd in its own process, so that signals reach the daemon).
  explicit DaemonUnderTest(std::vector<std::string> extra_args = {}, std::string dir = "",
                           std::vector<std::string> launcher = {});
  ~DaemonUnderTest();
  const std::string& socket() const { return socket_; }
  const std::string& dir() const { return dir_; }
  ChildProcess& process() { return *process_; }
  // Waits until the socket accepts connections. False on timeout or early exit.
  bool WaitReady(std::chrono::milliseconds timeout = std::chrono::seconds(10));

 private:
  std::string dir_;
  std::string socket_;
  bool own_dir_ = false;
  std::optional<ChildProcess> process_;
};

int64_t NowMs();
std::string FlexkvdPath();
std::string FlexkvctlPath();
std::string TestClientPath();
// flexkv-test-client on `socket` as `name`, `args` (e.g. {"--kv-blocks", "64", "--layers", "2"}), then one
// "--do STEP" per step.
ChildProcess SpawnTestClient(const std::string& socket, const std::string& name, const std::vector<std::string>& args,
                             const std::vector<std::string>& steps);

}  // namespace flexkv::testing
