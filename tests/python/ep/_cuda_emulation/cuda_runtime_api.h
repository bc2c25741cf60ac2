// Stands in for CUDA's headers when tests build a kernel source for the host
// (_layout_emulation.py): one OS thread per CUDA thread, the blocks of a
// launch one after another, so the kernels' own code runs where CI has no
// GPU. Only what mooncake-ep/src/elastic_layout.cu (and receive_layout.cuh) uses; a kernel that needs
// more fails to build here, which says so.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static  // the blocks run one at a time: one copy serves each in turn

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

using cudaError_t = int;
constexpr cudaError_t cudaSuccess = 0;
using cudaStream_t = struct CUstream_st*;
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char* cudaGetErrorString(cudaError_t) { return "emulated"; }

extern thread_local dim3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;
void __syncthreads();
int __syncthreads_or(int predicate);
unsigned __ballot_sync(unsigned lanes, int predicate);
unsigned __shfl_xor_sync(unsigned lanes, unsigned value, int lane_mask);
unsigned __shfl_up_sync(unsigned lanes, unsigned value, unsigned delta);
inline long long __shfl_up_sync(unsigned lanes, long long value, unsigned delta) {  // as two 32-bit halves
  const auto bits = static_cast<unsigned long long>(value);
  const unsigned low = __shfl_up_sync(lanes, static_cast<unsigned>(bits), delta);
  const unsigned high = __shfl_up_sync(lanes, static_cast<unsigned>(bits >> 32), delta);
  return static_cast<long long>(static_cast<unsigned long long>(high) << 32 | low);
}
void __syncwarp(unsigned lanes = 0xffffffffu);
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
int atomicAdd(int* at, int value);
unsigned atomicAdd(unsigned* at, unsigned value);
unsigned long long atomicAdd(unsigned long long* at, unsigned long long value);
void __threadfence();

// `extern __shared__ T name[]` becomes `T* name = emulatedDynamicShared<T>()`.
void* emulatedDynamicSharedBytes();
template <typename T>
T* emulatedDynamicShared() {
  return static_cast<T*>(emulatedDynamicSharedBytes());
}
// `kernel<<<grid, block, shared, stream>>>(args)` becomes this, with a lambda calling the kernel.
void emulatedLaunch(dim3 grid, dim3 block, size_t shared_bytes, const std::function<void()>& kernel);
