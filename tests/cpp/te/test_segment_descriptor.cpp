#include <gtest/gtest.h>

#include <random>

#include "mooncake/te/segment_descriptor.h"
#include "mooncake/te/status.h"

namespace mooncake::te {
namespace {

SegmentDescriptor sample() {
  SegmentDescriptor d;
  d.name = "[fe80::1]:15001";
  d.host_id = "boot/pid:[4026531836]";
  d.pid = 4242;
  d.process_start_ticks = 987654321;
  d.stamp_addr = 0x7fff00001000;
  d.engine_nonce = 0x1234567890abcdefull;
  d.registration_version = 17;
  d.transports = {"shm", "tcp"};
  d.attrs = {{"tcp.proto", "1"}};
  d.buffers.push_back(BufferDescriptor{0x5000, 0x1000, "cpu:0", {}});
  d.buffers.push_back(BufferDescriptor{0x1000, 0x800, "cpu:1", {{"rdma.rkey", "1,2"}}});
  return d;
}

TEST(SegmentDescriptor, RoundTripsEveryField) {
  SegmentDescriptor in = sample();
  SegmentDescriptor out;
  ASSERT_EQ(SegmentDescriptor::decode(in.encode(), out), kOk);
  EXPECT_EQ(out.name, in.name);
  EXPECT_EQ(out.host_id, in.host_id);
  EXPECT_EQ(out.pid, in.pid);
  EXPECT_EQ(out.process_start_ticks, in.process_start_ticks);
  EXPECT_EQ(out.stamp_addr, in.stamp_addr);
  EXPECT_EQ(out.engine_nonce, in.engine_nonce);
  EXPECT_EQ(out.registration_version, in.registration_version);
  EXPECT_EQ(out.transports, in.transports);
  EXPECT_EQ(out.attrs, in.attrs);
  ASSERT_EQ(out.buffers.size(), 2u);
  EXPECT_EQ(out.buffers[1].addr, 0x1000u);  // registration order is kept
  EXPECT_EQ(out.buffers[1].attrs.at("rdma.rkey"), "1,2");
  EXPECT_EQ(out.buffers[0].location, "cpu:0");
}

TEST(SegmentDescriptor, EveryTruncationIsRejected) {
  std::string bytes = sample().encode();
  for (size_t n = 0; n < bytes.size(); ++n) {
    SegmentDescriptor out;
    EXPECT_EQ(SegmentDescriptor::decode(bytes.substr(0, n), out), kMalformedMessage) << "prefix " << n;
  }
  SegmentDescriptor out;
  EXPECT_EQ(SegmentDescriptor::decode(bytes + "x", out), kMalformedMessage);  // trailing garbage
}

TEST(SegmentDescriptor, HostileCountsAndRandomBytesAreRejectedWithoutCrashing) {
  std::string bytes = sample().encode();
  std::mt19937 rng(7);
  for (int i = 0; i < 2000; ++i) {
    std::string corrupt = bytes;
    corrupt[rng() % corrupt.size()] = static_cast<char>(rng());
    SegmentDescriptor out;
    SegmentDescriptor::decode(corrupt, out);  // any result but a crash or a huge allocation
  }
  std::string huge_count = bytes.substr(0, 4);
  huge_count += std::string("\xff\xff\xff\x7f", 4);
  SegmentDescriptor out;
  EXPECT_EQ(SegmentDescriptor::decode(huge_count, out), kMalformedMessage);
}

TEST(SegmentDescriptor, IndexedLookupAgreesWithLinearScan) {
  SegmentDescriptor d;
  std::mt19937_64 rng(3);
  uint64_t addr = 4096;
  for (int i = 0; i < 300; ++i) {
    uint64_t len = 1 + rng() % 5000;
    d.buffers.push_back(BufferDescriptor{addr, len, "cpu:0", {}});
    addr += len + rng() % 3 * 100;  // adjacent or with gaps
  }
  std::shuffle(d.buffers.begin(), d.buffers.end(), rng);
  SegmentDescriptor indexed = d;
  indexed.index();
  for (int i = 0; i < 20000; ++i) {
    uint64_t a = rng() % (addr + 1000);
    uint64_t len = 1 + rng() % 3000;
    const BufferDescriptor* linear = d.findBuffer(a, len);
    const BufferDescriptor* fast = indexed.findBuffer(a, len);
    ASSERT_EQ(linear == nullptr, fast == nullptr) << a << "+" << len;
    if (linear) EXPECT_EQ(linear->addr, fast->addr);
  }
}

}  // namespace
}  // namespace mooncake::te
