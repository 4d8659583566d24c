// flexkv-ucx-peer: the serving side of the UCX transport tests, run in another network namespace. Registers a
// buffer filled with UcxPattern, prints "ENDPOINT <host:port>" and "DESC <hex of the region descriptor>" on
// stdout, then serves gets until it is killed.
// Usage: flexkv-ucx-peer <listen_address> <devices or -> <transports> <bytes>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "daemon/cluster/ucx/ucx_transport.h"

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s <listen_address> <devices|-> <transports> <bytes>\n", argv[0]);
    return 2;
  }
  flexkv::cluster::UcxOptions options;
  options.listen_address = argv[1];
  options.devices = std::string(argv[2]) == "-" ? "" : argv[2];
  options.transports = argv[3];
  const uint64_t bytes = std::strtoull(argv[4], nullptr, 10);
  auto transport = flexkv::cluster::UcxTransport::Create(options);
  if (!transport.ok()) {
    std::fprintf(stderr, "%s\n", transport.status().ToString().c_str());
    return 1;
  }
  std::vector<uint8_t> buffer(bytes);
  for (uint64_t j = 0; j < bytes; ++j) buffer[j] = static_cast<uint8_t>((j * 2654435761u) >> 11);
  auto region = (*transport)->Register(buffer.data(), bytes);
  if (!region.ok()) {
    std::fprintf(stderr, "%s\n", region.status().ToString().c_str());
    return 1;
  }
  std::string hex;
  static const char* const kDigits = "0123456789abcdef";
  for (unsigned char c : region->descriptor()) {
    hex.push_back(kDigits[c >> 4]);
    hex.push_back(kDigits[c & 15]);
  }
  std::printf("ENDPOINT %s\nDESC %s\n", (*transport)->endpoint().c_str(), hex.c_str());
  std::fflush(stdout);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigprocmask(SIG_BLOCK, &set, nullptr);
  int sig = 0;
  sigwait(&set, &sig);
  return 0;
}
