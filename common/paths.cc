// Default locations; see paths.h.
#include "common/paths.h"

#include <unistd.h>

#include <cstdlib>
#include <string>

namespace flexkv {

std::string DefaultSocketPath() {
  const uid_t uid = geteuid();
  if (uid == 0) return kSystemSocketPath;
  const char* xdg = std::getenv("XDG_RUNTIME_DIR");
  if (xdg != nullptr && *xdg != '\0') return std::string(xdg) + "/flexkvd/flexkvd.sock";
  return "/tmp/flexkvd-" + std::to_string(uid) + "/flexkvd.sock";
}

std::string ResolveSocketPath(const std::string& flag) {
  if (!flag.empty()) return flag;
  const char* env = std::getenv("FLEXKV_SOCKET");
  if (env != nullptr && *env != '\0') return env;
  // An unprivileged engine on a node where flexkvd runs as the system service: use the service's socket
  // unless this user runs a daemon of its own.
  std::string own = DefaultSocketPath();
  if (access(own.c_str(), F_OK) != 0 && access(kSystemSocketPath, F_OK) == 0) return kSystemSocketPath;
  return own;
}

}  // namespace flexkv
