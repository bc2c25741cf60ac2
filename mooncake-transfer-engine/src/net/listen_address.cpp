#include "net/listen_address.h"

#include <algorithm>
#include <cctype>

#include "net/ip_literal.h"

namespace mooncake::te::net {

ListenChoice listenAddressFor(const std::string& host, bool listen_all) {
  const bool v6 = isIpv6Literal(host);
  const std::string wildcard = v6 ? "::" : "0.0.0.0";
  if (listen_all) return {wildcard, true, "MC_LISTEN_ALL is set"};
  if (host == "0.0.0.0" || host == "::") return {host, true, "the host is the wildcard address"};
  // A zone ("fe80::1%eth0") stays: Listener::open binds that interface's address.
  if (isIpLiteral(host)) return {host, false, "the host's address"};
  std::string lower = host;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  if (lower == "localhost") return {"127.0.0.1", false, "localhost"};
  return {wildcard, true,
          "'" + host + "' is a name, not an address (its resolution here may differ from the peers'); pass the "
          "address peers reach this process at to listen on that interface alone"};
}

}  // namespace mooncake::te::net
