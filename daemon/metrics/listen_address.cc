// --metrics-listen parsing; see listen_address.h.
#include "daemon/metrics/listen_address.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>

#include <charconv>
#include <cstring>

namespace flexkv {

std::string ListenAddress::ToString() const {
  return host.find(':') != std::string::npos ? fmt::format("[{}]:{}", host, port) : fmt::format("{}:{}", host, port);
}

Result<ListenAddress> ParseListenAddress(const std::string& flag, std::string_view text) {
  auto bad = [&](const std::string& why) {
    return Status::InvalidArgument(fmt::format(
        "{} '{}' {}; expected HOST:PORT with HOST an IPv4 address, [IPv6 address] or localhost, e.g. 127.0.0.1:9400",
        flag, text, why));
  };
  const size_t colon = text.rfind(':');
  if (colon == std::string_view::npos) return bad("has no port");
  std::string_view host = text.substr(0, colon);
  const std::string_view port_text = text.substr(colon + 1);
  unsigned port = 0;
  const auto [end, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (port_text.empty() || ec != std::errc() || end != port_text.data() + port_text.size() || port > 65535) {
    return bad("has no valid port (0..65535)");
  }
  ListenAddress out;
  out.port = static_cast<uint16_t>(port);
  if (host == "localhost") host = "127.0.0.1";
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    out.host = std::string(host.substr(1, host.size() - 2));
    in6_addr a6{};
    if (inet_pton(AF_INET6, out.host.c_str(), &a6) != 1) return bad("has no valid IPv6 address in brackets");
    out.loopback = std::memcmp(&a6, &in6addr_loopback, sizeof(a6)) == 0;
    return out;
  }
  out.host = std::string(host);
  in_addr a4{};
  if (out.host.empty() || inet_pton(AF_INET, out.host.c_str(), &a4) != 1) {
    return bad("has no valid host (host names other than localhost are not resolved)");
  }
  out.loopback = (ntohl(a4.s_addr) >> 24) == 127;
  return out;
}

}  // namespace flexkv
