// The RDMA transport's pure pieces, without a device: which GID a port
// uses, and the bytes it publishes and exchanges (decoders refuse
// malformed input, since they read what peers send).
#include <gtest/gtest.h>

#include "transport/rdma/gid_choice.h"
#include "transport/rdma/nic_affinity.h"
#include "transport/rdma/rdma_wire.h"
#include "transport/rdma/verbs.h"

namespace mooncake::te::rdma {
namespace {

Gid ipv4Gid(uint8_t a, uint8_t b, uint8_t c, uint8_t d) {
  Gid g;
  g.raw[10] = 0xff;
  g.raw[11] = 0xff;
  g.raw[12] = a;
  g.raw[13] = b;
  g.raw[14] = c;
  g.raw[15] = d;
  return g;
}

Gid linkLocalGid() {
  Gid g;
  g.raw[0] = 0xfe;
  g.raw[1] = 0x80;
  g.raw[15] = 7;
  return g;
}

TEST(RdmaGid, TextFormRoundTripsAndRejectsAnythingElse) {
  const Gid g = ipv4Gid(10, 0, 0, 2);
  EXPECT_EQ(g.str(), "0000:0000:0000:0000:0000:ffff:0a00:0002");
  Gid back;
  ASSERT_TRUE(Gid::parse(g.str(), back));
  EXPECT_EQ(back, g);
  ASSERT_TRUE(Gid::parse("FE80:0000:0000:0000:0000:0000:0000:0007", back));
  EXPECT_EQ(back, linkLocalGid());
  for (const char* bad : {"", "fe80::7", "0000:0000:0000:0000:0000:ffff:0a00:000g",
                          "0000-0000:0000:0000:0000:ffff:0a00:0002", "0000:0000:0000:0000:0000:ffff:0a00:00020"}) {
    EXPECT_FALSE(Gid::parse(bad, back)) << bad;
  }
  EXPECT_TRUE(Gid{}.empty());
  EXPECT_FALSE(g.empty());
  EXPECT_TRUE(isIpv4Mapped(g));
  EXPECT_FALSE(isIpv4Mapped(linkLocalGid()));
}

PortInfo roceTwoInterfaces() {
  PortInfo port;
  port.device = "mlx5_0";
  port.ethernet = true;
  // A typical RoCE table: link-local v1/v2 first, then per-address entries.
  port.gids = {{0, linkLocalGid(), "eth1", false},  {1, linkLocalGid(), "eth1", true},
               {2, ipv4Gid(192, 168, 1, 5), "eth1", false}, {3, ipv4Gid(192, 168, 1, 5), "eth1", true},
               {4, ipv4Gid(10, 0, 0, 5), "eth2", true},      {5, ipv4Gid(127, 0, 0, 1), "lo", true}};
  return port;
}

TEST(RdmaGid, RoceTakesTheV2Ipv4EntryOfTheEnginesInterface) {
  const PortInfo port = roceTwoInterfaces();
  EXPECT_EQ(chooseGidIndex(port, "eth2"), 4);
  EXPECT_EQ(chooseGidIndex(port, "eth1"), 3);
  // The engine's address is on no interface of this port: a v2 IPv4 entry off loopback.
  EXPECT_EQ(chooseGidIndex(port, "bond0"), 3);
  EXPECT_EQ(chooseGidIndex(port, ""), 3);
  // Only loopback and v1 entries: loopback v2 before v1.
  PortInfo lo = port;
  lo.gids = {{0, linkLocalGid(), "eth1", false}, {2, ipv4Gid(127, 0, 0, 1), "lo", true}};
  EXPECT_EQ(chooseGidIndex(lo, ""), 2);
  // No v2 at all: the first entry.
  PortInfo v1 = port;
  v1.gids = {{0, linkLocalGid(), "eth1", false}, {1, ipv4Gid(192, 168, 1, 5), "eth1", false}};
  EXPECT_EQ(chooseGidIndex(v1, "eth1"), 0);
}

TEST(RdmaGid, ForcedIndexAndInfinibandAndEmptyTables) {
  const PortInfo port = roceTwoInterfaces();
  EXPECT_EQ(chooseGidIndex(port, "eth2", 2), 2);
  EXPECT_EQ(chooseGidIndex(port, "eth2", 9), -1);  // MC_GID_INDEX names no entry
  PortInfo ib;
  ib.ethernet = false;
  ib.lid = 17;
  ib.gids = {{0, linkLocalGid(), "", false}};
  EXPECT_EQ(chooseGidIndex(ib, "ib0"), 0);
  EXPECT_EQ(chooseGidIndex(PortInfo{}, "eth0"), -1);
}

TEST(RdmaGid, InterfaceOfLoopbackAddressIsFound) {
  EXPECT_FALSE(interfaceOfAddress("127.0.0.1").empty());
  EXPECT_EQ(interfaceOfAddress("not-an-address"), "");
  EXPECT_EQ(interfaceOfAddress("192.0.2.213"), "");  // TEST-NET-1: on no interface here
}

TEST(RdmaWire, DevicesAndRkeysRoundTrip) {
  std::vector<DeviceAddress> devices = {{"mlx5_0", true, 0, ipv4Gid(10, 0, 0, 5), 4096},
                                        {"mlx5_1", false, 33, linkLocalGid(), 2048}};
  std::vector<DeviceAddress> back;
  ASSERT_TRUE(decodeDevices(encodeDevices(devices), back));
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(back[1].name, "mlx5_1");
  EXPECT_FALSE(back[1].ethernet);
  EXPECT_EQ(back[1].lid, 33);
  EXPECT_EQ(back[0].gid, devices[0].gid);
  EXPECT_EQ(back[1].mtu, 2048u);
  std::vector<uint32_t> keys = {0x1234, 0xfeedbeef}, keys_back;
  ASSERT_TRUE(decodeRkeys(encodeRkeys(keys), keys_back));
  EXPECT_EQ(keys_back, keys);
}

TEST(RdmaWire, ConnectRequestRoundTripsAndEveryTruncationIsRefused) {
  ConnectRequest q;
  q.requester = "10.0.0.5:15123";
  q.requester_nonce = 0x0123456789abcdefull;
  q.requester_device = 1;
  q.responder_device = 0;
  q.address = QpAddress{0x00abcd, 0x123456, 0, ipv4Gid(10, 0, 0, 5), 4096};
  const std::string bytes = encodeConnectRequest(q);
  ConnectRequest back;
  ASSERT_TRUE(decodeConnectRequest(bytes, back));
  EXPECT_EQ(back.requester, q.requester);
  EXPECT_EQ(back.requester_nonce, q.requester_nonce);
  EXPECT_EQ(back.requester_device, 1u);
  EXPECT_EQ(back.address.qp_num, q.address.qp_num);
  EXPECT_EQ(back.address.psn, q.address.psn);
  EXPECT_EQ(back.address.gid, q.address.gid);
  for (size_t n = 0; n < bytes.size(); ++n) EXPECT_FALSE(decodeConnectRequest(bytes.substr(0, n), back)) << n;
  EXPECT_FALSE(decodeConnectRequest(bytes + "x", back));
  QpAddress a;
  ASSERT_TRUE(decodeQpAddress(encodeQpAddress(q.address), a));
  EXPECT_EQ(a.qp_num, q.address.qp_num);
}

TEST(RdmaWire, OutOfRangeFieldsAreRefused) {
  QpAddress a{1, 1, 0, ipv4Gid(10, 0, 0, 5), 4096}, back;
  for (auto broken : {QpAddress{0, 1, 0, a.gid, 4096}, QpAddress{1u << 24, 1, 0, a.gid, 4096},
                      QpAddress{1, 1u << 24, 0, a.gid, 4096}, QpAddress{1, 1, 0, a.gid, 3000},
                      QpAddress{1, 1, 0, a.gid, 8192}, QpAddress{1, 1, 0, a.gid, 128}}) {
    EXPECT_FALSE(decodeQpAddress(encodeQpAddress(broken), back)) << broken.qp_num << " " << broken.psn << " "
                                                                 << broken.mtu;
  }
  ConnectRequest q;
  q.requester = "x:1";
  q.address = a;
  q.responder_device = kMaxDevices;
  ConnectRequest q_back;
  EXPECT_FALSE(decodeConnectRequest(encodeConnectRequest(q), q_back));
  std::vector<uint32_t> too_many(kMaxDevices + 1, 7), keys;
  EXPECT_FALSE(decodeRkeys(encodeRkeys(too_many), keys));
  std::vector<DeviceAddress> devices;
  EXPECT_FALSE(decodeDevices(std::string("\xff\xff\xff\x7f", 4), devices));  // a count the bytes cannot hold
  EXPECT_FALSE(decodeDevices("", devices));
}

// A two-socket host: two PCIe switches per socket, a NIC and a GPU under
// each switch (the usual 8-GPU layout, halved).
std::vector<Place> fourNics() {
  return {{0, "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0"},
          {0, "/sys/devices/pci0000:00/0000:00:03.0/0000:11:00.0/0000:12:00.0/0000:13:00.0"},
          {1, "/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:00.0/0000:83:00.0"},
          {1, "/sys/devices/pci0000:80/0000:80:03.0/0000:91:00.0/0000:92:00.0/0000:93:00.0"}};
}

TEST(RdmaNics, AGpuGetsTheNicUnderItsSwitchHostMemoryThoseOfItsNode) {
  const std::vector<Place> nics = fourNics();
  // GPU under the second socket's first switch.
  Place gpu{1, "/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:01.0/0000:84:00.0"};
  EXPECT_EQ(nearestNics(nics, gpu), (std::vector<size_t>{2}));
  // Under the first socket's root port only (no switch shared): both of that root complex.
  Place gpu_on_root{0, "/sys/devices/pci0000:00/0000:00:05.0/0000:21:00.0"};
  EXPECT_EQ(nearestNics(nics, gpu_on_root), (std::vector<size_t>{0, 1}));
  // On a root complex no NIC shares: by its NUMA node.
  Place gpu_alone{1, "/sys/devices/pci0000:c0/0000:c0:01.0/0000:c1:00.0"};
  EXPECT_EQ(nearestNics(nics, gpu_alone), (std::vector<size_t>{2, 3}));
  EXPECT_EQ(nearestNics(nics, Place{0, ""}), (std::vector<size_t>{0, 1}));
  EXPECT_EQ(nearestNics(nics, Place{1, ""}), (std::vector<size_t>{2, 3}));
  // Nothing known of the memory, or a node without NICs: every NIC.
  EXPECT_EQ(nearestNics(nics, Place{}), (std::vector<size_t>{0, 1, 2, 3}));
  EXPECT_EQ(nearestNics(nics, Place{3, ""}), (std::vector<size_t>{0, 1, 2, 3}));
  // NICs with no place (the software provider's): every NIC.
  EXPECT_EQ(nearestNics({Place{}, Place{}}, gpu), (std::vector<size_t>{0, 1}));
  EXPECT_TRUE(nearestNics({}, gpu).empty());
}

TEST(RdmaNics, MemoryPlacesFromLocations) {
  EXPECT_EQ(memoryPlace("cpu:1").numa_node, 1);
  EXPECT_EQ(memoryPlace("cpu:0").numa_node, 0);
  EXPECT_EQ(memoryPlace("cpu:x").numa_node, -1);
  EXPECT_EQ(memoryPlace("*").numa_node, -1);
  EXPECT_TRUE(memoryPlace("cpu:0").pci_path.empty());
  EXPECT_TRUE(nicPlace("no-such-nic").pci_path.empty());
}

TEST(RdmaWire, NicListsRoundTripAndRefuseEmptyOrOutOfRange) {
  std::vector<uint32_t> nics = {2, 0}, back;
  ASSERT_TRUE(decodeNics(encodeNics(nics), back));
  EXPECT_EQ(back, nics);
  EXPECT_FALSE(decodeNics(encodeNics({}), back));
  EXPECT_FALSE(decodeNics(encodeNics({static_cast<uint32_t>(kMaxDevices)}), back));
}

}  // namespace
}  // namespace mooncake::te::rdma
