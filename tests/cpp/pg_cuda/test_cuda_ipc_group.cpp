// CudaIpcGroup across real processes, all ranks on one GPU (which NCCL
// refuses): each rank is pg_cuda_rank (rank_main.cpp), started with
// posix_spawn, so every rank starts CUDA in a process of its own whatever
// this one did. Without a GPU every test skips and says why.
#include <csignal>
#include <string>
#include <vector>

#include "common/gpu_test_support.h"
#include "common/rank_programs.h"
#include "common/spawn.h"

namespace {

using mooncake::testing::expectAllPassed;

std::vector<int> runRanks(const std::string& scenario, int world, const std::vector<std::string>& options = {},
                          std::chrono::seconds limit = std::chrono::seconds(240)) {
  return mooncake::testing::runRankPrograms(mooncake::testing::programBesideSelf("pg_cuda_rank", PG_CUDA_RANK_PATH),
                                            mooncake::testing::uniqueShmName("mc-pg-cuda-test"), scenario, world,
                                            options, limit);
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

// Two ranks, 512 KiB halves: the 768 KiB reductions are under one_shot_bytes
// but larger than an inbox, so the direct schedule runs in two rounds.
TEST(CudaIpcGroup, TwoRanksGoDirectInSeveralRounds) {
  REQUIRE_GPU();
  expectAllPassed(runRanks("reductions", 2, {"staging=1048576", "one_shot=1048576"}));
}

// Two ranks, 512 KiB halves: the collectives up to 16 MiB, reduce to a root
// included, take the two-shot schedule that two ranks otherwise skip.
TEST(CudaIpcGroup, TwoRanksTakeTwoShotWhenARoundDoesNotFit) {
  REQUIRE_GPU();
  expectAllPassed(runRanks("collectives", 2, {"staging=1048576"}));
}

// World 2 takes the direct schedule for both sizes unless the staging is too
// small for the large one (then two-shot); world 4 takes two-shot for it.
TEST(CudaIpcGroup, AllReduceCapturedInAGraphReplaysWithNewInputs) {
  REQUIRE_GPU();
  expectAllPassed(runRanks("graph", 2));
  expectAllPassed(runRanks("graph", 2, {"staging=2097152"}));
  expectAllPassed(runRanks("graph", 4, {"sync=kernels"}));
}

// The small direct reductions as one kernel (fused_bytes): every dtype x op
// against the CPU at world 3, and with only rank 0 fused (the forms mix),
// every collective at world 4 (reduce to a root: the root pushes nothing),
// and a captured graph with one fused and one unfused all_reduce.
TEST(CudaIpcGroup, FusedSmallReductionsMatchTheCpu) {
  REQUIRE_GPU();
  expectAllPassed(runRanks("reductions", 3, {"fused=1048576"}));
  expectAllPassed(runRanks("reductions", 3, {"fused=1048576", "fused_rank=0"}));
  expectAllPassed(runRanks("collectives", 4, {"fused=1048576"}));
  expectAllPassed(runRanks("graph", 2, {"fused=65536"}));
}

// The fused kernel's barriers spin on the GPU: a stalled rank must still
// time the others out, and a mismatched operation must still be reported.
TEST(CudaIpcGroup, FusedKernelFailsLikeTheStepsDo) {
  REQUIRE_GPU();
  expectAllPassed(runRanks("stall", 3, {"timeout_ms=2000", "fused=65536"}, std::chrono::seconds(60)));
  expectAllPassed(runRanks("mismatch", 2, {"timeout_ms=10000", "fused=65536"}, std::chrono::seconds(60)));
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
