// Signal words between ranks and the bounded wait on them. The ordering of
// each access is in its name (the process group's device_ordering.cuh):
//   a sender writes its rows with plain stores, then (after a barrier of its
//   block) publishes (sequence << 32) | count with a release store: a
//   receiver that reads that value with an acquire load is guaranteed to see
//   the rows. System scope, because the peer is another process (another
//   context, maybe another GPU over NVLink).
#pragma once

#include <cstdint>

#include "call_sequence.cuh"
#include "mooncake/pg/cuda/common/device_ordering.cuh"
#include "kernel_args.h"

namespace mooncake::ep::cuda {

using mooncake::pg::cuda::globaltimer_ns;
using mooncake::pg::cuda::ld_acquire_gpu;
using mooncake::pg::cuda::ld_acquire_sys;
using mooncake::pg::cuda::ld_relaxed_gpu;
using mooncake::pg::cuda::ld_relaxed_sys;
using mooncake::pg::cuda::st_relaxed_sys;
using mooncake::pg::cuda::st_release_gpu;
using mooncake::pg::cuda::st_release_sys;

// active_ranks entries: relaxed at system scope, so that a mask the caller
// keeps in host-mapped memory works too; several threads may write 0 at once.
__device__ __forceinline__ int32_t loadActive(const int32_t* p) { return ld_relaxed_sys(p); }
__device__ __forceinline__ void maskRank(int32_t* p) { st_relaxed_sys(p, 0); }

// Whether a sender skips destination `dest`: this rank or `dest` is masked,
// or `dest`'s process is known gone (its memory may no longer be backed):
// by the host when it enqueued the call, or by a wait kernel since. Never a
// host-memory read (see WaitEscape). The three loads are issued together
// (`|`, not `||`: a branch on each would wait for it before the next load),
// as this decision starts every send block's chain of round trips.
__device__ __forceinline__ bool skipDestination(const int32_t* active_ranks, const WaitEscape& escape, int rank,
                                                int dest) {
  const int32_t self_active = loadActive(active_ranks + rank);
  const int32_t dest_active = loadActive(active_ranks + dest);
  const uint32_t dest_seen_gone = ld_relaxed_sys(escape.departed_seen + dest);
  return (self_active == 0) | (dest_active == 0) | ((escape.departed_bits >> dest & 1u) != 0) | (dest_seen_gone != 0);
}

// The start of every send block, by all its threads: the call's number
// (read by thread 0, shared), and one decision for the whole block whether it
// sends to `dest` at all (its threads meet at barriers later). Nothing goes
// to a rank this rank masks, and a rank masked by its own caller takes no
// part at all, not even signals (the peers then give up on it, or skip it if
// they mask it too): such a block counts itself done, is told `skipped`, and
// must return. The number is the call's either way (a dispatch of one launch
// raises it as `laid_out`), read before this block counts itself done.
struct SendBlockStart {
  uint32_t sequence;
  bool skipped;
};

__device__ __forceinline__ SendBlockStart beginSendBlock(CallCounters* counters, const int32_t* active_ranks,
                                                         const WaitEscape& escape, int rank, int dest) {
  __shared__ uint32_t sequence;
  if (threadIdx.x == 0) sequence = sendSequence(counters);
  const bool skip = threadIdx.x == 0 && skipDestination(active_ranks, escape, rank, dest);
  if (__syncthreads_or(skip)) {  // also publishes `sequence` to the block
    if (threadIdx.x == 0) finishSendBlock(counters, sequence);
    return {sequence, true};
  }
  return {sequence, false};
}

// Wait kernels, at their start: copy the host-mapped departed words into
// departed_seen, a thread per peer (R parallel PCIe reads, overlapping the
// wait for the peers' signals). The threads are the block's last, counted
// down: the first ones wait for the signals, and a PCIe read ahead of a
// thread's own wait would hold that wait back by the read's round trip.
__device__ __forceinline__ void noteDepartedPeers(const WaitEscape& escape, int rank, int num_ranks) {
  for (int r = static_cast<int>(blockDim.x - 1 - threadIdx.x); r < num_ranks; r += static_cast<int>(blockDim.x)) {
    if (r != rank && escape.departed != nullptr && ld_relaxed_sys(escape.departed + r) != 0) {
      st_relaxed_sys(escape.departed_seen + r, 1u);
    }
  }
}

__device__ __forceinline__ uint64_t signalValue(uint32_t sequence, uint32_t count) {
  return static_cast<uint64_t>(sequence) << 32 | count;
}

// The sender's side, by thread 0 after a __syncthreads() that follows the
// whole block's writes of its rows. The barrier puts every thread's writes
// before this release store in causality order, and release is cumulative:
// whoever acquires the signal sees them (DeepEP signals its NVLink peers the
// same way). Measured against publishing every block's signal from the last
// block after one fence.sc.sys: a release per block is faster (world 1,
// DeepEP's shape: 51 + 35 us against 55 + 48 us of kernel time for
// dispatch + combine), and simpler.
__device__ __forceinline__ void publishSignal(char* region, size_t offset, uint32_t sequence, uint32_t count) {
  st_release_sys(reinterpret_cast<uint64_t*>(region + offset), signalValue(sequence, count));
}

// Waits until the signal word carries `sequence` and returns its count, or
// returns -1 once `src` is given up on: its active_ranks entry is 0 (set by
// the caller, or by another waiting thread), its process exited, the caller
// aborted the waits, or the deadline (start_ns + timeout_ns) passed; in the
// last three cases this thread masks it. A signal that has arrived is taken
// even when the source was masked meanwhile; the caller decides from the
// final mask whether its rows count. Never traps, never spins unbounded
// (with timeout_ns = -1 the wait ends when the peer's process exits).
__device__ __forceinline__ int waitSignal(const char* region, size_t offset, uint32_t sequence, int src,
                                          int32_t* active_ranks, const WaitEscape& escape, uint64_t start_ns,
                                          int64_t timeout_ns) {
  const uint64_t* word = reinterpret_cast<const uint64_t*>(region + offset);
  for (uint32_t spin = 0;; ++spin) {
    // The mask first, so that both loads are in flight at once (nothing after
    // an acquire load may be performed before it): one round trip a spin.
    const int32_t active = loadActive(active_ranks + src);
    const uint64_t v = ld_acquire_sys(word);  // acquire: the rows written before it are visible after
    if (static_cast<uint32_t>(v >> 32) == sequence) return static_cast<int>(static_cast<uint32_t>(v));
    if (active == 0) return -1;
    if ((spin & 15) == 15) {  // the host-mapped words cost a PCIe read: look less often
      const bool departed = escape.departed != nullptr && ld_relaxed_sys(escape.departed + src) != 0;
      const bool aborted = escape.abort != nullptr && ld_relaxed_sys(escape.abort) != 0;
      const bool late = timeout_ns >= 0 && globaltimer_ns() - start_ns > static_cast<uint64_t>(timeout_ns);
      if (departed || aborted || late) {
        if (departed) st_relaxed_sys(escape.departed_seen + src, 1u);  // later sends skip it
        maskRank(active_ranks + src);
        return -1;
      }
    }
    // Other ranks' kernels may share this GPU (time-sliced between
    // processes): back off a little instead of hammering L2.
    __nanosleep(128);
  }
}

}  // namespace mooncake::ep::cuda
