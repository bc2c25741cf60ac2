// Engine behaviour between two engines of one process, for every transport.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "engine_fixture.h"

namespace mooncake::te {
namespace {

using testing::digest;
using testing::EnginePair;
using testing::fillPattern;

TEST(EngineInit, RejectsBadArgumentsAndCallsBeforeInit) {
  TransferEngine e;
  char buf[64];
  EXPECT_EQ(e.registerLocalMemory(buf, sizeof(buf)), kNotInitialized);
  EXPECT_EQ(e.openSegment("127.0.0.1:15000"), kInvalidSegment);
  EXPECT_EQ(e.submitTransfer(1, {}), kNotInitialized);
  EXPECT_EQ(e.probe("127.0.0.1:15000"), kNotInitialized);
  EXPECT_EQ(e.init("etcd://127.0.0.1:2379", "127.0.0.1"), kInvalidArgument);
  EXPECT_EQ(e.init("P2PHANDSHAKE", "127.0.0.1", "carrier-pigeon"), kInvalidArgument);
  EXPECT_EQ(e.init("P2PHANDSHAKE", ""), kInvalidArgument);
  EXPECT_FALSE(e.initialized());
  ASSERT_EQ(e.init("P2PHANDSHAKE", "127.0.0.1:99", "rdma"), kOk);  // port ignored; no device: tcp/shm
  EXPECT_EQ(e.init("P2PHANDSHAKE", "127.0.0.1"), kInvalidArgument);  // twice
  EXPECT_EQ(e.segmentName(), "127.0.0.1:" + std::to_string(e.rpcPort()));
}

TEST(EngineInit, PortComesFromTheConfiguredRange) {
  EngineConfig c;
  c.min_rpc_port = 21000;
  c.max_rpc_port = 21015;
  TransferEngine a, b;
  ASSERT_EQ(a.init("P2PHANDSHAKE", "127.0.0.1", "", "", c), kOk);
  ASSERT_EQ(b.init("P2PHANDSHAKE", "127.0.0.1", "", "", c), kOk);
  EXPECT_GE(a.rpcPort(), 21000);
  EXPECT_LE(a.rpcPort(), 21015);
  EXPECT_NE(a.rpcPort(), b.rpcPort());
}

TEST(EngineRegistration, OverlapZeroLengthAndExactBaseUnregister) {
  TransferEngine e;
  ASSERT_EQ(e.init("P2PHANDSHAKE", "127.0.0.1"), kOk);
  std::vector<char> buf(8192);
  EXPECT_EQ(e.registerLocalMemory(buf.data(), 0), kInvalidArgument);
  ASSERT_EQ(e.registerLocalMemory(buf.data(), 4096), kOk);
  EXPECT_EQ(e.registerLocalMemory(buf.data() + 100, 10), kAddressOverlapped);
  EXPECT_EQ(e.registerLocalMemoryBatch({buf.data() + 4096, buf.data() + 10}, {4096, 10}), kAddressOverlapped);
  EXPECT_EQ(e.registerLocalMemory(buf.data() + 4096, 4096), kOk);  // batch above left nothing behind
  EXPECT_EQ(e.unregisterLocalMemory(buf.data() + 1), kAddressNotRegistered);
  EXPECT_EQ(e.unregisterLocalMemoryBatch({buf.data(), buf.data() + 4096}), kOk);
  EXPECT_EQ(e.registerLocalMemoryBatch({buf.data()}, {1, 2}), kInvalidArgument);
}

// "rdma" runs over the software verbs provider (transport/rdma/soft/): no
// machine the tests run on has an RDMA device.
class TransportTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "rdma") ::setenv("MC_RDMA_PROVIDER", "software", 1);
  }
};

// Sizes from 1 B to 256 MiB at odd offsets on both sides, each checked byte for byte.
TEST_P(TransportTest, WriteAndReadEverySizeAtOddOffsets) {
  constexpr size_t kMax = 256u << 20;
  EnginePair pair(GetParam(), kMax + 64);
  std::vector<size_t> sizes = {1, 7, 63, 4095, 65537, (1u << 20) + 3, (16u << 20) + 1, kMax};
  uint64_t seed = 1;
  for (size_t n : sizes) {
    SCOPED_TRACE("size " + std::to_string(n));
    size_t lo = n == kMax ? 0 : 13, ro = n == kMax ? 0 : 29;
    fillPattern(pair.local_buf.data + lo, n, ++seed);
    ASSERT_EQ(pair.local.transferSync({pair.request(Opcode::kWrite, lo, ro, n)}), kOk);
    ASSERT_EQ(digest(pair.remote_buf.data + ro, n), digest(pair.local_buf.data + lo, n));

    fillPattern(pair.remote_buf.data + ro, n, ++seed);
    std::memset(pair.local_buf.data + lo, 0, n);
    ASSERT_EQ(pair.local.transferSync({pair.request(Opcode::kRead, lo, ro, n)}), kOk);
    ASSERT_EQ(digest(pair.local_buf.data + lo, n), digest(pair.remote_buf.data + ro, n));
  }
}

TEST_P(TransportTest, ManyConcurrentBatchesFromManyThreads) {
  constexpr int kThreads = 6, kBatches = 40, kPerBatch = 4;
  constexpr size_t kSlot = 3001;  // odd: slots straddle cache lines and pages
  EnginePair pair(GetParam(), kThreads * kPerBatch * kSlot);
  fillPattern(pair.local_buf.data, pair.local_buf.size, 99);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int b = 0; b < kBatches; ++b) {
        std::vector<TransferRequest> reqs;
        for (int i = 0; i < kPerBatch; ++i) {
          size_t off = (t * kPerBatch + i) * kSlot;
          reqs.push_back(pair.request(Opcode::kWrite, off, off, kSlot));
        }
        BatchId id = pair.local.allocateBatchID(reqs.size());
        TransferStatus status;
        if (pair.local.submitTransfer(id, reqs) != kOk || pair.local.waitBatch(id, status) != kOk ||
            status.state != TransferState::kCompleted || status.transferred_bytes != kPerBatch * kSlot ||
            pair.local.freeBatchID(id) != kOk) {
          failures++;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(digest(pair.remote_buf.data, pair.remote_buf.size), digest(pair.local_buf.data, pair.local_buf.size));
}

TEST_P(TransportTest, PerTaskStatusAndBatchRules) {
  EnginePair pair(GetParam(), 1 << 20);
  BatchId id = pair.local.allocateBatchID(2);
  ASSERT_NE(id, kInvalidBatch);
  auto good = pair.request(Opcode::kWrite, 0, 0, 4096);
  auto outside = pair.request(Opcode::kWrite, 0, (1 << 20) - 10, 4096);  // runs past the peer's region
  ASSERT_EQ(pair.local.submitTransfer(id, {good, outside}), kOk);
  EXPECT_EQ(pair.local.submitTransfer(id, {good}), kTooManyRequests);  // capacity 2 is used up
  TransferStatus batch_status;
  EXPECT_EQ(pair.local.waitBatch(id, batch_status), kAddressNotRegistered);
  EXPECT_EQ(batch_status.state, TransferState::kFailed);
  TransferStatus s0, s1;
  ASSERT_EQ(pair.local.getTransferStatus(id, 0, s0), kOk);
  ASSERT_EQ(pair.local.getTransferStatus(id, 1, s1), kOk);
  EXPECT_EQ(s0.state, TransferState::kCompleted);
  EXPECT_EQ(s0.transferred_bytes, 4096u);
  EXPECT_EQ(s1.state, TransferState::kFailed);
  EXPECT_EQ(s1.error, kAddressNotRegistered);
  EXPECT_EQ(pair.local.getTransferStatus(id, 2, s1), kInvalidArgument);
  EXPECT_EQ(pair.local.freeBatchID(id), kOk);
  EXPECT_EQ(pair.local.freeBatchID(id), kInvalidArgument);  // ids are not reused
  EXPECT_EQ(pair.local.submitTransfer(id, {good}), kInvalidArgument);
}

TEST_P(TransportTest, RefusedRequestsLeaveTargetMemoryUntouched) {
  EnginePair pair(GetParam(), 1 << 16);
  std::memset(pair.remote_buf.data, 0x5a, pair.remote_buf.size);
  std::vector<char> unregistered(4096, 1);
  // Local source outside any registered region.
  TransferRequest bad_local{Opcode::kWrite, unregistered.data(), pair.peer,
                            reinterpret_cast<uint64_t>(pair.remote_buf.data), 4096};
  EXPECT_EQ(pair.local.transferSync({bad_local}), kAddressNotRegistered);
  // Remote range partly outside the peer's region.
  EXPECT_EQ(pair.local.transferSync({pair.request(Opcode::kWrite, 0, (1 << 16) - 100, 200)}), kAddressNotRegistered);
  // Zero length, null buffer, unknown segment: refused before anything starts.
  EXPECT_EQ(pair.local.transferSync({pair.request(Opcode::kWrite, 0, 0, 0)}), kInvalidArgument);
  TransferRequest unknown = pair.request(Opcode::kWrite, 0, 0, 16);
  unknown.target_id = 12345;
  EXPECT_EQ(pair.local.transferSync({unknown}), kInvalidArgument);
  EXPECT_EQ(pair.local.transferSync({pair.request(Opcode::kWrite, 0, 0, 16)}, "no-such-transport"), kInvalidArgument);
  for (size_t i = 0; i < pair.remote_buf.size; ++i) ASSERT_EQ(pair.remote_buf.data[i], 0x5a) << i;
}

TEST_P(TransportTest, DescriptorIsRefreshedForNewAndRemovedRegistrations) {
  EnginePair pair(GetParam(), 4096);
  testing::AlignedBuffer later(8192);
  // Registered after the peer cached our descriptor: found by one refresh.
  ASSERT_EQ(pair.remote.registerLocalMemory(later.data, later.size), kOk);
  fillPattern(pair.local_buf.data, 4096, 5);
  TransferRequest r{Opcode::kWrite, pair.local_buf.data, pair.peer, reinterpret_cast<uint64_t>(later.data) + 100, 4096};
  ASSERT_EQ(pair.local.transferSync({r}), kOk);
  EXPECT_EQ(digest(later.data + 100, 4096), digest(pair.local_buf.data, 4096));
  // Unregistered after being cached: refused, memory untouched.
  ASSERT_EQ(pair.remote.unregisterLocalMemory(later.data), kOk);
  std::memset(later.data, 0, later.size);
  EXPECT_EQ(pair.local.transferSync({r}), kAddressNotRegistered);
  for (size_t i = 0; i < later.size; ++i) ASSERT_EQ(later.data[i], 0) << i;
}

TEST_P(TransportTest, AWriteIntoAReceiveWindowNeedsNoDescriptorAndIsRefusedOnceItCloses) {
  // The peer opens a window after we cached its descriptor; a write marked
  // remote_window goes there over tcp without fetching the descriptor again
  // (the peer checks it), and is refused once the window is closed. Over
  // any other transport such a write is refused: only tcp writes are cut
  // short by a closing window.
  EnginePair pair(GetParam(), 4096);
  testing::AlignedBuffer window(8192);
  std::memset(window.data, 0, window.size);
  ASSERT_EQ(pair.remote.openReceiveWindow(window.data, window.size), kOk);
  fillPattern(pair.local_buf.data, 4096, 6);
  TransferRequest r{Opcode::kWrite, pair.local_buf.data, pair.peer, reinterpret_cast<uint64_t>(window.data) + 64, 4096};
  r.remote_window = true;
  const bool tcp = GetParam() == "tcp";
  ASSERT_EQ(pair.local.transferSync({r}), tcp ? kOk : kInvalidArgument);
  if (tcp) {
    EXPECT_EQ(digest(window.data + 64, 4096), digest(pair.local_buf.data, 4096));
  }
  // Not published: a plain write there finds no registered range even after
  // fetching the descriptor again.
  TransferRequest plain{Opcode::kWrite, pair.local_buf.data, pair.peer, reinterpret_cast<uint64_t>(window.data), 64};
  EXPECT_EQ(pair.local.transferSync({plain}), kAddressNotRegistered);
  EXPECT_EQ(pair.remote.closeReceiveWindow(pair.remote_buf.data), kInvalidArgument);  // a registration, not a window
  ASSERT_EQ(pair.remote.closeReceiveWindow(window.data), kOk);
  std::memset(window.data, 0, window.size);
  EXPECT_EQ(pair.local.transferSync({r}), tcp ? kAddressNotRegistered : kInvalidArgument);
  for (size_t i = 0; i < window.size; ++i) ASSERT_EQ(window.data[i], 0) << i;
}

TEST_P(TransportTest, WindowsOpenedAndClosedMeanwhileLeaveOtherWritesAlone) {
  // A receiver opens and closes windows all the time (one per receive);
  // writes into its registered memory go on meanwhile. Over shm each write
  // checks that its copy of the descriptor is current: windows must not
  // count as registration changes (they did: the writes failed as
  // "peer unreachable" once the check found the version moving twice).
  EnginePair pair(GetParam(), 1u << 20);
  std::atomic<bool> stop{false};
  std::thread churn([&] {
    std::vector<std::unique_ptr<testing::AlignedBuffer>> windows;
    for (int i = 0; i < 4; ++i) windows.push_back(std::make_unique<testing::AlignedBuffer>(64 * 1024));
    while (!stop) {
      for (auto& w : windows) EXPECT_EQ(pair.remote.openReceiveWindow(w->data, w->size), kOk);
      for (auto& w : windows) EXPECT_EQ(pair.remote.closeReceiveWindow(w->data), kOk);
    }
  });
  struct StopChurn {
    std::atomic<bool>& stop;
    std::thread& churn;
    ~StopChurn() {
      stop = true;
      churn.join();
    }
  } stop_churn{stop, churn};  // also when an assertion below returns early
  for (int i = 0; i < 2000; ++i) {
    fillPattern(pair.local_buf.data, 4096, 100 + i);
    ASSERT_EQ(pair.local.transferSync({pair.request(Opcode::kWrite, 0, (i % 200) * 4096, 4096)}), kOk) << i;
    ASSERT_EQ(digest(pair.remote_buf.data + (i % 200) * 4096, 4096), digest(pair.local_buf.data, 4096));
  }
}

TEST_P(TransportTest, UnreachableAndUnknownPeers) {
  EnginePair pair(GetParam(), 4096);
  auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(pair.local.openSegment("127.0.0.1:1"), kInvalidSegment);  // nothing listens on port 1
  EXPECT_EQ(pair.local.openSegment("not a name"), kInvalidSegment);
  EXPECT_NE(pair.local.probe("127.0.0.1:1"), kOk);
  EXPECT_EQ(pair.local.probe(pair.remote.segmentName()), kOk);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
}

TEST_P(TransportTest, NotificationsReachTheTarget) {
  EnginePair pair(GetParam(), 4096);
  ASSERT_EQ(pair.local.sendNotify(pair.remote.segmentName(), Notify{"writer", "bucket 3 ready"}), kOk);
  auto got = pair.remote.getNotifies();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].name, "writer");
  EXPECT_EQ(got[0].msg, "bucket 3 ready");
  EXPECT_TRUE(pair.remote.getNotifies().empty());
}

// A peer that registers a range anew gives it a new rkey; the rkey in our
// copy of its descriptor is refused by its NIC: that write fails, as
// unregistered, without touching the memory, and the next one, with the
// descriptor fetched again, lands.
TEST(RdmaTransport, AnRkeyThePeerReplacedIsRefusedAndTheNextWriteFetchesTheNewOne) {
  if (!MOONCAKE_WITH_RDMA) GTEST_SKIP() << "built without the rdma transport (MOONCAKE_WITH_RDMA)";
  ::setenv("MC_RDMA_PROVIDER", "software", 1);
  EnginePair pair("rdma", 1 << 16);
  fillPattern(pair.local_buf.data, 1 << 16, 21);
  ASSERT_EQ(pair.local.transferSync({pair.request(Opcode::kWrite, 0, 0, 1 << 16)}), kOk);
  ASSERT_EQ(pair.local.transportFor(pair.request(Opcode::kWrite, 0, 0, 1 << 16)), "rdma");
  ASSERT_EQ(pair.remote.unregisterLocalMemory(pair.remote_buf.data), kOk);
  ASSERT_EQ(pair.remote.registerLocalMemory(pair.remote_buf.data, 1 << 16), kOk);
  std::memset(pair.remote_buf.data, 0, 1 << 16);
  fillPattern(pair.local_buf.data, 1 << 16, 22);
  EXPECT_EQ(pair.local.transferSync({pair.request(Opcode::kWrite, 0, 0, 1 << 16)}), kAddressNotRegistered);
  for (size_t i = 0; i < (1 << 16); ++i) ASSERT_EQ(pair.remote_buf.data[i], 0) << i;
  ASSERT_EQ(pair.local.transferSync({pair.request(Opcode::kWrite, 0, 0, 1 << 16)}), kOk);
  EXPECT_EQ(digest(pair.remote_buf.data, 1 << 16), digest(pair.local_buf.data, 1 << 16));
}

// The same transport on this host's own NIC (the libibverbs provider),
// where rdma-core lists one: what the software provider stands in for
// everywhere else.
TEST(RdmaNic, WritesAndReadsLandOverThisHostsNic) {
  if (rdmaNicNames().empty()) GTEST_SKIP() << "no RDMA NIC on this host (rdma-core lists no device)";
  ::unsetenv("MC_RDMA_PROVIDER");
  constexpr size_t kBytes = (8u << 20) + 64;
  EnginePair pair("rdma", kBytes);
  ASSERT_EQ(pair.local.transportFor(pair.request(Opcode::kWrite, 0, 0, kBytes)), "rdma");
  std::vector<char> expected(kBytes);
  fillPattern(expected.data(), kBytes, 41);
  for (size_t n : {size_t{1}, size_t{4097}, size_t{8u << 20}}) {
    std::memcpy(pair.local_buf.data, expected.data(), kBytes);
    ASSERT_EQ(pair.local.transferSync({pair.request(Opcode::kWrite, 3, 5, n)}), kOk) << n;
    EXPECT_EQ(digest(pair.remote_buf.data + 5, n), digest(expected.data() + 3, n)) << n;
    ASSERT_EQ(pair.local.transferSync({pair.request(Opcode::kRead, 64, 5, n)}), kOk) << n;
    EXPECT_EQ(digest(pair.local_buf.data + 64, n), digest(expected.data() + 3, n)) << n;
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, TransportTest, ::testing::ValuesIn(testing::builtDataTransports()),
                         [](const auto& info) { return info.param; });

TEST(TransportChoice, AutoPicksShmOnTheSameHostAndProtocolOrHintOverrideIt) {
  EnginePair pair("", 1 << 16);
  EXPECT_EQ(pair.local.transportFor(pair.peer), "shm");
  EXPECT_EQ(pair.local.transportFor(pair.peer, "tcp"), "tcp");
  EnginePair forced("tcp", 4096);
  EXPECT_EQ(forced.local.transportFor(forced.peer), "tcp");
  EXPECT_EQ(forced.local.transportFor(forced.peer, "shm"), "shm");
  // Both paths deliver, whichever the peer's own protocol choice was.
  fillPattern(pair.local_buf.data, 1 << 16, 11);
  ASSERT_EQ(pair.local.transferSync({pair.request(Opcode::kWrite, 0, 0, 1 << 16)}, "tcp"), kOk);
  EXPECT_EQ(digest(pair.remote_buf.data, 1 << 16), digest(pair.local_buf.data, 1 << 16));
  fillPattern(pair.local_buf.data, 1 << 16, 12);
  ASSERT_EQ(pair.local.transferSync({pair.request(Opcode::kWrite, 0, 0, 1 << 16)}, "shm"), kOk);
  EXPECT_EQ(digest(pair.remote_buf.data, 1 << 16), digest(pair.local_buf.data, 1 << 16));
}

}  // namespace
}  // namespace mooncake::te
