// The barrier as a spinning warp and the gate after a barrier, shared by
// the barrier kernel (sync_kernels.cu) and the fused small all_reduce
// (fused_kernels.cu). They do what the memory-operation batch does
// (stream_sync.cpp), with the same flags, so that ranks using either form
// meet in the same barrier.
#pragma once

#include "mooncake/pg/cuda/common/device_ordering.cuh"
#include "kernel_args.h"
#include "op_guard.cuh"

namespace mooncake::pg::cuda {

// The gate between a barrier and the kernel after it, which reads the peers'
// memory: if the group is broken, it sets this rank's device abort word, and
// that kernel and every later one skip their work (op_guard.cuh). The one
// read of host memory per barrier (kernels read device memory only), and the
// watchdog makes no CUDA call: it only releases the waits, after which this
// runs. The report comes first, so that the watchdog counts the operation as
// failed even though its finished mark follows.
__device__ __forceinline__ void gate(const int32_t* broken_by, uint32_t* abort_word, DeviceReport* report,
                                     uint32_t op_id) {
  if (ld_acquire_sys(broken_by) >= 0) {
    reportOnce(report, kDeviceAborted, op_id, -1);
    st_relaxed_gpu(abort_word, 1);
  }
}

// A barrier done by one warp (every lane calls it; lane q serves peer q):
// lane q signals peer q, then waits for peer q's flag. A lane never waits
// past the deadline or a broken group: it reports and stops waiting, so the
// GPU is never held by a peer that is gone. Lane 0 then gates the work after
// the barrier. Whatever the threads of the block wrote before it (a
// __syncthreads() between) is visible to the peers with the signal.
__device__ __forceinline__ void barrierWarp(const BarrierKernelArgs& a) {
  const int q = threadIdx.x % 32;
  if (q == 0) {
    if (a.started_word != nullptr) st_relaxed_sys(a.started_word, a.started_value);
    if (a.signature_word != nullptr) st_relaxed_sys(a.signature_word, a.signature);
  }
  __syncwarp();  // orders lane 0's writes before every lane's signal
  if (q < a.size && a.signal[q] != nullptr) {
    // The staged data of earlier kernels, and lane 0's writes, before the flag.
    __threadfence_system();
    st_release_sys(a.signal[q], 1);
    const unsigned long long deadline = globaltimer_ns() + a.timeout_ns;
    for (;;) {
      // acquire: the peer's staged data is visible to the kernels after this one.
      if (ld_acquire_sys(a.arrival[q]) != 0) {
        st_relaxed_sys(a.arrival[q], 0);  // cleared for the barrier after next (see stream_sync.h)
        break;
      }
      if (ld_acquire_sys(a.broken_by) >= 0) break;
      if (globaltimer_ns() > deadline) {
        reportOnce(a.report, kDeviceBarrierTimeout, a.op_id, q);
        if (a.abort_word != nullptr) st_relaxed_gpu(a.abort_word, 1);  // the group breaks only once the host sees it
        break;
      }
      __nanosleep(200);
    }
  }
  __syncwarp();
  if (q == 0 && a.abort_word != nullptr) gate(a.broken_by, a.abort_word, a.report, a.op_id);
}

}  // namespace mooncake::pg::cuda
