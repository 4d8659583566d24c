// See spawn.h.
#include "tests/support/spawn.h"

#include <fcntl.h>
#include <spawn.h>
#include <unistd.h>

#include <cstring>

extern char** environ;

namespace flexkv::testing {

Result<pid_t> SpawnChild(const std::vector<std::string>& argv, const std::vector<ChildFd>& fds,
                         const std::vector<std::string>& extra_env, const std::string& exe) {
  if (argv.empty()) return Status::InvalidArgument("SpawnChild: argv is empty; expected at least the program");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  for (const ChildFd& f : fds) {
    if (!f.path.empty()) {
      posix_spawn_file_actions_addopen(&actions, f.child_fd, f.path.c_str(), f.open_flags, 0644);
    } else {
      posix_spawn_file_actions_adddup2(&actions, f.from, f.child_fd);
    }
  }
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
  for (const auto& e : extra_env) env_strings.push_back(e);
  std::vector<char*> envp;
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  const std::string& path = exe.empty() ? argv[0] : exe;
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, path.c_str(), &actions, nullptr, args.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) return Status::Internal("posix_spawn " + path + ": " + std::strerror(rc));
  return pid;
}

}  // namespace flexkv::testing
