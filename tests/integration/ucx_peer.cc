// flexkv-ucx-peer: the serving side of the UCX transport tests, run in another network namespace. Registers a
// buffer filled with UcxPattern, prints "ENDPOINT <host:port>" and "DESC <hex of the region descriptor>" on
// stdout, then serves gets (and Calls: method 1 echoes the request) until it is killed.
// With --connect ENDPOINT it is a client instead (no listener, as a stranger without the secret when none is given):
// it connects to ENDPOINT, prints "CONNECT OK" or "CONNECT <status>", and exits.
// Usage: flexkv-ucx-peer [--secret S --node-id N] [--connect ENDPOINT] <listen_address> <devices or -> <transports>
//        <bytes>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "daemon/cluster/ucx/ucx_transport.h"

int main(int argc, char** argv) {
  flexkv::cluster::UcxOptions options;
  std::vector<std::string> args;
  std::string connect;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if ((a == "--secret" || a == "--node-id") && i + 1 < argc) {
      (a == "--secret" ? options.secret : options.node_id) = argv[++i];
    } else if (a == "--connect" && i + 1 < argc) {
      connect = argv[++i];
    } else {
      args.push_back(a);
    }
  }
  if (args.size() != 4) {
    std::fprintf(stderr,
                 "usage: %s [--secret S --node-id N] [--connect ENDPOINT] <listen_address> <devices|-> <transports> "
                 "<bytes>\n",
                 argv[0]);
    return 2;
  }
  options.listen_address = connect.empty() ? args[0] : std::string();
  options.devices = args[1] == "-" ? "" : args[1];
  options.transports = args[2];
  const uint64_t bytes = std::strtoull(args[3].c_str(), nullptr, 10);
  auto transport = flexkv::cluster::UcxTransport::Create(options);
  if (!transport.ok()) {
    std::fprintf(stderr, "%s\n", transport.status().ToString().c_str());
    return 1;
  }
  if (!connect.empty()) {
    auto peer = (*transport)->Connect(connect);
    std::printf("CONNECT %s\n", peer.ok() ? "OK" : peer.status().ToString().c_str());
    return 0;
  }
  (*transport)->set_call_handler([](const std::string&, uint16_t method, std::string request,
                                    std::function<void(flexkv::Result<std::string>)> reply) {
    if (method == 1) {
      reply(std::move(request));
    } else {
      reply(flexkv::Status::Unimplemented("method " + std::to_string(method)));
    }
  });
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
