// One destination's rows sent by several thread blocks of a send kernel
// (gridDim.y "chunks" of it), then one signal. With few destinations (an
// ElasticBuffer opens the kernels with one "expert" per rank) a block per
// destination left most SMs idle and bounded a large call; with several,
// each block counts itself into a 64-bit tally word of this rank's region:
//   bits 48..63  blocks arrived     bits 32..47  blocks that skipped
//   bits  0..31  rows sent
// and the last to arrive publishes the destination's signal with the rows of
// all (or, when some block skipped the destination because it was masked
// meanwhile, publishes nothing: the receiver then gives up on this rank, as
// when a single block skips), and clears the word for the next call (which
// starts after this kernel, in stream order).
//
// Ordering: each block's threads write their rows and meet at a barrier;
// thread 0's add is acq_rel at system scope: its release carries the
// block's rows (cumulative after the barrier), and the last block's acquire
// (one read-modify-write chain through the others' adds) sees every block's
// rows before its release store of the signal. Whoever acquires the signal
// sees them all (publishSignal says why the single-block case needs only
// the release). Two fence.sc.sys around a relaxed add did the same, at the
// price of two sequentially consistent fences in every call's chain.
#pragma once

#include <cstdint>

#include "signals.cuh"

namespace mooncake::ep::cuda {

constexpr uint64_t kTallyArrival = uint64_t{1} << 48;
constexpr uint64_t kTallySkip = uint64_t{1} << 32;

// By thread 0 of a block, after the barrier that follows its rows. `rows`
// is what this block sent; `skipped`: it sent nothing because the
// destination is masked. Returns true when this block published.
__device__ __forceinline__ bool publishFromChunks(char* dest_region, size_t signal_offset, uint64_t* tally,
                                                  uint32_t sequence, uint32_t rows, bool skipped) {
  const uint32_t chunks = gridDim.y;
  if (chunks == 1) {
    if (!skipped) publishSignal(dest_region, signal_offset, sequence, rows);
    return !skipped;
  }
  const uint64_t mine = kTallyArrival | (skipped ? kTallySkip : 0) | rows;
  const uint64_t before = mooncake::pg::cuda::atom_add_acq_rel_sys(tally, mine);
  if ((before >> 48) != chunks - 1) return false;
  const uint64_t all = before + mine;
  *tally = 0;  // read by the next call's kernel only (stream order)
  if ((all >> 32 & 0xffff) != 0) return false;
  publishSignal(dest_region, signal_offset, sequence, static_cast<uint32_t>(all));
  return true;
}

// Blocks per destination for a send kernel over `experts` destinations and
// at most `rows` rows each: about two waves on an H200's 132 SMs when there
// are few destinations, at least `rows_per_chunk` rows a block (a block that
// counts the tokens before its own first needs more rows to pay for that);
// one block each from 132 destinations up (every block then has its own SM).
constexpr int kRowsPerChunkCounting = 128;    // a block that counts the earlier tokens first
constexpr int kRowsPerChunkNotCounting = 32;  // a block whose rows' places are known (combine, pick_slots)

inline int sendChunks(int experts, int rows, int rows_per_chunk = kRowsPerChunkCounting) {
  constexpr int kTargetBlocks = 264;
  const int per_chunk = rows_per_chunk < 1 ? 1 : rows_per_chunk;
  if (experts <= 0 || experts >= kTargetBlocks / 2) return 1;
  const int by_rows = (rows + per_chunk - 1) / per_chunk;
  const int by_blocks = kTargetBlocks / experts;
  return by_rows < 1 ? 1 : (by_rows < by_blocks ? by_rows : by_blocks);
}

}  // namespace mooncake::ep::cuda
