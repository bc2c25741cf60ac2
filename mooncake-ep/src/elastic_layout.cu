// ElasticBuffer's IPC-path layout in three kernels (elastic_layout.h, public
// header; the per-token rules in the internal elastic_layout.h):
//   layoutSend     per token, its destinations (each rank once, ascending)
//                  and, per pick, the token's index among those sent to the
//                  pick's rank (a prefix count in token order, so slots are
//                  deterministic); and the count per rank, written with the
//                  call's shape as the row they are gathered in (no tensor
//                  operations to assemble it). Two launches over tiles of
//                  256 tokens side by side: each tile counts within itself
//                  (its picks' destinations staged in shared memory, a warp
//                  ballot per rank present, a scan of the 8 warps' counts),
//                  then each adds the earlier tiles' counts (one launch for
//                  a call of one tile).
//   sendTail       one thread per 16 bytes of the rows' staged tails. A
//                  fresh dispatch hands them to layoutSend, which in a call
//                  of one tile (256 tokens) has helper blocks beside the
//                  tile's do them, as they copy topk_idx and zero what
//                  layoutReceive adds to: fewer launches for small calls.
//   layoutReceive  one warp per received row (local picks, weights,
//                  metadata, picks per local expert), then a thread per pick
//                  of this rank's tokens (dst_buffer_slot_idx); the last
//                  block to finish writes the picks' prefix sums per expert.
//                  Its pieces are receive_layout.cuh's, which the EP
//                  dispatch's copy blocks run instead when the call asks
//                  (DispatchArgs::receive_layout): then it is not launched.
// Why kernels: the same layout as ~60 small tensor operations took longer
// than the EP kernels themselves (docs/benchmarks/ep_cuda.md).
// layoutSend's last launch lets the rows' call that follows start before it
// ends (allowDependentLaunch, dependent_launch.cuh).
#include <algorithm>
#include <string>

#include "dependent_launch.cuh"
#include "elastic_layout.h"
#include "mooncake/ep/cuda/elastic_layout.h"
#include "mooncake/ep/cuda/ep_ipc_group.h"
#include "receive_layout.cuh"
#include "trace_points.cuh"

namespace mooncake::ep::cuda {
namespace {

constexpr int kTileTokens = kLayoutSendTileTokens;
constexpr int kTileWarps = kTileTokens / 32;
constexpr int kLoadsInFlight = 8;  // per thread, staging a tile's picks
constexpr int kMaxTileHelpers = 16;  // blocks beside a call's one tile (a thread per unit of their work, up to)
constexpr int kRowThreads = 256;
constexpr int kMaxRowBlocks = 1024;  // grid-stride beyond
constexpr unsigned kAllLanes = 0xffffffffu;

// True in the thread of each rank this rank has given up on (the offer word
// is withdrawn when any is): loaded at a kernel's start, so that the load's
// round trip overlaps the picks' instead of following the counts.
__device__ __forceinline__ bool givesUpOn(const SendLayoutArgs& a, int rank) {
  return a.offer_word >= 0 && a.active_ranks != nullptr && rank < a.num_ranks && a.active_ranks[rank] == 0;
}

// The row the counts are gathered in: the call's count per rank (`total`
// of each), then its shape, then zeros; the offer word -1 while a rank is
// given up on (`withdrawn`: givesUpOn in some thread of the block).
template <typename Total>
__device__ __forceinline__ void writeCountsRow(const SendLayoutArgs& a, int first, int stride, bool withdrawn,
                                               Total total) {
  for (int i = first; i < a.count_words; i += stride) {
    const int32_t word = i < a.num_ranks ? total(i) : i - a.num_ranks < a.shape_words ? a.shape[i - a.num_ranks] : 0;
    a.counts[i] = i == a.offer_word && withdrawn ? -1 : word;
  }
}

// The 16 bytes at `at` of `token`'s staged tail.
__device__ __forceinline__ void writeTailVector(const layout::TailSources& s, int64_t token, int64_t at,
                                                uint8_t* tail) {
  uint32_t words[4];
#pragma unroll
  for (int w = 0; w < 4; ++w) words[w] = layout::tailWord(s, token, at + 4 * w);
  *reinterpret_cast<uint4*>(tail + token * s.tail_bytes + at) = make_uint4(words[0], words[1], words[2], words[3]);
}

// The staged tails of `num_tokens` tokens, 16 bytes per step: this thread's
// vectors first, first + stride, ... in order.
__device__ __forceinline__ void stageTails(const layout::TailSources& s, int64_t num_tokens, uint8_t* tail,
                                           int64_t first, int64_t stride) {
  const int64_t vectors = s.tail_bytes / 16;
  for (int64_t v = first; v < num_tokens * vectors; v += stride)
    writeTailVector(s, v / vectors, v % vectors * 16, tail);
}

// The work of a call of one tile that does not decide the layout, by the
// helper blocks beside the tile's (thread `first` of `stride`): the rows'
// staged tails (a thread per 16 bytes, in order), the copy of topk_idx and
// the zeros. In the tile's own block it took a third of the kernel's 7.3 us
// at 128 tokens (H100, docs/benchmarks/ep_cuda.md, 2026-12-07), each
// thread's tail vectors one round trip after another; here each thread's
// loads are one round trip, beside the tile's.
__device__ __forceinline__ void helpOneTile(const SendLayoutArgs& a, const layout::TailSources& tail_sources,
                                            uint8_t* tail, int64_t first, int64_t stride) {
  if (a.topk_copy != nullptr) {
    const int64_t picks = static_cast<int64_t>(a.num_tokens) * a.num_topk;
    for (int64_t i = first; i < picks; i += stride) a.topk_copy[i] = a.topk_idx[i];
  }
  for (int64_t i = first; i < a.zeroed_words; i += stride) a.zeroed[i] = 0;
  if (tail != nullptr) stageTails(tail_sources, a.num_tokens, tail, first, stride);
}

// Helper blocks for a call of `tiles` tiles: a thread per unit of helpOneTile's
// largest share, up to kMaxTileHelpers blocks; none for several tiles (each
// tile copies its own picks, the first zeroes, sendTail stages the tails).
int tileHelpers(const SendLayoutArgs& a, int tiles, bool tails) {
  if (tiles != 1) return 0;
  int64_t units = a.zeroed_words;
  if (a.topk_copy != nullptr) units = std::max<int64_t>(units, static_cast<int64_t>(a.num_tokens) * a.num_topk);
  if (tails) units = std::max<int64_t>(units, a.num_tokens * (a.tail.tail_bytes / 16));
  return static_cast<int>(std::min<int64_t>((units + kTileTokens - 1) / kTileTokens, kMaxTileHelpers));
}

// One tile of kTileTokens tokens per block, one token per thread: each
// token's destinations, its index among the tile's tokens sent to each of
// them (a warp ballot per rank present, then a scan of the warps' counts),
// and the tile's count per rank in tile_counts. sendOffsetsKernel then adds
// the earlier tiles' counts; a call of one tile has none, so its tile writes
// the counts' row itself and layoutSend launches nothing more. (One block
// scanning every tile in turn took 130 us at 8192 tokens: its k scattered
// stores per token queue on one SM.)
// Blocks past the tiles are a call of one tile's helpers (helpOneTile, with
// the tails when `tail` is given); without them, each tile copies its picks
// to topk_copy and the first zeroes `zeroed`.
__global__ void __launch_bounds__(kTileTokens)
    sendTileKernel(SendLayoutArgs a, int tiles, layout::TailSources tail_sources, uint8_t* tail) {
  extern __shared__ int8_t tile_dests[];  // [kTileTokens * k]: the destination of each pick of the tile
  __shared__ int32_t warp_count[kTileWarps][kMaxEpRanks];
  __shared__ int32_t tile_total[kMaxEpRanks];
  trace::traceAt(trace::kLayoutStart);
  allowDependentLaunch();  // the rows' call that follows starts while this ends (it waits for what this writes)
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const int helpers = static_cast<int>(gridDim.x) - tiles;
  if (static_cast<int>(blockIdx.x) >= tiles) {
    helpOneTile(a, tail_sources, tail, static_cast<int64_t>(blockIdx.x - tiles) * kTileTokens + tid,
                static_cast<int64_t>(helpers) * kTileTokens);
    trace::traceAt(trace::kLayoutEnd);
    return;
  }
  const bool gives_up = givesUpOn(a, tid);
  int64_t* topk_copy = helpers == 0 ? a.topk_copy : nullptr;
  const int k = a.num_topk;
  const int64_t tile = static_cast<int64_t>(blockIdx.x) * kTileTokens;
  const int64_t left_in_call = a.num_tokens - tile;
  const int tile_tokens = left_in_call < kTileTokens ? static_cast<int>(left_in_call) : kTileTokens;
  // The tile's picks are contiguous: read once, in order (a thread reading
  // its own token's k picks would touch a line per lane), kLoadsInFlight
  // loads per thread before their first use.
  const int64_t picks = static_cast<int64_t>(tile_tokens) * k;
  const int64_t* tile_picks = a.topk_idx + tile * k;
  for (int64_t first = tid; first < picks; first += kLoadsInFlight * kTileTokens) {
    int64_t ids[kLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int64_t i = first + static_cast<int64_t>(u) * kTileTokens;
      ids[u] = i < picks ? tile_picks[i] : -1;
    }
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int64_t i = first + static_cast<int64_t>(u) * kTileTokens;
      if (i < picks) {
        tile_dests[i] = static_cast<int8_t>(layout::destinationOf(ids[u], a.num_local, a.num_ranks));
        if (topk_copy != nullptr) topk_copy[tile * k + i] = ids[u];
      }
    }
  }
  if (blockIdx.x == 0 && helpers == 0) {
    for (int64_t i = tid; i < a.zeroed_words; i += kTileTokens) a.zeroed[i] = 0;
  }
  for (int i = tid; i < kTileWarps * kMaxEpRanks; i += kTileTokens) (&warp_count[0][0])[i] = 0;
  const bool withdrawn = __syncthreads_or(gives_up) != 0;  // tile_dests written, warp_count zeroed
  const int64_t t = tile + tid;
  const bool in = tid < tile_tokens;
  const int8_t* dests = tile_dests + static_cast<int64_t>(tid) * k;
  uint32_t mask = 0;
  if (in) {
    mask = layout::destinationMask(dests, k);
    layout::uniqueDestinations(dests, k, a.dest + t * k);
    for (int j = 0; j < k; ++j) a.dest_slots[t * k + j] = -1;  // the destinations' own, below
  }
  uint32_t any = mask;  // the ranks some token of this warp goes to
  for (int step = 16; step > 0; step /= 2) any |= __shfl_xor_sync(kAllLanes, any, step);
  for (uint32_t left = any; left != 0; left &= left - 1u) {
    const int d = __ffs(static_cast<int>(left)) - 1;
    const uint32_t with = __ballot_sync(kAllLanes, (mask >> d) & 1u);
    if (lane == 0) warp_count[warp][d] = __popc(with);
  }
  __syncthreads();
  if (tid < a.num_ranks) {  // the warps' counts become where each warp's tokens start in the tile
    int32_t sum = 0;
    for (int w = 0; w < kTileWarps; ++w) {
      const int32_t count = warp_count[w][tid];
      warp_count[w][tid] = sum;
      sum += count;
    }
    a.tile_counts[static_cast<int64_t>(blockIdx.x) * a.num_ranks + tid] = sum;
    tile_total[tid] = sum;
  }
  __syncthreads();
  if (tiles == 1) writeCountsRow(a, tid, kTileTokens, withdrawn, [&](int r) { return tile_total[r]; });
  // Every lane takes part in the ballots (those past the tokens with no destination).
  const uint32_t lanes_below = (1u << lane) - 1u;
  for (uint32_t left = any; left != 0; left &= left - 1u) {
    const int d = __ffs(static_cast<int>(left)) - 1;
    const uint32_t with = __ballot_sync(kAllLanes, (mask >> d) & 1u);
    if ((mask >> d) & 1u) {
      const int32_t index = warp_count[warp][d] + __popc(with & lanes_below);
      for (int j = 0; j < k; ++j) {
        if (dests[j] == d) a.token_index[t * k + j] = index;
      }
      a.dest_slots[t * k + layout::uniquePosition(dests, k, d)] = index;
    }
  }
  if (in) {
    for (int j = 0; j < k; ++j) {
      if (dests[j] < 0) a.token_index[t * k + j] = -1;
    }
  }
  trace::traceAt(trace::kLayoutEnd);
}

// kLoadsInFlight of a thread's picks in sendOffsetsKernel, pick
// `first + u * kTileTokens` in slot u: what the offsets are added to.
struct PickBatch {
  int32_t index[kLoadsInFlight];  // token_index (-1: none)
  int32_t slot[kLoadsInFlight];   // dest_slots (-1: none)
  int64_t id[kLoadsInFlight];     // topk_idx: the pick's rank, for index
  int64_t dest[kLoadsInFlight];   // dest: the rank of slot
};

__device__ __forceinline__ void loadPicks(const SendLayoutArgs& a, int64_t tile_first, int64_t first, int64_t picks,
                                          PickBatch& b) {
#pragma unroll
  for (int u = 0; u < kLoadsInFlight; ++u) {
    const int64_t p = first + static_cast<int64_t>(u) * kTileTokens;
    const bool in = p < picks;
    b.index[u] = in ? a.token_index[tile_first + p] : -1;
    b.slot[u] = in ? a.dest_slots[tile_first + p] : -1;
    b.id[u] = in ? a.topk_idx[tile_first + p] : -1;
    b.dest[u] = in ? a.dest[tile_first + p] : -1;
  }
}

// Per tile: where its tokens start among those sent to each rank (the
// earlier tiles' counts, added by the whole block), added to the tile's
// token indices; the last tile writes the totals and the call's shape as
// the row the counts are gathered in. Each thread's picks are loaded
// kLoadsInFlight at a time, the first of them before the counts are summed
// (so that their round trips overlap): one pick at a time, each load after
// the previous pick's stores, took 9 us at 8192 tokens (H100, 2026-12-07).
__global__ void __launch_bounds__(kTileTokens) sendOffsetsKernel(SendLayoutArgs a) {
  __shared__ int32_t base[kMaxEpRanks];
  __shared__ int32_t total[kMaxEpRanks];
  allowDependentLaunch();  // as in sendTileKernel: this is the layout's last launch
  trace::traceAt(trace::kLayoutStart);
  const int tid = static_cast<int>(threadIdx.x), k = a.num_topk, num_ranks = a.num_ranks;
  const bool last = blockIdx.x + 1 == gridDim.x;
  const int64_t tile = static_cast<int64_t>(blockIdx.x) * kTileTokens;
  const int64_t picks = (a.num_tokens - tile < kTileTokens ? a.num_tokens - tile : kTileTokens) * k;
  PickBatch batch;
  loadPicks(a, tile * k, tid, picks, batch);
  const bool gives_up = last && givesUpOn(a, tid);  // only the last block writes the counts' row
  if (tid < kMaxEpRanks) base[tid] = total[tid] = 0;
  const bool withdrawn = __syncthreads_or(gives_up) != 0;
  const int64_t earlier = static_cast<int64_t>(blockIdx.x) * num_ranks;
  for (int64_t i = tid; i < earlier + num_ranks; i += kTileTokens) {
    const int32_t count = a.tile_counts[i];
    if (i < earlier) atomicAdd(&base[i % num_ranks], count);
    if (last) atomicAdd(&total[i % num_ranks], count);
  }
  __syncthreads();
  if (last) writeCountsRow(a, tid, kTileTokens, withdrawn, [&](int r) { return total[r]; });
  constexpr int64_t kBatchPicks = static_cast<int64_t>(kLoadsInFlight) * kTileTokens;
  for (int64_t first = tid; first < picks; first += kBatchPicks) {  // coalesced: the tile's picks in order
    if (first != tid) loadPicks(a, tile * k, first, picks, batch);
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int64_t at = tile * k + first + static_cast<int64_t>(u) * kTileTokens;
      if (batch.index[u] >= 0) {
        a.token_index[at] = batch.index[u] + base[layout::destinationOf(batch.id[u], a.num_local, num_ranks)];
      }
      if (batch.slot[u] >= 0) a.dest_slots[at] = batch.slot[u] + base[batch.dest[u]];
    }
  }
  trace::traceAt(trace::kLayoutEnd);
}

__global__ void sendTailKernel(layout::TailSources s, int64_t num_tokens, uint8_t* tail) {
  stageTails(s, num_tokens, tail, static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
             static_cast<int64_t>(gridDim.x) * blockDim.x);
}

// A warp per received row (layOutRow), then a thread per pick of this
// rank's tokens (laySlots); the last block to finish writes the picks'
// prefix sums per expert (finishBlock).
__global__ void __launch_bounds__(kRowThreads) receiveLayoutKernel(ReceiveLayoutArgs a, bool shared_counts) {
  extern __shared__ uint32_t expert_counts[];  // [L] this block's picks per local expert, when shared_counts
  __shared__ int64_t ends[kMaxEpRanks];
  __shared__ int32_t my_begin[kMaxEpRanks];
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32;
  const int num_ranks = a.num_ranks;
  uint32_t* block_counts = shared_counts ? expert_counts : nullptr;
  if (tid == 0) {
    int64_t sum = 0;
    for (int s = 0; s < num_ranks; ++s) {
      sum += a.ranges[s] & 0xffffffffLL;
      ends[s] = sum;
    }
  }
  if (tid < num_ranks) my_begin[tid] = receive_layout::rowsBeforeMineAt(a, tid);
  receive_layout::zeroBlockCounts(a, block_counts);
  __syncthreads();
  const int64_t total = ends[num_ranks - 1];
  if (blockIdx.x == 0 && tid < num_ranks) a.scaleup_psum[tid] = static_cast<int32_t>(ends[tid]);

  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kRowThreads / 32);
  const auto* tails = static_cast<const uint8_t*>(a.recv_tail);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * (kRowThreads / 32) + tid / 32; row < a.capacity; row += warps) {
    const bool real = row < total;
    receive_layout::layOutRow(a, row, real, tails + row * a.tail_bytes, layout::sourceOfRow(row, ends, num_ranks),
                              real ? a.src_token[row] : -1, lane, block_counts);
  }
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kRowThreads;
  receive_layout::laySlots(a, my_begin, static_cast<int64_t>(blockIdx.x) * kRowThreads + tid, stride);
  receive_layout::finishBlock(a, block_counts);
}

bool launched(const char* what, std::string* error) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return true;
  if (error != nullptr) *error = std::string(what) + ": launch failed: " + cudaGetErrorString(err);
  return false;
}

bool refuse(const std::string& why, std::string* error) {
  if (error != nullptr) *error = why;
  return false;
}

int rowBlocks(int64_t threads) {
  return static_cast<int>(std::clamp<int64_t>((threads + kRowThreads - 1) / kRowThreads, 1, kMaxRowBlocks));
}

}  // namespace

std::string tailFormatError(const SendTailArgs& a) {
  if (a.tail_bytes % 16 != 0 || a.num_tokens < 0 || a.num_topk < 0 ||
      a.head_bytes + a.tail_bytes < a.ids_at + 8 * static_cast<int64_t>(a.num_topk) ||
      (a.head_bytes != 0 && a.head_bytes != a.payload_bytes)) {
    return "row format out of range";
  }
  return {};
}

bool layoutSend(const SendLayoutArgs& a, cudaStream_t stream, std::string* error) {
  if (a.num_ranks < 1 || a.num_ranks > kMaxEpRanks || a.num_local < 1 || a.num_topk < 0 || a.num_tokens < 0) {
    return refuse("layoutSend: sizes out of range", error);
  }
  if (a.shape_words < 0 || a.count_words < a.num_ranks + a.shape_words) {
    return refuse("layoutSend: the counts' row is shorter than the counts and the shape", error);
  }
  if (a.offer_word < -1 || a.offer_word >= a.count_words) {
    return refuse("layoutSend: offer_word must be -1 or a word of the counts' row", error);
  }
  if (a.num_topk > kMaxLayoutTopk) {
    return refuse("layoutSend: num_topk " + std::to_string(a.num_topk) + " is more than the kernels take (" +
                      std::to_string(kMaxLayoutTopk) + ")",
                  error);
  }
  if (a.tile_counts == nullptr || a.tile_count_words < layoutSendScratchWords(a.num_tokens, a.num_ranks)) {
    return refuse("layoutSend: tile_counts holds fewer than layoutSendScratchWords(num_tokens, num_ranks) words",
                  error);
  }
  if (a.zeroed_words < 0 || (a.zeroed_words > 0 && a.zeroed == nullptr)) {
    return refuse("layoutSend: zeroed is required with zeroed_words >= 1", error);
  }
  // The tails of this call's tokens, with this call's picks.
  SendTailArgs tail = a.tail;
  tail.topk_idx = a.topk_idx;
  tail.num_tokens = a.num_tokens;
  tail.num_topk = a.num_topk;
  if (tail.tail != nullptr) {
    if (const std::string why = tailFormatError(tail); !why.empty()) return refuse("layoutSend: tail: " + why, error);
  }
  const auto tiles = static_cast<int>(layoutSendScratchWords(a.num_tokens, a.num_ranks) / a.num_ranks);
  // A call of one tile has helper blocks stage the tails too (one launch for
  // all). Larger calls use sendTail's wider grid: their tiles' few blocks
  // were slower at it than a launch costs (one A/B on an H100, 8192 tokens,
  // dispatch from a graph: 0.195 ms with sendTail, 0.213 ms in the tiles).
  trace::bindUnit();
  const bool tails_by_helpers = tiles == 1 && tail.tail != nullptr && tail.tail_bytes > 0;
  const int helpers = tileHelpers(a, tiles, tails_by_helpers);
  sendTileKernel<<<tiles + helpers, kTileTokens, static_cast<size_t>(kTileTokens) * a.num_topk, stream>>>(
      a, tiles, layout::tailSourcesOf(tail), tails_by_helpers ? static_cast<uint8_t*>(tail.tail) : nullptr);
  if (!launched("layoutSend", error)) return false;
  if (tail.tail != nullptr && !tails_by_helpers && !sendTail(tail, stream, error)) return false;
  if (tiles == 1) return true;  // the tile wrote the counts' row; its offsets are 0
  sendOffsetsKernel<<<tiles, kTileTokens, 0, stream>>>(a);
  return launched("layoutSend", error);
}

bool sendTail(const SendTailArgs& a, cudaStream_t stream, std::string* error) {
  if (const std::string why = tailFormatError(a); !why.empty()) return refuse("sendTail: " + why, error);
  if (a.num_tokens == 0 || a.tail_bytes == 0) return true;
  sendTailKernel<<<rowBlocks(a.num_tokens * (a.tail_bytes / 16)), kRowThreads, 0, stream>>>(
      layout::tailSourcesOf(a), a.num_tokens, static_cast<uint8_t*>(a.tail));
  return launched("sendTail", error);
}

std::string receiveLayoutError(const ReceiveLayoutArgs& a) {
  const int64_t fields = 4 * static_cast<int64_t>(a.num_topk);
  if (a.num_ranks < 1 || a.num_ranks > kMaxEpRanks || a.num_local < 1 || a.num_topk < 0 ||
      a.num_topk > kMaxLayoutTopk || a.num_tokens < 0 || a.capacity < 0 || a.rank < 0 || a.rank >= a.num_ranks ||
      a.gathered_stride < a.num_ranks) {
    return "sizes out of range";
  }
  // The kernels read ids and weights as 32-bit words of the rows.
  if (a.tail_bytes % 16 != 0 || a.ids_at < 0 || a.ids_at % 4 != 0 || a.ids_at + fields > a.tail_bytes ||
      (a.weights != nullptr && (a.weights_at < 0 || a.weights_at % 4 != 0 || a.weights_at + fields > a.tail_bytes))) {
    return "the ids and weights are not 4-byte aligned fields of the rows";
  }
  if (a.per_expert == nullptr || a.expert_psum == nullptr || a.finished_blocks == nullptr) {
    return "per_expert, expert_psum and finished_blocks are required";
  }
  return {};
}

bool layoutReceive(const ReceiveLayoutArgs& a, cudaStream_t stream, std::string* error) {
  if (const std::string why = receiveLayoutError(a); !why.empty()) return refuse("layoutReceive: " + why, error);
  const int64_t shared_bytes = receive_layout::sharedCountBytes(a);
  // A warp per row, a thread per pick.
  const int64_t threads = std::max(a.capacity * 32, static_cast<int64_t>(a.num_tokens) * a.num_topk);
  receiveLayoutKernel<<<rowBlocks(threads), kRowThreads, static_cast<size_t>(shared_bytes), stream>>>(a,
                                                                                                      shared_bytes > 0);
  return launched("layoutReceive", error);
}

}  // namespace mooncake::ep::cuda
