// flexkvd entry point: parse flags, run.
#include "daemon/config/config.h"
#include "daemon/daemon.h"

int main(int argc, char** argv) {
  flexkv::ParsedArgs args = flexkv::ParseDaemonArgs(argc, argv);
  if (!args.config) return args.exit_code;
  return flexkv::RunDaemon(*args.config);
}
