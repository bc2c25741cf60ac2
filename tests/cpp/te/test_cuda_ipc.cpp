// GPU memory through the engine, between real processes: the cuda_ipc
// transport on one host (every size, at odd offsets inside larger
// allocations), host <-> GPU mixes, and the tcp transport
// staging GPU memory through host memory. The peer is a separate program
// (posix_spawn + exec), so it starts CUDA afresh whatever this process did.
// Without a GPU (or a CUDA build) every test skips and says why.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#if MOONCAKE_WITH_CUDA
#include <cuda_runtime_api.h>

#include "common/gpu_test_support.h"  // REQUIRE_GPU
#endif

#include "engine_fixture.h"
#include "mooncake/te/host_identity.h"
#include "peer_process.h"

namespace mooncake::te {
namespace {

using testing::AlignedBuffer;
using testing::digest;
using testing::fillPattern;
using testing::PeerProcess;

#if MOONCAKE_WITH_CUDA

// `bytes` of GPU memory starting `offset` bytes into a larger cudaMalloc
// allocation: a sub-allocation, as torch's caching allocator hands out.
class GpuBuffer {
 public:
  GpuBuffer(size_t bytes, size_t offset) : bytes_(bytes) {
    EXPECT_EQ(cudaMalloc(&base_, offset + bytes + 4096), cudaSuccess);
    data = static_cast<char*>(base_) + offset;
  }
  ~GpuBuffer() { cudaFree(base_); }
  void upload(const void* host, size_t offset, size_t n) {
    ASSERT_EQ(cudaMemcpy(data + offset, host, n, cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<char> download(size_t offset, size_t n) const {
    std::vector<char> out(n);
    EXPECT_EQ(cudaMemcpy(out.data(), data + offset, n, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
  char* data = nullptr;

 private:
  size_t bytes_;
  void* base_ = nullptr;
};

constexpr size_t kPeerOffset = 4099;  // where the peer's buffer starts in its allocation
constexpr size_t kLocalOffset = 1234;

// Sizes from one byte to 256 MiB, each at one of two odd offset pairs:
// relatively misaligned, and equal modulo 16.
const std::vector<size_t> kSizes = {1, 3, 4095, 4096 + 7, 65537, (1u << 20) + 13, (16u << 20) + 5, 256u << 20};
const std::pair<size_t, size_t> kOffsets[] = {{3, 5}, {7, 23}};
constexpr size_t kRoom = (256u << 20) + (64u << 10);

// An engine with a registered GPU sub-allocation and a peer process whose
// buffer is GPU memory (or host memory with gpu_peer = false).
class GpuPair {
 public:
  GpuPair(const std::string& protocol, size_t bytes, bool gpu_peer = true)
      : peer(bytes, 77, gpu_peer ? std::vector<std::string>{"gpu", std::to_string(kPeerOffset)}
                                 : std::vector<std::string>{}),
        local(bytes, kLocalOffset),
        expected(bytes) {
    EXPECT_EQ(engine.init("P2PHANDSHAKE", "127.0.0.1", protocol, "", testing::fastFailConfig()), kOk);
    EXPECT_EQ(engine.registerLocalMemory(local.data, bytes), kOk);  // location "*": detected as cuda:0
    fillPattern(expected.data(), bytes, 5);
    local.upload(expected.data(), 0, bytes);
    handle = engine.openSegment(peer.segment);
    EXPECT_NE(handle, kInvalidSegment);
  }
  TransferRequest request(Opcode op, char* local_ptr, size_t remote_offset, size_t n) const {
    return TransferRequest{op, local_ptr, handle, peer.buffer_addr + remote_offset, n};
  }
  // Writes expected[lo, +n) to the peer at ro and checks the peer's bytes;
  // reads them back to lo + 17 and checks ours; restores our buffer.
  void roundTrip(size_t lo, size_t ro, size_t n, const std::string& transport) {
    TransferRequest write = request(Opcode::kWrite, local.data + lo, ro, n);
    EXPECT_EQ(engine.transportFor(write), transport) << n << " bytes";
    ASSERT_EQ(engine.transferSync({write}), kOk) << "write of " << n << " bytes";
    EXPECT_EQ(peer.digestOf(ro, n), digest(expected.data() + lo, n)) << "write of " << n << " bytes";
    TransferRequest read = request(Opcode::kRead, local.data + lo + 17, ro, n);
    ASSERT_EQ(engine.transferSync({read}), kOk) << "read of " << n << " bytes";
    std::vector<char> got = local.download(lo + 17, n);
    EXPECT_EQ(std::memcmp(got.data(), expected.data() + lo, n), 0) << "read of " << n << " bytes";
    local.upload(expected.data() + lo + 17, lo + 17, n);
  }

  PeerProcess peer;
  TransferEngine engine;
  GpuBuffer local;
  std::vector<char> expected;  // our buffer's contents
  SegmentHandle handle = kInvalidSegment;
};

TEST(CudaIpc, GpuToGpuAcrossProcessesAtEverySizeAndOffset) {
  REQUIRE_GPU();
  GpuPair pair("", kRoom);
  for (size_t i = 0; i < kSizes.size(); ++i) {
    auto [lo, ro] = kOffsets[i % 2];
    pair.roundTrip(lo, ro, kSizes[i], "cuda_ipc");
    auto [lo2, ro2] = kOffsets[(i + 1) % 2];
    if (kSizes[i] < (1u << 20)) pair.roundTrip(lo2, ro2, kSizes[i], "cuda_ipc");  // small ones both ways
  }
}

// Many requests in one asynchronous batch: completed on the transport's
// own thread when their copies finish, not by the submitting thread.
TEST(CudaIpc, AsyncBatchOfManyRequestsCompletes) {
  REQUIRE_GPU();
  constexpr size_t kPiece = 4097, kCount = 200;
  GpuPair pair("", kPiece * kCount + 64);
  std::vector<TransferRequest> pieces;
  for (size_t k = 0; k < kCount; ++k) {
    pieces.push_back(pair.request(Opcode::kWrite, pair.local.data + k * kPiece, k * kPiece + 1, kPiece));
  }
  BatchId batch = pair.engine.allocateBatchID(kCount);
  ASSERT_EQ(pair.engine.submitTransfer(batch, pieces), kOk);
  TransferStatus status;
  ASSERT_EQ(pair.engine.waitBatch(batch, status), kOk);
  EXPECT_EQ(status.state, TransferState::kCompleted);
  EXPECT_EQ(status.transferred_bytes, kPiece * kCount);
  EXPECT_EQ(pair.engine.freeBatchID(batch), kOk);
  EXPECT_EQ(pair.peer.digestOf(1, kPiece * kCount), digest(pair.expected.data(), kPiece * kCount));
}

// Host memory on our side, GPU memory on the peer's: cuda_ipc copies
// between them. GPU memory on our side, host memory on the peer's: CUDA
// cannot map another process's host memory, so tcp stages it.
TEST(CudaIpc, HostAndGpuMemoryMix) {
  REQUIRE_GPU();
  constexpr size_t kBytes = (8u << 20) + 333;
  {
    PeerProcess peer(kBytes, 77, {"gpu", std::to_string(kPeerOffset)});
    TransferEngine engine;
    AlignedBuffer host(kBytes);
    fillPattern(host.data, kBytes, 11);
    ASSERT_EQ(engine.init("P2PHANDSHAKE", "127.0.0.1", "", "", testing::fastFailConfig()), kOk);
    ASSERT_EQ(engine.registerLocalMemory(host.data, kBytes), kOk);
    SegmentHandle h = engine.openSegment(peer.segment);
    TransferRequest write{Opcode::kWrite, host.data + 1, h, peer.buffer_addr + 2, kBytes - 2};
    EXPECT_EQ(engine.transportFor(write), "cuda_ipc");
    ASSERT_EQ(engine.transferSync({write}), kOk);
    EXPECT_EQ(peer.digestOf(2, kBytes - 2), digest(host.data + 1, kBytes - 2));
    std::vector<char> before(host.data, host.data + kBytes);
    ASSERT_EQ(engine.transferSync({TransferRequest{Opcode::kRead, host.data, h, peer.buffer_addr + 2, 1000}}), kOk);
    EXPECT_EQ(std::memcmp(host.data, before.data() + 1, 1000), 0);
  }
  {
    GpuPair pair("", kBytes, /*gpu_peer=*/false);
    pair.roundTrip(5, 9, kBytes - 64, "tcp");
    pair.roundTrip(0, 0, 1, "tcp");
  }
}

// Protocol "tcp": GPU memory on both sides goes through host memory at
// both ends (D2H, socket, H2D), across several slices for large requests.
TEST(CudaIpc, TcpStagesGpuMemoryThroughHostMemory) {
  REQUIRE_GPU();
  constexpr size_t kBytes = (9u << 20) + 3 + 64;  // three 4 MiB slices
  GpuPair pair("tcp", kBytes);
  for (size_t n : {size_t{1}, size_t{4097}, size_t{(9u << 20) + 3}}) pair.roundTrip(3, 5, n, "tcp");
  // A host buffer of ours against the peer's GPU memory, also over tcp.
  AlignedBuffer host(1 << 20);
  fillPattern(host.data, 1 << 20, 21);
  ASSERT_EQ(pair.engine.registerLocalMemory(host.data, 1 << 20), kOk);
  TransferRequest write{Opcode::kWrite, host.data, pair.handle, pair.peer.buffer_addr + 100, 1 << 20};
  EXPECT_EQ(pair.engine.transportFor(write), "tcp");
  ASSERT_EQ(pair.engine.transferSync({write}), kOk);
  EXPECT_EQ(pair.peer.digestOf(100, 1 << 20), digest(host.data, 1 << 20));
}

// Protocol "rdma" with GPU memory on both ends (GPUDirect RDMA): registered
// with the NIC as GPU memory and moved by it, no host staging in the engine.
// Over the software provider, whose NIC copies with CUDA (no machine here
// has an RDMA NIC); the peer process inherits the provider choice.
TEST(CudaIpc, RdmaCarriesGpuMemoryRegisteredWithTheNic) {
  if (!MOONCAKE_WITH_RDMA) GTEST_SKIP() << "built without the rdma transport (MOONCAKE_WITH_RDMA)";
  REQUIRE_GPU();
  ::setenv("MC_RDMA_PROVIDER", "software", 1);
  constexpr size_t kBytes = (3u << 20) + 64;
  GpuPair pair("rdma", kBytes);
  for (size_t n : {size_t{1}, size_t{4097}, size_t{(3u << 20) + 5}}) pair.roundTrip(13, 7, n, "rdma");
  // A host buffer of ours against the peer's GPU memory.
  AlignedBuffer host(1 << 20);
  fillPattern(host.data, 1 << 20, 31);
  ASSERT_EQ(pair.engine.registerLocalMemory(host.data, 1 << 20), kOk);
  TransferRequest write{Opcode::kWrite, host.data, pair.handle, pair.peer.buffer_addr + 100, 1 << 20};
  EXPECT_EQ(pair.engine.transportFor(write), "rdma");
  ASSERT_EQ(pair.engine.transferSync({write}), kOk);
  EXPECT_EQ(pair.peer.digestOf(100, 1 << 20), digest(host.data, 1 << 20));
  ::unsetenv("MC_RDMA_PROVIDER");
}

// The peer frees its buffer and registers a new allocation (cudaMalloc may
// give the same address back). Its stamp moved, so we fetch its descriptor
// again, see a new handle, and open the new allocation instead of writing
// into the old one.
TEST(CudaIpc, ReallocatedPeerBufferIsOpenedAfresh) {
  REQUIRE_GPU();
  constexpr size_t kBytes = 1 << 20;
  GpuPair pair("", kBytes);
  pair.roundTrip(0, 0, kBytes - 64, "cuda_ipc");  // opens the first allocation
  uint64_t addr = pair.peer.reallocate(9);
  std::vector<char> fresh(kBytes);
  fillPattern(fresh.data(), kBytes, 9);
  ASSERT_EQ(pair.engine.transferSync({TransferRequest{Opcode::kRead, pair.local.data, pair.handle, addr, kBytes}}),
            kOk);
  std::vector<char> got = pair.local.download(0, kBytes);
  EXPECT_EQ(std::memcmp(got.data(), fresh.data(), kBytes), 0);
  ASSERT_EQ(pair.engine.transferSync({TransferRequest{Opcode::kWrite, pair.local.data, pair.handle, addr, 4096}}),
            kOk);
  EXPECT_EQ(pair.peer.digestOf(0, 4096), digest(fresh.data(), 4096));
}

// Copies through an open mapping would go on after the peer died; the stamp
// check at submission turns them into a failure instead.
TEST(CudaIpc, KilledPeerFailsTheNextTransfer) {
  REQUIRE_GPU();
  constexpr size_t kBytes = 1 << 20;
  GpuPair pair("", kBytes);
  TransferRequest write = pair.request(Opcode::kWrite, pair.local.data, 0, kBytes);
  ASSERT_EQ(pair.engine.transferSync({write}), kOk);
  pair.peer.killNow();
  auto start = std::chrono::steady_clock::now();
  EXPECT_NE(pair.engine.transferSync({write}), kOk);
  EXPECT_LT(std::chrono::steady_clock::now() - start, pair.engine.config().budgetFor(kBytes));
}

// Two engines of one process: cuda_ipc copies with the pointers as they are
// (CUDA cannot open a handle in the process that exported it), GPU to GPU
// and GPU to the other engine's host memory.
TEST(CudaIpc, EnginesOfOneProcessCopyDirectly) {
  REQUIRE_GPU();
  constexpr size_t kBytes = (4u << 20) + 5;
  TransferEngine a, b;
  ASSERT_EQ(a.init("P2PHANDSHAKE", "127.0.0.1", "", "", testing::fastFailConfig()), kOk);
  ASSERT_EQ(b.init("P2PHANDSHAKE", "127.0.0.1", "", "", testing::fastFailConfig()), kOk);
  GpuBuffer src(kBytes, 77), dst(kBytes, 3);
  AlignedBuffer host(kBytes);
  std::vector<char> pattern(kBytes);
  fillPattern(pattern.data(), kBytes, 31);
  src.upload(pattern.data(), 0, kBytes);
  ASSERT_EQ(a.registerLocalMemory(src.data, kBytes), kOk);
  ASSERT_EQ(b.registerLocalMemory(dst.data, kBytes), kOk);
  ASSERT_EQ(b.registerLocalMemory(host.data, kBytes), kOk);
  SegmentHandle h = a.openSegment(b.segmentName());
  for (char* target : {dst.data, host.data}) {
    TransferRequest write{Opcode::kWrite, src.data, h, reinterpret_cast<uint64_t>(target), kBytes};
    EXPECT_EQ(a.transportFor(write), "cuda_ipc");
    ASSERT_EQ(a.transferSync({write}), kOk);
  }
  EXPECT_EQ(std::memcmp(dst.download(0, kBytes).data(), pattern.data(), kBytes), 0);
  EXPECT_EQ(std::memcmp(host.data, pattern.data(), kBytes), 0);
}

// The sequence a Python client goes through with a tensor: register a piece,
// be refused an overlapping one, unregister, register the whole allocation
// under a wrong label (corrected).
TEST(CudaIpc, RegistrationOfPiecesAndMislabeledGpuMemory) {
  REQUIRE_GPU();
  GpuBuffer gpu(1 << 20, 0);
  TransferEngine engine;
  ASSERT_EQ(engine.init("P2PHANDSHAKE", "127.0.0.1"), kOk);
  ASSERT_EQ(engine.registerLocalMemory(gpu.data + 100, 4096), kOk);
  EXPECT_EQ(engine.registerLocalMemory(gpu.data + 200, 16), kAddressOverlapped);
  ASSERT_EQ(engine.unregisterLocalMemory(gpu.data + 100), kOk);
  ASSERT_EQ(engine.registerLocalMemory(gpu.data, 1 << 20, "cpu:0"), kOk);
  ASSERT_EQ(engine.unregisterLocalMemory(gpu.data), kOk);
}

// Location "*" finds GPU memory, also from a thread with no CUDA context,
// and anywhere inside an allocation.
TEST(CudaIpc, GpuMemoryIsDetectedAndMislabelsCorrected) {
  REQUIRE_GPU();
  GpuBuffer gpu(1 << 20, 12345);
  int device = -1;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  const std::string expected = "cuda:" + std::to_string(device);
  EXPECT_EQ(detectMemoryLocation(gpu.data), expected);
  EXPECT_EQ(detectMemoryLocation(gpu.data + 777), expected);
  std::string from_thread;
  std::thread([&] { from_thread = detectMemoryLocation(gpu.data + 5); }).join();
  EXPECT_EQ(from_thread, expected);
  EXPECT_EQ(resolveMemoryLocation(gpu.data, "cpu:0"), expected);
  std::vector<char> host(64);
  EXPECT_EQ(resolveMemoryLocation(host.data(), expected).rfind("cpu:", 0), 0u);
}

#else  // !MOONCAKE_WITH_CUDA

TEST(CudaIpc, NeedsACudaBuild) { GTEST_SKIP() << "built without CUDA (MOONCAKE_WITH_CUDA=OFF)"; }

#endif

}  // namespace
}  // namespace mooncake::te
