// ElasticBuffer's IPC-path layout on the device (docs/ep-elastic.md): the
// tensor operations of python/mooncake/_ep_elastic/rows_layout.py as three
// kernels on the caller's stream, with no host synchronisation (a CUDA graph
// captures them). A dispatch enqueues layoutSend (which can also stage the
// rows' tails and zero what layoutReceive adds to) before the EP kernels'
// calls and layoutReceive after them (or has the rows' dispatch make that
// layout as it copies: DispatchArgs::receive_layout). Addresses are device memory; every
// output is written whole by each call (graph replays need no zeroing),
// except ReceiveLayoutArgs::per_expert and finished_blocks, which the caller
// zeroes (or has layoutSend zero).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

namespace mooncake::ep::cuda {

// Picks per token that layoutSend takes (a tile's destinations, one byte
// each, in shared memory); python/mooncake/_ep_elastic/layout_kernels.py
// keeps larger calls on the torch form.
constexpr int kMaxLayoutTopk = 32;

// layoutSend's tokens per thread block: the tiles run side by side, each
// counts its tokens per rank into SendLayoutArgs::tile_counts, and a second
// launch adds the earlier tiles' counts (python's SEND_TILE_TOKENS).
constexpr int kLayoutSendTileTokens = 256;

// int32 words of SendLayoutArgs::tile_counts a call of num_tokens needs.
inline int64_t layoutSendScratchWords(int64_t num_tokens, int num_ranks) {
  const int64_t tiles = num_tokens > 0 ? (num_tokens + kLayoutSendTileTokens - 1) / kLayoutSendTileTokens : 1;
  return tiles * num_ranks;
}

// The rows' staged tail (bytes [head, head + tail_bytes) of each row, see
// ipc_rows.RowFormat); sources as in layout::TailSources.
struct SendTailArgs {
  const void* payload = nullptr;      // [N, payload_bytes]
  const void* scales = nullptr;       // [N, scale_bytes] or null
  const int64_t* topk_idx = nullptr;  // [N, k] or null (ids not sent: cached dispatch)
  const float* weights = nullptr;     // [N, k] or null (zeros sent)
  int64_t payload_bytes = 0, scale_bytes = 0, head_bytes = 0, tail_bytes = 0, ids_at = 0;
  int num_tokens = 0, num_topk = 0;
  void* tail = nullptr;  // out [N, tail_bytes], 16-byte aligned, tail_bytes % 16 == 0
};

// From this rank's top-k picks, before the rows are sent.
struct SendLayoutArgs {
  const int64_t* topk_idx = nullptr;                               // [N, k] global expert ids (-1: none)
  int num_tokens = 0, num_topk = 0, num_local = 0, num_ranks = 0;  // num_ranks <= kMaxEpRanks
  int64_t* dest = nullptr;         // out [N, k]: destination ranks, each once, ascending, repeats -1
  // out [N, k], beside dest: the token's index among those sent to dest's
  // rank (-1 where dest is -1), the EP kernels' DispatchArgs::pick_slots.
  int32_t* dest_slots = nullptr;
  int32_t* token_index = nullptr;  // out [N, k]: the token's index among those sent to the pick's rank (-1: none)
  // out [count_words]: the row the counts are gathered in: tokens sent to
  // each rank ([R]), then `shape` ([shape_words], the call's shape), then zeros.
  int32_t* counts = nullptr;
  int count_words = 0;  // >= num_ranks + shape_words
  const int32_t* shape = nullptr;
  int shape_words = 0;
  int32_t* tile_counts = nullptr;  // scratch: layoutSendScratchWords(num_tokens, num_ranks) words, any contents
  int64_t tile_count_words = 0;
  // A word of the counts' row that offers something only while this rank
  // hears every rank (ElasticBuffer's output slot, DirectHeads): written as
  // -1 while any of active_ranks [R] is 0. -1, or active_ranks null: none.
  int offer_word = -1;
  const int32_t* active_ranks = nullptr;
  // Work a dispatch would otherwise launch apart, done in the same launch
  // (each only when its output is given; one launch each fewer per call):
  // - the rows' staged tails, as sendTail makes them (`tail.tail` set; its
  //   topk_idx, num_tokens and num_topk are this call's): by helper blocks
  //   beside the tile in a call of one tile, else by a sendTail launch of
  //   layoutSend's;
  SendTailArgs tail;
  // - `zeroed_words` int64 zeros at `zeroed` (layoutReceive's per_expert and
  //   finished_blocks, which it adds to);
  int64_t* zeroed = nullptr;
  int64_t zeroed_words = 0;
  // - a copy of topk_idx ([N, k], the handle's own).
  int64_t* topk_copy = nullptr;
};

// From what this rank received (C rows at capacity) and the gathered counts.
struct ReceiveLayoutArgs {
  // The send side's picks, for dst_buffer_slot_idx.
  const int64_t* topk_idx = nullptr;     // [N, k]
  const int32_t* token_index = nullptr;  // [N, k] SendLayoutArgs::token_index
  // Every rank's counts (SendLayoutArgs::counts first in each row) as the EP
  // kernels delivered them to this rank: rows of `gathered_stride` int32,
  // source s's at row begin_s of gathered_ranges[s] = (begin_s << 32) | count_s
  // (count 0: the source was given up on, its counts read as zeros).
  const int32_t* gathered = nullptr;
  int64_t gathered_stride = 0;
  const int64_t* gathered_ranges = nullptr;  // [R]
  int num_tokens = 0;
  // The received rows.
  const int64_t* ranges = nullptr;                      // [R] (begin << 32) | count per source
  const int32_t* src_token = nullptr;                   // [C] token index at the source
  const void* recv_tail = nullptr;                      // [C, tail_bytes]
  int64_t tail_bytes = 0, ids_at = 0, weights_at = -1;  // offsets in the tail; weights_at -1: no weights
  int64_t capacity = 0;                                 // C
  int num_topk = 0, num_local = 0, num_ranks = 0, rank = 0, tokens_per_rank = 0;
  // Outputs.
  int32_t* slots = nullptr;         // [N, k] dst_buffer_slot_idx (-1: none)
  bool* real = nullptr;             // [C] row < rows received
  int64_t* local = nullptr;         // [C, k] local expert of each pick here (-1: none)
  float* weights = nullptr;         // [C, k] its weight (0 where none), or null
  int32_t* metadata = nullptr;      // [C, k + 2] source * T + token, picks here, then -1 (the caller may fill slots)
  int64_t* per_expert = nullptr;    // [L] picks per local expert, added to (zero it first)
  int32_t* expert_psum = nullptr;   // [L] inclusive prefix sums of per_expert (after the additions)
  int32_t* scaleup_psum = nullptr;  // [R] inclusive prefix sums of the received counts
  // Scratch: the blocks that finished (zero it first, with per_expert); the last one writes expert_psum.
  unsigned long long* finished_blocks = nullptr;
};

// Each returns false with *error set when the launch fails or the sizes are out of range.
bool layoutSend(const SendLayoutArgs& args, cudaStream_t stream, std::string* error);
bool sendTail(const SendTailArgs& args, cudaStream_t stream, std::string* error);
bool layoutReceive(const ReceiveLayoutArgs& args, cudaStream_t stream, std::string* error);

// What layoutReceive (and a dispatch that makes the layout itself,
// DispatchArgs::receive_layout) refuses in `args`, or "" when they are fine.
std::string receiveLayoutError(const ReceiveLayoutArgs& args);

}  // namespace mooncake::ep::cuda
