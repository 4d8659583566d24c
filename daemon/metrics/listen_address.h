// ListenAddress: the TCP address of the metrics endpoint, as --metrics-listen gives it (HOST:PORT).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "flexkv/status.h"

namespace flexkv {

struct ListenAddress {
  std::string host;       // numeric: "127.0.0.1", "::1" (no brackets)
  uint16_t port = 0;      // 0: the kernel picks one (the daemon logs it)
  bool loopback = false;  // 127.0.0.0/8 or ::1

  // "127.0.0.1:9400" or "[::1]:9400": the form the flag takes and the HTTP server binds.
  std::string ToString() const;
};

// Parses "HOST:PORT". HOST is an IPv4 address, an IPv6 address in brackets, or `localhost` (127.0.0.1);
// names are not resolved. PORT is 0..65535. INVALID_ARGUMENT naming `flag`, the value and the expected form.
Result<ListenAddress> ParseListenAddress(const std::string& flag, std::string_view text);

}  // namespace flexkv
