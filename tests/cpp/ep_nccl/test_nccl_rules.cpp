// The NCCL transport's rules that need neither NCCL nor a GPU
// (mooncake/ep/nccl/nccl_rules.h), each against values worked out by hand.
#include <gtest/gtest.h>

#include <string>

#include "mooncake/ep/cuda/ep_ipc_group.h"
#include "mooncake/ep/nccl/nccl_rules.h"

namespace mooncake::ep::nccl {
namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(NcclRules, VersionCodesFollowNcclsTwoEncodings) {
  EXPECT_EQ(ncclVersionCode(2, 30, 4), 23004);
  EXPECT_EQ(ncclVersionCode(2, 32, 6), 23206);
  EXPECT_EQ(ncclVersionCode(2, 8, 4), 2804);  // before 2.9: X * 1000 + Y * 100 + Z
  EXPECT_EQ(ncclVersionText(23206), "2.32.6");
  EXPECT_EQ(ncclVersionText(22809), "2.28.9");
  EXPECT_EQ(ncclVersionText(2804), "2.8.4");
  EXPECT_EQ(kMinNcclVersionCode, 23004);
}

TEST(NcclRules, RuntimeMustBeTheHeadersOrNewerOfTheSameMajor) {
  EXPECT_EQ(runtimeVersionProblem(23206, 23206), "");
  EXPECT_EQ(runtimeVersionProblem(23301, 23206), "");  // a newer 2.x keeps what the headers declare
  EXPECT_EQ(runtimeVersionProblem(23004, 23004), "");
  // torch 2.11's own NCCL beside a build against 2.32.6: say what is loaded, what is needed, what to preload.
  const std::string torch_nccl = runtimeVersionProblem(22809, 23206);
  EXPECT_TRUE(contains(torch_nccl, "is 2.28.9")) << torch_nccl;
  EXPECT_TRUE(contains(torch_nccl, "needs 2.32.6 or newer")) << torch_nccl;
  EXPECT_TRUE(contains(torch_nccl, "LD_PRELOAD=")) << torch_nccl;
  EXPECT_TRUE(contains(torch_nccl, "nvidia-nccl-cu13==2.32.6")) << torch_nccl;
  EXPECT_TRUE(contains(runtimeVersionProblem(23205, 23206), "needs 2.32.6"));
  EXPECT_TRUE(contains(runtimeVersionProblem(0, 23206), "no NCCL library could be loaded"));
  EXPECT_TRUE(contains(runtimeVersionProblem(30000, 23206), "another major version"));
}

TEST(NcclRules, EveryRankInOneLsaTeamOfAnySize) {
  for (int ranks : {1, 2, 3, 5, 8, 16, 32}) EXPECT_EQ(lsaTeamProblem(ranks, ranks), "") << ranks;
  const std::string two_hosts = lsaTeamProblem(16, 8);  // two hosts of 8 GPUs, no multi-node NVLink
  EXPECT_TRUE(contains(two_hosts, "holds 8 of the 16 ranks")) << two_hosts;
  EXPECT_TRUE(contains(two_hosts, "GIN")) << two_hosts;
  const std::string too_many = lsaTeamProblem(72, 72);  // an NVL72 rack: beyond the kernels' pointer table
  EXPECT_TRUE(contains(too_many, "at most 32 peers")) << too_many;
}

TEST(NcclRules, WindowIsTheKernelsRegionRoundedToNcclsAlignment) {
  // T=2, H=128, E=2, R=2 by hand (region_layout.h): signals, counters and
  // tallies fit in the first 4 KiB page; dispatch rows 2 parities x 1 local
  // expert x 2 sources x 2 slots x (16 + 256) bytes = 2176 -> ends at 8 KiB;
  // combine rows 2 x 2 experts x 2 tokens x 256 bytes = 2048 -> 12 KiB.
  EXPECT_EQ(windowBytes(2, 128, 2, 2), 12288u);
  for (int ranks : {1, 3, 8}) {
    const size_t bytes = windowBytes(128, 7168, 8 * ranks, ranks);
    EXPECT_EQ(bytes % kWindowAlignment, 0u);
    EXPECT_GE(bytes, cuda::epReceiveRegionBytes(128, 7168, 8 * ranks, ranks));
    EXPECT_LT(bytes, cuda::epReceiveRegionBytes(128, 7168, 8 * ranks, ranks) + kWindowAlignment);
  }
}

}  // namespace
}  // namespace mooncake::ep::nccl
