// CudaIpcGroup across real processes, all ranks on one GPU (which NCCL
// refuses): each rank is pg_cuda_rank (rank_main.cpp), started with
// posix_spawn, so every rank starts CUDA in a process of its own whatever
// this one did. Without a GPU every test skips and says why.
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>

extern char** environ;

namespace {

bool haveGpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

#define REQUIRE_GPU()                                 \
  do {                                                \
    if (!haveGpu()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

// pg_cuda_rank beside this program (so that the pair can be moved together),
// else where the build put it.
std::string rankProgram() {
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n > 0) {
    std::string beside(self, static_cast<size_t>(n));
    beside = beside.substr(0, beside.rfind('/') + 1) + "pg_cuda_rank";
    if (::access(beside.c_str(), X_OK) == 0) return beside;
  }
  return PG_CUDA_RANK_PATH;
}

// Seconds a multi-process test may run before its ranks are killed
// (PG_CUDA_TEST_LIMIT_S, default 240).
std::chrono::seconds testLimit(std::chrono::seconds fallback) {
  const char* env = std::getenv("PG_CUDA_TEST_LIMIT_S");
  return env != nullptr ? std::chrono::seconds(std::atoi(env)) : fallback;
}

std::string uniqueName() {
  static int counter = 0;
  return "/mc-pg-cuda-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++) + "-" +
         std::to_string(std::random_device{}());
}

// Starts `world` ranks of `scenario`; returns each one's exit status (0:
// passed; 200 + n: killed by signal n). Ranks still running after `limit`
// are killed (a hang fails the test instead of stalling it).
std::vector<int> runRanks(const std::string& scenario, int world, const std::vector<std::string>& options = {},
                          std::chrono::seconds limit = std::chrono::seconds(240)) {
  const std::string name = uniqueName(), program = rankProgram();
  limit = std::min(limit, testLimit(limit));
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> args = {program, scenario, name, std::to_string(r), std::to_string(world)};
    args.insert(args.end(), options.begin(), options.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = -1;
    if (posix_spawn(&pid, program.c_str(), nullptr, nullptr, argv.data(), environ) != 0) pid = -1;
    pids.push_back(pid);
  }
  std::vector<int> status(world, -1);
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (int r = 0; r < world; ++r) {
    if (pids[r] < 0) continue;
    int st = 0;
    while (waitpid(pids[r], &st, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        kill(pids[r], SIGKILL);
        waitpid(pids[r], &st, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    status[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 200 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
  }
  return status;
}

void expectAllPassed(const std::vector<int>& status) {
  for (size_t r = 0; r < status.size(); ++r) EXPECT_EQ(status[r], 0) << "rank " << r;
}

TEST(CudaIpcGroup, EveryCollectiveOneRank) {
  REQUIRE_GPU();
  expectAllPassed(runRanks("collectives", 1));
}

TEST(CudaIpcGroup, EveryCollectiveTwoRanksOnOneGpu) {
  REQUIRE_GPU();
  expectAllPassed(runRanks("collectives", 2));
}

// Small staging buffers: every operation of 16 MiB takes many rounds.
TEST(CudaIpcGroup, EveryCollectiveFourRanksOnOneGpuInManyRounds) {
  REQUIRE_GPU();
  expectAllPassed(runRanks("collectives", 4, {"staging=4194304"}));
}

// The spinning-warp barriers, which graph capture falls back to where stream
// memory operations cannot be captured.
TEST(CudaIpcGroup, EveryCollectiveWithBarrierKernels) {
  REQUIRE_GPU();
  expectAllPassed(runRanks("collectives", 3, {"sync=kernels"}));
}

TEST(CudaIpcGroup, EveryDtypeAndReductionMatchesTheCpu) {
  REQUIRE_GPU();
  expectAllPassed(runRanks("reductions", 3, {"staging=1048576"}));
}

TEST(CudaIpcGroup, AllReduceCapturedInAGraphReplaysWithNewInputs) {
  REQUIRE_GPU();
  expectAllPassed(runRanks("graph", 2));
  expectAllPassed(runRanks("graph", 4, {"sync=kernels"}));
}

TEST(CudaIpcGroup, DeadRankFailsTheOthersNamingIt) {
  REQUIRE_GPU();
  const std::vector<int> status = runRanks("dead", 4, {"timeout_ms=30000"}, std::chrono::seconds(60));
  for (int r = 0; r < 3; ++r) EXPECT_EQ(status[r], 0) << "survivor rank " << r;
  EXPECT_EQ(status[3], 200 + SIGKILL) << "the victim should have been killed";
}

TEST(CudaIpcGroup, StalledRankTimesOutTheOthersNamingIt) {
  REQUIRE_GPU();
  expectAllPassed(runRanks("stall", 3, {"timeout_ms=2000"}, std::chrono::seconds(60)));
}

// The same failures when the barriers are spinning kernels: a barrier kernel
// that gives up (the group broke, or its own deadline passed) sets the abort
// word that the kernels after it check.
TEST(CudaIpcGroup, FailuresWithBarrierKernels) {
  REQUIRE_GPU();
  const std::vector<int> status =
      runRanks("dead", 4, {"timeout_ms=30000", "sync=kernels"}, std::chrono::seconds(60));
  for (int r = 0; r < 3; ++r) EXPECT_EQ(status[r], 0) << "survivor rank " << r;
  EXPECT_EQ(status[3], 200 + SIGKILL) << "the victim should have been killed";
  expectAllPassed(runRanks("stall", 3, {"timeout_ms=2000", "sync=kernels"}, std::chrono::seconds(60)));
}

TEST(CudaIpcGroup, MismatchedCollectivesAreReported) {
  REQUIRE_GPU();
  expectAllPassed(runRanks("mismatch", 2, {"timeout_ms=10000"}, std::chrono::seconds(60)));
}

}  // namespace
