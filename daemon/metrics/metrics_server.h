// MetricsServer: the Prometheus endpoint. Answers `GET /metrics` over HTTP/1.1 on a TCP address (404 for
// any other path) with what a Collectable collects, on its own threads: prometheus-cpp's Exposer (civetweb).
// Bounded: two serving threads, a short queue of accepted connections, no keep-alive, 8 KiB requests at
// most, 5 s to send one. Scrapes read atomics and take no data-plane lock.
#pragma once

#include <cstdint>
#include <memory>

#include "daemon/metrics/listen_address.h"
#include "flexkv/status.h"

namespace prometheus {
class Collectable;
class Exposer;
}  // namespace prometheus

namespace flexkv {

class MetricsServer {
 public:
  // Listens on `address` and serves `metrics` (weakly held: once it is gone, scrapes get no samples).
  // UNAVAILABLE naming the address and the cause when it cannot listen.
  static Result<std::unique_ptr<MetricsServer>> Start(const ListenAddress& address,
                                                      std::weak_ptr<prometheus::Collectable> metrics);
  // Stops listening and waits for scrapes in progress.
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // The port bound (the kernel's choice when the address said 0).
  uint16_t port() const { return port_; }

 private:
  MetricsServer(std::unique_ptr<prometheus::Exposer> exposer, uint16_t port);
  std::unique_ptr<prometheus::Exposer> exposer_;
  uint16_t port_;
};

}  // namespace flexkv
