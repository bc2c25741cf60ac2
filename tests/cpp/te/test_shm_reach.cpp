// When the same-host transport must refuse a peer: another host, or a pid
// that no longer belongs to the process that published the descriptor.
#include <gtest/gtest.h>
#include <unistd.h>

#include "host_identity.h"
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
    ASSERT_EQ(transport_.install(TransportContext{&config_, &regions_, &local_}), kOk);
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

}  // namespace
}  // namespace mooncake::te
