// EpIpcGroup dispatch/combine across real processes, all ranks on one GPU:
// each rank is ep_cuda_rank (ep_rank_main.cpp), started by the helpers the
// CudaIpcGroup tests use (tests/cpp/common/rank_programs.h). Every rank checks
// its own outputs against the CPU reference (ep_reference.h). Without a GPU
// every test skips and says why.
#include <csignal>
#include <string>
#include <vector>

#include "common/gpu_test_support.h"
#include "common/rank_programs.h"
#include "common/spawn.h"

namespace {

using mooncake::testing::expectAllPassed;

std::vector<int> runRanks(const std::string& scenario, int world, const std::vector<std::string>& options = {},
                          std::chrono::seconds limit = std::chrono::seconds(60)) {
  return mooncake::testing::runRankPrograms(mooncake::testing::programBesideSelf("ep_cuda_rank", EP_CUDA_RANK_PATH),
                                            mooncake::testing::uniqueShmName("mc-ep-cuda-test"), scenario, world,
                                            options, limit);
}

TEST(EpIpcGroup, OneRankSendsToItself) {
  REQUIRE_GPU();
  expectAllPassed(runRanks("exchange", 1, {"seed=11"}));
}

TEST(EpIpcGroup, TwoRanksOnOneGpu) {
  REQUIRE_GPU();
  expectAllPassed(runRanks("exchange", 2, {"seed=12"}));
}

TEST(EpIpcGroup, FourRanksOnOneGpu) {
  REQUIRE_GPU();
  expectAllPassed(runRanks("exchange", 4, {"seed=13", "calls=5"}));
}

// A realistic width (several 16-byte vectors per lane, 8 scale groups), one
// expert per rank, top-1.
TEST(EpIpcGroup, WideRowsOneExpertPerRankTopOne) {
  REQUIRE_GPU();
  expectAllPassed(runRanks("exchange", 2, {"seed=14", "hidden=1024", "local_experts=1", "topk=1", "tokens=40"}));
}

// More (local expert, source) pairs than the wait kernel has threads:
// 4 ranks x 300 local experts = 1200 pairs, top-9.
TEST(EpIpcGroup, ManyExpertsLoopInTheWaitKernel) {
  REQUIRE_GPU();
  expectAllPassed(runRanks("exchange", 4, {"seed=15", "hidden=128", "local_experts=300", "topk=9", "tokens=8",
                                           "calls=2"}));
}

TEST(EpIpcGroup, RankThatDoesNotCallIsMaskedWithinTheTimeout) {
  REQUIRE_GPU();
  expectAllPassed(runRanks("absent", 3, {"seed=16"}));
}

TEST(EpIpcGroup, LateRankIsMaskedAndThenGoesOnAlone) {
  REQUIRE_GPU();
  expectAllPassed(runRanks("late", 3, {"seed=19"}));
}

TEST(EpIpcGroup, RankMaskedByEveryCallerIsNeverWaitedFor) {
  REQUIRE_GPU();
  expectAllPassed(runRanks("masked", 3, {"seed=17"}, std::chrono::seconds(30)));
}

TEST(EpIpcGroup, DeadRankEndsWaitsWithoutTimeout) {
  REQUIRE_GPU();
  const std::vector<int> status = runRanks("dead", 3, {"seed=18"}, std::chrono::seconds(30));
  for (int r = 0; r < 2; ++r) EXPECT_EQ(status[r], 0) << "survivor rank " << r;
  EXPECT_EQ(status[2], 200 + SIGKILL) << "the victim should have been killed";
}

// Direct heads in the call that loses a source before them: rank 0's counts
// are given to the others as gathered, but it never sends; ranks 1 and 2 place
// heads in each other's output slot counting its rows, then give up on it.
TEST(EpIpcGroup, DirectHeadsLandInPlaceWhenAnEarlierSourceIsLostInTheCall) {
  REQUIRE_GPU();
  expectAllPassed(runRanks("direct_loss", 3, {"seed=20", "local_experts=1", "topk=2", "hidden=256", "output_slots=1"}));
}

// A rank that comes after the others gave up on it finds their slots
// offered in the counts rows they sent it, and must not write there.
TEST(EpIpcGroup, LateRankPlacesNoHeadInTheOutputsOfRanksThatGaveUpOnIt) {
  REQUIRE_GPU();
  expectAllPassed(runRanks("direct_late", 3, {"seed=21", "local_experts=1", "topk=2", "hidden=256", "output_slots=1"}));
}

}  // namespace
