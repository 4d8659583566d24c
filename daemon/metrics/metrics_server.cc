// The HTTP metrics endpoint; see metrics_server.h.
#include "daemon/metrics/metrics_server.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <civetweb.h>

#include <cerrno>
#include <exception>
#include <prometheus/exposer.h>

#include "common/uds.h"
#include "common/unique_fd.h"

namespace flexkv {
namespace {

// Why civetweb could not listen (it throws one message for every cause): bind the address ourselves.
std::string BindError(const ListenAddress& address) {
  const bool v6 = address.host.find(':') != std::string::npos;
  UniqueFd fd(socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) return ErrnoText(errno);
  const int one = 1;
  setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  int rc;
  if (v6) {
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_port = htons(address.port);
    inet_pton(AF_INET6, address.host.c_str(), &a.sin6_addr);
    rc = bind(fd.get(), reinterpret_cast<const sockaddr*>(&a), sizeof(a));
  } else {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(address.port);
    inet_pton(AF_INET, address.host.c_str(), &a.sin_addr);
    rc = bind(fd.get(), reinterpret_cast<const sockaddr*>(&a), sizeof(a));
  }
  return rc == 0 ? std::string("the HTTP server did not start") : ErrnoText(errno);
}

}  // namespace

MetricsServer::MetricsServer(std::unique_ptr<prometheus::Exposer> exposer, uint16_t port)
    : exposer_(std::move(exposer)), port_(port) {}

MetricsServer::~MetricsServer() = default;

Result<std::unique_ptr<MetricsServer>> MetricsServer::Start(const ListenAddress& address,
                                                            std::weak_ptr<prometheus::Collectable> metrics) {
  constexpr unsigned kCivetwebIpv6 = 8;  // mg_check_feature: built with USE_IPV6 (Debian 12's is not)
  if (address.host.find(':') != std::string::npos && mg_check_feature(kCivetwebIpv6) == 0) {
    return Status::Unavailable(fmt::format(
        "cannot serve metrics on {}: this build's HTTP server (civetweb) has no IPv6; use an IPv4 address such as "
        "127.0.0.1",
        address.ToString()));
  }
  std::unique_ptr<prometheus::Exposer> exposer;
  try {
    // civetweb options. No document_root: nothing but /metrics is served.
    exposer = std::make_unique<prometheus::Exposer>(std::vector<std::string>{
        "listening_ports", address.ToString(),  //
        "num_threads", "2",                     // scrapes served at once
        "connection_queue", "8",                // accepted connections waiting for a thread
        "listen_backlog", "16",                 //
        "enable_keep_alive", "no",              // a scraper cannot hold a thread between scrapes
        "max_request_size", "8192",             // request line and headers
        "request_timeout_ms", "5000"});         // to send the request
    exposer->RegisterCollectable(metrics);
  } catch (const std::exception& e) {
    return Status::Unavailable(
        fmt::format("cannot serve metrics on {}: {} ({})", address.ToString(), BindError(address), e.what()));
  }
  uint16_t port = address.port;
  const std::vector<int> ports = exposer->GetListeningPorts();
  if (!ports.empty()) port = static_cast<uint16_t>(ports.front());
  return std::unique_ptr<MetricsServer>(new MetricsServer(std::move(exposer), port));
}

}  // namespace flexkv
