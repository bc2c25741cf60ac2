// IP literals with and without an IPv6 zone (net/ip_literal.h), where the
// listener binds for them (net/listen_address.h), and a listener on a
// link-local address with its zone, reached by connectTo. The last one needs
// a link-local address on some interface of this host (/proc/net/if_inet6;
// loopback has none) and skips, saying so, where there is none.
#include <gtest/gtest.h>
#include <net/if.h>
#include <netinet/in.h>

#include <fstream>
#include <future>
#include <sstream>
#include <string>

#include "mooncake/te/status.h"
#include "net/ip_literal.h"
#include "net/listen_address.h"
#include "net/socket.h"

namespace mooncake::te::net {
namespace {

TEST(IpLiteral, PlainAddressesOfBothFamilies) {
  sockaddr_storage address{};
  socklen_t length = 0;
  std::string why;
  ASSERT_EQ(parseIpLiteral("10.1.2.3", 80, address, length, why), kOk) << why;
  EXPECT_EQ(address.ss_family, AF_INET);
  EXPECT_EQ(length, sizeof(sockaddr_in));
  EXPECT_EQ(ntohs(reinterpret_cast<sockaddr_in*>(&address)->sin_port), 80);
  ASSERT_EQ(parseIpLiteral("::1", 81, address, length, why), kOk) << why;
  EXPECT_EQ(address.ss_family, AF_INET6);
  EXPECT_EQ(length, sizeof(sockaddr_in6));
  EXPECT_EQ(reinterpret_cast<sockaddr_in6*>(&address)->sin6_scope_id, 0u);
  EXPECT_TRUE(isIpLiteral("10.1.2.3"));
  EXPECT_TRUE(isIpv6Literal("::1"));
  EXPECT_FALSE(isIpv6Literal("10.1.2.3"));
  EXPECT_FALSE(isIpLiteral("node-7.cluster"));
}

TEST(IpLiteral, AZoneNamesTheInterfaceByNameOrIndex) {
  const unsigned loopback = ::if_nametoindex("lo");
  if (loopback == 0) GTEST_SKIP() << "no interface named lo";
  sockaddr_storage address{};
  socklen_t length = 0;
  std::string why;
  const auto* v6 = reinterpret_cast<sockaddr_in6*>(&address);
  ASSERT_EQ(parseIpLiteral("fe80::1%lo", 80, address, length, why), kOk) << why;
  EXPECT_EQ(v6->sin6_scope_id, loopback);
  ASSERT_EQ(parseIpLiteral("fe80::1%" + std::to_string(loopback), 80, address, length, why), kOk) << why;
  EXPECT_EQ(v6->sin6_scope_id, loopback);
  EXPECT_TRUE(isIpv6Literal("fe80::1%lo"));
  EXPECT_TRUE(isIpLiteral("fe80::1%lo"));
}

TEST(IpLiteral, BadZonesAndNonLiteralsSayWhichRuleTheyBreak) {
  sockaddr_storage address{};
  socklen_t length = 0;
  std::string why;
  EXPECT_EQ(parseIpLiteral("node-7.cluster", 80, address, length, why), kInvalidArgument);
  EXPECT_EQ(why, "not an IP address");
  EXPECT_EQ(parseIpLiteral("10.1.2.3%lo", 80, address, length, why), kInvalidArgument);
  EXPECT_NE(why.find("IPv6 addresses only"), std::string::npos) << why;
  for (const char* bad : {"fe80::1%", "fe80::1%no-such-if9", "fe80::1%4294967295", "fe80::1%99999999999"}) {
    EXPECT_EQ(parseIpLiteral(bad, 80, address, length, why), kInvalidArgument) << bad;
    EXPECT_NE(why.find("must name an interface of this host"), std::string::npos) << bad << ": " << why;
  }
}

TEST(ListenAddress, AZonedIpv6AddressIsBoundAsGiven) {
  const ListenChoice zoned = listenAddressFor("fe80::1%eth0", false);
  EXPECT_EQ(zoned.address, "fe80::1%eth0");
  EXPECT_FALSE(zoned.every_interface);
  EXPECT_EQ(listenAddressFor("fe80::1%eth0", true).address, "::");  // MC_LISTEN_ALL: the IPv6 wildcard
}

// A link-local address of this host with its zone ("fe80::...%eth0"), from
// /proc/net/if_inet6 (address, index, prefix, scope, flags, name); "" if none.
std::string linkLocalAddressWithZone() {
  std::ifstream table("/proc/net/if_inet6");
  std::string hex, index, prefix, scope, flags, name;
  while (table >> hex >> index >> prefix >> scope >> flags >> name) {
    const unsigned flag_bits = std::stoul(flags, nullptr, 16);
    const bool usable = (flag_bits & 0x40) == 0 && (flag_bits & 0x08) == 0;  // not tentative, not failed DAD
    if (scope != "20" || !usable || hex.size() != 32) continue;              // 0x20: link scope
    std::ostringstream text;
    for (size_t i = 0; i < 32; i += 4) text << (i ? ":" : "") << hex.substr(i, 4);
    return text.str() + "%" + name;
  }
  return "";
}

TEST(IpLiteral, AListenerOnALinkLocalAddressIsReachedThroughItsZone) {
  const std::string host = linkLocalAddressWithZone();
  if (host.empty()) GTEST_SKIP() << "no link-local IPv6 address on this host (/proc/net/if_inet6)";
  Listener listener;
  ASSERT_EQ(listener.open(0, 0, host), kOk) << host;
  auto accepted = std::async(std::launch::async, [&] {
    Socket connection;
    return listener.accept(connection);
  });
  Socket client;
  const int connected = connectTo(host, listener.port(), after(std::chrono::seconds(5)), client);
  EXPECT_EQ(connected, kOk) << host;
  if (connected != kOk) listener.stop();  // the accept returns
  EXPECT_EQ(accepted.get(), connected == kOk ? kOk : kSocketFailed);
}

}  // namespace
}  // namespace mooncake::te::net
