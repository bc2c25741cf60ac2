// A small all_reduce / reduce in one kernel: the direct schedule's single
// round (cuda_ipc_group_reduce.cpp) without the launches and stream memory
// operations between its steps. One block: its threads push the input into
// every receiver's inbox, warp 0 runs the first barrier (the kernel form,
// barrier_warp.cuh, on the same flags as the memory-operation form), the
// threads fold the inboxes, warp 0 runs the closing barrier, and thread 0
// writes the finished mark. A __syncthreads() between the steps carries each
// step's memory effects to the next: the pushes reach the peers before the
// signal (the signalling lanes fence at system scope after it), and the
// peers' pushes, acquired by the waiting lanes, are seen by every thread's
// fold.
#include "barrier_warp.cuh"
#include "mooncake/pg/cuda/common/copy_range.cuh"
#include "fold.cuh"
#include "kernel_launch.h"

namespace mooncake::pg::cuda {
namespace {

template <typename T, ReduceOp Op>
__global__ void __launch_bounds__(kFusedThreads) fusedDirectKernel(FusedDirectArgs a) {
  const size_t first = threadIdx.x, stride = blockDim.x;
  if (guardAllows(a.start_guard)) {
    for (int d = 0; d < a.npush; ++d) {
      copyRange(static_cast<const char*>(a.push_src), static_cast<char*>(a.push_dst[d]), a.push_bytes, first, stride);
    }
  }
  __syncthreads();  // every push issued before warp 0 signals
  if (threadIdx.x < 32) barrierWarp(a.first);
  __syncthreads();  // the peers' pushes and the gate's abort word, before the fold
  if (guardAllows(a.fold_guard) && a.fold.ndst > 0) fold::foldRange<T, Op>(a.fold, first, stride, a.vectorized);
  __syncthreads();  // every read of the inboxes done before the closing signals
  if (threadIdx.x < 32) barrierWarp(a.closing);
  if (threadIdx.x == 0 && a.finished_word != nullptr) {
    __threadfence_system();
    st_release_sys(a.finished_word, a.finished_value);  // release: the operation's effects come first
  }
}

}  // namespace

cudaError_t launchFusedDirect(const FusedDirectArgs& args, cudaStream_t stream) {
  if (args.npush < 0 || args.npush > kMaxLocalRanks || args.fold.nsrc < 1 || args.fold.nsrc > kMaxLocalRanks ||
      args.fold.ndst > kMaxReduceDestinations) {
    return cudaErrorInvalidValue;
  }
  FusedDirectArgs a = args;
  a.vectorized = fold::vectorizable(a.fold);
  return fold::withReduction(a.fold.type, a.fold.op, [&](auto element, auto op) {
    fusedDirectKernel<decltype(element), decltype(op)::value><<<1, kFusedThreads, 0, stream>>>(a);
    return cudaGetLastError();
  });
}

}  // namespace mooncake::pg::cuda
