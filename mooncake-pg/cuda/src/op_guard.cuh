// The check every group kernel makes before it touches a peer's memory: once
// the group is broken (a peer died, or did not arrive in time) the kernel
// skips its work and says so, so that the operation completes on the stream
// as failed instead of reading memory a dead process may no longer back.
// The signal is the rank's abort word in device memory (kernel_args.h), set
// on the stream by the gate that ends each barrier (sync_kernels.cu): a
// kernel that reads the peers' memory always follows a barrier, and a wait
// released because the group broke passes through that gate first.
// One kind of kernel comes before any barrier of its operation: the first
// push of a reducing operation (cuda_ipc_group_reduce.cpp), which writes into
// the peers' staging. Its abort word is the one the previous operation's
// gates left, so it can still write after a peer died since. It then writes
// only into staging that no operation of the broken group reads again (every
// later one fails at its start or at its first gate), through a mapping this
// process keeps open; the dead-rank tests cover it.
#pragma once

#include "mooncake/pg/cuda/common/device_ordering.cuh"
#include "kernel_args.h"

namespace mooncake::pg::cuda {

// The first failure is the one the host reports: later kernels leave it be.
__device__ __forceinline__ void reportOnce(DeviceReport* report, uint32_t error, uint32_t op_id, int32_t rank) {
  if (report == nullptr || ld_relaxed_sys(&report->error) != kDeviceOk) return;
  st_relaxed_sys(&report->op_id, op_id);
  st_relaxed_sys(&report->rank, rank);
  st_release_sys(&report->error, error);  // release: op_id and rank are visible once error is
}

// Called by every thread of the block; true when the block may do its work.
// Each block reads the rank's abort word in device memory (L2), never host
// memory: the host-mapped report is written only when the kernel skips, and
// by block 0 alone (one report per kernel is all the watchdog needs).
__device__ __forceinline__ bool guardAllows(const OpGuard& guard) {
  __shared__ int proceed;
  if (threadIdx.x == 0) {
    proceed = 1;
    const bool first_block = blockIdx.x == 0 && blockIdx.y == 0;
    if (guard.abort_word != nullptr && ld_relaxed_gpu(guard.abort_word) != 0) {
      proceed = 0;
      if (first_block) reportOnce(guard.report, kDeviceAborted, guard.op_id, -1);
    } else if (guard.check_signature && first_block) {
      // Each peer staged its signature before its first barrier signal
      // (release), and this kernel runs after that barrier's wait.
      for (int q = 0; q < guard.size; ++q) {
        const uint32_t* theirs = guard.peer_signature[q];
        if (theirs != nullptr && ld_relaxed_sys(theirs) != guard.signature) {
          reportOnce(guard.report, kDeviceSignatureMismatch, guard.op_id, q);
          break;
        }
      }
    }
  }
  __syncthreads();
  return proceed != 0;
}

}  // namespace mooncake::pg::cuda
