// How the engine picks a transport per request from the memory on both ends,
// and how it labels memory: the parts that need no GPU to check.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "engine_fixture.h"
#include "mooncake/te/host_identity.h"
#include "mooncake/te/memory_region.h"
#include "transport/shm/shm_transport.h"

namespace mooncake::te {
namespace {

TEST(TransportChoice, LocationsNameCudaDevices) {
  EXPECT_EQ(cudaDeviceOfLocation("cuda:0"), 0);
  EXPECT_EQ(cudaDeviceOfLocation("cuda:13"), 13);
  for (const char* host : {"cpu:0", "*", "", "cuda:", "cuda:x", "cuda:1x", "cuda:-1", "gpu:0", "CUDA:0"}) {
    EXPECT_EQ(cudaDeviceOfLocation(host), -1) << host;
  }
}

// The list a build reports and the transports an engine installs come from
// one table, in the order the automatic choice tries them. rdma is in every
// build with MOONCAKE_WITH_RDMA; an engine lists it only where it opened a
// device (the software provider's, here).
TEST(TransportChoice, BuiltTransportsAreExactlyWhatAnEngineInstalls) {
  std::vector<std::string> built = builtTransports();
  std::vector<std::string> expected{"shm", "tcp"};
  if (MOONCAKE_WITH_RDMA) expected.insert(expected.begin() + 1, "rdma");
  if (MOONCAKE_WITH_CUDA) expected.insert(expected.begin(), "cuda_ipc");
  EXPECT_EQ(built, expected);
  std::vector<std::string> without_rdma = built;
  if (auto rdma = std::find(without_rdma.begin(), without_rdma.end(), "rdma"); rdma != without_rdma.end()) {
    without_rdma.erase(rdma);
  }
  ::setenv("MC_RDMA_PROVIDER", "none-such", 1);  // no provider: no device
  TransferEngine engine;
  ASSERT_EQ(engine.init("P2PHANDSHAKE", "127.0.0.1"), kOk);
  EXPECT_EQ(engine.transports(), without_rdma);
  ::setenv("MC_RDMA_PROVIDER", "software", 1);
  TransferEngine with_device;
  ASSERT_EQ(with_device.init("P2PHANDSHAKE", "127.0.0.1"), kOk);
  EXPECT_EQ(with_device.transports(), built);
  ::unsetenv("MC_RDMA_PROVIDER");
}

// initialize()'s device list names the RDMA devices an engine may open:
// one of them, or none of those the provider has.
TEST(TransportChoice, TheDeviceListRestrictsRdmaDevices) {
  if (!MOONCAKE_WITH_RDMA) GTEST_SKIP() << "built without the rdma transport (MOONCAKE_WITH_RDMA)";
  ::setenv("MC_RDMA_PROVIDER", "software", 1);
  ::setenv("MC_SOFTVERBS_DEVICES", "2", 1);
  auto serves_rdma = [](const std::string& devices) {
    TransferEngine e;
    EXPECT_EQ(e.init("P2PHANDSHAKE", "127.0.0.1", "", devices), kOk);
    auto names = e.transports();
    return std::find(names.begin(), names.end(), "rdma") != names.end();
  };
  EXPECT_TRUE(serves_rdma(""));
  EXPECT_TRUE(serves_rdma("soft1"));
  EXPECT_TRUE(serves_rdma(" soft0 , soft1 "));
  EXPECT_FALSE(serves_rdma("mlx5_0"));
  // Two devices each side: a request is spread over both queue pairs and lands whole.
  testing::EnginePair pair("rdma", 8u << 20);
  testing::fillPattern(pair.local_buf.data, 8u << 20, 9);
  ASSERT_EQ(pair.local.transferSync({pair.request(Opcode::kWrite, 0, 0, 8u << 20)}), kOk);
  EXPECT_EQ(testing::digest(pair.remote_buf.data, 8u << 20), testing::digest(pair.local_buf.data, 8u << 20));
  std::memset(pair.local_buf.data, 0, 8u << 20);
  ASSERT_EQ(pair.local.transferSync({pair.request(Opcode::kRead, 0, 0, 8u << 20)}), kOk);
  EXPECT_EQ(testing::digest(pair.remote_buf.data, 8u << 20), testing::digest(pair.local_buf.data, 8u << 20));
  ::unsetenv("MC_SOFTVERBS_DEVICES");
  ::unsetenv("MC_RDMA_PROVIDER");
}

// Protocol "rdma" (what the reference's clients pass) puts rdma first
// wherever it carries the memory, also to a peer on this host; without it,
// host memory of a same-host peer goes over shm, and rdma comes before tcp.
TEST(TransportChoice, RdmaProtocolPutsRdmaFirstAndAutomaticKeepsShmFirst) {
  if (!MOONCAKE_WITH_RDMA) GTEST_SKIP() << "built without the rdma transport (MOONCAKE_WITH_RDMA)";
  ::setenv("MC_RDMA_PROVIDER", "software", 1);
  testing::EnginePair rdma("rdma", 1 << 16);
  TransferRequest r = rdma.request(Opcode::kWrite, 100, 200, 300);
  EXPECT_EQ(rdma.local.transportFor(r), "rdma");
  EXPECT_EQ(rdma.local.transportFor(r, "tcp"), "tcp");
  testing::EnginePair automatic("", 1 << 16);
  EXPECT_EQ(automatic.local.transportFor(automatic.peer), "shm");
  EXPECT_EQ(automatic.local.transportFor(automatic.peer, "rdma"), "rdma");
  testing::fillPattern(automatic.local_buf.data, 1 << 16, 5);
  ASSERT_EQ(automatic.local.transferSync({automatic.request(Opcode::kWrite, 0, 0, 1 << 16)}, "rdma"), kOk);
  EXPECT_EQ(testing::digest(automatic.remote_buf.data, 1 << 16), testing::digest(automatic.local_buf.data, 1 << 16));
  ::unsetenv("MC_RDMA_PROVIDER");
}

// "nvlink" and friends ask for GPU transfers on one host: the automatic
// choice, which uses cuda_ipc for GPU memory where it is built. Host memory
// still goes over shm.
TEST(TransportChoice, NvlinkProtocolNamesSelectTheAutomaticChoice) {
  for (const char* protocol : {"nvlink", "nvlink_intra", "cuda_ipc", "NVLINK"}) {
    testing::EnginePair pair(protocol, 1 << 16);
    EXPECT_EQ(pair.local.transportFor(pair.peer), "shm") << protocol;
    ASSERT_EQ(pair.local.transferSync({pair.request(Opcode::kWrite, 0, 0, 1 << 16)}), kOk) << protocol;
  }
}

TEST(TransportChoice, RequestsBetweenHostBuffersGoToShmUnlessHinted) {
  testing::EnginePair pair("", 1 << 16);
  TransferRequest r = pair.request(Opcode::kWrite, 100, 200, 300);
  EXPECT_EQ(pair.local.transportFor(r), "shm");
  EXPECT_EQ(pair.local.transportFor(r, "tcp"), "tcp");
  TransferRequest unregistered = r;
  unregistered.target_offset = 16;  // no buffer of the peer's there
  EXPECT_EQ(pair.local.transportFor(unregistered), "");
#if MOONCAKE_WITH_CUDA
  // Host memory is not cuda_ipc's: a forced choice refuses rather than misroutes.
  EXPECT_EQ(pair.local.transportFor(r, "cuda_ipc"), "");
#endif
}

// memcpy and process_vm_* cannot touch GPU memory on either end.
TEST(TransportChoice, ShmCarriesHostMemoryOnly) {
  ShmTransport shm;
  PeerSegment peer(1, "127.0.0.1:1", "127.0.0.1", 1);
  MemoryRegion host{4096, 4096, "cpu:0"}, gpu{4096, 4096, "cuda:0"};
  BufferDescriptor remote_host{8192, 4096, "cpu:1", {}}, remote_gpu{8192, 4096, "cuda:2", {}};
  EXPECT_TRUE(shm.carries(peer, host, remote_host));
  EXPECT_FALSE(shm.carries(peer, gpu, remote_host));
  EXPECT_FALSE(shm.carries(peer, host, remote_gpu));
  EXPECT_FALSE(shm.carries(peer, gpu, remote_gpu));
}

TEST(TransportChoice, HostMemoryIsLabeledHostMemory) {
  std::vector<char> host(4096);
  EXPECT_EQ(detectMemoryLocation(host.data()).rfind("cpu:", 0), 0u);
  EXPECT_EQ(resolveMemoryLocation(host.data(), "*").rfind("cpu:", 0), 0u);
  EXPECT_EQ(resolveMemoryLocation(host.data(), "cpu:1"), "cpu:1");  // the caller's NUMA label is kept
#if MOONCAKE_WITH_CUDA
  // A host pointer labeled as GPU memory would send shm and tcp down the
  // wrong path: the label is corrected.
  EXPECT_EQ(resolveMemoryLocation(host.data(), "cuda:0").rfind("cpu:", 0), 0u);
#endif
}

}  // namespace
}  // namespace mooncake::te
