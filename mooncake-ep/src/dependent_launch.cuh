// Programmatic dependent launch (Hopper and later): a kernel launched with
// cudaLaunchAttributeProgrammaticStreamSerialization may start while the
// kernel before it on the stream is still running, once every block of that
// kernel allowed it (allowDependentLaunch); before it reads anything that
// kernel writes it waits for its completion and its memory
// (waitForPreviousKernel). What such a kernel does before the wait overlaps
// its predecessor's end: its blocks' start and whatever they read that the
// predecessor does not write.
//
// Both are no-ops where the code is built for an older architecture: such a
// kernel is never launched so (dispatch_kernels.cu checks the function's
// PTX version), and a kernel that never allows it is waited for whole.
#pragma once

#include <cuda_runtime_api.h>  // __device__ where the layout kernels are built for the host (the tests' emulation)

namespace mooncake::ep::cuda {

constexpr int kDependentLaunchPtxVersion = 90;  // griddepcontrol: PTX for sm_90 on

__device__ __forceinline__ void allowDependentLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void waitForPreviousKernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace mooncake::ep::cuda
