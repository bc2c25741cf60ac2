// Call sequence numbers, kept by the kernels in device memory (the rank's own
// GroupCounters in its region) rather than passed by the host: a CUDA graph
// captured once then numbers every replay anew, and the host never has to
// know how many calls the device has run.
//
// Each call kind (dispatch, combine) has two counters because its send and
// its receive may be issued apart (return_recv_hook): `sent` is advanced by
// the send kernel, `received` by the wait kernel, one step per call each, so
// the n-th send and the n-th receive of every rank carry the same number.
// Numbers run 1 .. kLastSequence and wrap to 1: never 0 (the value of a
// signal nobody wrote), and an even count of them, so the parity (which half
// of the region a call uses) alternates across the wrap too.
#pragma once

#include <cstdint>

#include "mooncake/pg/cuda/common/device_ordering.cuh"
#include "region_layout.h"

namespace mooncake::ep::cuda {

constexpr uint32_t kLastSequence = 0xfffffffeu;

struct CallCounters {
  uint32_t sent;         // sequence of the last call whose send kernel completed
  uint32_t received;     // sequence of the last call whose wait kernel started
  uint32_t send_blocks;  // blocks of the running send kernel that are done (0 between calls)
  // A dispatch of one launch (dispatch_kernels.cu, wholeCall): its send
  // sequence, raised by the block that waited once the layout is written.
  // Unused in the combine's counters.
  uint32_t laid_out;
};

struct GroupCounters {
  CallCounters dispatch;
  CallCounters combine;
};

static_assert(sizeof(GroupCounters) <= kCountersBytes);  // the space region_layout.h gives them

__device__ __forceinline__ uint32_t nextSequence(uint32_t s) { return s >= kLastSequence ? 1u : s + 1u; }

// Send kernels: every block reads its call's number when it starts...
__device__ __forceinline__ uint32_t sendSequence(const CallCounters* c) {
  return nextSequence(*reinterpret_cast<const volatile uint32_t*>(&c->sent));
}

// ... and the last block to finish advances `sent` (by thread 0 of each
// block, after the block's work). Every block read `sent` before counting
// itself done, so no block of this call can see the new value.
// The count is an acq_rel atomic at GPU scope: the counters are this rank's
// own, read by its own later kernels only.
__device__ __forceinline__ void finishSendBlock(CallCounters* c, uint32_t sequence) {
  const uint32_t before = mooncake::pg::cuda::atom_add_acq_rel_gpu(&c->send_blocks, 1u);
  if (before == gridDim.x * gridDim.y - 1) {
    c->send_blocks = 0;
    c->sent = sequence;
  }
}

// The wait kernel (one block; thread 0) takes the next number for the
// receive; the kernels after it on the stream read it with receivedSequence.
__device__ __forceinline__ uint32_t beginReceive(CallCounters* c) {
  const uint32_t sequence = nextSequence(c->received);
  c->received = sequence;
  return sequence;
}

__device__ __forceinline__ uint32_t receivedSequence(const CallCounters* c) { return c->received; }

}  // namespace mooncake::ep::cuda
