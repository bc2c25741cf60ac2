#include <gtest/gtest.h>

#include <random>

#include "mooncake/te/segment_descriptor.h"
#include "mooncake/te/status.h"
#include "transport/cuda_ipc/ipc_buffer.h"

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
    if (linear) {
      EXPECT_EQ(linear->addr, fast->addr);
    }
  }
}

// Attribute values are length-prefixed bytes: NULs and high bytes survive.
TEST(SegmentDescriptor, BinaryAttributeValuesRoundTrip) {
  SegmentDescriptor in = sample();
  std::string binary("\0\x01\xff\x80\0tail", 9);
  in.buffers[0].attrs["x.blob"] = binary;
  in.attrs["x.empty"] = "";
  SegmentDescriptor out;
  ASSERT_EQ(SegmentDescriptor::decode(in.encode(), out), kOk);
  EXPECT_EQ(out.buffers[0].attrs.at("x.blob"), binary);
  EXPECT_EQ(out.attrs.at("x.empty"), "");
}

CudaIpcBuffer sampleIpc() {
  CudaIpcBuffer ipc;
  for (size_t i = 0; i < CudaIpcBuffer::kHandleBytes; ++i) ipc.handle.push_back(static_cast<char>(i * 37));
  ipc.handle[3] = '\0';
  ipc.handle[4] = '\xff';
  for (size_t i = 0; i < CudaIpcBuffer::kUuidBytes; ++i) ipc.device_uuid.push_back(static_cast<char>(255 - i));
  ipc.allocation_base = 0x7f0000000000;
  ipc.allocation_size = 64u << 20;
  ipc.device = 3;
  return ipc;
}

// A GPU buffer registered 4099 bytes into its allocation, as a sub-allocation
// of a caching allocator is: the peer reads back the handle, the allocation
// and the device, through the whole descriptor codec.
TEST(SegmentDescriptor, CudaIpcAttributesRoundTripThroughTheCodec) {
  CudaIpcBuffer ipc = sampleIpc();
  SegmentDescriptor in = sample();
  BufferDescriptor gpu{ipc.allocation_base + 4099, 1u << 20, "cuda:3", {}};
  ipc.store(gpu);
  in.buffers.push_back(gpu);
  SegmentDescriptor out;
  ASSERT_EQ(SegmentDescriptor::decode(in.encode(), out), kOk);
  const BufferDescriptor* found = out.findBuffer(ipc.allocation_base + 4099 + 17, 100);
  ASSERT_NE(found, nullptr);
  CudaIpcBuffer loaded;
  ASSERT_TRUE(CudaIpcBuffer::load(*found, loaded));
  EXPECT_EQ(loaded.handle, ipc.handle);
  EXPECT_EQ(loaded.device_uuid, ipc.device_uuid);
  EXPECT_EQ(loaded.allocation_base, ipc.allocation_base);
  EXPECT_EQ(loaded.allocation_size, ipc.allocation_size);
  EXPECT_EQ(loaded.device, 3);
  EXPECT_EQ(found->addr - loaded.allocation_base, 4099u);
  // Host buffers carry no CUDA IPC attributes.
  CudaIpcBuffer none;
  EXPECT_FALSE(CudaIpcBuffer::load(out.buffers[0], none));
}

TEST(SegmentDescriptor, MalformedCudaIpcAttributesAreRejected) {
  const CudaIpcBuffer ipc = sampleIpc();
  auto stored = [&](uint64_t addr, uint64_t length) {
    BufferDescriptor b{addr, length, "cuda:3", {}};
    ipc.store(b);
    return b;
  };
  CudaIpcBuffer out;
  ASSERT_TRUE(CudaIpcBuffer::load(stored(ipc.allocation_base, ipc.allocation_size), out));
  // The buffer must lie inside the allocation the handle names.
  EXPECT_FALSE(CudaIpcBuffer::load(stored(ipc.allocation_base - 1, 16), out));
  EXPECT_FALSE(CudaIpcBuffer::load(stored(ipc.allocation_base + ipc.allocation_size - 8, 16), out));
  EXPECT_FALSE(CudaIpcBuffer::load(stored(ipc.allocation_base, ipc.allocation_size + 1), out));
  // Every field damaged in turn.
  const BufferDescriptor good = stored(ipc.allocation_base + 64, 64);
  const std::vector<std::pair<std::string, std::string>> damage = {
      {"cuda_ipc.handle", "abcd"},                       // short
      {"cuda_ipc.handle", std::string(128, 'g')},        // not hex
      {"cuda_ipc.device_uuid", std::string(30, '0')},    // short
      {"cuda_ipc.allocation_base", "12x"},
      {"cuda_ipc.allocation_size", ""},
      {"cuda_ipc.allocation_size", "18446744073709551615"},  // base + size overflows
      {"cuda_ipc.device", "4096"},
  };
  for (const auto& [key, value] : damage) {
    BufferDescriptor b = good;
    b.attrs[key] = value;
    EXPECT_FALSE(CudaIpcBuffer::load(b, out)) << key << "=" << value;
  }
  for (const char* key : {"cuda_ipc.handle", "cuda_ipc.device_uuid", "cuda_ipc.allocation_base",
                          "cuda_ipc.allocation_size", "cuda_ipc.device"}) {
    BufferDescriptor b = good;
    b.attrs.erase(key);
    EXPECT_FALSE(CudaIpcBuffer::load(b, out)) << "without " << key;
  }
}

}  // namespace
}  // namespace mooncake::te
