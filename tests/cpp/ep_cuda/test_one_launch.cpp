// When a dispatch runs in one launch (one_launch.h), on the host: the sizes
// of the calls the benchmarks measure, and each limit crossed on its own,
// against the bytes counted here by hand.
#include <gtest/gtest.h>

#include "one_launch.h"

namespace mooncake::ep::cuda {
namespace {

constexpr int kH100Blocks = 132 * 3;  // SMs times the dispatch kernel's blocks per SM

// ElasticBuffer's rows at world R, one expert per rank: the payload as the
// head (2 H bytes), ids and weights as a 64-byte tail, rows past those
// received zeroed up to the call's capacity (R x tokens).
DispatchArgs elasticRows(int R, int tokens, int hidden) {
  DispatchArgs args;
  args.num_tokens = tokens;
  args.bytes.enabled = true;
  args.bytes.head_bytes = 2 * static_cast<size_t>(hidden);
  args.bytes.tail_bytes = 64;
  args.bytes.zeroed_rows = R * tokens;
  return args;
}

TEST(EpOneLaunch, ElasticBufferCallsOfTheBenchmarkRunInOneLaunch) {
  // World 2, 128 tokens, H = 4096: 256 rows of 8256 bytes, 2.1 MB; grid 2 x 4.
  const RegionLayout w2 = RegionLayout::make(128, 4096, 2, 2);
  EXPECT_EQ(dispatchCopyBytes(w2, elasticRows(2, 128, 4096)), 256 * 8256);
  EXPECT_TRUE(oneLaunch(w2, elasticRows(2, 128, 4096), 8, kH100Blocks));
  // World 1: 128 rows, 1.1 MB.
  const RegionLayout w1 = RegionLayout::make(128, 4096, 1, 1);
  EXPECT_TRUE(oneLaunch(w1, elasticRows(1, 128, 4096), 4, kH100Blocks));
  // 8192 tokens: 16384 rows of 14400 bytes at H = 7168, far past 4 MiB.
  const RegionLayout big = RegionLayout::make(8192, 7168, 2, 2);
  EXPECT_FALSE(oneLaunch(big, elasticRows(2, 8192, 7168), 64, kH100Blocks));
}

TEST(EpOneLaunch, TheCountsGatherRunsInOneLaunchAtEverySize) {
  // One 16-byte row per rank, nothing zeroed, in a group sized for 8192 tokens.
  const RegionLayout lay = RegionLayout::make(8192, 7168, 8, 8);
  DispatchArgs gather;
  gather.num_tokens = 1;
  gather.bytes.enabled = true;
  gather.bytes.tail_bytes = 16;
  EXPECT_EQ(dispatchCopyBytes(lay, gather), 8 * 16);
  EXPECT_TRUE(oneLaunch(lay, gather, 8, kH100Blocks));
}

TEST(EpOneLaunch, EachLimitAloneKeepsThreeLaunches) {
  const RegionLayout lay = RegionLayout::make(128, 4096, 2, 2);
  const DispatchArgs args = elasticRows(2, 128, 4096);
  EXPECT_TRUE(oneLaunch(lay, args, kOneLaunchMaxBlocks, kH100Blocks));
  EXPECT_FALSE(oneLaunch(lay, args, kOneLaunchMaxBlocks + 1, kH100Blocks));  // too many blocks
  // All ranks' grids must fit at once: 2 x 8 blocks on a device that holds 15.
  EXPECT_TRUE(oneLaunch(lay, args, 8, 16));
  EXPECT_FALSE(oneLaunch(lay, args, 8, 15));
  EXPECT_FALSE(oneLaunch(lay, args, 8, 0));  // capacity unknown
  // The rows zeroed count when they are more than those sent: 128 tokens in
  // a call whose capacity is 1024 rows of 8256 bytes, 8.5 MB.
  DispatchArgs zeroing = args;
  zeroing.bytes.zeroed_rows = 1024;
  const RegionLayout wide = RegionLayout::make(512, 4096, 2, 2);
  EXPECT_EQ(dispatchCopyBytes(wide, zeroing), 1024 * 8256);
  EXPECT_FALSE(oneLaunch(wide, zeroing, 8, kH100Blocks));
  // ...but never past the region's R x T rows.
  zeroing.bytes.zeroed_rows = 1 << 20;
  EXPECT_EQ(dispatchCopyBytes(lay, zeroing), 256 * 8256);
}

TEST(EpOneLaunch, AnMpsShareOfTheSmsBoundsTheBlocks) {
  EXPECT_EQ(mpsShareOfBlocks(396, nullptr), 396);
  EXPECT_EQ(mpsShareOfBlocks(396, ""), 396);
  EXPECT_EQ(mpsShareOfBlocks(396, "25"), 99);
  EXPECT_EQ(mpsShareOfBlocks(396, "12.5"), 49);  // 49.5, rounded down
  EXPECT_EQ(mpsShareOfBlocks(396, "100"), 396);
  EXPECT_EQ(mpsShareOfBlocks(396, "0"), 396);  // not a share: the whole device
  EXPECT_EQ(mpsShareOfBlocks(396, "half"), 396);
  EXPECT_EQ(mpsShareOfBlocks(396, "25%"), 396);
  // Four ranks of 16 blocks under a 12.5 % share: 64 > 49, three launches.
  const RegionLayout lay = RegionLayout::make(128, 4096, 4, 4);
  DispatchArgs args;
  args.num_tokens = 16;
  args.bytes.enabled = true;
  args.bytes.tail_bytes = 16;
  EXPECT_TRUE(oneLaunch(lay, args, 16, mpsShareOfBlocks(396, "25")));
  EXPECT_FALSE(oneLaunch(lay, args, 16, mpsShareOfBlocks(396, "12.5")));
}

TEST(EpOneLaunch, TheBuffersRowsCountEveryLocalExpert) {
  // The Buffer: 8 experts at world 2 (L = 4), bf16 rows of 2 H bytes, 512
  // tokens at H = 7168: 4 x 1024 rows of 14336 bytes, 58.7 MB.
  const RegionLayout lay = RegionLayout::make(512, 7168, 8, 2);
  DispatchArgs args;
  args.num_tokens = 512;
  EXPECT_EQ(dispatchCopyBytes(lay, args), int64_t{4} * 1024 * 14336);
  EXPECT_FALSE(oneLaunch(lay, args, 32, kH100Blocks));
  // FP8 rows: H bytes and a float32 scale per 128 channels, 7392 bytes at H = 7168.
  args.num_tokens = 16;
  args.use_fp8 = true;
  EXPECT_EQ(dispatchCopyBytes(lay, args), int64_t{4} * 32 * 7392);
  EXPECT_TRUE(oneLaunch(lay, args, 8, kH100Blocks));
}

TEST(EpOneLaunch, ASmallCallsGridWidensToAboutARowPerWarp) {
  // ElasticBuffer's rows give their slots; 16 warps a block.
  const int32_t slots = 0;
  DispatchArgs w2 = elasticRows(2, 128, 4096);
  w2.pick_slots = &slots;
  // World 2: 256 rows (those sent, and as many zeroed) -> 16 blocks over 2 experts.
  EXPECT_EQ(wholeCallChunks(RegionLayout::make(128, 4096, 2, 2), w2, 2, 4, kH100Blocks), 8);
  // World 1: 128 rows -> 8 blocks.
  DispatchArgs w1 = elasticRows(1, 128, 4096);
  w1.pick_slots = &slots;
  EXPECT_EQ(wholeCallChunks(RegionLayout::make(128, 4096, 1, 1), w1, 1, 4, kH100Blocks), 8);
  // The counts' gather (a row per rank) keeps its one block per rank.
  DispatchArgs gather;
  gather.num_tokens = 1;
  gather.bytes.enabled = true;
  gather.bytes.tail_bytes = 16;
  gather.pick_slots = &slots;
  EXPECT_EQ(wholeCallChunks(RegionLayout::make(8192, 7168, 8, 8), gather, 8, 1, kH100Blocks), 1);
  // Never fewer than the send's own blocks.
  EXPECT_EQ(wholeCallChunks(RegionLayout::make(128, 4096, 1, 1), w1, 1, 12, kH100Blocks), 12);
}

TEST(EpOneLaunch, TheWidenedGridStaysWithinTheOneLaunchBounds) {
  const int32_t slots = 0;
  // World 8, 48 tokens: 384 rows want 24 blocks, 3 per expert; on a device that holds 160 of the
  // kernel's blocks, 8 ranks' grids fit 20 blocks each: 2 per expert, still one launch.
  const RegionLayout lay = RegionLayout::make(48, 4096, 8, 8);
  DispatchArgs w8 = elasticRows(8, 48, 4096);
  w8.pick_slots = &slots;
  EXPECT_EQ(wholeCallChunks(lay, w8, 8, 1, 100000), 3);
  EXPECT_EQ(wholeCallChunks(lay, w8, 8, 1, 160), 2);
  EXPECT_TRUE(oneLaunch(lay, w8, 8 * 2, 160));
  // At most kOneLaunchMaxBlocks: world 2, 1024 narrow rows a rank want 128 blocks, 32 per expert.
  DispatchArgs narrow = elasticRows(2, 1024, 128);
  narrow.pick_slots = &slots;
  EXPECT_EQ(wholeCallChunks(RegionLayout::make(1024, 256, 2, 2), narrow, 2, 1, 100000), kOneLaunchMaxBlocks / 2);
  // A call that does not give its slots keeps the send's grid (its blocks count the tokens before theirs).
  w8.pick_slots = nullptr;
  EXPECT_EQ(wholeCallChunks(lay, w8, 8, 1, 100000), 1);
}

TEST(EpOneLaunch, RowsSentFromTheCallersInputsWidenOnlyWithinOneLayoutTile) {
  // OwnSendInputs: the blocks count their slots in the picks, one pass of their threads over a tile.
  const int64_t picks = 0;
  const RegionLayout w1 = RegionLayout::make(512, 4096, 1, 1);
  DispatchArgs own = elasticRows(1, 128, 4096);
  own.own_send.picks = &picks;
  EXPECT_TRUE(slotsCheap(own));
  EXPECT_EQ(wholeCallChunks(w1, own, 1, 4, kH100Blocks), 8);  // 128 rows -> 8 blocks, as with given slots
  own.num_tokens = kLayoutSendTileTokens + 1;                 // past one tile: each added block would count more
  EXPECT_FALSE(slotsCheap(own));
  EXPECT_EQ(wholeCallChunks(w1, own, 1, 2, kH100Blocks), 2);
  // Given slots are cheap at any size.
  const int32_t slots = 0;
  DispatchArgs given = elasticRows(1, 512, 4096);
  given.pick_slots = &slots;
  EXPECT_TRUE(slotsCheap(given));
}

TEST(EpOneLaunch, OnlyZeroInTheEnvironmentTurnsItOff) {
  EXPECT_TRUE(oneLaunchAllowed(nullptr));
  EXPECT_TRUE(oneLaunchAllowed("1"));
  EXPECT_TRUE(oneLaunchAllowed(""));
  EXPECT_FALSE(oneLaunchAllowed("0"));
}

}  // namespace
}  // namespace mooncake::ep::cuda
