// Dispatch in three launches on the caller's stream, one per phase of one
// kernel (`dispatch`, see there), or in one for a small call (below):
//   send  one block per global expert e (destination rank d = e / L): scans
//         this rank's tokens in order, and writes each token that picked e
//         into d's region, slot (parity, local expert, this rank, n-th token
//         that picked e, or the caller's pick_slots); then publishes the
//         count with the call's sequence.
//         Slots in token order make every (source, expert) segment ordered by
//         token, deterministically, without atomics.
//         With DirectHeads, a byte row's head goes straight to its final row
//         in d's output slot instead (only its header and tail to the region).
//   wait  one block: waits for every (local expert, source) signal, bounded;
//         then lays the segments out by source rank (layout_range,
//         recv_count) from the final mask. On a call that gave up on a rank
//         while its output slot was offered, also marks the sources given up
//         on (noteGivenUp) and brings back the heads whose row moved
//         (stageMovedHeads).
//   copy  one block per (local expert, source): moves the segment's rows
//         from the receive region into recv_x / recv_scales / src_info (or
//         bytes.recv_tail; with DirectHeads the heads already in their row
//         stay, the others move), and fills src_info past the count with -1
//         (and byte rows up to bytes.zeroed_rows with zeros).
// The send phase is the call's first half, wait and copy its second
// (EpStages); each half takes its call number from the device counters.
// A small call enqueued whole runs the three phases in one launch
// (wholeCall): the send's blocks, one of which then waits, all of which then
// copy; two launches fewer, which is most of such a call's time.
// Right after ElasticBuffer's layout kernel (DispatchArgs::follows_layout_send)
// the first launch is a programmatic dependent one: its blocks start and take
// the call's number while that kernel ends (dependent_launch.cuh).
#include <cuda_bf16.h>

#include <algorithm>
#include <array>
#include <atomic>

#include "dependent_launch.cuh"
#include "elastic_layout.h"  // layout::destinationOf, layout::tailWord (OwnSendInputs)
#include "fp8_quant.cuh"
#include "kernel_args.h"
#include "one_launch.h"
#include "receive_layout.cuh"
#include "send_tally.cuh"
#include "signals.cuh"
#include "trace_points.cuh"
#include "warp_copy.cuh"

namespace mooncake::ep::cuda {
namespace {

constexpr int kSendThreads = 512;
constexpr int kWaitThreads = 512;
constexpr int kCopyThreads = 512;
// The one kernel's bounds: two blocks of 512 threads per SM, 64 registers a
// thread. Three (40 registers, so that DeepEP's 288 experts' send blocks took
// one wave on an H200's 132 SMs) spilled 2-3 KB a thread, most of it in the
// row copies that every phase runs. Those 288 send blocks now take two waves
// (264 resident); the Buffer path has not been timed since.
constexpr int kMaxThreads = 512;
constexpr int kMinBlocks = 2;
constexpr int kWarp = 32;

// Where `token`'s pick of `expert` is in topk_idx ([token, num_topk]), -1
// when it has none; with `pick_slots` ([token, num_topk], beside topk_idx),
// that pick's slot too (-1 when none). The token's first slot is loaded with
// its first id, so that the slot's sector is in L1 by the time the pick is
// known: one round trip to L2 per token, where the slot's load after the
// pick made every send block's first step wait for two. (Loading all of a
// token's ids and slots into registers first spilled more of the kernel's.)
struct PickAndSlot {
  int64_t pick = -1;
  int32_t slot = -1;
};
__device__ __forceinline__ PickAndSlot pickOf(const int64_t* topk_idx, const int32_t* pick_slots, int token,
                                              int num_topk, int expert) {
  const int64_t first = static_cast<int64_t>(token) * num_topk;
  const int32_t first_slot = pick_slots != nullptr && num_topk > 0 ? pick_slots[first] : -1;
  for (int k = 0; k < num_topk; ++k) {
    if (topk_idx[first + k] != expert) continue;
    return {first + k, k == 0 ? first_slot : pick_slots != nullptr ? pick_slots[first + k] : -1};
  }
  return {};
}

// The picks a send block looks through: the kernels' own (an id per expert
// e, destination e / L), or OwnSendInputs' (global expert ids of a caller
// whose rows go one per rank: `expert` is then the rank, an id's rank is
// layout::destinationOf's). `slots`: the caller's pick_slots, or null.
struct SendPicks {
  const int64_t* ids;
  const int32_t* slots;
  int per_rank;  // 0: ids are the kernels' experts
  int num_ranks;
};

__device__ __forceinline__ SendPicks sendPicksOf(const EpKernelContext& ctx, const DispatchArgs& args) {
  const OwnSendInputs& own = args.own_send;
  if (own.picks == nullptr) return {args.topk_idx, args.pick_slots, 0, ctx.layout.R};
  return {own.picks, nullptr, own.picks_per_rank, ctx.layout.R};
}

// Whether `token` goes to `expert`, and where (pickOf).
__device__ __forceinline__ PickAndSlot pickOf(const SendPicks& p, int token, int num_topk, int expert) {
  if (p.per_rank == 0) return pickOf(p.ids, p.slots, token, num_topk, expert);
  const int64_t first = static_cast<int64_t>(token) * num_topk;
  for (int k = 0; k < num_topk; ++k) {
    if (layout::destinationOf(p.ids[first + k], p.per_rank, p.num_ranks) == expert) return {first + k, -1};
  }
  return {};
}

// A byte row's tail into the message, by one warp: the staged tail's bytes,
// or (OwnSendInputs) the same bytes made from their sources, a word per lane
// at a time (a tail is a few dozen words: one step; fewer registers than 16
// bytes a lane, in a kernel that spills already).
__device__ __forceinline__ void writeRowTail(char* to, const DispatchArgs& args, int64_t token, int lane) {
  const ByteRows& b = args.bytes;
  if (args.own_send.picks == nullptr) {
    warpCopy(to, static_cast<const char*>(b.tail) + token * b.tail_bytes, b.tail_bytes, lane);
    return;
  }
  layout::TailSources sources = layout::tailSourcesOf(args.own_send.tail);
  sources.topk_idx = args.own_send.picks;  // the ids sent are the picks, as layoutSend stages them
  for (int64_t at = 4 * static_cast<int64_t>(lane); at < static_cast<int64_t>(b.tail_bytes); at += 4 * kWarp) {
    *reinterpret_cast<uint32_t*>(to + at) = layout::tailWord(sources, token, at);
  }
}

// Where this rank's heads to `dest` go in dest's output slot (DirectHeads,
// ep_ipc_group.h): the slot's first row, and the row of this rank's first
// head there; or a null slot: through dest's region. Only while every rank's
// counts came here and this rank gives up on none: dest offers its slot only
// while it hears every rank (layoutSend's offer word), so both then count
// every source before this one. Should dest give up on a source within this
// very call, its wait phase finds the heads whose place moved by their
// headers and brings them back through the region (stageMovedHeads). Never
// once dest gave up on this rank (its mark in this region, noteGivenUp): a
// rank that comes late finds the counts row dest sent it, slot and all, but
// dest's call is over and the slot is an output.
struct DirectPlace {  // no initialisers: a __shared__ variable below
  char* slot;
  int64_t begin;
};

__device__ __forceinline__ DirectPlace directHeadsAt(const EpKernelContext& ctx, const DispatchArgs& args, int dest) {
  const DirectHeads& d = args.direct;
  const RegionLayout& lay = ctx.layout;
  if (d.gathered == nullptr || args.bytes.head_bytes == 0) return {nullptr, 0};
  if (ld_relaxed_sys(reinterpret_cast<const uint32_t*>(ctx.regions[ctx.rank] + lay.givenUpBy(dest))) != 0) {
    return {nullptr, 0};
  }
  for (int r = 0; r < lay.R; ++r) {
    if ((d.gathered_ranges[r] & 0xffffffff) == 0 || loadActive(args.active_ranks + r) == 0) return {nullptr, 0};
  }
  auto row_of = [&](int r) { return d.gathered + (d.gathered_ranges[r] >> 32) * d.gathered_stride; };
  const int slot = row_of(dest)[d.slot_word];
  if (slot < 0 || slot >= lay.O) return {nullptr, 0};
  // Clamped to T as the wait phase clamps: every row lands inside the slot.
  int64_t begin = 0;
  for (int src = 0; src < ctx.rank; ++src) begin += min(max(row_of(src)[dest], 0), lay.T);
  return {ctx.regions[dest] + lay.outputSlot(slot), begin};
}

// `self_by_reference`: rows for this rank itself travel only as their
// headers; the copy phase reads their bytes from the caller's x and tail
// (one copy instead of two). Only for byte rows enqueued whole (EpStages::kAll):
// a receive half enqueued later could find x already reused.
// Returns the call's send number (also when the block skipped its destination).
__device__ __forceinline__ uint32_t sendPhase(const EpKernelContext& ctx, const DispatchArgs& args,
                                              bool self_by_reference) {
  const RegionLayout& lay = ctx.layout;
  const int expert = blockIdx.x, dest = expert / lay.L, le = expert % lay.L;
  CallCounters* counters = &ctx.counters->dispatch;
  auto* tally = reinterpret_cast<uint64_t*>(ctx.regions[ctx.rank] + lay.sendTally(0, expert));
  trace::traceAt(trace::kRowsStart);
  const SendBlockStart start = beginSendBlock(counters, args.active_ranks, ctx.escape, ctx.rank, dest);
  // A launch that overlaps the layout's kernel (DispatchArgs::follows_layout_send)
  // meets its end here, before it reads what that kernel writes; with
  // OwnSendInputs the rows need none of it, and the blocks that send meet it
  // after them instead (below).
  const SendPicks picks = sendPicksOf(ctx, args);
  if (picks.per_rank == 0 || start.skipped) waitForPreviousKernel();
  if (start.skipped) {
    if (threadIdx.x == 0) publishFromChunks(nullptr, 0, tally, 0, 0, /*skipped=*/true);
    return start.sequence;
  }
  const uint32_t sequence = start.sequence;
  const int parity = static_cast<int>(sequence & 1);
  char* region = ctx.regions[dest];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  constexpr int kWarps = kSendThreads / kWarp;
  // This block's tokens (gridDim.y blocks share the expert's), and how many
  // tokens before them picked the expert: the first slot this block fills.
  const int per_block = (args.num_tokens + static_cast<int>(gridDim.y) - 1) / static_cast<int>(gridDim.y);
  const int first_token = min(args.num_tokens, static_cast<int>(blockIdx.y) * per_block);
  const int end_token = min(args.num_tokens, first_token + per_block);
  // With the caller's pick_slots the slots are given: nothing to count.
  int picked_before = 0;
  for (int base = 0; picks.slots == nullptr && base < first_token; base += kSendThreads) {
    const int token = base + threadIdx.x;
    picked_before += __syncthreads_count(token < first_token && pickOf(picks, token, args.num_topk, expert).pick >= 0);
  }
  __shared__ int warp_totals[kWarps];
  __shared__ int chunk_tokens[kSendThreads];
  __shared__ int chunk_slots[kSendThreads];  // with pick_slots: each row's slot
  __shared__ int sent_before;  // tokens before this chunk of the loop that picked `expert`
  __shared__ DirectPlace direct;  // where this rank's heads go in dest's output slot (null slot: through the region)
  if (threadIdx.x == 0) {
    sent_before = picked_before;
    direct = lay.L == 1 ? directHeadsAt(ctx, args, dest) : DirectPlace{nullptr, 0};
  }
  __syncthreads();
  for (int base = first_token; base < end_token; base += kSendThreads) {
    // Slot of each picking token in this chunk: an exclusive scan in token order.
    const int token = base + threadIdx.x;
    int slot = -1;  // with pick_slots: this token's row at the expert (a slot outside [0, T) is not sent)
    bool picked = false;
    if (token < end_token) {
      const PickAndSlot found = pickOf(picks, token, args.num_topk, expert);
      if (picks.slots != nullptr) {
        slot = found.slot;
        picked = slot >= 0 && slot < lay.T;
      } else {
        picked = found.pick >= 0;
      }
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, picked);
    if (lane == 0) warp_totals[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < kWarps; ++w) {
      before += w < warp ? warp_totals[w] : 0;
      total += warp_totals[w];
    }
    if (picked) {
      const int at = before + __popc(ballot & ((1u << lane) - 1));
      chunk_tokens[at] = token;
      chunk_slots[at] = slot;
    }
    __syncthreads();
    for (int i = warp; i < total; i += kWarps) {
      const int t = chunk_tokens[i];
      const int row = picks.slots != nullptr ? chunk_slots[i] : sent_before + i;
      char* message = region + lay.dispatchMessage(parity, le, ctx.rank, row);
      const auto* src = static_cast<const __nv_bfloat16*>(args.x) + static_cast<size_t>(t) * lay.H;
      // The header: the token, and 1 + the slot row its head was placed in (DirectHeads), else 0.
      const bool self_row = self_by_reference && dest == ctx.rank;
      const bool placed = direct.slot != nullptr && !self_row;
      const int64_t slot_row = direct.begin + row;
      if (lane == 0) *reinterpret_cast<int2*>(message) = make_int2(t, placed ? static_cast<int>(slot_row + 1) : 0);
      char* payload = message + kMessageHeaderBytes;
      // The header says which token: the copy phase, which spreads rows over more
      // blocks, copies it from x (into recv_x, also when that is the output slot).
      if (self_row) continue;
      if (placed) {  // the head in its final place, the tail as ever
        const ByteRows& b = args.bytes;
        warpCopy(direct.slot + static_cast<size_t>(slot_row) * b.head_bytes,
                 static_cast<const char*>(args.x) + t * b.head_bytes, b.head_bytes, lane);
        warpCopy(payload + b.head_bytes, static_cast<const char*>(b.tail) + t * b.tail_bytes, b.tail_bytes, lane);
        continue;
      }
      if (args.use_fp8) {
        quantizeTokenWarp(src, reinterpret_cast<uint8_t*>(payload), reinterpret_cast<float*>(payload + lay.H), lay.H,
                          lane);
      } else if (args.bytes.enabled) {
        const ByteRows& b = args.bytes;
        warpCopy(payload, static_cast<const char*>(args.x) + t * b.head_bytes, b.head_bytes, lane);
        writeRowTail(payload + b.head_bytes, args, t, lane);
      } else {
        warpCopy(payload, src, 2 * static_cast<size_t>(lay.H), lane);
      }
    }
    __syncthreads();  // chunk_tokens and warp_totals are reused by the next chunk
    if (threadIdx.x == 0) sent_before += total;
    __syncthreads();
  }
  // The rows sent from the caller's own inputs beside the layout's kernel:
  // the carried row is that kernel's, and what follows this phase reads its
  // outputs too.
  trace::traceAt(trace::kRowsSent);
  if (picks.per_rank != 0) waitForPreviousKernel();
  trace::traceAt(trace::kLayoutWaited);
  // The carried row, once per destination (its first block of local expert
  // 0), under the same signal as the rows.
  if (args.carried.mine != nullptr && le == 0 && blockIdx.y == 0 && warp == 0) {
    warpCopy(region + lay.carriedRow(parity, ctx.rank), args.carried.mine, args.carried.bytes, lane);
  }
  // Every thread's rows before the signal: the barrier orders them before
  // thread 0's release, which is cumulative (see publishSignal, send_tally.cuh).
  __syncthreads();
  if (threadIdx.x == 0) {
    publishFromChunks(region, lay.dispatchSignal(parity, le, ctx.rank), tally, sequence,
                      static_cast<uint32_t>(sent_before - picked_before), /*skipped=*/false);
    finishSendBlock(counters, sequence);
    trace::traceAt(trace::kSignalled);
  }
  return sequence;
}

// True when recv_x is this rank's output slot (the call's heads may arrive
// there): each message's header then says where its head was placed.
__device__ __forceinline__ bool slotOffered(const DispatchArgs& args) {
  return args.direct.gathered != nullptr && args.direct.own_slot >= 0 && args.bytes.head_bytes > 0;
}

// True when senders were told they may place heads in this rank's output
// slot this call: its own counts row, as every rank gathered it, names the
// slot. layoutSend withdraws the offer (-1) while this rank does not hear
// every rank, so after a loss this is false until the group is rebuilt: the
// wait phase's extra work below runs on one call per loss.
__device__ __forceinline__ bool slotOfferStands(const EpKernelContext& ctx, const DispatchArgs& args) {
  if (!slotOffered(args)) return false;
  const DirectHeads& d = args.direct;
  const int64_t own = d.gathered_ranges[ctx.rank];
  if ((own & 0xffffffff) == 0) return false;
  return d.gathered[(own >> 32) * d.gathered_stride + d.slot_word] == d.own_slot;
}

// After the waits of a call whose slot offer stood (a thread per rank):
// marks this rank in the region of each source it gave up on and that is
// still alive as far as it knows (a departed process's memory may be gone),
// so that the source, should it come late, sends no head to this rank's
// output slots (directHeadsAt). The mark is never cleared: a rebuilt group
// (update_ep_member) opens new regions.
__device__ __forceinline__ void noteGivenUp(const EpKernelContext& ctx, const DispatchArgs& args) {
  const WaitEscape& escape = ctx.escape;
  for (int src = threadIdx.x; src < ctx.layout.R; src += blockDim.x) {
    if (src == ctx.rank || loadActive(args.active_ranks + src) != 0) continue;
    // The host-mapped word too (one PCIe read, only for a rank given up on):
    // a death the watchdog saw since this wait began.
    const bool departed = (escape.departed_bits >> src & 1u) != 0 || ld_relaxed_sys(escape.departed_seen + src) != 0 ||
                          (escape.departed != nullptr && ld_relaxed_sys(escape.departed + src) != 0);
    if (!departed) st_relaxed_sys(reinterpret_cast<uint32_t*>(ctx.regions[src] + ctx.layout.givenUpBy(ctx.rank)), 1u);
  }
}

// After the wait phase's layout (one block): a sender placed its heads in
// this rank's output slot counting every source before it, while this layout
// counts only those still heard. The two differ only when a source was given
// up on during this call; then each head placed elsewhere than its row of the
// layout is copied from the slot back into its message (whose head bytes the
// sender left unused) and its header cleared, so that the copy phase moves it
// from the region like any other. The copy phase writes rows the heads were
// read from: hence here, before it (a launch before it, or before wholeCall
// hands the layout on). Only on a call that lost a rank
// (`lost`, the same answer in every thread).
__device__ __forceinline__ void stageMovedHeads(const EpKernelContext& ctx, const DispatchArgs& args, int parity,
                                                bool lost) {
  const RegionLayout& lay = ctx.layout;
  if (!lost) return;
  const ByteRows& b = args.bytes;
  char* region = ctx.regions[ctx.rank];
  const char* slot = static_cast<const char*>(args.recv_x);
  const int64_t slot_rows = static_cast<int64_t>(lay.L) * lay.R * lay.T;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, warps = blockDim.x / kWarp;
  for (int pair = 0; pair < lay.L * lay.R; ++pair) {
    const int le = pair / lay.R, src = pair % lay.R;
    const int64_t range = args.layout_range[pair];
    const int begin = static_cast<int>(range >> 32), count = static_cast<int>(range & 0xffffffff);
    for (int i = warp; i < count; i += warps) {
      char* message = region + lay.dispatchMessage(parity, le, src, i);
      int2* header = reinterpret_cast<int2*>(message);
      const int placed_at = __ldcg(&header->y) - 1;
      const int64_t row = static_cast<int64_t>(le) * lay.R * lay.T + begin + i;
      if (placed_at < 0 || placed_at == row) continue;
      if (placed_at < slot_rows) {
        // A plain loop, not warpCopy: the kernel's phases share one register
        // allocation, and this rare path's loads in flight added spills.
        const auto* from = reinterpret_cast<const int4*>(slot + static_cast<size_t>(placed_at) * b.head_bytes);
        auto* to = reinterpret_cast<int4*>(message + kMessageHeaderBytes);
        for (size_t v = lane; v < b.head_bytes / 16; v += kWarp) to[v] = __ldcg(from + v);
      }
      __syncwarp();
      if (lane == 0) header->y = 0;
    }
  }
}

// After the waits (the whole block): every source's carried row out of the
// region, or zeros where it was not heard (masked in the final mask
// `active`, or every source when this rank takes no part: it waited for
// none), with their ranges in Gathered's form. The acquire of each source's
// signal, then the block's barrier, make its row visible here (read through
// L2, see L2Load).
__device__ __forceinline__ void receiveCarried(const EpKernelContext& ctx, const DispatchArgs& args, int parity,
                                               bool self_active, const bool* active) {
  const CarriedRows& c = args.carried;
  const RegionLayout& lay = ctx.layout;
  const int vectors = c.bytes / 16;
  const char* region = ctx.regions[ctx.rank];
  for (int i = threadIdx.x; i < lay.R * vectors; i += blockDim.x) {
    const int src = i / vectors, v = i % vectors;
    const bool heard = self_active && active[src];
    const int4 value =
        heard ? __ldcg(reinterpret_cast<const int4*>(region + lay.carriedRow(parity, src)) + v) : make_int4(0, 0, 0, 0);
    reinterpret_cast<int4*>(static_cast<char*>(c.received) + static_cast<size_t>(src) * c.bytes)[v] = value;
  }
  for (int src = threadIdx.x; src < lay.R; src += blockDim.x) {
    c.ranges[src] = static_cast<int64_t>(src) << 32 | (self_active && active[src] ? 1 : 0);
  }
}

__device__ __forceinline__ void waitPhase(const EpKernelContext& ctx, const DispatchArgs& args) {
  const RegionLayout& lay = ctx.layout;
  __shared__ uint32_t sequence;
  if (threadIdx.x == 0) sequence = beginReceive(&ctx.counters->dispatch);
  trace::traceAt(trace::kWaitStart);
  __syncthreads();
  noteDepartedPeers(ctx.escape, ctx.rank, ctx.layout.R);
  const int parity = static_cast<int>(sequence & 1);
  const char* region = ctx.regions[ctx.rank];
  const bool self_active = loadActive(args.active_ranks + ctx.rank) != 0;
  const uint64_t start = globaltimer_ns();
  // Pass 1: each (local expert, source) pair's count, or 0 when given up;
  // layout_range holds the bare counts meanwhile.
  for (int pair = threadIdx.x; pair < lay.L * lay.R; pair += blockDim.x) {
    const int le = pair / lay.R, src = pair % lay.R;
    int count = 0;
    if (self_active) {
      count = waitSignal(region, lay.dispatchSignal(parity, le, src), sequence, src, args.active_ranks,
                         ctx.escape, start, ctx.timeout_ns);
    }
    // A count never exceeds T (a sender has at most T tokens); the clamp
    // keeps a rank that was handed a different T from writing out of bounds.
    args.layout_range[pair] = count < 0 ? 0 : min(count, lay.T);
  }
  __syncthreads();  // every wait is over: the mask is final for this call
  trace::traceAt(trace::kSignalsHeard);
  // The final mask, read once (a thread per rank, side by side) into shared
  // memory, so that pass 2's loop over sources reads no global word and
  // every thread sees the same mask (the caller may keep it host-mapped).
  __shared__ bool heard[kMaxEpRanks];
  for (int r = threadIdx.x; r < lay.R; r += blockDim.x) heard[r] = loadActive(args.active_ranks + r) != 0;
  // The same in every thread: no one writes the gathered rows now.
  const bool offer_stood = slotOfferStands(ctx, args);
  if (offer_stood) noteGivenUp(ctx, args);
  __syncthreads();  // heard[] written
  if (args.carried.mine != nullptr) receiveCarried(ctx, args, parity, self_active, heard);
  // Pass 2: segments one after another by source rank; a source masked by
  // now contributes nothing to any expert, even where its signal came.
  for (int le = threadIdx.x; le < lay.L; le += blockDim.x) {
    int64_t begin = 0;
    for (int src = 0; src < lay.R; ++src) {
      const int64_t count = heard[src] ? args.layout_range[le * lay.R + src] : 0;
      args.layout_range[le * lay.R + src] = begin << 32 | count;
      begin += count;
    }
    args.recv_count[le] = static_cast<int32_t>(begin);
  }
  if (!offer_stood) return;
  // A barrier every thread reaches (layout_range's begins are then written).
  bool masked_here = false;
  for (int r = threadIdx.x; r < lay.R; r += blockDim.x) masked_here |= !heard[r];
  stageMovedHeads(ctx, args, parity, __syncthreads_or(masked_here) != 0);
}

// One (local expert, source) segment's rows, by the `chunks` blocks that
// share it (this one is `chunk`).
// With DispatchArgs::receive_layout, the warp that copies a row lays it out
// too (receive_layout.cuh), and the rows past those received are laid out
// as none; `block_counts`: the block's picks per expert (null: not shared).
__device__ __forceinline__ void copySegment(const EpKernelContext& ctx, const DispatchArgs& args,
                                            bool self_by_reference, int parity, int le, int src, int chunk, int chunks,
                                            uint32_t* block_counts) {
  const RegionLayout& lay = ctx.layout;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  constexpr int kWarps = kCopyThreads / kWarp;
  // `chunks` blocks share a segment's rows, a warp's rows kWarps * chunks apart.
  const int first = chunk * kWarps + warp, stride = kWarps * chunks;
  const size_t rows_per_expert = static_cast<size_t>(lay.R) * lay.T;
  const int64_t range = args.layout_range[le * lay.R + src];
  const int total = args.recv_count[le];  // for the rows past it, below (loaded beside the range)
  const int begin = static_cast<int>(range >> 32), count = static_cast<int>(range & 0xffffffff);
  const char* region = ctx.regions[ctx.rank];
  // recv_x is this rank's output slot: a header says where its sender put the head there.
  const bool slot_offered = slotOffered(args);
  // The wait phase's acquire loads ended before this kernel began (stream
  // order), or before wholeCall's hand-over (release and acquire), so the
  // rows are visible here (read through L2, see L2Load).
  for (int i = first; i < count; i += stride) {
    const char* message = region + lay.dispatchMessage(parity, le, src, i);
    const size_t row = le * rows_per_expert + begin + i;
    const int2 header = __ldcg(reinterpret_cast<const int2*>(message));
    const int32_t token = header.x;
    const bool head_in_place = slot_offered && header.y == static_cast<int64_t>(row) + 1;
    if (lane == 0) args.src_info[row] = token;
    const char* payload = message + kMessageHeaderBytes;
    if (self_by_reference && src == ctx.rank) {  // only the header came: the bytes are this rank's own inputs
      const ByteRows& b = args.bytes;
      if (token >= 0 && token < args.num_tokens) {  // never an address outside x
        warpCopy(static_cast<char*>(args.recv_x) + row * b.head_bytes,
                 static_cast<const char*>(args.x) + token * b.head_bytes, b.head_bytes, lane);
        warpCopy(static_cast<char*>(b.recv_tail) + row * b.tail_bytes,
                 static_cast<const char*>(b.tail) + token * b.tail_bytes, b.tail_bytes, lane);
      }
    } else if (args.use_fp8) {
      warpCopy(static_cast<uint8_t*>(args.recv_x) + row * lay.H, payload, lay.H, lane, L2Load());
      const float* scales = reinterpret_cast<const float*>(payload + lay.H);
      for (int g = lane; g < lay.H / kChannelsPerScale; g += kWarp) {
        args.recv_scales[(static_cast<size_t>(le) * (lay.H / kChannelsPerScale) + g) * rows_per_expert + begin + i] =
            __ldcg(scales + g);
      }
    } else if (args.bytes.enabled) {
      const ByteRows& b = args.bytes;
      if (!head_in_place) {
        warpCopy(static_cast<char*>(args.recv_x) + row * b.head_bytes, payload, b.head_bytes, lane, L2Load());
      }
      warpCopy(static_cast<char*>(b.recv_tail) + row * b.tail_bytes, payload + b.head_bytes, b.tail_bytes, lane,
               L2Load());
    } else {
      warpCopy(static_cast<__nv_bfloat16*>(args.recv_x) + row * lay.H, payload, 2 * static_cast<size_t>(lay.H), lane,
               L2Load());
    }
    if (args.with_receive_layout && static_cast<int64_t>(row) < args.receive_layout.capacity) {
      __syncwarp();  // the row's tail, which the warp's lanes wrote, read back by them
      receive_layout::layOutRow(args.receive_layout, static_cast<int64_t>(row), true,
                                static_cast<const uint8_t*>(args.bytes.recv_tail) + row * args.bytes.tail_bytes, src,
                                token, lane, block_counts);
    }
  }
  // Rows past the count have no source: src_info -1 (recv_x stays unwritten).
  const size_t filler = (static_cast<size_t>(chunk) * lay.R + src) * blockDim.x + threadIdx.x;
  for (size_t j = static_cast<size_t>(total) + filler; j < rows_per_expert;
       j += static_cast<size_t>(lay.R) * chunks * blockDim.x) {
    args.src_info[le * rows_per_expert + j] = -1;
  }
  if (args.bytes.enabled) {  // and zeros up to zeroed_rows, a warp per row
    const ByteRows& b = args.bytes;
    const size_t warps = static_cast<size_t>(lay.R) * chunks * kWarps;
    const size_t zeroed = min(static_cast<size_t>(b.zeroed_rows), rows_per_expert);
    for (size_t j = total + (static_cast<size_t>(chunk) * lay.R + src) * kWarps + warp; j < zeroed; j += warps) {
      warpZero(static_cast<char*>(args.recv_x) + (le * rows_per_expert + j) * b.head_bytes, b.head_bytes, lane);
      warpZero(static_cast<char*>(b.recv_tail) + (le * rows_per_expert + j) * b.tail_bytes, b.tail_bytes, lane);
    }
  }
  if (args.with_receive_layout) {  // rows past the count: no picks (one local expert: le is 0)
    const size_t warps = static_cast<size_t>(lay.R) * chunks * kWarps;
    const size_t rows = min(rows_per_expert, static_cast<size_t>(args.receive_layout.capacity));
    for (size_t j = total + (static_cast<size_t>(chunk) * lay.R + src) * kWarps + warp; j < rows; j += warps) {
      receive_layout::layOutRow(args.receive_layout, static_cast<int64_t>(j), false, nullptr, 0, -1, lane,
                                block_counts);
    }
  }
}

// The block's counts for receive_layout in dynamic shared memory (null:
// none, or too many experts to hold), zeroed; a barrier follows before the
// first row is laid out.
__device__ __forceinline__ uint32_t* receiveCounts(const DispatchArgs& args, uint32_t* shared) {
  if (!args.with_receive_layout || receive_layout::sharedCountBytes(args.receive_layout) == 0) return nullptr;
  receive_layout::zeroBlockCounts(args.receive_layout, shared);
  return shared;
}

// After a block's copies, the rest of receive_layout (every block once):
// where this rank's rows start at each rank and so its picks' slots, the
// received counts' prefix sums (the segments lie one after another by
// source: each ends at begin + count), and the counts per expert with their
// prefix sums (finishBlock's last block).
__device__ __forceinline__ void finishReceiveLayout(const DispatchArgs& args, int block, int blocks,
                                                    const uint32_t* block_counts) {
  if (!args.with_receive_layout) return;
  const ReceiveLayoutArgs& a = args.receive_layout;
  __shared__ int32_t my_begin[kMaxEpRanks];
  const int tid = static_cast<int>(threadIdx.x);
  if (tid < a.num_ranks) {
    my_begin[tid] = receive_layout::rowsBeforeMineAt(a, tid);
    const int64_t range = args.layout_range[tid];
    if (block == 0) a.scaleup_psum[tid] = static_cast<int32_t>((range >> 32) + (range & 0xffffffff));
  }
  __syncthreads();
  receive_layout::laySlots(a, my_begin, static_cast<int64_t>(block) * blockDim.x + tid,
                           static_cast<int64_t>(blocks) * blockDim.x);
  receive_layout::finishBlock(a, block_counts);
}

__device__ __forceinline__ void copyPhase(const EpKernelContext& ctx, const DispatchArgs& args, bool self_by_reference,
                                          uint32_t* shared_counts) {
  const int parity = static_cast<int>(receivedSequence(&ctx.counters->dispatch) & 1);
  uint32_t* block_counts = receiveCounts(args, shared_counts);
  if (args.with_receive_layout) __syncthreads();  // the counts zeroed
  copySegment(ctx, args, self_by_reference, parity, static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y),
              static_cast<int>(blockIdx.z), static_cast<int>(gridDim.z), block_counts);
  const int block = static_cast<int>((blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x);
  finishReceiveLayout(args, block, static_cast<int>(gridDim.x * gridDim.y * gridDim.z), block_counts);
}

// The three phases in one launch of the send's grid, for a small call
// enqueued whole (launchDispatch says which): every block sends its share;
// block 0 then waits and lays out as the wait phase does, and raises
// `laid_out` with the call's send sequence; the others wait for that, then
// every block copies its share of the segments as the copy phase's blocks
// do. Block 0 needs the blocks that send to this rank itself to run, and
// peers need theirs: launchDispatch takes this path only when the grids of
// all ranks fit on the device at once (oneLaunch), so no block that spins
// keeps another from its SM. The spin ends when block 0's wait does, which
// is bounded as the wait phase's.
__device__ __forceinline__ void wholeCall(const EpKernelContext& ctx, const DispatchArgs& args, bool self_by_reference,
                                          uint32_t* shared_counts) {
  const RegionLayout& lay = ctx.layout;
  CallCounters* counters = &ctx.counters->dispatch;
  uint32_t* block_counts = receiveCounts(args, shared_counts);  // zeroed before the barriers below
  const uint32_t call = sendPhase(ctx, args, self_by_reference);
  const int block = static_cast<int>(blockIdx.y * gridDim.x + blockIdx.x);
  if (block == 0) {
    waitPhase(ctx, args);
    __syncthreads();  // every thread's layout_range, recv_count and staging before the release
    if (threadIdx.x == 0) st_release_gpu(&counters->laid_out, call);
    trace::traceAt(trace::kLaidOut);
  } else {
    if (threadIdx.x == 0) {
      while (ld_acquire_gpu(&counters->laid_out) != call) {
      }
    }
    trace::traceAt(trace::kHandedOver);
    __syncthreads();
  }
  // This call's receive number: block 0 took it (beginReceive) before the release.
  const int parity = static_cast<int>(ld_relaxed_gpu(&counters->received) & 1);
  const int segments = lay.L * lay.R, blocks = static_cast<int>(gridDim.x * gridDim.y);
  const int chunks = max(1, blocks / segments);
  for (int b = block; b < segments * chunks; b += blocks) {
    const int pair = b % segments;
    copySegment(ctx, args, self_by_reference, parity, pair / lay.R, pair % lay.R, b / segments, chunks, block_counts);
  }
  trace::traceAt(trace::kCopied);
  finishReceiveLayout(args, block, blocks, block_counts);
  trace::traceAt(trace::kRowsEnd);
}

enum class DispatchPhase : int { kSend, kWait, kCopy, kWhole };

// Blocks per (local expert, source) segment in the copy phase: enough for
// about two waves on an H200's 132 SMs when there are few segments (one
// "expert" per rank, as ElasticBuffer uses the kernels), never more than a
// segment's rows can keep busy.
int copyChunks(const RegionLayout& lay) {
  constexpr int kTargetBlocks = 264;
  const int segments = lay.L * lay.R;
  const int by_rows = (lay.T + kCopyThreads / kWarp - 1) / (kCopyThreads / kWarp);
  return std::max(1, std::min(by_rows, kTargetBlocks / segments));
}

// The three phases are one kernel, launched once per phase (the phase is the
// same for every thread of a launch): a profiler then shows all of a
// dispatch's GPU time in one row named "dispatch", as the benchmark helpers of
// DeepEP and the reference expect (exactly one row per operation name).
__global__ void __launch_bounds__(kMaxThreads, kMinBlocks)
    dispatch(EpKernelContext ctx, DispatchArgs args, DispatchPhase phase, bool self_by_reference) {
  extern __shared__ uint32_t receive_counts[];  // receive_layout's per block, when the launch gives them room
  switch (phase) {
    case DispatchPhase::kSend:
      sendPhase(ctx, args, self_by_reference);
      break;
    case DispatchPhase::kWait:
      waitPhase(ctx, args);
      break;
    case DispatchPhase::kCopy:
      copyPhase(ctx, args, self_by_reference, receive_counts);
      break;
    case DispatchPhase::kWhole:
      wholeCall(ctx, args, self_by_reference, receive_counts);
      break;
  }
}

static_assert(kCopyThreads == kSendThreads, "wholeCall copies with the send's blocks");
static_assert(kSendThreads / kWarp == kOneLaunchWarpsPerBlock, "wholeCallChunks counts the send blocks' warps");

// The most dynamic shared memory a dispatch launch takes (receive_layout's
// counts): the blocks an SM holds are counted with it, whatever a call
// takes (on an H100 as many as with none).
constexpr size_t kMostReceiveCountBytes = sizeof(uint32_t) * receive_layout::kMaxSharedExperts;

// A fact of the current device about the dispatch kernel, found once per
// device: `find(device)` answers a positive value, or 0 when it cannot tell
// (asked again next time; a failed CUDA call's error is cleared, not this
// call's). 0 also where the device is unknown.
using PerDevice = std::array<std::atomic<int>, 64>;  // a value per device ordinal, 0 while unknown

template <typename Find>
int knownPerDevice(PerDevice& known, Find find) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= static_cast<int>(known.size())) return 0;
  if (const int value = known[device].load(std::memory_order_relaxed); value > 0) return value;
  const int value = find(device);
  if (value > 0) known[device].store(value, std::memory_order_relaxed);
  return value;
}

// Blocks of the dispatch kernel the current device holds at once (its SMs,
// or a MIG instance's, times the blocks one SM holds, within this process's
// MPS share); 0 when unknown.
int residentDispatchBlocks() {
  static PerDevice known{};
  return knownPerDevice(known, [](int device) {
    int sms = 0, per_sm = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, dispatch, kSendThreads, kMostReceiveCountBytes) !=
            cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return mpsShareOfBlocks(sms * per_sm, std::getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"));
  });
}

// Whether the dispatch kernel the current device runs was built with
// griddepcontrol (dependent_launch.cuh): only then may its launch overlap the
// kernel before it.
bool dependentLaunchBuilt() {
  constexpr int kNo = 1, kYes = 2;
  static PerDevice known{};
  return knownPerDevice(known, [](int) {
           cudaFuncAttributes attributes{};
           if (cudaFuncGetAttributes(&attributes, dispatch) != cudaSuccess) {
             cudaGetLastError();
             return 0;
           }
           // The PTX the code was compiled from (0 for a cubin without it: then the binary's architecture).
           const int built_for = attributes.ptxVersion != 0 ? attributes.ptxVersion : attributes.binaryVersion;
           return built_for >= kDependentLaunchPtxVersion ? kYes : kNo;
         }) == kYes;
}

// The first launch of a dispatch (its send phase, or the whole call), with
// the send's blocks; with `overlap`, a programmatic dependent launch (its
// blocks may start before the kernel ahead of it on the stream ends).
cudaError_t launchFirst(dim3 grid, size_t shared_bytes, cudaStream_t stream, bool overlap, const EpKernelContext& ctx,
                        const DispatchArgs& args, DispatchPhase phase, bool self_by_reference) {
  if (!overlap) {
    dispatch<<<grid, kSendThreads, shared_bytes, stream>>>(ctx, args, phase, self_by_reference);
    return cudaGetLastError();
  }
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(kSendThreads);
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, dispatch, ctx, args, phase, self_by_reference);
}

}  // namespace

cudaError_t launchDispatch(const EpKernelContext& ctx, const DispatchArgs& given, EpStages stages,
                           cudaStream_t stream) {
  trace::bindUnit();
  DispatchArgs args = given;
  size_t counts_bytes = 0;         // receive_layout's counts per block, in dynamic shared memory
  if (args.with_receive_layout) {  // the rows it lays out are this call's own
    ReceiveLayoutArgs& r = args.receive_layout;
    r.ranges = args.layout_range;
    r.src_token = args.src_info;
    r.recv_tail = args.bytes.recv_tail;
    r.rank = ctx.rank;
    counts_bytes = static_cast<size_t>(receive_layout::sharedCountBytes(r));
  }
  // Each launch checked at once: a kernel whose predecessor failed to launch is not enqueued.
  const bool self_by_reference = stages == EpStages::kAll && args.bytes.enabled;
  // Where a block need not count many tokens before its own, smaller blocks pay.
  const dim3 grid(ctx.layout.E, slotsCheap(args) ? sendChunks(ctx.layout.E, args.num_tokens, kRowsPerChunkNotCounting)
                                                 : sendChunks(ctx.layout.E, args.num_tokens));
  static const bool one_launch_allowed = oneLaunchAllowed(std::getenv(kOneLaunchEnv));
  // Only the first launch may overlap: the wait and copy launches read what the send writes.
  const bool overlap = args.follows_layout_send && stages != EpStages::kReceiveOnly && dependentLaunchBuilt();
  if (stages == EpStages::kAll && one_launch_allowed) {
    const int resident = residentDispatchBlocks();
    const dim3 whole(grid.x,
                     wholeCallChunks(ctx.layout, args, static_cast<int>(grid.x), static_cast<int>(grid.y), resident));
    if (oneLaunch(ctx.layout, args, static_cast<int>(whole.x * whole.y), resident)) {
      return launchFirst(whole, counts_bytes, stream, overlap, ctx, args, DispatchPhase::kWhole, self_by_reference);
    }
  }
  if (stages != EpStages::kReceiveOnly) {
    const cudaError_t err = launchFirst(grid, 0, stream, overlap, ctx, args, DispatchPhase::kSend, self_by_reference);
    if (err != cudaSuccess) return err;
  }
  if (stages != EpStages::kSendOnly) {
    dispatch<<<1, kWaitThreads, 0, stream>>>(ctx, args, DispatchPhase::kWait, self_by_reference);
    if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
    dispatch<<<dim3(ctx.layout.L, ctx.layout.R, copyChunks(ctx.layout)), kCopyThreads, counts_bytes, stream>>>(
        ctx, args, DispatchPhase::kCopy, self_by_reference);
  }
  return cudaGetLastError();
}

}  // namespace mooncake::ep::cuda
