// The eager path of the P2P channel: a message of up to the receiver's
// eager size goes without a credit into a ring of slots the receiver keeps
// for each sender, so its bytes move at once instead of after a credit's
// round trip. What is here is the bookkeeping both ends keep about one
// ring, pure so that it is tested without engines.
//
// Slot `seq % slots` of a sender's ring holds its eager message `seq`
// (numbered per lane and epoch). The receiver takes messages in any order
// (they match receives by tag) but frees slots in order: it tells the
// sender the count below which every message was taken (a ReleaseSlot),
// which messages above it were taken already, and for each recent message
// whether it matched its receive's size. The sender writes message `seq`
// only while seq < count + slots; a send ends when its message was taken,
// whatever became of earlier ones (a message taken later must not hold up
// one taken now: the two programs may depend on that order).
//
// A send may also end as soon as its write is on the wire (a collective's,
// kEagerEndsWhenSent): then nobody waits for its release, and the receiver
// gathers releases instead of writing one per message (releaseDue): it
// tells the sender once half of the ring's room is free again, or at once
// when the sender cannot write any more (every slot it may use holds a
// message), when a sender waits for a taken message, or when a message did
// not match its receive. The sender never writes past the count it was told,
// so gathering never lets it overrun a slot.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace mooncake::pg::p2p {

// The bits of a release cover the messages in [count - slots, count + slots):
// with at most 32 slots a 64-bit mask names each of them once.
constexpr uint32_t kMaxEagerSlots = 32;

// Whether `a` comes before `b` in sequence order (counters wrap).
inline bool seqBefore(uint32_t a, uint32_t b) { return static_cast<int32_t>(a - b) < 0; }

class EagerWindow {
 public:
  EagerWindow() = default;
  explicit EagerWindow(uint32_t slots) : state_(slots, kWaiting) {}

  uint32_t slots() const { return static_cast<uint32_t>(state_.size()); }
  // Every message below this one was taken.
  uint32_t base() const { return base_; }
  bool inWindow(uint32_t seq) const { return seq - base_ < slots(); }
  // Whether slot of `seq` may still receive it (in the window, not seen yet).
  bool waiting(uint32_t seq) const { return inWindow(seq) && state_[seq % slots()] == kWaiting; }
  void arrived(uint32_t seq) {
    if (inWindow(seq)) state_[seq % slots()] = kArrived;
  }
  // Message `seq` was copied out (matched, spilled or dropped). `mismatch`:
  // it did not match the size of its receive, which the sender learns.
  // `sender_waits`: its send ends only when the sender learns it was taken.
  void take(uint32_t seq, bool mismatch, bool sender_waits = true) {
    if (!inWindow(seq) || state_[seq % slots()] == kTaken) return;
    state_[seq % slots()] = kTaken;
    const uint64_t bit = 1ull << (seq % 64);
    mismatch_ = mismatch ? (mismatch_ | bit) : (mismatch_ & ~bit);
    changed_ = true;
    urgent_ = urgent_ || mismatch || sender_waits;
    while (slots() > 0 && state_[base_ % slots()] == kTaken) {
      state_[base_ % slots()] = kWaiting;
      ++base_;
    }
  }
  // No slot of the window can receive: every one holds a message not taken.
  bool full() const {
    for (uint32_t seq = base_; seq != base_ + slots(); ++seq) {
      if (state_[seq % slots()] == kWaiting) return false;
    }
    return slots() > 0;
  }
  uint64_t mismatchBits() const { return mismatch_; }
  // Bit seq % 64 for each message at or above base() already taken.
  uint64_t takenAheadBits() const {
    uint64_t bits = 0;
    for (uint32_t seq = base_; seq != base_ + slots(); ++seq) {
      if (state_[seq % slots()] == kTaken) bits |= 1ull << (seq % 64);
    }
    return bits;
  }
  // Something was taken since the sender was last told.
  bool releaseOwed() const { return changed_; }
  // Whether the sender must be told now (see the top of this file): a
  // release owed that someone waits for, or that frees half of the ring,
  // or without which the sender cannot write on.
  bool releaseDue() const {
    if (!changed_) return false;
    if (urgent_ || base_ - told_base_ >= std::max<uint32_t>(slots() / 2, 1)) return true;
    // The last slot the sender may write under the count it was told: once
    // that message is in, the sender waits for a release to write more.
    const uint32_t last = told_base_ + slots() - 1;
    return seqBefore(last, base_) || (inWindow(last) && state_[last % slots()] != kWaiting);
  }
  // Records that the sender is being told; returns the release's version
  // (1, 2, ...), which tells one release from the next.
  uint32_t tell() {
    changed_ = false;
    urgent_ = false;
    told_base_ = base_;
    return ++version_;
  }

 private:
  enum : uint8_t { kWaiting, kArrived, kTaken };
  std::vector<uint8_t> state_;
  uint32_t base_ = 0;
  uint32_t told_base_ = 0;  // base() when the sender was last told
  uint32_t version_ = 0;
  bool changed_ = false;
  bool urgent_ = false;  // a take since then that must be told at once
  uint64_t mismatch_ = 0;
};

// By a release (count, taken-ahead bits): whether the receiver took `seq`,
// a message the sender wrote and still waits for.
inline bool releaseTook(uint32_t count, uint64_t taken_ahead_bits, uint32_t seq) {
  return seqBefore(seq, count) || (seq - count < kMaxEagerSlots && ((taken_ahead_bits >> (seq % 64)) & 1));
}
// Whether message `seq`, which that release took, did not match its
// receive's size.
inline bool releasedAsMismatch(uint64_t mismatch_bits, uint32_t seq) { return (mismatch_bits >> (seq % 64)) & 1; }

}  // namespace mooncake::pg::p2p
