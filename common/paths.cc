// Default locations; see paths.h.
#include "common/paths.h"

#include <unistd.h>

#include <cstdlib>
#include <string>

namespace flexkv {

std::string DefaultSocketPath() {
  const uid_t uid = geteuid();
  if (uid == 0) return "/run/flexkvd/flexkvd.sock";
  const char* xdg = std::getenv("XDG_RUNTIME_DIR");
  if (xdg != nullptr && *xdg != '\0') return std::string(xdg) + "/flexkvd/flexkvd.sock";
  return "/tmp/flexkvd-" + std::to_string(uid) + "/flexkvd.sock";
}

std::string ResolveSocketPath(const std::string& flag) {
  if (!flag.empty()) return flag;
  const char* env = std::getenv("FLEXKV_SOCKET");
  if (env != nullptr && *env != '\0') return env;
  return DefaultSocketPath();
}

}  // namespace flexkv
