// The check every group kernel makes before it touches a peer's memory: once
// the group is broken (a peer died, or did not arrive in time) the kernel
// skips its work and says so, so that the operation completes on the stream
// as failed instead of reading memory a dead process may no longer back.
#pragma once

#include "device_ordering.cuh"
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
__device__ __forceinline__ bool guardAllows(const OpGuard& guard) {
  __shared__ int proceed;
  if (threadIdx.x == 0) {
    proceed = 1;
    // acquire: pairs with the host's release of broken_by.
    if (guard.broken_by != nullptr && ld_acquire_sys(guard.broken_by) >= 0) {
      proceed = 0;
      reportOnce(guard.report, kDeviceAborted, guard.op_id, -1);
    } else if (guard.check_signature && blockIdx.x == 0 && blockIdx.y == 0) {
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
