// The receiver's bookkeeping of one sender's eager ring (p2p_eager.h):
// slots are freed in order whatever order messages are taken in, the
// mismatch bits a release carries name each message it can count, and
// releases nobody waits for are gathered without holding the sender up.
#include <gtest/gtest.h>

#include <random>

#include "p2p_eager.h"

namespace mooncake::pg::p2p {
namespace {

TEST(EagerWindow, FreesSlotsInOrderWhateverOrderMessagesAreTakenIn) {
  EagerWindow w(4);
  for (uint32_t s = 0; s < 4; ++s) {
    EXPECT_TRUE(w.waiting(s));
    w.arrived(s);
  }
  EXPECT_FALSE(w.waiting(4)) << "message 4 would reuse message 0's slot";
  EXPECT_TRUE(w.full());
  w.take(2, false);
  w.take(1, false);
  EXPECT_EQ(w.base(), 0u) << "message 0 still holds its slot";
  // The sender learns at once that 1 and 2 were taken (their sends end).
  EXPECT_TRUE(w.releaseOwed());
  EXPECT_EQ(w.tell(), 1u);
  EXPECT_FALSE(w.releaseOwed());
  EXPECT_TRUE(releaseTook(w.base(), w.takenAheadBits(), 1));
  EXPECT_TRUE(releaseTook(w.base(), w.takenAheadBits(), 2));
  EXPECT_FALSE(releaseTook(w.base(), w.takenAheadBits(), 0));
  EXPECT_FALSE(releaseTook(w.base(), w.takenAheadBits(), 3));
  w.take(0, false);
  EXPECT_EQ(w.base(), 3u);
  EXPECT_TRUE(w.releaseOwed());
  EXPECT_EQ(w.tell(), 2u);
  EXPECT_FALSE(w.releaseOwed());
  EXPECT_EQ(w.takenAheadBits(), 0u);
  EXPECT_TRUE(w.waiting(4) && w.waiting(5) && w.waiting(6));
  EXPECT_FALSE(w.waiting(3)) << "arrived, not taken";
  EXPECT_FALSE(w.full());
}

TEST(EagerWindow, ReleasesOfSendsThatEndedWhenSentAreGatheredUntilHalfTheRingIsFree) {
  EagerWindow w(8);
  // Nobody waits for these: the first three taken owe a release, not yet due.
  for (uint32_t s = 0; s < 3; ++s) {
    w.arrived(s);
    w.take(s, false, /*sender_waits=*/false);
  }
  EXPECT_TRUE(w.releaseOwed());
  EXPECT_FALSE(w.releaseDue());
  w.arrived(3);
  w.take(3, false, false);
  EXPECT_TRUE(w.releaseDue()) << "half of the ring is free again";
  w.tell();
  EXPECT_FALSE(w.releaseOwed());
  // The sender may write up to message 11 (4 + 8 - 1). Once that one is in,
  // it cannot write on: one taken message is then enough.
  for (uint32_t s = 4; s < 11; ++s) w.arrived(s);
  w.take(4, false, false);
  EXPECT_FALSE(w.releaseDue());
  w.arrived(11);
  EXPECT_TRUE(w.releaseDue()) << "the sender waits for room";
  w.tell();
  // A sender that waits for its message, or a mismatch, is told at once.
  w.take(5, false, /*sender_waits=*/true);
  EXPECT_TRUE(w.releaseDue());
  w.tell();
  w.take(6, /*mismatch=*/true, false);
  EXPECT_TRUE(w.releaseDue());
  w.tell();
  w.take(7, false, false);
  EXPECT_FALSE(w.releaseDue());
}

TEST(EagerWindow, TakingTwiceOrOutsideTheWindowChangesNothing) {
  EagerWindow w(2);
  w.arrived(0);
  w.take(0, true);
  w.take(0, false);  // a slot already freed: message 0 is gone
  w.take(5, false);  // not sent yet
  EXPECT_EQ(w.base(), 1u);
  EXPECT_TRUE(releasedAsMismatch(w.mismatchBits(), 0));
}

TEST(EagerWindow, MismatchBitsNameEveryMessageASenderCanStillWaitFor) {
  // Random take orders over many wraps: whenever the sender reads a release,
  // it finds exactly the messages taken so far among those it waits for,
  // each with the bit it was taken with.
  std::mt19937 rng(7);
  for (uint32_t slots : {1u, 3u, 8u, kMaxEagerSlots}) {
    EagerWindow w(slots);
    std::vector<bool> truth, taken;
    uint32_t next = 0, released = 0;
    for (int round = 0; round < 2000; ++round) {
      // The sender writes message `next` only while next < released + slots.
      while (next - released < slots && rng() % 2) {
        w.arrived(next++);
        truth.push_back(rng() % 3 == 0);
        taken.push_back(false);
      }
      std::vector<uint32_t> arrived;
      for (uint32_t s = w.base(); s != next; ++s) {
        if (!w.waiting(s)) arrived.push_back(s);
      }
      if (!arrived.empty()) {
        const uint32_t s = arrived[rng() % arrived.size()];
        w.take(s, truth[s]);
        taken[s] = true;
      }
      if (w.releaseOwed() && rng() % 2) {
        w.tell();
        const uint32_t count = w.base();
        for (uint32_t s = released; s != next; ++s) {
          const bool took = releaseTook(count, w.takenAheadBits(), s);
          ASSERT_EQ(took, taken[s]) << "slots " << slots << " message " << s;
          if (took) {
            ASSERT_EQ(releasedAsMismatch(w.mismatchBits(), s), truth[s]) << "slots " << slots << " message " << s;
          }
        }
        released = count;
      }
    }
  }
}

TEST(EagerWindow, WithoutSlotsNothingIsEverWaitingOrFull) {
  EagerWindow w(0);
  EXPECT_FALSE(w.waiting(0));
  EXPECT_FALSE(w.full());
  EXPECT_FALSE(w.releaseOwed());
}

TEST(SeqBefore, OrdersAcrossTheWrap) {
  EXPECT_TRUE(seqBefore(0xfffffff0u, 3u));
  EXPECT_FALSE(seqBefore(3u, 0xfffffff0u));
  EXPECT_FALSE(seqBefore(5u, 5u));
}

}  // namespace
}  // namespace mooncake::pg::p2p
