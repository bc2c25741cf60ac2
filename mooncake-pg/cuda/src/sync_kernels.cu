// The kernel forms of the stream's synchronization, for SyncMode::kKernels
// (and wherever stream memory operations are missing or cannot be captured).
// They do what the memory-operation batch does (stream_sync.cpp), with the
// same flags, so that ranks using either form meet in the same barrier.
#include "kernel_launch.h"
#include "op_guard.cuh"

namespace mooncake::pg::cuda {
namespace {

// One warp; lane q signals peer q, then waits for peer q's flag. A lane
// never waits past the deadline or a broken group: it reports and returns,
// so the GPU is never held by a peer that is gone.
__global__ void barrierKernel(BarrierKernelArgs a) {
  const int q = threadIdx.x;
  if (q == 0) {
    if (a.started_word != nullptr) st_relaxed_sys(a.started_word, a.started_value);
    if (a.signature_word != nullptr) st_relaxed_sys(a.signature_word, a.signature);
  }
  __syncwarp();  // orders lane 0's writes before every lane's signal
  if (q >= a.size || a.signal[q] == nullptr) return;
  // The staged data of earlier kernels, and lane 0's writes, before the flag.
  __threadfence_system();
  st_release_sys(a.signal[q], 1);
  const unsigned long long deadline = globaltimer_ns() + a.timeout_ns;
  for (;;) {
    // acquire: the peer's staged data is visible to the kernels after this one.
    if (ld_acquire_sys(a.arrival[q]) != 0) {
      st_relaxed_sys(a.arrival[q], 0);  // cleared for the barrier after next (see stream_sync.h)
      return;
    }
    if (ld_acquire_sys(a.broken_by) >= 0) return;
    if (globaltimer_ns() > deadline) {
      reportOnce(a.report, kDeviceBarrierTimeout, a.op_id, q);
      return;
    }
    __nanosleep(200);
  }
}

__global__ void markKernel(uint32_t* word, uint32_t value) {
  __threadfence_system();
  st_release_sys(word, value);  // release: everything the stream did before is visible with it
}

}  // namespace

cudaError_t launchBarrierKernel(const BarrierKernelArgs& args, cudaStream_t stream) {
  barrierKernel<<<1, 32, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launchMarkKernel(uint32_t* word, uint32_t value, cudaStream_t stream) {
  markKernel<<<1, 1, 0, stream>>>(word, value);
  return cudaGetLastError();
}

}  // namespace mooncake::pg::cuda
