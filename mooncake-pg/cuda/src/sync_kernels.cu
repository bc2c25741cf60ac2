// The kernel forms of the stream's synchronization, for SyncMode::kKernels
// (and wherever stream memory operations are missing or cannot be captured):
// the barrier (barrier_warp.cuh), the gate alone, and the progress mark.
#include "barrier_warp.cuh"
#include "kernel_launch.h"

namespace mooncake::pg::cuda {
namespace {

__global__ void barrierKernel(BarrierKernelArgs a) { barrierWarp(a); }

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
