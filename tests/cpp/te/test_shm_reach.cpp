// When the same-host transport must refuse a peer: another host, or a pid
// that no longer belongs to the process that published the descriptor.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>

#include "batch.h"
#include "mooncake/te/host_identity.h"
#include "mooncake/te/shared_memory.h"
#include "transport/shm/shm_transport.h"

namespace mooncake::te {
namespace {

class ShmReach : public ::testing::Test {
 protected:
  void SetUp() override {
    local_.host_id = hostIdentity();
    local_.pid = ::getpid();
    local_.process_start_ticks = processStartTicks(::getpid());
    local_.stamp_addr = reinterpret_cast<uint64_t>(&stamp_);
    ASSERT_EQ(transport_.install(TransportContext{&config_, &regions_, &local_, "", ""}), kOk);
  }

  std::unique_ptr<PeerSegment> peerLike(const SegmentDescriptor& d, SegmentHandle handle) {
    auto p = std::make_unique<PeerSegment>(handle, "127.0.0.1:1", "127.0.0.1", 1);
    p->setDescriptor(d);
    return p;
  }

  EngineConfig config_;
  RegionTable regions_;
  SegmentDescriptor local_;
  SegmentStamp stamp_;
  ShmTransport transport_;
};

TEST_F(ShmReach, ReachesItselfOnThisHost) {
  SegmentDescriptor d = local_;
  d.transports = {"shm"};
  EXPECT_TRUE(transport_.reaches(*peerLike(d, 1)));
}

TEST_F(ShmReach, RefusesAnotherHostOrAPeerNotServingShm) {
  SegmentDescriptor other_host = local_;
  other_host.transports = {"shm"};
  other_host.host_id = "another-boot-id/pid:[1]";
  EXPECT_FALSE(transport_.reaches(*peerLike(other_host, 2)));
  SegmentDescriptor tcp_only = local_;
  tcp_only.transports = {"tcp"};
  EXPECT_FALSE(transport_.reaches(*peerLike(tcp_only, 3)));
}

TEST_F(ShmReach, RefusesAReusedPid) {
  SegmentDescriptor reused = local_;
  reused.transports = {"shm"};
  reused.process_start_ticks += 1;  // same pid number, different process
  EXPECT_FALSE(transport_.reaches(*peerLike(reused, 4)));
}

// A buffer in shared memory is reached through a mapping of the owner's
// memfd; ordinary memory through cross-memory attach. Both deliver the bytes.
TEST_F(ShmReach, SharedMemoryIsCopiedThroughAMappingOtherMemoryByAttaching) {
  constexpr size_t kBytes = 1 << 20;
  char* shared = static_cast<char*>(allocateSharedMemory(kBytes));
  ASSERT_NE(shared, nullptr);
  std::vector<char> ordinary(kBytes, 0), source(kBytes);
  for (size_t i = 0; i < kBytes; ++i) source[i] = static_cast<char>(i * 131 + 7);
  SegmentDescriptor d = local_;
  d.transports = {"shm"};
  BufferDescriptor shared_buf{reinterpret_cast<uint64_t>(shared), kBytes, "cpu:0", {}};
  ASSERT_EQ(transport_.registerMemory(MemoryRegion{shared_buf.addr, kBytes, "cpu:0"}, shared_buf), kOk);
  EXPECT_EQ(shared_buf.attrs.count("shm.fd"), 1u);
  BufferDescriptor ordinary_buf{reinterpret_cast<uint64_t>(ordinary.data()), kBytes, "cpu:0", {}};
  ASSERT_EQ(transport_.registerMemory(MemoryRegion{ordinary_buf.addr, kBytes, "cpu:0"}, ordinary_buf), kOk);
  EXPECT_TRUE(ordinary_buf.attrs.empty());
  d.buffers = {shared_buf, ordinary_buf};
  auto peer = peerLike(d, 5);
  ASSERT_TRUE(transport_.reaches(*peer));

  Batch batch(2);
  std::vector<TransferTask*> tasks;
  ASSERT_EQ(batch.addTasks({TransferRequest{Opcode::kWrite, source.data(), 5, shared_buf.addr + 3, kBytes - 3},
                            TransferRequest{Opcode::kWrite, source.data(), 5, ordinary_buf.addr + 5, kBytes - 5}},
                           tasks),
            kOk);
  transport_.submit(*peer, tasks, true);
  ASSERT_TRUE(batch.settled());
  EXPECT_EQ(batch.aggregate().state, TransferState::kCompleted);
  EXPECT_EQ(transport_.mappedCopies(), 1u);
  EXPECT_EQ(transport_.attachedCopies(), 1u);
  EXPECT_EQ(std::memcmp(shared + 3, source.data(), kBytes - 3), 0);
  EXPECT_EQ(std::memcmp(ordinary.data() + 5, source.data(), kBytes - 5), 0);
  transport_.forget(5);
  EXPECT_EQ(freeSharedMemory(shared), kOk);
  EXPECT_EQ(freeSharedMemory(shared), kInvalidArgument);
}

}  // namespace
}  // namespace mooncake::te
