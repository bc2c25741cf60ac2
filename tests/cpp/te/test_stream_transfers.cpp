// StreamTransfers without a GPU: a fake launcher records the host functions
// as a stream would queue them, and the test plays the stream, calling each
// on a thread of its own as CUDA's host-function thread does.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include "engine_fixture.h"
#include "mooncake/te/stream_transfers.h"

namespace mooncake::te::testing {
namespace {

class FakeStream {
 public:
  StreamTransfers::HostFunctionLauncher launcher() {
    return [this](void* stream, void (*fn)(void*), void* arg) {
      EXPECT_EQ(stream, this);
      std::lock_guard lock(mutex_);
      queued_.push_back({fn, arg});
      return static_cast<int>(kOk);
    };
  }
  void* handle() { return this; }
  size_t queued() {
    std::lock_guard lock(mutex_);
    return queued_.size();
  }
  // The stream gets to its next host function: true when it returned in `limit`.
  bool runNext(std::chrono::seconds limit = std::chrono::seconds(20)) {
    Queued next;
    {
      std::lock_guard lock(mutex_);
      if (queued_.empty()) return false;
      next = queued_.front();
      queued_.erase(queued_.begin());
    }
    auto ran = std::async(std::launch::async, [next] { next.fn(next.arg); });
    return ran.wait_for(limit) == std::future_status::ready;
  }

 private:
  struct Queued {
    void (*fn)(void*) = nullptr;
    void* arg = nullptr;
  };
  std::mutex mutex_;
  std::vector<Queued> queued_;
};

// The engine pair owns its engines; StreamTransfers wants shared ownership.
std::shared_ptr<TransferEngine> borrowed(TransferEngine& engine) {
  return std::shared_ptr<TransferEngine>(&engine, [](TransferEngine*) {});
}

class StreamTransfersTest : public ::testing::TestWithParam<const char*> {};

TEST_P(StreamTransfersTest, AWriteStartsWhenTheStreamGetsThereAndHasLandedWhenTheStreamGoesOn) {
  constexpr size_t kBytes = (4u << 20) + 5;
  EnginePair pair(GetParam(), kBytes);
  FakeStream stream;
  StreamTransfers transfers(borrowed(pair.local), stream.launcher());
  std::memset(pair.remote_buf.data, 0, kBytes);
  fillPattern(pair.local_buf.data, kBytes, 7);
  ASSERT_EQ(transfers.enqueue(stream.handle(), {pair.request(Opcode::kWrite, 0, 0, kBytes)}, "", "write"), kOk);
  ASSERT_EQ(stream.queued(), 1u);
  // Queued, not started: the stream has not got there.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(digest(pair.remote_buf.data, kBytes), digest(std::vector<char>(kBytes).data(), kBytes));
  ASSERT_TRUE(stream.runNext());
  EXPECT_EQ(digest(pair.remote_buf.data, kBytes), digest(pair.local_buf.data, kBytes));
  EXPECT_EQ(transfers.takeFailure(), "");
}

TEST_P(StreamTransfersTest, TransfersRunInTheStreamsOrder) {
  // Three transfers into one remote range: the last one the stream reaches wins.
  constexpr size_t kBytes = 1u << 20;
  EnginePair pair(GetParam(), 4 * kBytes);
  FakeStream stream;
  StreamTransfers transfers(borrowed(pair.local), stream.launcher());
  for (int i = 0; i < 3; ++i) {
    fillPattern(pair.local_buf.data + i * kBytes, kBytes, 100 + i);
    ASSERT_EQ(transfers.enqueue(stream.handle(), {pair.request(Opcode::kWrite, i * kBytes, 0, kBytes)}, "", "w"), kOk);
  }
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(stream.runNext());
    EXPECT_EQ(digest(pair.remote_buf.data, kBytes), digest(pair.local_buf.data + i * kBytes, kBytes)) << i;
  }
  // And a read back into the fourth block.
  ASSERT_EQ(transfers.enqueue(stream.handle(), {pair.request(Opcode::kRead, 3 * kBytes, 0, kBytes)}, "", "r"), kOk);
  ASSERT_TRUE(stream.runNext());
  EXPECT_EQ(digest(pair.local_buf.data + 3 * kBytes, kBytes), digest(pair.local_buf.data + 2 * kBytes, kBytes));
  EXPECT_EQ(transfers.takeFailure(), "");
}

TEST_P(StreamTransfersTest, AFailedTransferReleasesTheStreamAndIsReportedOnce) {
  EnginePair pair(GetParam(), 1u << 16);
  FakeStream stream;
  StreamTransfers transfers(borrowed(pair.local), stream.launcher());
  // Beyond the peer's registered buffer: refused by the peer.
  TransferRequest outside = pair.request(Opcode::kWrite, 0, 0, 4096);
  outside.target_offset += 1u << 20;
  ASSERT_EQ(transfers.enqueue(stream.handle(), {outside}, "", "transfer_write_on_cuda to 'peer'"), kOk);
  ASSERT_EQ(transfers.enqueue(stream.handle(), {outside}, "", "second"), kOk);
  ASSERT_TRUE(stream.runNext());
  ASSERT_TRUE(stream.runNext());
  std::string failure = transfers.takeFailure();
  EXPECT_NE(failure.find("transfer_write_on_cuda to 'peer' (1 requests, 4096 bytes) failed"), std::string::npos)
      << failure;
  EXPECT_NE(failure.find("and 1 later"), std::string::npos) << failure;
  EXPECT_EQ(transfers.takeFailure(), "");
}

TEST_P(StreamTransfersTest, TransfersStillOnAStreamAreServedAfterTheirOwnerIsGone) {
  constexpr size_t kBytes = 1u << 20;
  EnginePair pair(GetParam(), kBytes);
  FakeStream stream;
  fillPattern(pair.local_buf.data, kBytes, 3);
  {
    StreamTransfers transfers(borrowed(pair.local), stream.launcher());
    ASSERT_EQ(transfers.enqueue(stream.handle(), {pair.request(Opcode::kWrite, 0, 0, kBytes)}, "", "w"), kOk);
  }
  ASSERT_TRUE(stream.runNext());
  EXPECT_EQ(digest(pair.remote_buf.data, kBytes), digest(pair.local_buf.data, kBytes));
}

INSTANTIATE_TEST_SUITE_P(Transports, StreamTransfersTest, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return std::string(info.param); });

TEST(StreamTransfers, ALaunchThatFailsQueuesNothing) {
  EnginePair pair("tcp", 4096);
  StreamTransfers transfers(borrowed(pair.local),
                            [](void*, void (*)(void*), void*) { return static_cast<int>(kEndpointError); });
  EXPECT_EQ(transfers.enqueue(nullptr, {pair.request(Opcode::kWrite, 0, 0, 64)}, "", "w"), kEndpointError);
  EXPECT_EQ(transfers.takeFailure(), "");
}

}  // namespace
}  // namespace mooncake::te::testing
