#include "net/listen_address.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <cctype>

namespace mooncake::te::net {
namespace {

bool isLiteral(const std::string& host, int family) {
  unsigned char buffer[sizeof(in6_addr)];
  return ::inet_pton(family, host.c_str(), buffer) == 1;
}

}  // namespace

ListenChoice listenAddressFor(const std::string& host, bool listen_all) {
  const bool v6 = isLiteral(host, AF_INET6);
  const std::string wildcard = v6 ? "::" : "0.0.0.0";
  if (listen_all) return {wildcard, true, "MC_LISTEN_ALL is set"};
  if (host == "0.0.0.0" || host == "::") return {host, true, "the host is the wildcard address"};
  if (v6 || isLiteral(host, AF_INET)) return {host, false, "the host's address"};
  std::string lower = host;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  if (lower == "localhost") return {"127.0.0.1", false, "localhost"};
  return {wildcard, true,
          "'" + host + "' is a name, not an address (its resolution here may differ from the peers'); pass the "
          "address peers reach this process at to listen on that interface alone"};
}

}  // namespace mooncake::te::net
