// The device side of mooncake/ep/cuda/trace.h. With MOONCAKE_EP_TRACE
// defined, traceAt(point) has thread 0 of the calling block stamp
// %globaltimer into the point's first (atomicMin) and last (atomicMax);
// without it traceAt is empty and the kernels are as without this header.
// A CUPTI timeline shows one bar per launch, while a small dispatch is one
// launch holding a chain of grid-wide steps (the rows, the wait for the
// layout, the signal, the wait, the hand-over, the copies, the ticket).
#pragma once

#include <cuda_runtime_api.h>

#include "mooncake/ep/cuda/trace.h"

namespace mooncake::ep::cuda::trace {

Stamps* stampsBuffer();  // device memory, allocated on first use (trace_points.cpp)

// Internal linkage throughout: each translation unit has its own pointer to
// the one buffer (there is no relocatable device code to share a variable)
// and its own bindUnit, which sets that unit's pointer.
namespace {  // NOLINT(google-build-namespaces, cert-dcl59-cpp): one copy per unit is the point

#ifdef MOONCAKE_EP_TRACE
__device__ Stamps* g_stamps = nullptr;

__device__ __forceinline__ void traceAt(Point point) {
  if (threadIdx.x != 0 || g_stamps == nullptr) return;
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  atomicMin(&g_stamps->first[point], now);
  atomicMax(&g_stamps->last[point], now);
}

// Points this unit's g_stamps at the buffer, once per process: from the host
// before the unit's first launch, outside stream capture (ElasticBuffer's
// first call of a shape is eager).
inline void bindUnit() {
  static const bool bound = [] {
    Stamps* buffer = stampsBuffer();
    if (buffer != nullptr && cudaMemcpyToSymbol(g_stamps, &buffer, sizeof buffer) == cudaSuccess) return true;
    cudaGetLastError();  // unstamped, but not an error for the launch that follows
    return false;
  }();
  (void)bound;
}
#else
__device__ __forceinline__ void traceAt(Point) {}
inline void bindUnit() {}
#endif

}  // namespace

}  // namespace mooncake::ep::cuda::trace
