// Two initialized engines in this process, each with a registered buffer:
// enough for every transport, since they talk over real sockets and
// cross-memory attach exactly as separate processes do.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "mooncake/te/transfer_engine.h"
#include "test_pattern.h"

namespace mooncake::te::testing {

// Page-aligned heap memory, released with free().
struct AlignedBuffer {
  explicit AlignedBuffer(size_t n) : size(n), data(static_cast<char*>(std::aligned_alloc(4096, (n + 4095) & ~size_t{4095}))) {}
  ~AlignedBuffer() { std::free(data); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  size_t size;
  char* data;
};

// The transports the parameterized suites run over: "rdma" (over the
// software provider) only where the build has it (MOONCAKE_WITH_RDMA).
inline std::vector<std::string> builtDataTransports() {
  std::vector<std::string> names{"tcp", "shm"};
  if (MOONCAKE_WITH_RDMA) names.push_back("rdma");
  return names;
}

inline EngineConfig fastFailConfig() {
  EngineConfig c;
  c.transfer_timeout = std::chrono::milliseconds(2000);
  c.connect_timeout = std::chrono::milliseconds(1000);
  c.rpc_timeout = std::chrono::milliseconds(2000);
  return c;
}

class EnginePair {
 public:
  EnginePair(const std::string& protocol, size_t bytes, const EngineConfig& config = fastFailConfig())
      : local_buf(bytes), remote_buf(bytes) {
    EXPECT_EQ(local.init("P2PHANDSHAKE", "127.0.0.1", protocol, "", config), kOk);
    EXPECT_EQ(remote.init("P2PHANDSHAKE", "127.0.0.1", protocol, "", config), kOk);
    EXPECT_EQ(local.registerLocalMemory(local_buf.data, bytes), kOk);
    EXPECT_EQ(remote.registerLocalMemory(remote_buf.data, bytes), kOk);
    peer = local.openSegment(remote.segmentName());
    EXPECT_NE(peer, kInvalidSegment);
  }

  TransferRequest request(Opcode op, size_t local_offset, size_t remote_offset, size_t length) const {
    return TransferRequest{op, local_buf.data + local_offset, peer,
                           reinterpret_cast<uint64_t>(remote_buf.data) + remote_offset, length};
  }

  TransferEngine local;
  TransferEngine remote;
  AlignedBuffer local_buf;
  AlignedBuffer remote_buf;
  SegmentHandle peer = kInvalidSegment;
};

}  // namespace mooncake::te::testing
