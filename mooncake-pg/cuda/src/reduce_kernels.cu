// The reduction kernel: dst[d][i] = op over k of srcs[k][i] (fold.cuh has
// the arithmetic and its CPU-matching semantics), grid-stride, each thread
// handling 16 bytes of every source per step when every pointer is 16-byte
// aligned.
#include <algorithm>

#include "fold.cuh"
#include "kernel_launch.h"
#include "mooncake/pg/cuda/device_reduce.h"
#include "op_guard.cuh"

namespace mooncake::pg::cuda {
namespace {

constexpr int kThreads = 512;

template <typename T, ReduceOp Op>
__global__ void __launch_bounds__(kThreads) reduceKernel(ReduceJob job, OpGuard guard, bool vectorized) {
  if (!guardAllows(guard)) return;
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  fold::foldRange<T, Op>(job, first, stride, vectorized);
}

template <typename T, ReduceOp Op>
cudaError_t launchTypedOp(const ReduceJob& job, const OpGuard& guard, int sm_count, cudaStream_t stream) {
  const bool vectorized = fold::vectorizable(job);
  const size_t items = vectorized ? (job.count + fold::Pack<T>::kCount - 1) / fold::Pack<T>::kCount : job.count;
  // No more blocks than the device keeps resident: the kernels of the small
  // types need more than 32 registers, so fewer than 4 blocks fit per SM,
  // and a second partial wave would only add a tail.
  static const int per_sm = [] {
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, reduceKernel<T, Op>, kThreads, 0) != cudaSuccess || n < 1) {
      cudaGetLastError();
      n = 1;
    }
    return n;
  }();
  const size_t wanted = (items + kThreads - 1) / kThreads;
  const size_t room = static_cast<size_t>(std::max(1, sm_count)) * per_sm;
  const unsigned blocks = static_cast<unsigned>(std::max<size_t>(1, std::min(wanted, room)));
  reduceKernel<T, Op><<<blocks, kThreads, 0, stream>>>(job, guard, vectorized);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launchReduce(const ReduceJob& job, const OpGuard& guard, int sm_count, cudaStream_t stream) {
  if (job.count == 0 || job.ndst == 0) return cudaSuccess;
  if (job.nsrc < 1 || job.nsrc > kMaxLocalRanks || job.ndst > kMaxReduceDestinations) return cudaErrorInvalidValue;
  return fold::withReduction(job.type, job.op, [&](auto element, auto op) {
    return launchTypedOp<decltype(element), decltype(op)::value>(job, guard, sm_count, stream);
  });
}

cudaError_t reduceOnDevice(void* dst, const void* const* srcs, int nsrc, size_t count, DataType type, ReduceOp op,
                           cudaStream_t stream) {
  if (nsrc < 1 || nsrc > kMaxLocalRanks || !reductionUnsupportedReason(type, op).empty()) return cudaErrorInvalidValue;
  ReduceJob job;
  for (int k = 0; k < nsrc; ++k) job.srcs[k] = srcs[k];
  job.nsrc = nsrc;
  job.dsts[0] = dst;
  job.ndst = 1;
  job.count = count;
  job.type = type;
  job.op = op;
  int device = 0, sm_count = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  return launchReduce(job, OpGuard{}, sm_count, stream);
}

}  // namespace mooncake::pg::cuda
