#include <gtest/gtest.h>

#include "mooncake/te/transfer_engine.h"

namespace mooncake::te {
namespace {

TEST(SegmentName, ParsesHostsAndBracketedIpv6) {
  std::string host;
  uint16_t port = 0;
  ASSERT_TRUE(parseSegmentName("10.1.2.3:15001", host, port));
  EXPECT_EQ(host, "10.1.2.3");
  EXPECT_EQ(port, 15001);
  ASSERT_TRUE(parseSegmentName("node-7.cluster:17000", host, port));
  EXPECT_EQ(host, "node-7.cluster");
  ASSERT_TRUE(parseSegmentName("[fe80::1%eth0]:80", host, port));
  EXPECT_EQ(host, "fe80::1%eth0");
  EXPECT_EQ(port, 80);
}

TEST(SegmentName, RejectsMalformedNames) {
  std::string host;
  uint16_t port = 0;
  for (const char* bad : {"", "host", "host:", ":15000", "host:0", "host:65536", "host:12a", "fe80::1:15000",
                          "[fe80::1]", "[fe80::1]15000", "host:123456"}) {
    EXPECT_FALSE(parseSegmentName(bad, host, port)) << bad;
  }
}

TEST(SegmentName, FormatBracketsIpv6AndRoundTrips) {
  EXPECT_EQ(formatSegmentName("10.0.0.1", 15000), "10.0.0.1:15000");
  EXPECT_EQ(formatSegmentName("::1", 15000), "[::1]:15000");
  std::string host;
  uint16_t port = 0;
  ASSERT_TRUE(parseSegmentName(formatSegmentName("::1", 16001), host, port));
  EXPECT_EQ(host, "::1");
  EXPECT_EQ(port, 16001);
}

}  // namespace
}  // namespace mooncake::te
