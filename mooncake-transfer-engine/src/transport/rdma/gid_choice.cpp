#include "transport/rdma/gid_choice.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <algorithm>
#include <cstring>

namespace mooncake::te::rdma {

bool isIpv4Mapped(const Gid& gid) {
  static const uint8_t kPrefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return std::memcmp(gid.raw.data(), kPrefix, sizeof(kPrefix)) == 0;
}

int chooseGidIndex(const PortInfo& port, const std::string& interface, int forced) {
  const auto& gids = port.gids;
  if (gids.empty()) return -1;
  if (forced >= 0) {
    auto it = std::find_if(gids.begin(), gids.end(), [&](const GidEntry& e) { return e.index == forced; });
    return it == gids.end() ? -1 : forced;
  }
  if (!port.ethernet) return gids.front().index;
  auto first = [&](auto&& wanted) {
    auto it = std::find_if(gids.begin(), gids.end(), wanted);
    return it == gids.end() ? -1 : it->index;
  };
  auto v2_ipv4 = [](const GidEntry& e) { return e.rocev2 && isIpv4Mapped(e.gid); };
  int index = -1;
  if (!interface.empty()) index = first([&](const GidEntry& e) { return v2_ipv4(e) && e.interface == interface; });
  if (index < 0) index = first([&](const GidEntry& e) { return v2_ipv4(e) && e.interface != "lo" && e.gid.raw[12] != 127; });
  if (index < 0) index = first(v2_ipv4);
  if (index < 0) index = first([](const GidEntry& e) { return e.rocev2; });
  return index >= 0 ? index : gids.front().index;
}

std::string interfaceOfAddress(const std::string& host) {
  in_addr wanted{};
  if (::inet_pton(AF_INET, host.c_str(), &wanted) != 1) return "";
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::string name;
  for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    if (reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr.s_addr == wanted.s_addr) {
      name = a->ifa_name;
      break;
    }
  }
  ::freeifaddrs(list);
  return name;
}

}  // namespace mooncake::te::rdma
