// Process plumbing shared by the multi-process benches (`ring` in main.cc, `trace` in trace_bench.cc): child
// processes that report on a stdout pipe, the private flexkvd a bench starts, and latency percentiles.
//
// Not thread-safe: the benches drive their children from one thread. Timestamps are CLOCK_MONOTONIC
// (steady_clock) nanoseconds, comparable across the processes of one machine.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/clock.h"
#include "common/unique_fd.h"

namespace flexkv::bench {

// The path of this executable (/proc/self/exe); empty when it cannot be resolved.
std::string SelfExe();

// Writes `line` to stdout and flushes, so that a parent reading the pipe sees it at once. For a worker's
// protocol lines; `line` carries its own '\n'.
void Emit(std::string_view line);

// A start barrier for child processes: a pipe whose read end each child is given (a Spawn dup, e.g.
// {barrier.read_end(), 0}) and waits on with AwaitBarrier; Release() closes the write end, and every child sees
// EOF at once. Both ends are O_CLOEXEC here (a child holds only its dup2'ed copy of the read end) and are closed
// on destruction, which releases the children too.
class StartBarrier {
 public:
  // Prints why on stderr and returns nullopt when the pipe cannot be made.
  static std::optional<StartBarrier> Create();

  int read_end() const { return read_.get(); }
  void Release() { write_.reset(); }

 private:
  StartBarrier(int read_end, int write_end) : read_(read_end), write_(write_end) {}

  UniqueFd read_, write_;
};

// In a child: blocks until the StartBarrier whose read end is `fd` is released (EOF), or reading fails.
void AwaitBarrier(int fd);

// "<head> <n> <s1> ... <sn>\n": a protocol line carrying a list of integer samples.
std::string SampleLine(std::string_view head, const std::vector<int64_t>& samples);

// Parses `n` whitespace-separated integers from `text` (the tail of a SampleLine after its count). Stops early
// when the text runs out, so the result may be shorter than `n`: callers check the count they expect.
std::vector<int64_t> ParseSamples(const char* text, size_t n);

// A child process started by Spawn, with its stdout on a pipe (`out`) unless Spawn was given a file.
// Move-only; owns `out`. Does not reap `pid` on destruction: the owner calls Wait or Kill.
struct Child {
  pid_t pid = -1;
  UniqueFd out;
  std::string buf;  // read but not yet returned by ReadLine

  // The next line from `out` without its '\n'; nullopt when `timeout` passes first, or on EOF (then `out` is
  // closed; a partial last line without '\n' is dropped).
  std::optional<std::string> ReadLine(std::chrono::milliseconds timeout);

  // Reaps the child (blocking) and closes `out`; returns the waitpid status. Call after reading `out` to EOF:
  // a child blocked writing to a full pipe would never exit.
  int Wait();

  // SIGKILL, reap and close `out`: for abandoning a child on an error path.
  void Kill();
};

// posix_spawn of argv[0] (a path; no PATH search) with argv and this process's environment. Its stdout goes to
// a pipe (Child::out) or, when `stdout_path` is given, to that file (created or truncated), with stderr too.
// Each (from, to) in `dups` is dup2'ed in the child after that, so `from` may be an O_CLOEXEC fd of this
// process. Spawn's own fds are O_CLOEXEC: children do not inherit each other's pipes. Prints why on stderr and
// returns nullopt on failure.
std::optional<Child> Spawn(const std::vector<std::string>& argv, const std::vector<std::pair<int, int>>& dups,
                           const std::string& stdout_path = "");

// The flexkvd a bench starts for itself, in a private directory: flexkvd.sock, pool, flexkvd.log (its stdout
// and stderr). Destruction sends SIGTERM, waits up to 15 s (then SIGKILL) and removes the directory.
//
// From the first Start on, SIGINT, SIGTERM and SIGHUP exit this process with 128 + signal, after sending SIGTERM
// to the live OwnDaemon's flexkvd if there is one, so that an interrupted bench does not leave a daemon running.
// The directory stays behind then (removing it is not async-signal-safe), and so do running workers (they fail
// on their own once the daemon is gone). The handler knows one pid: at most one OwnDaemon may exist at a time
// (Start aborts otherwise).
class OwnDaemon {
 public:
  // Makes a directory from the mkdtemp template `dir_template` (then mode 0755) and starts the flexkvd next to
  // this executable in it:
  //   flexkvd --socket DIR/flexkvd.sock --pool-path DIR/pool --log-level warning <args>
  // `args` must at least give --pool-size. Returns once the process exists, not once the socket accepts: the
  // clients' Connect waits for it. Prints why on stderr and returns nullptr on failure (the directory removed).
  static std::unique_ptr<OwnDaemon> Start(std::string dir_template, const std::vector<std::string>& args);

  OwnDaemon(const OwnDaemon&) = delete;
  OwnDaemon& operator=(const OwnDaemon&) = delete;
  ~OwnDaemon();

  const std::string& socket() const { return socket_; }
  pid_t pid() const { return pid_; }

  // Prints the last 4000 bytes of the daemon's log on stderr: for a failed run, before destruction removes it.
  void DumpLog() const;

 private:
  OwnDaemon() = default;

  std::string dir_, socket_, log_;
  pid_t pid_ = -1;
};

// Latency summary of one sample set, in microseconds; all zero when there are no samples.
struct Percentiles {
  double p50_us = 0, p99_us = 0, p999_us = 0, mean_us = 0;
  size_t n = 0;  // samples
};

// Percentiles of `samples_ns` (nanoseconds): the value at rank floor(q × n) of the sorted samples (nearest
// rank, no interpolation), and the mean.
Percentiles Summarize(std::vector<int64_t> samples_ns);

}  // namespace flexkv::bench
