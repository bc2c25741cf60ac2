// Combine in three launches on the caller's stream, one per phase of one
// kernel (`combine`, see there):
//   send    one block per (token rank d, local expert le): the rows of d's
//           segment in le's block (layout_range of the dispatch) go to d's
//           region, slot (parity, global expert, token index at d from
//           src_info); then the signal of (parity, global expert) on d.
//   wait    one block: waits for the signal of every global expert from its
//           owner, bounded; a late owner is masked.
//   reduce  one block per token: out[t] = sum over k, in k order, of
//           w[t, k] * row(expert of pick k, t), float32 multiply then add,
//           rounded to bf16 once; picks that are -1 or whose owner is masked
//           (after the wait) are skipped. The collective path's arithmetic.
//           Warp 0 finds the picks that count (findPicks); each thread loads
//           kRowsInFlight rows' vectors before it adds them.
// The send phase is the call's first half, wait and reduce its second
// (EpStages); each half takes its call number from the device counters.
#include <cuda_bf16.h>

#include <algorithm>

#include "kernel_args.h"
#include "send_tally.cuh"
#include "signals.cuh"
#include "warp_copy.cuh"

namespace mooncake::ep::cuda {
namespace {

constexpr int kSendThreads = 512;
constexpr int kWaitThreads = 512;
constexpr int kMaxThreads = 512;  // three blocks per SM, 40 registers a thread (few spills here; dispatch takes two)
constexpr int kMinBlocks = 3;
constexpr int kWarp = 32;
constexpr int kChannelsPerThread = 8;  // one 16-byte load of bf16

// The channels that travel (y's and out's row strides); rows in the region keep H.
__host__ __device__ __forceinline__ int channelsOf(const CombineArgs& args, const RegionLayout& lay) {
  return args.channels > 0 ? args.channels : lay.H;
}

// `self_by_reference`: a row for this rank itself does not travel; its slot
// holds the row's index in y instead, and the reduce reads y there (one copy
// fewer). Only for calls enqueued whole (EpStages::kAll): a receive half
// enqueued later could find y already reused.
__device__ __forceinline__ void sendPhase(const EpKernelContext& ctx, const CombineArgs& args, bool self_by_reference) {
  const RegionLayout& lay = ctx.layout;
  const int dest = blockIdx.x / lay.L, le = blockIdx.x % lay.L;
  CallCounters* counters = &ctx.counters->combine;
  auto* tally = reinterpret_cast<uint64_t*>(ctx.regions[ctx.rank] + lay.sendTally(1, blockIdx.x));
  const SendBlockStart start = beginSendBlock(counters, args.active_ranks, ctx.escape, ctx.rank, dest);
  if (start.skipped) {
    if (threadIdx.x == 0) publishFromChunks(nullptr, 0, tally, 0, 0, /*skipped=*/true);
    return;
  }
  const uint32_t sequence = start.sequence;
  const int parity = static_cast<int>(sequence & 1);
  char* region = ctx.regions[dest];
  const int expert = ctx.rank * lay.L + le;
  const size_t rows_per_expert = static_cast<size_t>(lay.R) * lay.T;
  const int64_t range = args.layout_range[le * lay.R + dest];
  // The handle's segment, kept inside the expert's rows whatever the caller
  // passed (a layout_range nobody wrote would otherwise send reads of y
  // anywhere).
  const int64_t slots = static_cast<int64_t>(rows_per_expert);
  const int begin = static_cast<int>(min(max(range >> 32, int64_t{0}), slots));
  const int count = static_cast<int>(min(range & 0xffffffff, slots - begin));
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  constexpr int kWarps = kSendThreads / kWarp;
  const int channels = channelsOf(args, lay);
  // gridDim.y blocks share the segment, a warp's rows kWarps * gridDim.y apart.
  for (int i = static_cast<int>(blockIdx.y) * kWarps + warp; i < count; i += kWarps * static_cast<int>(gridDim.y)) {
    const size_t row = le * rows_per_expert + begin + i;
    const int token = args.src_info[row];
    if (token < 0 || token >= lay.T) continue;  // not a dispatch handle's row: never write out of the slot table
    if (self_by_reference && dest == ctx.rank) {
      if (lane == 0) *reinterpret_cast<int64_t*>(region + lay.combineRow(parity, expert, token)) = static_cast<int64_t>(row);
      continue;
    }
    warpCopy(region + lay.combineRow(parity, expert, token), static_cast<const __nv_bfloat16*>(args.y) + row * channels,
             2 * static_cast<size_t>(channels), lane);
  }
  // Every thread's rows before the signal: the barrier orders them before
  // thread 0's release, which is cumulative (see publishSignal, send_tally.cuh).
  __syncthreads();
  if (threadIdx.x == 0) {
    // The count (not needed by the receiver, which addresses rows by token) is the segment's, once.
    publishFromChunks(region, lay.combineSignal(parity, expert), tally, sequence,
                      blockIdx.y == 0 ? static_cast<uint32_t>(count) : 0u, /*skipped=*/false);
    finishSendBlock(counters, sequence);
  }
}

__device__ __forceinline__ void waitPhase(const EpKernelContext& ctx, const CombineArgs& args) {
  const RegionLayout& lay = ctx.layout;
  __shared__ uint32_t sequence;
  if (threadIdx.x == 0) sequence = beginReceive(&ctx.counters->combine);  // numbered even when taking no part
  __syncthreads();
  noteDepartedPeers(ctx.escape, ctx.rank, ctx.layout.R);
  if (loadActive(args.active_ranks + ctx.rank) == 0) return;  // no part in this call: the output is zero
  const int parity = static_cast<int>(sequence & 1);
  const char* region = ctx.regions[ctx.rank];
  const uint64_t start = globaltimer_ns();
  for (int expert = threadIdx.x; expert < lay.E; expert += blockDim.x) {
    // The count is not needed: the rows are addressed by token.
    waitSignal(region, lay.combineSignal(parity, expert), sequence, expert / lay.L, args.active_ranks,
               ctx.escape, start, ctx.timeout_ns);
  }
}

// A token's picks that contribute, in k order: where each one's row is in
// the region, and its weight. Warp 0 finds them, kPickBatch picks at a time,
// once per block: every thread then reads them from shared memory, instead
// of each thread loading every pick's id, mask word and weight (dependent
// loads, one after another) before each row it adds.
constexpr int kPickBatch = kWarp;
constexpr int kMaxReducePasses = 2;  // 16-byte vectors per thread: hidden <= 8192 with 512 threads
constexpr int kRowsInFlight = 4;     // rows whose vectors a thread loads before it adds them

struct PickBatch {
  const char* row[kPickBatch];  // in the region, or y's own row (self_by_reference)
  float weight[kPickBatch];
  int count;
};

// By warp 0: the contributing picks of [first, first + kPickBatch) into `batch`, in k order.
__device__ __forceinline__ void findPicks(const EpKernelContext& ctx, const CombineArgs& args, int token, int first,
                                          int parity, bool self_by_reference, PickBatch& batch) {
  const RegionLayout& lay = ctx.layout;
  const int lane = threadIdx.x % kWarp, k = first + lane;
  bool live = false;
  int64_t expert = -1;
  if (k < args.num_topk) {
    expert = args.topk_idx[static_cast<size_t>(token) * args.num_topk + k];
    // Entries outside [0, E) are not checked on the host (that would
    // synchronise): they count as -1 here, never as an address.
    live = expert >= 0 && expert < lay.E && loadActive(args.active_ranks + expert / lay.L) != 0;
  }
  const unsigned ballot = __ballot_sync(0xffffffffu, live);
  if (live) {
    const int at = __popc(ballot & ((1u << lane) - 1));
    const char* slot = ctx.regions[ctx.rank] + lay.combineRow(parity, static_cast<int>(expert), token);
    if (self_by_reference && expert / lay.L == ctx.rank) {  // the slot holds the row's index in y (sendPhase)
      // A row index outside y (a slot this call's send did not write: a caller's protocol error) is never
      // an address: the slot's own bytes are read then, as for any peer's unwritten slot.
      const int64_t y_row = __ldcg(reinterpret_cast<const long long*>(slot));
      if (y_row >= 0 && y_row < static_cast<int64_t>(lay.L) * lay.R * lay.T) {
        slot = static_cast<const char*>(args.y) + static_cast<size_t>(y_row) * channelsOf(args, lay) * 2;
      }
    }
    batch.row[at] = slot;
    batch.weight[at] = args.topk_weights[static_cast<size_t>(token) * args.num_topk + k];
  }
  if (lane == 0) batch.count = __popc(ballot);
}

__device__ __forceinline__ void reducePhase(const EpKernelContext& ctx, const CombineArgs& args, bool self_by_reference) {
  const RegionLayout& lay = ctx.layout;
  const int token = blockIdx.x;
  const int parity = static_cast<int>(receivedSequence(&ctx.counters->combine) & 1);
  const int channels = channelsOf(args, lay);
  __shared__ PickBatch batch;
  __shared__ bool self_active;  // read once: every thread must take the same barriers
  if (threadIdx.x == 0) self_active = loadActive(args.active_ranks + ctx.rank) != 0;
  __syncthreads();
  const int picks = self_active ? args.num_topk : 0;
  const bool one_batch = picks <= kPickBatch;  // then found once, for every pass
  const int passes = (channels / kChannelsPerThread + static_cast<int>(blockDim.x) - 1) / static_cast<int>(blockDim.x);
  for (int pass = 0; pass < passes; ++pass) {
    const int c = (threadIdx.x + pass * static_cast<int>(blockDim.x)) * kChannelsPerThread;
    float acc[kChannelsPerThread] = {};
    for (int first = 0; first < picks; first += kPickBatch) {
      if (pass == 0 || !one_batch) {
        if (threadIdx.x < kWarp) findPicks(ctx, args, token, first, parity, self_by_reference, batch);
        __syncthreads();
      }
      for (int i = 0; c < channels && i < batch.count; i += kRowsInFlight) {
        // Written by the owner before its signal, which the wait kernel
        // acquired before this kernel began (stream order). Loaded through L2
        // only, where the owner's stores land, never from a stale L1 line.
        int4 raw[kRowsInFlight];
#pragma unroll
        for (int u = 0; u < kRowsInFlight; ++u) {
          if (i + u < batch.count) {
            raw[u] = __ldcg(reinterpret_cast<const int4*>(batch.row[i + u] + static_cast<size_t>(c) * 2));
          }
        }
#pragma unroll
        for (int u = 0; u < kRowsInFlight; ++u) {
          if (i + u >= batch.count) break;
          const float w = batch.weight[i + u];
          const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw[u]);
          for (int j = 0; j < kChannelsPerThread / 2; ++j) {
            // Multiply, then add, each rounded, in k order: never fused into an FMA.
            acc[2 * j] = __fadd_rn(acc[2 * j], __fmul_rn(__low2float(pairs[j]), w));
            acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], __fmul_rn(__high2float(pairs[j]), w));
          }
        }
      }
      if (!one_batch) __syncthreads();  // the batch read by every thread before warp 0 finds the next
    }
    if (c >= channels) continue;
    int4 packed;
    __nv_bfloat162* out_pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
    for (int j = 0; j < kChannelsPerThread / 2; ++j) out_pairs[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
    *reinterpret_cast<int4*>(static_cast<__nv_bfloat16*>(args.out) + static_cast<size_t>(token) * channels + c) = packed;
  }
}

enum class CombinePhase : int { kSend, kWait, kReduce };

// One kernel, launched once per phase: one profiler row named "combine" (see
// `dispatch` in dispatch_kernels.cu).
__global__ void __launch_bounds__(kMaxThreads, kMinBlocks)
    combine(EpKernelContext ctx, CombineArgs args, CombinePhase phase, bool self_by_reference) {
  switch (phase) {
    case CombinePhase::kSend: sendPhase(ctx, args, self_by_reference); break;
    case CombinePhase::kWait: waitPhase(ctx, args); break;
    case CombinePhase::kReduce: reducePhase(ctx, args, self_by_reference); break;
  }
}

}  // namespace

cudaError_t launchCombine(const EpKernelContext& ctx, const CombineArgs& args, EpStages stages,
                          cudaStream_t stream) {
  // Each launch checked at once: a kernel whose predecessor failed to launch is not enqueued.
  const bool self_by_reference = stages == EpStages::kAll;
  if (stages != EpStages::kReceiveOnly) {
    // No block counts anything before its rows here: small blocks pay.
    const dim3 grid(ctx.layout.E, sendChunks(ctx.layout.E, ctx.layout.T, kRowsPerChunkNotCounting));
    combine<<<grid, kSendThreads, 0, stream>>>(ctx, args, CombinePhase::kSend, self_by_reference);
    if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess || stages == EpStages::kSendOnly) return err;
  }
  combine<<<1, kWaitThreads, 0, stream>>>(ctx, args, CombinePhase::kWait, self_by_reference);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  if (args.num_tokens > 0) {
    // A warp at least (warp 0 finds each token's picks), every vector in kMaxReducePasses.
    const int vectors = channelsOf(args, ctx.layout) / kChannelsPerThread;
    const int threads = std::max(kWarp, std::min(kMaxThreads, vectors));
    if (vectors > threads * kMaxReducePasses) return cudaErrorInvalidValue;
    combine<<<args.num_tokens, threads, 0, stream>>>(ctx, args, CombinePhase::kReduce, self_by_reference);
  }
  return cudaGetLastError();
}

}  // namespace mooncake::ep::cuda
