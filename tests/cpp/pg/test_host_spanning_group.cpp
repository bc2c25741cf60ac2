// HostSpanningGroup across real processes (fork), each with its own transfer
// engine forced onto tcp, as ranks on different hosts would be. The layout
// is declared, so every shape is covered on one machine: two hosts of two,
// hosts whose ranks interleave, one rank per host (the ring), and uneven
// hosts. Results by closed formula; failures must end in errors, not hangs.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <thread>

#include "collective_checks.h"
#include "common/spawn.h"
#include "mooncake/pg/host_spanning_group.h"
#include "mooncake/te/transfer_engine.h"

namespace mooncake::pg {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

struct SpanOptions {
  std::chrono::milliseconds timeout = 20s;  // shm steps and P2P progress
  size_t slot_bytes = 256 * 1024;           // small, so large messages take several chunks
};

// Publishes this rank's endpoint in `dir` and reads everyone's (a stand-in
// for the torch store).
bool exchangeEndpoints(const fs::path& dir, int rank, int world, const P2pEndpoint& mine,
                       std::vector<P2pEndpoint>& all) {
  {
    std::ofstream(dir / ("tmp" + std::to_string(rank))) << mine.encode();
    fs::rename(dir / ("tmp" + std::to_string(rank)), dir / std::to_string(rank));
  }
  all.resize(world);
  auto deadline = std::chrono::steady_clock::now() + 20s;
  for (int r = 0; r < world; ++r) {
    for (;;) {
      std::ifstream in(dir / std::to_string(r));
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      if (!text.empty() && P2pEndpoint::decode(text, all[r])) break;
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(2ms);
    }
  }
  return true;
}

// Runs body(group) in one forked process per entry of `hosts` (the host
// name of each rank); returns each child's exit status (0 = checks passed).
std::vector<int> runSpanning(const std::vector<std::string>& hosts, const SpanOptions& options,
                             const std::function<int(HostSpanningGroup&)>& body,
                             std::chrono::seconds limit = 90s) {
  const int world = static_cast<int>(hosts.size());
  // One name for the endpoint folder and, with the host appended, each host's shm group.
  const std::string tag = testing::uniqueName("mc-span");
  const fs::path dir = fs::temp_directory_path() / tag;
  fs::create_directories(dir);
  std::vector<int> status = testing::runForkedRanks(
      world,
      [&](int r) -> int {
        HostLayout layout = HostLayout::fromIdentities(hosts);
        te::TransferEngine engine;
        if (engine.init("P2PHANDSHAKE", "127.0.0.1", "tcp") != te::kOk) ::_exit(101);
        P2pOptions p2p;
        p2p.chunk_bytes = 64 * 1024;
        p2p.pool_chunks = 4;
        p2p.timeout = options.timeout;
        auto channel = std::make_unique<P2pChannel>(engine, r, world, p2p);
        std::vector<P2pEndpoint> endpoints;
        if (!exchangeEndpoints(dir, r, world, channel->localEndpoint(), endpoints)) ::_exit(102);
        channel->connect(endpoints);
        const int host = layout.hostOf(r);
        ShmGroupOptions shm;
        shm.slot_bytes = options.slot_bytes;
        shm.timeout = options.timeout;
        shm.rank_names = layout.ranksOn(host);
        std::string error;
        auto local = ShmGroup::open("/" + tag + "-" + std::to_string(host), layout.localIndexOf(r),
                                    static_cast<int>(layout.ranksOn(host).size()), shm, &error);
        if (!local) {
          std::fprintf(stderr, "rank %d: %s\n", r, error.c_str());
          ::_exit(103);
        }
        HostSpanningGroup group(r, layout, std::move(local), std::move(channel));
        const int status = body(group);
        std::fflush(stderr);
        ::_exit(status);  // the group, channel and engine left open: no destructor runs in a rank
      },
      limit);
  fs::remove_all(dir);
  return status;
}

struct Shape {
  const char* name;
  std::vector<std::string> hosts;  // host of each rank
};

void PrintTo(const Shape& shape, std::ostream* os) { *os << shape.name; }

class SpanningShapes : public ::testing::TestWithParam<Shape> {};

TEST(HostLayout, HostsNumberedByTheirLowestRank) {
  HostLayout l = HostLayout::fromIdentities({"b", "a", "b", "c", "a"});
  ASSERT_EQ(l.hosts(), 3);
  EXPECT_EQ(l.ranksOn(0), (std::vector<int>{0, 2}));
  EXPECT_EQ(l.ranksOn(1), (std::vector<int>{1, 4}));
  EXPECT_EQ(l.ranksOn(2), (std::vector<int>{3}));
  EXPECT_EQ(l.leaderOf(1), 1);
  EXPECT_EQ(l.localIndexOf(4), 1);
  EXPECT_EQ(l.hostOf(3), 2);
}

TEST_P(SpanningShapes, EveryCollectiveEveryRootAndSize) {
  const int world = static_cast<int>(GetParam().hosts.size());
  auto status = runSpanning(GetParam().hosts, SpanOptions{}, [&](HostSpanningGroup& g) {
    // 1 element, odd, and above the leaders' one-exchange size (the ring
    // when there are more than two hosts) and several shm slots.
    for (size_t count : {size_t{1}, size_t{1237}, size_t{300000}}) {
      for (int shift = 0; shift < world; ++shift) {
        if (int rc = everyCollective(g, count, shift)) return rc;
        if (count > 1237) break;  // every root once at the small sizes
      }
    }
    return 0;
  });
  for (int r = 0; r < world; ++r) EXPECT_EQ(status[r], 0) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, SpanningShapes,
    ::testing::Values(Shape{"TwoHostsOfTwo", {"A", "A", "B", "B"}}, Shape{"Interleaved", {"A", "B", "A", "B"}},
                      Shape{"RankPerHostRing", {"A", "B", "C", "D"}}, Shape{"Uneven", {"A", "B", "B", "C", "B"}},
                      Shape{"TwoHostsOneRankEach", {"A", "B"}}),
    [](const ::testing::TestParamInfo<Shape>& info) { return std::string(info.param.name); });

// Sums `count` random floats over the group in place and checks that every
// rank ended with the same bits (0), else which step failed.
int sumsAgreeBitForBit(HostSpanningGroup& g, size_t count) {
  std::vector<float> v(count);
  std::mt19937 rng(g.rank() + 1);
  std::uniform_real_distribution<float> dist(-1e3f, 1e3f);
  for (float& x : v) x = dist(rng) * 1e-3f;
  if (!g.allreduce(v.data(), v.data(), count, DataType::kFloat32, ReduceOp::kSum).ok) return 1;
  std::vector<float> all(count * g.size());
  if (!g.allgather(v.data(), all.data(), count * sizeof(float)).ok) return 2;
  for (int s = 1; s < g.size(); ++s) {
    if (std::memcmp(all.data(), all.data() + s * count, count * sizeof(float)) != 0) return 3;
  }
  return 0;
}

TEST(HostSpanningGroup, FloatReductionsAgreeBitForBitOnEveryRank) {
  // Sums of values that round differently in different orders: every rank
  // must still end with the same bits (one owner per segment, fixed order).
  auto status = runSpanning({"A", "B", "C"}, SpanOptions{},
                            [](HostSpanningGroup& g) { return sumsAgreeBitForBit(g, 200000); });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(status[r], 0) << "rank " << r;
}

TEST(HostSpanningGroup, TwoHostsReduceByHalvesToTheExactSumInPlaceAndNot) {
  // One rank per host: every element's sum is one float addition, whoever
  // makes it, so each rank checks against a + b computed here from both
  // ranks' inputs. An odd count splits into unequal halves; the sizes are
  // below and above the size from which the leaders go by halves (1 MiB).
  auto status = runSpanning({"A", "B"}, SpanOptions{}, [](HostSpanningGroup& g) {
    auto input_of = [](int rank, size_t count) {
      std::vector<float> v(count);
      std::mt19937 rng(rank + 11);
      std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
      for (float& x : v) x = dist(rng) * 1e-3f;
      return v;
    };
    for (size_t count : {size_t{100003}, size_t{300001}, size_t{1u << 20}}) {
      const std::vector<float> a = input_of(0, count), b = input_of(1, count);
      std::vector<float> expected(count);
      for (size_t i = 0; i < count; ++i) expected[i] = a[i] + b[i];
      std::vector<float> io = g.rank() == 0 ? a : b, out(count, -1.0f);
      const std::vector<float> kept = io;
      if (!g.allreduce(io.data(), out.data(), count, DataType::kFloat32, ReduceOp::kSum).ok) return 1;
      if (std::memcmp(out.data(), expected.data(), count * sizeof(float)) != 0) return 2;
      if (io != kept) return 3;  // out of place: the input is left alone
      if (!g.allreduce(io.data(), io.data(), count, DataType::kFloat32, ReduceOp::kSum).ok) return 4;
      if (std::memcmp(io.data(), expected.data(), count * sizeof(float)) != 0) return 5;
    }
    return 0;
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(status[r], 0) << "rank " << r;
}

TEST(HostSpanningGroup, TwoHostsOfTwoAgreeBitForBitOnLargeReductions) {
  auto status = runSpanning({"A", "A", "B", "B"}, SpanOptions{},
                            [](HostSpanningGroup& g) { return sumsAgreeBitForBit(g, 300001); });
  for (int r = 0; r < 4; ++r) EXPECT_EQ(status[r], 0) << "rank " << r;
}

// All-reduces of whole numbers (exact in float32 in any order, so every rank
// checks against a closed formula) at sizes across every two-host form: one
// exchange folded where it lands, and by halves (one rank per host, from
// 1 MiB); in place and out of place.
int exactSumsAcrossTwoHosts(HostSpanningGroup& g) {
  const int world = g.size();
  for (size_t count : {size_t{100003}, size_t{300001}, size_t{(3u << 20) / 4 + 5}, size_t{(6u << 20) / 4 + 1}}) {
    std::vector<float> io(count), out(count, -1.0f);
    for (size_t i = 0; i < count; ++i) io[i] = static_cast<float>(i % 97) + g.rank();
    const std::vector<float> kept = io;
    auto exact = [&](const std::vector<float>& v) {
      for (size_t i = 0; i < count; ++i) {
        if (v[i] != static_cast<float>(world * (i % 97) + world * (world - 1) / 2)) return false;
      }
      return true;
    };
    if (!g.allreduce(io.data(), out.data(), count, DataType::kFloat32, ReduceOp::kSum).ok) return 1;
    if (!exact(out)) return 2;
    if (io != kept) return 3;  // out of place: the input is left alone
    if (!g.allreduce(io.data(), io.data(), count, DataType::kFloat32, ReduceOp::kSum).ok) return 4;
    if (!exact(io)) return 5;
  }
  return 0;
}

TEST(HostSpanningGroup, TwoHostsOfEveryShapeSumExactly) {
  // Uneven hosts included: both leaders must take the same form (they once
  // did not, and every all_reduce from 1 MiB failed with a size mismatch).
  for (const std::vector<std::string>& hosts :
       {std::vector<std::string>{"A", "B", "B"}, std::vector<std::string>{"A", "A", "A", "B"},
        std::vector<std::string>{"A", "B", "A", "B", "B"}, std::vector<std::string>{"A", "B"}}) {
    auto status = runSpanning(hosts, SpanOptions{}, exactSumsAcrossTwoHosts);
    for (size_t r = 0; r < hosts.size(); ++r) EXPECT_EQ(status[r], 0) << hosts.size() << " ranks, rank " << r;
  }
}

TEST(HostSpanningGroupFailure, AnInPlaceReductionByHalvesSaysWhetherItWroteBeforeItsPeerDied) {
  // Rank 1 dies while a large in-place all_reduce is under way. Rank 0's
  // call fails; when it reports its output unwritten (so that it may be
  // run again), its tensor must still hold its input, bit for bit.
  SpanOptions options;
  options.timeout = 3s;
  auto status = runSpanning({"A", "B"}, options, [](HostSpanningGroup& g) {
    const size_t count = 4u << 20;  // 16 MiB: many pieces, each of many chunks
    std::vector<float> v(count);
    for (size_t i = 0; i < count; ++i) v[i] = static_cast<float>(i % 1000) * 0.25f;
    const std::vector<float> kept = v;
    if (g.rank() == 1) {
      std::thread([] {
        std::this_thread::sleep_for(30ms);
        _exit(42);
      }).detach();
      for (;;) g.allreduce(v.data(), v.data(), count, DataType::kFloat32, ReduceOp::kSum);
    }
    OpResult r = g.allreduce(v.data(), v.data(), count, DataType::kFloat32, ReduceOp::kSum);
    for (int more = 0; r.ok && more < 100; ++more) {
      std::copy(kept.begin(), kept.end(), v.begin());
      r = g.allreduce(v.data(), v.data(), count, DataType::kFloat32, ReduceOp::kSum);
    }
    if (r.ok) return 1;
    std::fprintf(stderr, "rank 0: %s (output %s)\n", r.error.c_str(), r.output_written ? "written" : "intact");
    if (!r.output_written && v != kept) return 2;
    return 0;
  });
  EXPECT_EQ(status[1], 42);
  EXPECT_EQ(status[0], 0);
}

TEST(HostSpanningGroupFailure, DeadRankFailsEveryHostAtOnceAndEveryHintNamesIt) {
  // Rank 3 (host B) dies. Its host mate sees it through the arena; host A
  // learns it from B's leader giving up, not from a timeout: every survivor
  // fails well inside the 3 s deadline, and names rank 3 (not the leader it
  // was waiting for).
  SpanOptions options;
  options.timeout = 3s;
  auto status = runSpanning({"A", "A", "B", "B"}, options, [](HostSpanningGroup& g) {
    std::vector<int32_t> v(1000, 1);
    if (!g.allreduce(v.data(), v.data(), v.size(), DataType::kInt32, ReduceOp::kSum).ok) return 1;
    if (g.rank() == 3) _exit(42);  // host B loses a rank before the next collective
    auto t0 = std::chrono::steady_clock::now();
    OpResult r = g.allreduce(v.data(), v.data(), v.size(), DataType::kInt32, ReduceOp::kSum);
    auto took = std::chrono::steady_clock::now() - t0;
    if (r.ok) return 2;
    std::fprintf(stderr, "rank %d after %lld ms: %s\n", g.rank(),
                 static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(took).count()),
                 r.error.c_str());
    if (took > 1500ms) return 3;
    if (r.failed_ranks != std::vector<int>{3}) return 4;
    if (g.barrier().ok || !g.broken()) return 5;  // fails fast from now on
    return 0;
  });
  EXPECT_EQ(status[3], 42);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(status[r], 0) << "rank " << r;
}

TEST(HostSpanningGroupFailure, StalledLeaderTimesOutEverywhere) {
  // Host B's leader stops taking part (alive, silent): the others fail at
  // the deadline, not later, and the group stays failed.
  SpanOptions options;
  options.timeout = 1s;
  auto start = std::chrono::steady_clock::now();
  auto status = runSpanning({"A", "B", "B"}, options, [](HostSpanningGroup& g) {
    std::vector<float> v(100, 1.0f);
    if (g.rank() == 1) {
      std::this_thread::sleep_for(4s);
      return 0;
    }
    OpResult r = g.allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
    return r.ok ? 1 : 0;
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(status[r], 0) << "rank " << r;
  EXPECT_LT(std::chrono::steady_clock::now() - start, 20s);
}

TEST(HostSpanningGroupFailure, WithSeveralSurvivorsTheLeadersKeepTheirInputsForTheRunAgain) {
  // Hosts A (rank 0 alone) and B (ranks 1, 2); rank 2 dies during large
  // in-place all_reduces. Both leaders hold their inputs, bit for bit, so
  // the call can run again; rank 0, alone on its host, reports its output
  // unwritten. (Rank 1's report may say written: its host's shared-memory
  // reduction flags any reduced chunk, though it reduced into scratch.)
  SpanOptions options;
  options.timeout = 3s;
  auto status = runSpanning({"A", "B", "B"}, options, [](HostSpanningGroup& g) {
    const size_t count = 4u << 20;
    std::vector<float> v(count);
    for (size_t i = 0; i < count; ++i) v[i] = static_cast<float>(i % 1000) * 0.5f + g.rank();
    const std::vector<float> kept = v;
    if (g.rank() == 2) {
      std::thread([] {
        std::this_thread::sleep_for(30ms);
        _exit(42);
      }).detach();
    }
    OpResult r;
    for (int i = 0; i < 1000 && r.ok; ++i) {
      std::copy(kept.begin(), kept.end(), v.begin());
      r = g.allreduce(v.data(), v.data(), count, DataType::kFloat32, ReduceOp::kSum);
    }
    if (r.ok) return 1;
    std::fprintf(stderr, "rank %d: %s (output %s)\n", g.rank(), r.error.c_str(), r.output_written ? "written" : "intact");
    if (g.rank() == 0 && r.output_written) return 2;
    return v == kept ? 0 : 3;
  });
  EXPECT_EQ(status[2], 42);
  EXPECT_EQ(status[0], 0);
  EXPECT_EQ(status[1], 0);
}

TEST(HostSpanningGroupFailure, ALeaderStoppedMidTransferFailsTheOtherAtTheDeadlineNotTheEngines) {
  // Large messages go from the callers' buffers as they are (no staging),
  // so a call may end only once no write reads them. Rank 1 stops (SIGSTOP)
  // in the middle of 16 MiB all_reduces: rank 0's writes to it block, and
  // must be canceled when the 1 s deadline passes, not end at the engine's
  // 30 s transfer timeout.
  SpanOptions options;
  options.timeout = 1s;
  auto start = std::chrono::steady_clock::now();
  auto status = runSpanning(
      {"A", "B"}, options,
      [](HostSpanningGroup& g) {
        const size_t count = 4u << 20;
        std::vector<float> v(count, 1.0f);
        if (g.rank() == 1) {
          std::thread([] {
            std::this_thread::sleep_for(50ms);
            raise(SIGSTOP);
          }).detach();
        }
        OpResult r;
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < 1000 && r.ok; ++i) r = g.allreduce(v.data(), v.data(), count, DataType::kFloat32, ReduceOp::kSum);
        if (r.ok) return 1;
        const auto took = std::chrono::steady_clock::now() - t0;
        std::fprintf(stderr, "rank %d failed after %lld ms: %s\n", g.rank(),
                     static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(took).count()),
                     r.error.c_str());
        return took < 5s ? 0 : 2;
      },
      8s);
  EXPECT_EQ(status[0], 0);
  EXPECT_EQ(status[1], 200 + SIGKILL);  // stopped until the harness's limit
  EXPECT_LT(std::chrono::steady_clock::now() - start, 12s);
}

TEST(HostSpanningGroupFailure, RanksDisagreeingOnTheOperationGetErrorsNotMixedData) {
  SpanOptions options;
  options.timeout = 2s;
  auto status = runSpanning({"A", "B"}, options, [](HostSpanningGroup& g) {
    std::vector<int32_t> v(64, g.rank());
    // Same byte count on the wire, different operations. Rank 0 waits for
    // rank 1's part of the all_reduce, which never comes: it fails.
    if (g.rank() == 0) return g.allreduce(v.data(), v.data(), v.size(), DataType::kInt32, ReduceOp::kSum).ok ? 1 : 0;
    // The broadcast's root only sends, and a collective's small send ends
    // once it is on the wire: the root cannot tell yet that nobody receives
    // it (nor could Gloo's). Its next call learns: rank 0 gives up and says
    // so, within rank 0's timeout.
    if (!g.broadcast(v.data(), v.size() * 4, 1).ok) return 2;
    const auto t0 = std::chrono::steady_clock::now();
    OpResult next = g.barrier();
    if (next.ok) return 3;
    std::fprintf(
        stderr, "rank 1's next call failed after %lld ms: %s\n",
        static_cast<long long>(
            std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count()),
        next.error.c_str());
    return 0;
  });
  EXPECT_EQ(status[0], 0);
  EXPECT_EQ(status[1], 0);
}

}  // namespace
}  // namespace mooncake::pg
