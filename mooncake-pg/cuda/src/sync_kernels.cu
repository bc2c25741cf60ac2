// The kernel forms of the stream's synchronization, for SyncMode::kKernels
// (and wherever stream memory operations are missing or cannot be captured).
// They do what the memory-operation batch does (stream_sync.cpp), with the
// same flags, so that ranks using either form meet in the same barrier.
#include "kernel_launch.h"
#include "op_guard.cuh"

namespace mooncake::pg::cuda {
namespace {

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

// One warp; lane q signals peer q, then waits for peer q's flag. A lane
// never waits past the deadline or a broken group: it reports and stops
// waiting, so the GPU is never held by a peer that is gone. Lane 0 then
// gates the kernels after the barrier.
__global__ void barrierKernel(BarrierKernelArgs a) {
  const int q = threadIdx.x;
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

__global__ void gateKernel(const int32_t* broken_by, uint32_t* abort_word, DeviceReport* report, uint32_t op_id) {
  gate(broken_by, abort_word, report, op_id);
}

__global__ void markKernel(uint32_t* word, uint32_t value) {
  __threadfence_system();
  st_release_sys(word, value);  // release: everything the stream did before is visible with it
}

}  // namespace

cudaError_t launchGateKernel(const int32_t* broken_by, uint32_t* abort_word, DeviceReport* report, uint32_t op_id,
                             cudaStream_t stream) {
  gateKernel<<<1, 1, 0, stream>>>(broken_by, abort_word, report, op_id);
  return cudaGetLastError();
}

cudaError_t launchBarrierKernel(const BarrierKernelArgs& args, cudaStream_t stream) {
  barrierKernel<<<1, 32, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launchMarkKernel(uint32_t* word, uint32_t value, cudaStream_t stream) {
  markKernel<<<1, 1, 0, stream>>>(word, value);
  return cudaGetLastError();
}

}  // namespace mooncake::pg::cuda
