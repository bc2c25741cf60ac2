// The arithmetic of the CUDA schedules (no GPU needed): rounds cover the
// payload exactly, start 16-byte aligned, fit the staging half, and come out
// in the parity that lets operations follow each other and graph replays.
#include <gtest/gtest.h>

#include <set>

#include "schedule.h"

namespace mooncake::pg::cuda {
namespace {

void expectCovers(const RoundPlan& plan, size_t total, size_t capacity, size_t unit_bytes) {
  size_t covered = 0;
  for (size_t i = 0; i < plan.rounds; ++i) {
    EXPECT_EQ(plan.begin(i), std::min(total, covered));
    EXPECT_LE(plan.length(i), capacity) << "round " << i;
    if (plan.length(i) > 0) {  // trailing rounds may be empty (kept for the parity)
      EXPECT_EQ(plan.begin(i) * unit_bytes % kRoundAlignBytes, 0u) << "round " << i << " of " << total;
    }
    covered += plan.length(i);
  }
  EXPECT_EQ(covered, total);
}

TEST(CudaSchedule, OneRoundWithAClosingBarrierOrAnEvenNumberOfRounds) {
  for (size_t unit : {1, 2, 4, 8}) {
    const size_t capacity = (1u << 20) / unit;
    for (size_t total : {size_t{1}, size_t{7}, capacity - 1, capacity, capacity + 1, 3 * capacity + 5, 10 * capacity}) {
      const RoundPlan plan = planRounds(total, capacity, unit);
      expectCovers(plan, total, capacity, unit);
      if (total <= capacity) {
        EXPECT_EQ(plan.rounds, 1u);
        EXPECT_TRUE(plan.closing_barrier);
      } else {
        EXPECT_EQ(plan.rounds % 2, 0u) << total;
        EXPECT_FALSE(plan.closing_barrier);
      }
    }
  }
}

TEST(CudaSchedule, EvenRoundsAreForcedWhenAsked) {
  for (size_t total : {size_t{1}, size_t{5}, size_t{100}, size_t{1} << 20}) {
    const RoundPlan plan = planRounds(total, 1u << 18, 4, /*even_rounds=*/true);
    EXPECT_EQ(plan.rounds % 2, 0u);
    EXPECT_GE(plan.rounds, 2u);
    EXPECT_FALSE(plan.closing_barrier);
    expectCovers(plan, total, 1u << 18, 4);
  }
}

TEST(CudaSchedule, NothingToMoveTakesNoRound) {
  const RoundPlan plan = planRounds(0, 1024, 4);
  EXPECT_EQ(plan.rounds, 0u);
  EXPECT_FALSE(plan.closing_barrier);
}

TEST(CudaSchedule, SegmentsTileTheRoundAligned) {
  for (size_t unit : {1, 2, 4, 8}) {
    for (size_t count : {size_t{1}, size_t{3}, size_t{1027}, size_t{300007}}) {
      for (int parts : {1, 2, 3, 4, 7}) {
        size_t next = 0;
        for (int s = 0; s < parts; ++s) {
          size_t begin = 0, length = 0;
          alignedSegment(count, parts, s, unit, begin, length);
          EXPECT_EQ(begin, std::min(next, count));
          if (length > 0) {
            EXPECT_EQ(begin * unit % kRoundAlignBytes, 0u);
          }
          next = begin + length;
        }
        EXPECT_EQ(next, count);
      }
    }
  }
}

// Every (source, row) of an owner gets its own inbox, inside the half and
// aligned; and a round planned for the two-shot schedule (W segments, one
// per inbox) never overflows an inbox, at any world size and element size.
TEST(CudaSchedule, InboxesAreDisjointAlignedAndHoldTheirSegments) {
  for (int size : {2, 3, 4, 7, 8, 32}) {
    for (size_t half : {size_t{4096} * size, size_t{1} << 20, size_t{32} << 20}) {
      for (int rows : {1, 2}) {
        const size_t inbox = inboxBytes(half, size, rows);
        ASSERT_GT(inbox, 0u);
        EXPECT_EQ(inbox % kRoundAlignBytes, 0u);
        for (int owner = 0; owner < size; ++owner) {
          std::set<size_t> offsets;
          for (int row = 0; row < rows; ++row) {
            for (int source = 0; source < size; ++source) {
              if (source == owner) continue;
              const size_t at = inboxOffset(owner, source, size, inbox, row);
              EXPECT_TRUE(offsets.insert(at).second) << "owner " << owner << " source " << source << " row " << row;
              EXPECT_LE(at + inbox, half);
            }
          }
        }
        for (size_t unit : {1, 2, 4, 8}) {
          const size_t capacity = inbox / unit * size;  // as the two-shot schedule plans its rounds
          for (size_t total : {capacity - 1, capacity, 3 * capacity + 5}) {
            const RoundPlan plan = planRounds(total, capacity, unit, /*even_rounds=*/true);
            for (size_t i = 0; i < plan.rounds; ++i) {
              for (int q = 0; q < size; ++q) {
                size_t begin = 0, length = 0;
                alignedSegment(plan.length(i), size, q, unit, begin, length);
                EXPECT_LE(length * unit, inbox) << "size " << size << " unit " << unit << " round " << i;
              }
            }
          }
        }
      }
    }
  }
}

// Which way an all_reduce goes, against the rules written out by hand.
TEST(CudaSchedule, ReductionsGoDirectWhenSmallOrAtTwoRanksAndFuseOnlyWhenAsked) {
  const size_t half = 32u << 20, one_shot = 256u << 10;
  // Small: direct; fused only when fused_bytes reaches it.
  EXPECT_EQ(reduceSchedule(4096, 4, half, one_shot, 0), ReduceSchedule::kDirect);
  EXPECT_EQ(reduceSchedule(4096, 4, half, one_shot, 65536), ReduceSchedule::kDirectFused);
  EXPECT_EQ(reduceSchedule(65537, 4, half, one_shot, 65536), ReduceSchedule::kDirect);
  // Larger than one_shot_bytes: two-shot, except at two ranks up to a whole half.
  EXPECT_EQ(reduceSchedule(one_shot + 1, 4, half, one_shot, 0), ReduceSchedule::kTwoShot);
  EXPECT_EQ(reduceSchedule(one_shot + 1, 2, half, one_shot, 0), ReduceSchedule::kDirect);
  EXPECT_EQ(reduceSchedule(half, 2, half, one_shot, 0), ReduceSchedule::kDirect);
  EXPECT_EQ(reduceSchedule(half + 16, 2, half, one_shot, 0), ReduceSchedule::kTwoShot);
  // Never fused above one_shot_bytes, whatever fused_bytes says.
  EXPECT_EQ(reduceSchedule(one_shot + 16, 2, half, one_shot, half), ReduceSchedule::kDirect);
  // A direct operation of several rounds (one_shot_bytes above the inbox) is not fused.
  const size_t small_half = 3 * 4096;  // world 4: inboxes of 4096 bytes
  EXPECT_EQ(reduceSchedule(8192, 4, small_half, one_shot, one_shot), ReduceSchedule::kDirect);
  EXPECT_EQ(reduceSchedule(4096, 4, small_half, one_shot, one_shot), ReduceSchedule::kDirectFused);
}

TEST(CudaSchedule, SignaturesTellOperationsApart) {
  std::set<uint32_t> seen;
  for (int op = 1; op <= 9; ++op) {
    for (uint64_t a : {0, 1, 1000, 1001}) {
      for (uint64_t root : {0, 1, 2}) {
        const uint32_t s = opSignature(static_cast<OpCode>(op), a, root);
        EXPECT_NE(s, 0u);
        seen.insert(s);
      }
    }
  }
  EXPECT_EQ(seen.size(), 9u * 4 * 3);
}

}  // namespace
}  // namespace mooncake::pg::cuda
