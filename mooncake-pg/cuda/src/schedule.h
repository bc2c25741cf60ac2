// How operations are cut into rounds that fit the staging buffer, and what
// identifies an operation across ranks. Pure arithmetic, tested without a GPU.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace mooncake::pg::cuda {

// Every round starts on a 16-byte boundary of the user's buffers and of the
// staging halves, so that the kernels can use vector accesses throughout.
constexpr size_t kRoundAlignBytes = 16;

// A payload of `total` units cut into `rounds` pieces of `per_round` units
// (the last ones shorter, possibly empty). Round i stages into half i % 2 and
// synchronizes on barrier set i % 2 (stream_sync.h). So that every operation
// leaves both where it found them (graph replays rely on it), there is either
// one round followed by a closing barrier (after which nobody reads the
// staging buffer any more), or an even number of rounds (the last reads are
// then of half 1, and the next operation starts with half 0).
struct RoundPlan {
  size_t total = 0;
  size_t rounds = 0;
  size_t per_round = 0;
  bool closing_barrier = false;

  size_t begin(size_t round) const { return std::min(total, round * per_round); }
  size_t length(size_t round) const { return std::min(total, begin(round) + per_round) - begin(round); }
};

// `capacity` units fit in one round; units are `unit_bytes` each. With
// `even_rounds`, a payload that fits in one round still takes two (for
// schedules whose last reads follow their last barrier).
inline RoundPlan planRounds(size_t total, size_t capacity, size_t unit_bytes, bool even_rounds = false) {
  RoundPlan plan;
  plan.total = total;
  if (total == 0) return plan;
  const size_t align = std::max<size_t>(1, kRoundAlignBytes / unit_bytes);
  capacity = std::max(align, capacity / align * align);
  if (total <= capacity && !even_rounds) {
    plan.rounds = 1;
    plan.per_round = total;
    plan.closing_barrier = true;
    return plan;
  }
  size_t rounds = std::max<size_t>(2, (total + capacity - 1) / capacity);
  rounds += rounds % 2;
  const size_t share = (total + rounds - 1) / rounds;
  plan.rounds = rounds;
  plan.per_round = std::min(capacity, (share + align - 1) / align * align);
  return plan;
}

// Segment `index` of `parts` over `count` units, each segment aligned like a
// round (the last ones shorter or empty): [begin, begin + length).
inline void alignedSegment(size_t count, int parts, int index, size_t unit_bytes, size_t& begin, size_t& length) {
  const size_t align = std::max<size_t>(1, kRoundAlignBytes / unit_bytes);
  const size_t share = (count + parts - 1) / parts;
  const size_t step = (share + align - 1) / align * align;
  begin = std::min(count, static_cast<size_t>(index) * step);
  length = std::min(count, begin + step) - begin;
}

// Inboxes: the reducing schedules push, so a rank's staging half is cut into
// rows of `size - 1` inboxes, one per source rank (the owner left out), each
// `inboxBytes` long and 16-byte aligned. `row` 0 is the first row (direct and
// two-shot's scatter), 1 the second (two-shot's gather).
inline size_t inboxBytes(size_t half_bytes, int size, int rows) {
  return half_bytes / (static_cast<size_t>(rows) * (size - 1)) / kRoundAlignBytes * kRoundAlignBytes;
}
inline size_t inboxOffset(int owner, int source, int size, size_t inbox_bytes, int row = 0) {
  const int slot = (source < owner ? source : source - 1) + row * (size - 1);
  return static_cast<size_t>(slot) * inbox_bytes;
}

// How an all_reduce / reduce of `bytes` runs (cuda_ipc_group_reduce.cpp):
// direct (every receiver folds every input) up to one_shot_bytes, and at two
// ranks at any size that fits one round, where it moves no more than
// two-shot; as one kernel when that is one round of at most fused_bytes and
// one_shot_bytes; two-shot otherwise. `half_bytes` is a staging half; at
// least two ranks.
enum class ReduceSchedule : uint8_t { kDirectFused, kDirect, kTwoShot };
inline ReduceSchedule reduceSchedule(size_t bytes, int size, size_t half_bytes, size_t one_shot_bytes,
                                     size_t fused_bytes) {
  const size_t direct_inbox = inboxBytes(half_bytes, size, 1);
  if (bytes > one_shot_bytes && !(size == 2 && bytes <= direct_inbox)) return ReduceSchedule::kTwoShot;
  const bool one_round = bytes <= direct_inbox;  // planRounds: one round when the payload fits
  if (one_round && bytes <= std::min(fused_bytes, one_shot_bytes)) return ReduceSchedule::kDirectFused;
  return ReduceSchedule::kDirect;
}

enum class OpCode : uint8_t { kBarrier = 1, kBroadcast, kAllreduce, kReduce, kAllgather, kReduceScatter, kAlltoall,
                              kGather, kScatter };

// splitmix64's finalizer: every input bit moves about half the output bits.
inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// What every rank must agree on for one operation; never 0 (a fresh staging
// header reads 0).
inline uint32_t opSignature(OpCode op, uint64_t a = 0, uint64_t b = 0, uint64_t c = 0, uint64_t d = 0) {
  uint64_t h = mix64(static_cast<uint64_t>(op));
  for (uint64_t v : {a, b, c, d}) h = mix64(h ^ mix64(v + 0x9e3779b97f4a7c15ull));
  const uint32_t folded = static_cast<uint32_t>(h ^ (h >> 32));
  return folded != 0 ? folded : 1u;
}

}  // namespace mooncake::pg::cuda
