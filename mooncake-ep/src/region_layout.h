// Layout of one rank's receive region (device memory, exported with CUDA
// IPC). Every rank computes the same offsets from the same sizes, so a
// sender finds a slot in a peer's region at the offset it would have in its
// own. Each part exists twice, by call parity: consecutive calls use
// different halves, so a fast sender of call n+1 never overwrites rows that a
// slow receiver still copies out of call n (see docs/ep-kernels.md for why
// two halves are enough).
//
//   dispatch signals [2][L][R] uint64   (parity, local expert, source rank)
//   combine signals  [2][E]    uint64   (parity, global expert of the sender)
//   call counters    GroupCounters       (this rank's own, never written by peers)
//   departed seen    [R] uint32          (this rank's own: peers its kernels found gone)
//   given up by      [R] uint32          (written by peers: 1 once peer r's dispatch gave up
//                                         waiting for this rank; then this rank never places
//                                         heads in r's output slots, DirectHeads)
//   send tallies     [2][E] uint64       (this rank's own: dispatch, combine; blocks that share
//                                         one destination's rows count themselves in, see send_tally.cuh)
//   carried rows     [2][R] of kCarriedRowBytes (parity, source rank): the small row a
//                                         dispatch carries to every rank with its signals
//                                         (DispatchArgs::carried)
//   dispatch rows    [2][L][R][T] messages of msg_stride bytes:
//                      int32 token index at the source, int32 1 + the output
//                      slot row its head was placed in (DirectHeads; 0: in the
//                      payload), 8 bytes padding,
//                      then bf16 [H], or e4m3 [H] followed by float32 [H / 128]
//   combine rows     [2][E][T] bf16 [H]  (global expert, token index at the owner)
//   output slots     [O] of R * T rows of at most 2H bytes (O = 0 unless asked for):
//                      receive buffers that a caller hands out as its outputs, into
//                      which senders write rows in their final place (DirectHeads,
//                      ep_ipc_group.h); only with one local expert per rank
//
// A signal word is (sequence << 32) | count: one 64-bit store publishes both,
// and a word left from an earlier call never matches the current sequence,
// so signals are never cleared.
#pragma once

#include <cuda_runtime_api.h>  // __host__ __device__ in host-only translation units

#include <cstddef>
#include <cstdint>

namespace mooncake::ep::cuda {

constexpr size_t kMessageHeaderBytes = 16;  // keeps the payload 16-byte aligned
constexpr int kChannelsPerScale = 128;
constexpr size_t kCountersBytes = 64;  // GroupCounters (call_sequence.cuh), with room to spare
constexpr size_t kCarriedRowBytes = 512;  // DispatchArgs::carried: 128 int32 words

struct RegionLayout {
  int T = 0, H = 0, E = 0, R = 0, L = 0, O = 0;
  size_t msg_stride = 0;
  size_t dispatch_signals = 0, combine_signals = 0, counters = 0, departed_seen = 0, given_up_by = 0, send_tallies = 0,
         carried_rows = 0, dispatch_rows = 0, combine_rows = 0, output_slots = 0, output_slot_bytes = 0, total = 0;

  static RegionLayout make(int tokens, int hidden, int experts, int ranks, int output_slots = 0) {
    RegionLayout l;
    l.T = tokens;
    l.H = hidden;
    l.E = experts;
    l.R = ranks;
    l.L = experts / ranks;
    l.O = output_slots;
    // The bf16 payload bounds the FP8 one (H + H / 32 <= 2H): one stride for both.
    l.msg_stride = kMessageHeaderBytes + 2 * static_cast<size_t>(hidden);
    auto align = [](size_t n) { return (n + 4095) / 4096 * 4096; };
    l.dispatch_signals = 0;
    l.combine_signals = l.dispatch_signals + 2 * static_cast<size_t>(l.L) * ranks * sizeof(uint64_t);
    l.counters = l.combine_signals + 2 * static_cast<size_t>(experts) * sizeof(uint64_t);
    l.departed_seen = l.counters + kCountersBytes;
    l.given_up_by = l.departed_seen + static_cast<size_t>(ranks) * sizeof(uint32_t);
    l.send_tallies = (l.given_up_by + static_cast<size_t>(ranks) * sizeof(uint32_t) + 7) / 8 * 8;
    l.carried_rows = (l.send_tallies + 2 * static_cast<size_t>(experts) * sizeof(uint64_t) + 15) / 16 * 16;
    l.dispatch_rows = align(l.carried_rows + 2 * static_cast<size_t>(ranks) * kCarriedRowBytes);
    const size_t dispatch_half = static_cast<size_t>(l.L) * ranks * tokens * l.msg_stride;
    l.combine_rows = align(l.dispatch_rows + 2 * dispatch_half);
    const size_t combine_half = static_cast<size_t>(experts) * tokens * 2 * hidden;
    l.output_slots = align(l.combine_rows + 2 * combine_half);
    l.output_slot_bytes = align(static_cast<size_t>(ranks) * tokens * 2 * hidden);
    l.total = l.output_slots + static_cast<size_t>(output_slots) * l.output_slot_bytes;
    return l;
  }

  __host__ __device__ size_t dispatchSignal(int parity, int le, int src) const {
    return dispatch_signals + ((static_cast<size_t>(parity) * L + le) * R + src) * sizeof(uint64_t);
  }
  __host__ __device__ size_t combineSignal(int parity, int expert) const {
    return combine_signals + (static_cast<size_t>(parity) * E + expert) * sizeof(uint64_t);
  }
  // kind 0: dispatch, 1: combine; one word per block group (a global expert).
  __host__ __device__ size_t sendTally(int kind, int expert) const {
    return send_tallies + (static_cast<size_t>(kind) * E + expert) * sizeof(uint64_t);
  }
  __host__ __device__ size_t dispatchMessage(int parity, int le, int src, int slot) const {
    return dispatch_rows + (((static_cast<size_t>(parity) * L + le) * R + src) * T + slot) * msg_stride;
  }
  __host__ __device__ size_t carriedRow(int parity, int src) const {
    return carried_rows + (static_cast<size_t>(parity) * R + src) * kCarriedRowBytes;
  }
  __host__ __device__ size_t givenUpBy(int peer) const {
    return given_up_by + static_cast<size_t>(peer) * sizeof(uint32_t);
  }
  __host__ __device__ size_t outputSlot(int slot) const {
    return output_slots + static_cast<size_t>(slot) * output_slot_bytes;
  }
  __host__ __device__ size_t combineRow(int parity, int expert, int token) const {
    return combine_rows + ((static_cast<size_t>(parity) * E + expert) * T + token) * 2 * static_cast<size_t>(H);
  }
};

}  // namespace mooncake::ep::cuda
