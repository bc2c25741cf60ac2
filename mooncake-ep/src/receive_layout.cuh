// ElasticBuffer's layout of the rows a dispatch received
// (ReceiveLayoutArgs, mooncake/ep/cuda/elastic_layout.h) in pieces that two
// kernels share: layoutReceive, a launch of its own after the EP kernels
// (elastic_layout.cu), and the EP dispatch's copy blocks, which lay out each
// row as they copy it (DispatchArgs::receive_layout, dispatch_kernels.cu):
// one launch fewer, which at 128 tokens was about a sixth of a dispatch.
// A warp per row and a lane per pick (k <= kMaxLayoutTopk = 32), so that a
// row's k outputs are written side by side. Device code that the host
// emulation of the layout kernels also builds (tests/python/ep/
// _layout_emulation.py): no `extern __shared__` here, the caller passes it.
#pragma once

#include <cstdint>

#include "elastic_layout.h"  // layout::localPick
#include "mooncake/ep/cuda/elastic_layout.h"

namespace mooncake::ep::cuda::receive_layout {

constexpr unsigned kAllLanes = 0xffffffffu;
constexpr int kWarpLanes = 32;

// Per-block counts of picks per local expert live in shared memory up to
// this many local experts (32 KB); beyond, each pick adds to per_expert in
// global memory.
constexpr int kMaxSharedExperts = 8192;

// Dynamic shared memory of a block that counts its picks there, in bytes (0: it does not).
__host__ __device__ inline int64_t sharedCountBytes(const ReceiveLayoutArgs& a) {
  return a.num_local <= kMaxSharedExperts ? static_cast<int64_t>(sizeof(uint32_t)) * a.num_local : 0;
}

// Zeroes a block's counts (`block_counts`, null when they are not shared);
// the caller's barrier follows before any row is laid out.
__device__ __forceinline__ void zeroBlockCounts(const ReceiveLayoutArgs& a, uint32_t* block_counts) {
  if (block_counts == nullptr) return;
  for (int e = static_cast<int>(threadIdx.x); e < a.num_local; e += static_cast<int>(blockDim.x)) block_counts[e] = 0;
}

// Received row `row`, laid out by one whole warp (`lane` its lane): `real`
// whether it is one of the rows received (then `tail` is its tail, `source`
// the rank it came from and `token` its index there; else they are not
// read). Writes the row's local picks, weights, metadata and `real`, and
// counts its picks.
__device__ __forceinline__ void layOutRow(const ReceiveLayoutArgs& a, int64_t row, bool real, const uint8_t* tail,
                                          int source, int32_t token, int lane, uint32_t* block_counts) {
  const int k = a.num_topk;
  const bool pick = lane < k;
  int64_t local = -1;
  uint32_t weight = 0;  // the weight's bits as sent (a NaN keeps its payload), +0.0 where no pick is here
  // Rows are 16-byte multiples and the ids and weights 4-byte aligned in them (RowFormat): 32-bit loads.
  if (real && pick) {
    local = layout::localPick(reinterpret_cast<const int32_t*>(tail + a.ids_at)[lane], true, a.rank, a.num_local);
    if (a.weights != nullptr && local >= 0) weight = reinterpret_cast<const uint32_t*>(tail + a.weights_at)[lane];
  }
  if (pick) {
    a.local[row * k + lane] = local;
    if (a.weights != nullptr) reinterpret_cast<uint32_t*>(a.weights)[row * k + lane] = weight;
    if (local >= 0) {
      if (block_counts != nullptr) {
        atomicAdd(&block_counts[local], 1u);
      } else {
        atomicAdd(reinterpret_cast<unsigned long long*>(a.per_expert) + local, 1ull);
      }
    }
  }
  const int here = __popc(__ballot_sync(kAllLanes, local >= 0 ? 1 : 0));
  int32_t* meta = a.metadata + row * (k + 2);
  for (int j = lane; j < k + 2; j += kWarpLanes) {
    int32_t value = -1;  // the expanded slots, filled by the caller
    if (real && j == 0) value = static_cast<int32_t>(static_cast<int64_t>(source) * a.tokens_per_rank + token);
    if (real && j == 1) value = here;
    meta[j] = value;
  }
  if (lane == 0) a.real[row] = real;
}

// Where this rank's rows start at rank `dest`: what the lower ranks sent
// there, as gathered (a source given up on in the gather counts 0).
__device__ __forceinline__ int32_t rowsBeforeMineAt(const ReceiveLayoutArgs& a, int dest) {
  int32_t begin = 0;
  for (int s = 0; s < a.rank; ++s) {
    const int64_t range = a.gathered_ranges[s];
    if ((range & 0xffffffffLL) != 0) begin += a.gathered[(range >> 32) * a.gathered_stride + dest];
  }
  return begin;
}

// dst_buffer_slot_idx of this rank's picks p = first, first + stride, ...:
// where its rows start at the pick's rank, plus the token's index among
// them. `my_begin`: rowsBeforeMineAt of every rank.
__device__ __forceinline__ void laySlots(const ReceiveLayoutArgs& a, const int32_t* my_begin, int64_t first,
                                         int64_t stride) {
  const int64_t picks = static_cast<int64_t>(a.num_tokens) * a.num_topk;
  for (int64_t p = first; p < picks; p += stride) {
    const int d = layout::destinationOf(a.topk_idx[p], a.num_local, a.num_ranks);
    const int32_t index = a.token_index[p];
    a.slots[p] = d >= 0 && index >= 0 ? my_begin[d] + index : -1;
  }
}

// The exclusive prefix sum of each thread's `value` over the block (every
// thread calls it; at most 32 warps).
__device__ __forceinline__ long long blockExclusiveSum(long long value) {
  __shared__ long long warp_sums[kWarpLanes];
  const int tid = static_cast<int>(threadIdx.x), lane = tid % kWarpLanes, warp = tid / kWarpLanes;
  const int warps = (static_cast<int>(blockDim.x) + kWarpLanes - 1) / kWarpLanes;
  long long inclusive = value;
  for (int step = 1; step < kWarpLanes; step *= 2) {
    const long long below = __shfl_up_sync(kAllLanes, inclusive, step);
    if (lane >= step) inclusive += below;
  }
  if (lane == kWarpLanes - 1) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    long long total = lane < warps ? warp_sums[lane] : 0;
    for (int step = 1; step < kWarpLanes; step *= 2) {
      const long long below = __shfl_up_sync(kAllLanes, total, step);
      if (lane >= step) total += below;
    }
    if (lane < warps) warp_sums[lane] = total;  // inclusive over the warps
  }
  __syncthreads();
  const long long before_warp = warp > 0 ? warp_sums[warp - 1] : 0;
  __syncthreads();  // warp_sums may be reused by the next call
  return before_warp + inclusive - value;
}

// After a block's rows (every thread of every block of the grid, once):
// the block's counts are added to per_expert, and the block that finishes
// last (a ticket taken after them, fenced: the threadFenceReduction
// pattern) turns per_expert into its inclusive prefix sums, as int32: the
// handle's psum_num_recv_tokens_per_expert without a scan and a cast of
// torch's. Each thread sums a run of experts; a block-wide scan of the runs.
__device__ __forceinline__ void finishBlock(const ReceiveLayoutArgs& a, const uint32_t* block_counts) {
  __shared__ bool last;
  const int tid = static_cast<int>(threadIdx.x), threads = static_cast<int>(blockDim.x);
  __syncthreads();  // every row of the block counted
  if (block_counts != nullptr) {
    for (int e = tid; e < a.num_local; e += threads) {
      if (block_counts[e] != 0) {
        atomicAdd(reinterpret_cast<unsigned long long*>(a.per_expert) + e,
                  static_cast<unsigned long long>(block_counts[e]));
      }
    }
  }
  // The block's additions, then its ticket: after the barrier one thread's
  // fence orders every thread's additions before the ticket (cumulative, as
  // in a cooperative grid's sync), where a fence by each of the block's
  // threads had each wait for its own; the last block's thread 0 fences
  // again after its ticket, and the barrier hands what it saw to the block.
  __syncthreads();
  const unsigned long long blocks = static_cast<unsigned long long>(gridDim.x) * gridDim.y * gridDim.z;
  if (tid == 0) {
    __threadfence();
    last = atomicAdd(a.finished_blocks, 1ull) + 1 == blocks;
    if (last) __threadfence();  // the other blocks' additions, seen after their tickets
  }
  __syncthreads();
  if (!last) return;
  const int run = (a.num_local + threads - 1) / threads;
  const int first = tid * run, end = first + run < a.num_local ? first + run : a.num_local;
  // Read where the atomics landed (L2), never a stale L1 line.
  const volatile int64_t* counts = a.per_expert;
  long long sum = 0;
  for (int e = first; e < end; ++e) sum += counts[e];
  long long psum = blockExclusiveSum(sum);
  for (int e = first; e < end; ++e) {
    psum += counts[e];
    a.expert_psum[e] = static_cast<int32_t>(psum);
  }
}

}  // namespace mooncake::ep::cuda::receive_layout
