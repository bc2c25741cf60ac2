#include "net/ip_literal.h"

#include <arpa/inet.h>
#include <net/if.h>
#include <netinet/in.h>

#include <algorithm>
#include <cctype>

#include "mooncake/te/status.h"

namespace mooncake::te::net {
namespace {

bool parses(int family, const std::string& text, void* address) {
  return ::inet_pton(family, text.c_str(), address) == 1;
}

// "fe80::1%eth0" -> "fe80::1" and "eth0"; no '%': the whole text, no zone.
void splitZone(const std::string& text, std::string& address, std::string& zone, bool& has_zone) {
  const size_t percent = text.find('%');
  has_zone = percent != std::string::npos;
  address = has_zone ? text.substr(0, percent) : text;
  zone = has_zone ? text.substr(percent + 1) : std::string();
}

// The interface index a zone names: its name (if_nametoindex) or, all
// digits, the index itself, when such an interface exists. 0: none.
uint32_t interfaceOf(const std::string& zone) {
  const bool digits = !zone.empty() && zone.size() <= 10 &&
                      std::all_of(zone.begin(), zone.end(), [](unsigned char c) { return std::isdigit(c); });
  if (digits) {
    const unsigned long index = std::stoul(zone);
    char name[IF_NAMESIZE];
    return index <= UINT32_MAX && ::if_indextoname(static_cast<unsigned>(index), name) != nullptr
               ? static_cast<uint32_t>(index)
               : 0;
  }
  return ::if_nametoindex(zone.c_str());
}

}  // namespace

bool isIpv6Literal(const std::string& text) {
  std::string address, zone;
  bool has_zone = false;
  splitZone(text, address, zone, has_zone);
  in6_addr parsed{};
  return parses(AF_INET6, address, &parsed);
}

bool isIpLiteral(const std::string& text) {
  in_addr parsed{};
  return parses(AF_INET, text, &parsed) || isIpv6Literal(text);
}

int parseIpLiteral(const std::string& text, uint16_t port, sockaddr_storage& out, socklen_t& length, std::string& why) {
  out = sockaddr_storage{};
  std::string address, zone;
  bool has_zone = false;
  splitZone(text, address, zone, has_zone);
  auto* v4 = reinterpret_cast<sockaddr_in*>(&out);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&out);
  if (parses(AF_INET, address, &v4->sin_addr)) {
    if (has_zone) {
      why = "a zone ('%' and an interface) belongs to IPv6 addresses only";
      return kInvalidArgument;
    }
    v4->sin_family = AF_INET;
    v4->sin_port = htons(port);
    length = sizeof(sockaddr_in);
    return kOk;
  }
  if (!parses(AF_INET6, address, &v6->sin6_addr)) {
    why = "not an IP address";
    return kInvalidArgument;
  }
  if (has_zone) {
    v6->sin6_scope_id = interfaceOf(zone);
    if (v6->sin6_scope_id == 0) {
      why = "the zone after '%' must name an interface of this host, by name (e.g. eth0) or by index";
      return kInvalidArgument;
    }
  }
  v6->sin6_family = AF_INET6;
  v6->sin6_port = htons(port);
  length = sizeof(sockaddr_in6);
  return kOk;
}

}  // namespace mooncake::te::net
