// The engine against a peer in another process: bytes verified by the peer
// itself, and a peer that dies or stalls turning transfers into bounded
// failures.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "engine_fixture.h"
#include "peer_process.h"

namespace mooncake::te {
namespace {

using namespace std::chrono_literals;
using testing::AlignedBuffer;
using testing::digest;
using testing::fillPattern;
using testing::PeerProcess;

// "rdma" runs over the software verbs provider (transport/rdma/soft/), in
// both processes (the peer inherits the environment).
class MultiProcess : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "rdma") ::setenv("MC_RDMA_PROVIDER", "software", 1);
  }
  void start(size_t bytes, const EngineConfig& config = testing::fastFailConfig()) {
    peer_ = std::make_unique<PeerProcess>(bytes, 77);
    buf_ = std::make_unique<AlignedBuffer>(bytes);
    ASSERT_EQ(engine_.init("P2PHANDSHAKE", "127.0.0.1", GetParam(), "", config), kOk);
    ASSERT_EQ(engine_.registerLocalMemory(buf_->data, bytes), kOk);
    handle_ = engine_.openSegment(peer_->segment);
    ASSERT_NE(handle_, kInvalidSegment);
    ASSERT_EQ(engine_.transportFor(handle_), GetParam());
  }
  TransferRequest request(Opcode op, size_t offset, size_t length) {
    return TransferRequest{op, buf_->data + offset, handle_, peer_->buffer_addr + offset, length};
  }

  TransferEngine engine_;
  std::unique_ptr<PeerProcess> peer_;
  std::unique_ptr<AlignedBuffer> buf_;
  SegmentHandle handle_ = kInvalidSegment;
};

TEST_P(MultiProcess, PeerSeesTheBytesWeWriteAndWeReadItsBytes) {
  constexpr size_t kBytes = 32u << 20;
  start(kBytes);
  // Read the peer's initial pattern (seed 77) and compare with our own copy.
  ASSERT_EQ(engine_.transferSync({request(Opcode::kRead, 0, kBytes)}), kOk);
  AlignedBuffer expected(kBytes);
  fillPattern(expected.data, kBytes, 77);
  EXPECT_EQ(digest(buf_->data, kBytes), digest(expected.data, kBytes));
  // Write odd-sized pieces; the peer digests what landed.
  fillPattern(buf_->data, kBytes, 1234);
  std::vector<TransferRequest> pieces;
  for (size_t off = 0; off + 1000003 <= kBytes; off += 1000003) pieces.push_back(request(Opcode::kWrite, off, 1000003));
  ASSERT_EQ(engine_.transferSync(pieces), kOk);
  size_t covered = pieces.size() * 1000003;
  EXPECT_EQ(peer_->digestOf(0, covered), digest(buf_->data, covered));
}

TEST_P(MultiProcess, PeerKilledMidTransferFailsWithinTheTimeout) {
  constexpr size_t kBytes = 256u << 20;
  start(kBytes);
  // Keep large transfers going while the peer is killed; the one in flight
  // (and any after it) must fail, never hang.
  std::thread killer([&] {
    std::this_thread::sleep_for(30ms);
    peer_->killNow();
  });
  auto start_time = std::chrono::steady_clock::now();
  int rc = kOk;
  for (int i = 0; i < 1000 && rc == kOk; ++i) rc = engine_.transferSync({request(Opcode::kWrite, 0, kBytes)});
  killer.join();
  EXPECT_NE(rc, kOk);
  auto elapsed = std::chrono::steady_clock::now() - start_time;
  EXPECT_LT(elapsed, engine_.config().budgetFor(kBytes) + 2s);
  EXPECT_NE(engine_.probe(peer_->segment, 500ms), kOk);
}

// Polls `batch` while it is pending, until `deadline`; returns its last status.
TransferStatus pollWhilePending(TransferEngine& engine, BatchId batch, std::chrono::steady_clock::time_point deadline) {
  TransferStatus status;
  while (engine.getBatchTransferStatus(batch, status) == kOk && status.state == TransferState::kPending &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  return status;
}

// Submits `requests` as one batch and polls it to its end.
TransferStatus submitAndWait(TransferEngine& engine, const std::vector<TransferRequest>& requests) {
  const BatchId batch = engine.allocateBatchID(requests.size());
  TransferStatus status;
  status.state = TransferState::kFailed;
  if (batch == kInvalidBatch || engine.submitTransfer(batch, requests) != kOk) return status;
  while (engine.getBatchTransferStatus(batch, status) == kOk && status.state == TransferState::kPending) {
    std::this_thread::yield();
  }
  engine.freeBatchID(batch);
  return status;
}

TEST_P(MultiProcess, SmallAsyncWritesLandAndFailBoundedOnceThePeerIsGone) {
  // Small writes submitted without waiting go out from the submitting
  // thread on a pooled connection (tcp); every one lands, and once the peer
  // is killed the next fails within its deadline (the stale connection's
  // answer never comes; the retry cannot connect).
  constexpr size_t kBytes = 1u << 20;
  start(kBytes);
  fillPattern(buf_->data, kBytes, 4321);
  ASSERT_EQ(engine_.transferSync({request(Opcode::kWrite, 0, 4096)}), kOk);  // a connection to pool
  for (size_t off = 0; off + 3000 <= kBytes; off += 3000) {
    ASSERT_EQ(submitAndWait(engine_, {request(Opcode::kWrite, off, 3000)}).state, TransferState::kCompleted) << off;
  }
  const size_t covered = (kBytes / 3000) * 3000;
  EXPECT_EQ(peer_->digestOf(0, covered), digest(buf_->data, covered));
  peer_->killNow();
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(submitAndWait(engine_, {request(Opcode::kWrite, 0, 3000)}).state, TransferState::kFailed);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, engine_.config().budgetFor(3000) + 2s);
}

TEST_P(MultiProcess, WriteWithTrailerLandsBothAndRefusesBadTrailers) {
  constexpr size_t kPayload = 3u << 20, kBytes = kPayload + 4096;
  start(kBytes);
  fillPattern(buf_->data, kPayload, 99);
  unsigned char trailer[kMaxTrailerBytes];
  fillPattern(trailer, sizeof(trailer), 7);
  TransferRequest r = request(Opcode::kWrite, 0, kPayload);
  r.trailer = trailer;
  r.trailer_length = sizeof(trailer);
  r.trailer_target = peer_->buffer_addr + kPayload + 128;
  ASSERT_EQ(engine_.transferSync({r}), kOk);
  EXPECT_EQ(peer_->digestOf(0, kPayload), digest(buf_->data, kPayload));
  EXPECT_EQ(peer_->digestOf(kPayload + 128, sizeof(trailer)), digest(trailer, sizeof(trailer)));
  // Outside what the peer registered: the request fails, naming why.
  TransferRequest outside = r;
  outside.trailer_target = peer_->buffer_addr + kBytes + (1u << 30);
  EXPECT_EQ(engine_.transferSync({outside}), kAddressNotRegistered);
  // Structural errors refuse the submission.
  TransferRequest too_long = r;
  too_long.trailer_length = kMaxTrailerBytes + 1;
  EXPECT_EQ(engine_.transferSync({too_long}), kInvalidArgument);
  TransferRequest on_read = r;
  on_read.opcode = Opcode::kRead;
  EXPECT_EQ(engine_.transferSync({on_read}), kInvalidArgument);
}

TEST_P(MultiProcess, WritesStraightFromUnregisteredHostMemoryWhenTheRequestSaysSo) {
  constexpr size_t kBytes = 4u << 20;
  start(kBytes);
  AlignedBuffer loose(kBytes);  // never registered
  fillPattern(loose.data, kBytes, 4321);
  TransferRequest r{Opcode::kWrite, loose.data, handle_, peer_->buffer_addr, kBytes};
  TransferStatus refused = submitAndWait(engine_, {r});
  EXPECT_EQ(refused.state, TransferState::kFailed);
  EXPECT_EQ(refused.error, kAddressNotRegistered);
  r.unregistered_source = true;
  ASSERT_EQ(engine_.transferSync({r}), kOk);
  EXPECT_EQ(peer_->digestOf(0, kBytes), digest(loose.data, kBytes));
}

INSTANTIATE_TEST_SUITE_P(Transports, MultiProcess, ::testing::ValuesIn(testing::builtDataTransports()),
                         [](const auto& info) { return info.param; });

// The stall tests' setting: a peer process, and an engine over tcp that
// has registered `buf` and opened the peer's segment (`handle`). The test
// stops the peer when it wants to.
struct EngineBesideAPeer {
  EngineBesideAPeer(size_t bytes, int seed) : peer(bytes, seed), buf(bytes), bytes(bytes) {}
  void open(const EngineConfig& config) {
    ASSERT_EQ(engine.init("P2PHANDSHAKE", "127.0.0.1", "tcp", "", config), kOk);
    ASSERT_EQ(engine.registerLocalMemory(buf.data, bytes), kOk);
    handle = engine.openSegment(peer.segment);
    ASSERT_NE(handle, kInvalidSegment);
  }
  PeerProcess peer;
  AlignedBuffer buf;
  TransferEngine engine;  // first to go: nothing reads `buf` after it
  SegmentHandle handle = kInvalidSegment;
  size_t bytes;
};

// A peer that is alive but stopped (SIGSTOP) never answers over TCP: the
// transfer must end with a timeout. (Cross-memory attach needs nothing from
// the target, so a stopped peer is still written over shm, as designed.)
TEST(MultiProcessStall, StoppedPeerTimesOutOverTcp) {
  constexpr size_t kBytes = 64u << 20;
  EngineBesideAPeer setting(kBytes, 3);
  EngineConfig config = testing::fastFailConfig();
  config.transfer_timeout = 1000ms;
  ASSERT_NO_FATAL_FAILURE(setting.open(config));
  auto& [peer, buf, engine, h, bytes] = setting;
  peer.stopNow();
  auto start_time = std::chrono::steady_clock::now();
  int rc = engine.transferSync({TransferRequest{Opcode::kWrite, buf.data, h, peer.buffer_addr, kBytes}});
  auto elapsed = std::chrono::steady_clock::now() - start_time;
  peer.signal(SIGCONT);
  EXPECT_EQ(rc, kTimeout);
  EXPECT_GE(elapsed, 900ms);
  EXPECT_LT(elapsed, config.budgetFor(kBytes) + 1500ms);
}

// The same over rdma: the stopped peer's (software) NIC answers nothing, so
// the queue pair runs out of retries (or the deadline passes first) and
// the transfer fails, bounded, naming the peer as unreachable.
TEST(MultiProcessStall, StoppedPeerFailsBoundedOverRdma) {
  if (!MOONCAKE_WITH_RDMA) GTEST_SKIP() << "built without the rdma transport (MOONCAKE_WITH_RDMA)";
  constexpr size_t kBytes = 64u << 20;
  ::setenv("MC_RDMA_PROVIDER", "software", 1);
  PeerProcess peer(kBytes, 3);
  EngineConfig config = testing::fastFailConfig();
  config.transfer_timeout = 3000ms;
  TransferEngine engine;
  AlignedBuffer buf(kBytes);
  ASSERT_EQ(engine.init("P2PHANDSHAKE", "127.0.0.1", "rdma", "", config), kOk);
  ASSERT_EQ(engine.registerLocalMemory(buf.data, kBytes), kOk);
  SegmentHandle h = engine.openSegment(peer.segment);
  ASSERT_NE(h, kInvalidSegment);
  ASSERT_EQ(engine.transportFor(h), "rdma");
  const TransferRequest r{Opcode::kWrite, buf.data, h, peer.buffer_addr, kBytes};
  ASSERT_EQ(engine.transferSync({r}), kOk);  // connected, and its queue pair works
  peer.stopNow();
  auto start_time = std::chrono::steady_clock::now();
  int rc = engine.transferSync({r});
  auto elapsed = std::chrono::steady_clock::now() - start_time;
  peer.signal(SIGCONT);
  // Retries run out in 4.096 us * 2^14 * 8 = 0.54 s, before the 3 s deadline.
  EXPECT_EQ(rc, kPeerUnreachable) << errorName(rc);
  EXPECT_GE(elapsed, 400ms);
  EXPECT_LT(elapsed, 2500ms);
  // The peer runs again: the next transfer connects anew and lands.
  fillPattern(buf.data, kBytes, 55);
  ASSERT_EQ(engine.transferSync({r}), kOk);
  EXPECT_EQ(peer.digestOf(0, kBytes), digest(buf.data, kBytes));
}

// A receive window closed while a write is landing in it, its writer stopped
// mid-payload (SIGSTOP): the close cuts the write short at once instead of
// waiting out the transfer budget (20 s here), and nothing lands after it,
// also once the writer goes on. One slice per request, so the payload lands
// in order on one connection and its first bytes show the write is under way.
TEST(MultiProcessStall, ClosingAReceiveWindowCutsShortAWriteWhoseWriterStopped) {
  constexpr size_t kBytes = 256u << 20;
  ::setenv("MC_TCP_SLICE_SIZE", std::to_string(kBytes).c_str(), 1);  // read by the peer's engine
  PeerProcess writer(kBytes, 7);
  ::unsetenv("MC_TCP_SLICE_SIZE");
  EngineConfig config = testing::fastFailConfig();
  config.transfer_timeout = 20000ms;
  TransferEngine engine;
  AlignedBuffer window(kBytes);
  std::memset(window.data, 0, kBytes);
  ASSERT_EQ(engine.init("P2PHANDSHAKE", "127.0.0.1", "tcp", "", config), kOk);
  ASSERT_EQ(engine.openReceiveWindow(window.data, kBytes), kOk);
  EXPECT_EQ(engine.openReceiveWindow(window.data + 4096, 4096), kAddressOverlapped);  // refused, quietly
  auto first = reinterpret_cast<volatile uint64_t*>(window.data);
  auto last = reinterpret_cast<volatile uint64_t*>(window.data + kBytes - 8);
  writer.startWrite(engine.segmentName(), reinterpret_cast<uint64_t>(window.data), kBytes);
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (*first == 0 && std::chrono::steady_clock::now() < deadline) {
  }
  writer.stopNow();
  ASSERT_NE(*first, 0u) << "the write never started";
  ASSERT_EQ(*last, 0u) << "the write ended before its writer was stopped";
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(engine.closeReceiveWindow(window.data), kOk);
  const auto took = std::chrono::steady_clock::now() - t0;
  const uint64_t closed = digest(window.data, kBytes);
  writer.signal(SIGCONT);
  EXPECT_NE(writer.writeResult(), kOk);
  EXPECT_LT(took, 2s);
  EXPECT_EQ(digest(window.data, kBytes), closed);  // nothing landed after the close
  EXPECT_EQ(*last, 0u);
}

// A write to a stopped peer still goes out: the kernels take its bytes
// (small ones into the socket buffers), but no answer comes. Its status says
// so (`sent`, state still pending) until the deadline fails it, which is
// reported as for any write. A read is sent only when it has its bytes.
TEST(MultiProcessStall, AWriteIsSentBeforeItsAnswerAndStillFailsWithoutOne) {
  EngineBesideAPeer setting(1u << 20, 9);
  EngineConfig config = testing::fastFailConfig();
  config.transfer_timeout = 1000ms;
  ASSERT_NO_FATAL_FAILURE(setting.open(config));
  auto& [peer, buf, engine, h, bytes] = setting;
  const TransferStatus healthy = submitAndWait(engine, {{Opcode::kWrite, buf.data, h, peer.buffer_addr, 4096}});
  EXPECT_EQ(healthy.state, TransferState::kCompleted);
  EXPECT_TRUE(healthy.sent);
  peer.stopNow();
  // 64 bytes go inline on the pooled connection (the control lane), 32 KiB
  // through a worker; a read of 64 bytes waits for bytes that never come.
  struct Probe {
    TransferRequest request;
    BatchId id;
  };
  std::vector<Probe> probes = {{{Opcode::kWrite, buf.data, h, peer.buffer_addr, 64}, kInvalidBatch},
                               {{Opcode::kWrite, buf.data + 4096, h, peer.buffer_addr + 4096, 32768}, kInvalidBatch},
                               {{Opcode::kRead, buf.data + 65536, h, peer.buffer_addr, 64}, kInvalidBatch}};
  for (Probe& p : probes) {
    p.id = engine.allocateBatchID(1);
    ASSERT_EQ(engine.submitTransfer(p.id, {p.request}), kOk);
  }
  for (size_t i = 0; i < 2; ++i) {
    TransferStatus status;
    const auto limit = std::chrono::steady_clock::now() + 500ms;
    while (engine.getBatchTransferStatus(probes[i].id, status) == kOk && !status.sent &&
           std::chrono::steady_clock::now() < limit) {
      std::this_thread::sleep_for(1ms);
    }
    EXPECT_TRUE(status.sent) << "write " << i;
    EXPECT_EQ(status.state, TransferState::kPending) << "write " << i;
  }
  const auto limit = std::chrono::steady_clock::now() + config.budgetFor(32768) + 2s;
  for (const Probe& p : probes) {
    TransferStatus status;
    while (engine.getBatchTransferStatus(p.id, status) == kOk && status.state == TransferState::kPending &&
           std::chrono::steady_clock::now() < limit) {
      if (p.request.opcode == Opcode::kRead) {
        EXPECT_FALSE(status.sent);
      }
      std::this_thread::sleep_for(1ms);
    }
    EXPECT_EQ(status.state, TransferState::kTimeout);  // never answered: sent does not make it a success
    engine.freeBatchID(p.id);
  }
  peer.signal(SIGCONT);
}

// Small writes submitted without waiting (credits, acks) have their answers
// awaited together on the control lane, not by the workers: while a stopped
// peer holds its answers back (and ties up workers trying to connect),
// another peer's small write still completes at once.
TEST(MultiProcessStall, AStoppedPeerHoldsUpOnlyItsOwnSmallWrites) {
  constexpr size_t kBytes = 1u << 20, kWarm = 64u << 10;
  PeerProcess stopped(kBytes, 5), healthy(kBytes, 6);
  EngineConfig config = testing::fastFailConfig();
  config.transfer_timeout = 3000ms;
  TransferEngine engine;
  AlignedBuffer buf(kBytes);
  ASSERT_EQ(engine.init("P2PHANDSHAKE", "127.0.0.1", "tcp", "", config), kOk);
  ASSERT_EQ(engine.registerLocalMemory(buf.data, kBytes), kOk);
  const SegmentHandle to_stopped = engine.openSegment(stopped.segment), to_healthy = engine.openSegment(healthy.segment);
  ASSERT_NE(to_stopped, kInvalidSegment);
  ASSERT_NE(to_healthy, kInvalidSegment);
  // Writes above the control size go to the workers, several at once: both
  // peers then have idle pooled connections.
  for (auto [handle, addr] : {std::pair{to_stopped, stopped.buffer_addr}, std::pair{to_healthy, healthy.buffer_addr}}) {
    std::vector<TransferRequest> warm;
    for (size_t i = 0; i < 8; ++i) warm.push_back({Opcode::kWrite, buf.data + i * kWarm, handle, addr + i * kWarm, kWarm});
    ASSERT_EQ(submitAndWait(engine, warm).state, TransferState::kCompleted);
  }
  stopped.stopNow();
  std::vector<BatchId> held;
  for (size_t i = 0; i < 8; ++i) {
    const BatchId id = engine.allocateBatchID(1);
    ASSERT_EQ(engine.submitTransfer(id, {{Opcode::kWrite, buf.data + i * 64, to_stopped, stopped.buffer_addr + i * 64, 64}}),
              kOk);
    held.push_back(id);
  }
  std::this_thread::sleep_for(50ms);
  fillPattern(buf.data + 4096, 64, 11);
  const auto t0 = std::chrono::steady_clock::now();
  const TransferStatus to_the_healthy =
      submitAndWait(engine, {{Opcode::kWrite, buf.data + 4096, to_healthy, healthy.buffer_addr + 4096, 64}});
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(to_the_healthy.state, TransferState::kCompleted);
  // Held up behind the stopped peer, it would take the 3 s deadline; the
  // bound leaves room for a loaded 2-core machine (500 ms failed once there).
  EXPECT_LT(took, 1500ms);
  EXPECT_EQ(healthy.digestOf(4096, 64), digest(buf.data + 4096, 64));
  // The stopped peer's writes end, timed out, within their deadline.
  const auto limit = std::chrono::steady_clock::now() + config.budgetFor(64) + 2s;
  for (BatchId id : held) {
    const TransferStatus status = pollWhilePending(engine, id, limit);
    EXPECT_EQ(status.state, TransferState::kTimeout);  // never answered
    engine.freeBatchID(id);
  }
  stopped.signal(SIGCONT);
}

// A write blocked on a stopped peer (its socket buffers full, or its
// answer never coming) ends at once when its batch is canceled, long before
// its deadline; small writes on the control lane end too. With `workers`
// workers and slices of `slice_bytes`, one write is on several connections
// at once, and every one of them is shut down.
void expectCanceledWritesToAStoppedPeerEndAtOnce(int workers, size_t slice_bytes) {
  constexpr size_t kBytes = 64u << 20;
  EngineBesideAPeer setting(kBytes, 8);
  EngineConfig config = testing::fastFailConfig();
  config.transfer_timeout = 30000ms;
  config.tcp_workers = workers;
  config.tcp_slice_size = slice_bytes;
  ASSERT_NO_FATAL_FAILURE(setting.open(config));
  auto& [peer, buf, engine, h, bytes] = setting;
  ASSERT_EQ(engine.transferSync({{Opcode::kWrite, buf.data, h, peer.buffer_addr, 4096}}), kOk);  // a pooled connection
  peer.stopNow();
  std::vector<BatchId> batches;
  // The last 4 KiB stay clear of the canceled writes: bytes of theirs that
  // were already in the kernel's buffers still land once the peer goes on.
  constexpr size_t kClear = 4096, kCanceledPart = kBytes - kClear;
  for (auto [offset, length] :
       {std::pair<size_t, size_t>{0, kCanceledPart / 2}, {kCanceledPart / 2, kCanceledPart / 2}, {0, 64}}) {
    const BatchId id = engine.allocateBatchID(1);
    ASSERT_EQ(engine.submitTransfer(id, {{Opcode::kWrite, buf.data + offset, h, peer.buffer_addr + offset, length}}),
              kOk);
    batches.push_back(id);
  }
  std::this_thread::sleep_for(300ms);
  for (BatchId id : batches) {
    TransferStatus status;
    ASSERT_EQ(engine.getBatchTransferStatus(id, status), kOk);
    EXPECT_EQ(status.state, TransferState::kPending);  // held up by the stopped peer
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (BatchId id : batches) ASSERT_EQ(engine.cancelBatch(id), kOk);
  for (BatchId id : batches) {
    const TransferStatus status = pollWhilePending(engine, id, t0 + 5s);
    EXPECT_EQ(status.state, TransferState::kCanceled);
    EXPECT_EQ(status.error, kCanceled);
    EXPECT_EQ(engine.freeBatchID(id), kOk);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
  peer.signal(SIGCONT);
  // The peer answers again: new writes go through.
  fillPattern(buf.data + kCanceledPart, kClear, 9);
  EXPECT_EQ(
      engine.transferSync({{Opcode::kWrite, buf.data + kCanceledPart, h, peer.buffer_addr + kCanceledPart, kClear}}),
      kOk);
  EXPECT_EQ(peer.digestOf(kCanceledPart, kClear), digest(buf.data + kCanceledPart, kClear));
}

// One worker: the second write, queued behind the first, never starts.
TEST(MultiProcessStall, CanceledWritesToAStoppedPeerEndAtOnce) {
  expectCanceledWritesToAStoppedPeerEndAtOnce(1, 4u << 20);
}

// Four workers, 1 MiB slices: each write's slices block on four connections
// at once (a cancel that shut down only the last one announced left the
// others to the 30 s deadline, and a P2P send of a stopped peer with them).
TEST(MultiProcessStall, CanceledWritesInSeveralSlicesEndAtOnce) {
  expectCanceledWritesToAStoppedPeerEndAtOnce(4, 1u << 20);
}

// The only worker is held up by a write to the stopped peer that nobody
// cancels (a P2P channel's credit or ack, say). A canceled write queued
// behind it ends at once all the same (it used to wait for the worker,
// until the first write's deadline), and the first is still pending.
TEST(MultiProcessStall, ACanceledWriteQueuedBehindABusyWorkerEndsAtOnce) {
  EngineBesideAPeer setting(64u << 20, 10);
  EngineConfig config = testing::fastFailConfig();
  config.transfer_timeout = 30000ms;
  config.tcp_workers = 1;
  ASSERT_NO_FATAL_FAILURE(setting.open(config));
  auto& [peer, buf, engine, h, bytes] = setting;
  ASSERT_EQ(engine.transferSync({{Opcode::kWrite, buf.data, h, peer.buffer_addr, 4096}}), kOk);
  peer.stopNow();
  const BatchId held = engine.allocateBatchID(1), queued = engine.allocateBatchID(1);
  ASSERT_EQ(engine.submitTransfer(held, {{Opcode::kWrite, buf.data, h, peer.buffer_addr, 32u << 20}}), kOk);
  ASSERT_EQ(engine.submitTransfer(queued, {{Opcode::kWrite, buf.data + (32u << 20), h, peer.buffer_addr, 65536}}), kOk);
  std::this_thread::sleep_for(300ms);
  TransferStatus status;
  ASSERT_EQ(engine.getBatchTransferStatus(queued, status), kOk);
  EXPECT_EQ(status.state, TransferState::kPending);
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(engine.cancelBatch(queued), kOk);
  status = pollWhilePending(engine, queued, t0 + 5s);
  EXPECT_EQ(status.state, TransferState::kCanceled);
  EXPECT_FALSE(status.sent);  // it never left
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
  ASSERT_EQ(engine.getBatchTransferStatus(held, status), kOk);
  EXPECT_EQ(status.state, TransferState::kPending);  // still held up by the peer
  ASSERT_EQ(engine.cancelBatch(held), kOk);
  status = pollWhilePending(engine, held, std::chrono::steady_clock::now() + 5s);
  EXPECT_EQ(status.state, TransferState::kCanceled);
  EXPECT_EQ(engine.freeBatchID(held), kOk);
  EXPECT_EQ(engine.freeBatchID(queued), kOk);
  peer.signal(SIGCONT);
}

}  // namespace
}  // namespace mooncake::te
