// Test support: the one posix_spawn wrapper of the test programs and flexkv-bench (ChildProcess, the bench's
// workers and daemon, the GPU test client's TP ranks). The caller keeps the pipes and reaps the child.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "flexkv/status.h"

namespace flexkv::testing {

// How one of the child's fds is set up, in order: a dup2 of `from` (an fd of this process), or, with `path`
// set, an open() of that file with `open_flags` (mode 0644 when it creates).
struct ChildFd {
  int child_fd = -1;
  int from = -1;
  std::string path;
  int open_flags = 0;
};

// Starts `argv` (argv[0] is the path run, unless `exe` names another) with `fds` set up, and this process's
// environment plus `extra_env` ("K=V", later ones win). Fds not named stay as they are: open them O_CLOEXEC.
// INTERNAL with the errno text of posix_spawn on failure. Thread-safe.
Result<pid_t> SpawnChild(const std::vector<std::string>& argv, const std::vector<ChildFd>& fds,
                         const std::vector<std::string>& extra_env = {}, const std::string& exe = "");

}  // namespace flexkv::testing
