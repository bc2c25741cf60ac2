// Failures: a rank that dies during a collective, one that stays alive but
// never arrives, and ranks that disagree on the operation. The survivors
// must see the operation fail within the timeout, with the rank at fault
// named, the group broken for later operations, and their GPU context
// healthy (nothing hung or trapped).
#include <csignal>
#include <chrono>
#include <thread>

#include "rank_support.h"

namespace mooncake::pg::cuda::testing {
namespace {

using Clock = std::chrono::steady_clock;

void sleepOnStream(void* milliseconds) {
  std::this_thread::sleep_for(std::chrono::milliseconds(reinterpret_cast<intptr_t>(milliseconds)));
}

// What every survivor checks after its collective failed because of `victim`.
int survivorChecks(CudaIpcGroup& g, const OpResult& r, int victim, double seconds, double max_seconds,
                   const char* expected_words, DeviceBuffer& buffer, cudaStream_t stream) {
  int failures = 0;
  RANK_CHECK(!r.ok, "the collective should fail");
  RANK_CHECK(seconds < max_seconds, "it failed after %.2f s, more than %.2f s", seconds, max_seconds);
  const std::string named = "rank " + std::to_string(victim);
  RANK_CHECK(r.error.find(named) != std::string::npos && r.error.find(expected_words) != std::string::npos,
             "the error should name %s and say '%s': %s", named.c_str(), expected_words, r.error.c_str());
  bool victim_in_hint = false;
  for (int q : r.failed_ranks) victim_in_hint = victim_in_hint || q == victim;
  RANK_CHECK(victim_in_hint, "failed_ranks should hold %d", victim);
  RANK_CHECK(g.broken(), "the group should be broken");
  const CudaOp later = g.allreduce(buffer.get(), buffer.get(), 16, DataType::kFloat32, ReduceOp::kSum, stream);
  RANK_CHECK(!later.result.ok, "a later operation should fail fast");
  RANK_CHECK(cudaStreamSynchronize(stream) == cudaSuccess && cudaDeviceSynchronize() == cudaSuccess &&
                 cudaGetLastError() == cudaSuccess,
             "the GPU context should be healthy");
  std::fprintf(stderr, "rank %d: failed after %.3f s as expected: %s\n", g.rank(), seconds, r.error.c_str());
  return failures;
}

}  // namespace

// The last rank enqueues a large all_reduce behind 300 ms of other work on
// its stream and is killed before its stream gets there; the others are in
// the middle of the same all_reduce (their pushes into its staging done,
// waiting for it at the barrier).
int deadRankScenario(CudaIpcGroup& g) {
  int failures = 0;
  const int victim = g.size() - 1;
  const size_t count = 4u << 20;  // 16 MiB of fp32: the reduce-scatter + all-gather path
  DeviceBuffer buffer(count * 4);
  Stream stream;
  auto allreduce = [&](size_t n) {
    return g.allreduce(buffer.get(), buffer.get(), n, DataType::kFloat32, ReduceOp::kSum, stream);
  };
  OpResult warm = complete(g, allreduce(count));
  RANK_CHECK(warm.ok, "warm-up: %s", warm.error.c_str());
  if (g.rank() == victim) {
    cudaLaunchHostFunc(stream, sleepOnStream, reinterpret_cast<void*>(intptr_t{300}));
    allreduce(count);
    std::raise(SIGKILL);
  }
  const auto start = Clock::now();
  const OpResult r = complete(g, allreduce(count));
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  // The group's timeout is far longer: the death itself must end the wait.
  return failures + survivorChecks(g, r, victim, seconds, 5.0, "exited", buffer, stream);
}

// The last rank never calls the collective while the others wait (it is
// alive); they must give up after the group's timeout (2 s in the test).
int stalledRankScenario(CudaIpcGroup& g) {
  int failures = 0;
  const int victim = g.size() - 1;
  DeviceBuffer buffer(1 << 20);
  Stream stream;
  if (g.rank() == victim) {
    std::this_thread::sleep_for(std::chrono::seconds(5));
    const CudaOp late = g.allreduce(buffer.get(), buffer.get(), 1000, DataType::kFloat32, ReduceOp::kSum, stream);
    RANK_CHECK(!late.result.ok, "the late rank's collective should fail fast on the broken group");
    return failures;
  }
  const auto start = Clock::now();
  const OpResult r =
      complete(g, g.allreduce(buffer.get(), buffer.get(), 1000, DataType::kFloat32, ReduceOp::kSum, stream));
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  RANK_CHECK(seconds > 1.5, "it gave up after %.2f s, before the 2 s timeout", seconds);
  return failures + survivorChecks(g, r, victim, seconds, 4.5, "timed out", buffer, stream);
}

// Rank 0 reduces 1000 elements, the others 1001: the signatures differ and
// the first kernel after the first barrier says so.
int mismatchScenario(CudaIpcGroup& g) {
  int failures = 0;
  DeviceBuffer buffer(1 << 20);
  Stream stream;
  const size_t count = g.rank() == 0 ? 1000 : 1001;
  const OpResult r =
      complete(g, g.allreduce(buffer.get(), buffer.get(), count, DataType::kFloat32, ReduceOp::kSum, stream));
  RANK_CHECK(!r.ok && r.error.find("different collective") != std::string::npos,
             "the mismatch should be reported: %s", r.error.c_str());
  RANK_CHECK(cudaDeviceSynchronize() == cudaSuccess, "the GPU context should be healthy");
  return failures;
}

}  // namespace mooncake::pg::cuda::testing
