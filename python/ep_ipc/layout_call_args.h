// The layout kernels' arguments (mooncake/ep/cuda/elastic_layout.h) from
// Python's integers (device addresses, sizes): one spelling for
// mooncake._ep_ipc's layout_send / send_tail / layout_receive and for the
// tests that run the kernels' code on the host
// (tests/python/ep/test_elastic_layout_emulated.py). No pybind11 here.
#pragma once

#include <cstdint>

#include "mooncake/ep/cuda/elastic_layout.h"

namespace mooncake::ep::python {

template <typename T>
T* address(uintptr_t value) {
  return reinterpret_cast<T*>(value);
}

inline cuda::SendLayoutArgs sendLayoutArgs(uintptr_t topk_idx, int num_tokens, int num_topk, int num_local,
                                           int num_ranks, uintptr_t dest, uintptr_t dest_slots, uintptr_t token_index,
                                           uintptr_t counts, int count_words, uintptr_t shape, int shape_words,
                                           uintptr_t tile_counts, int64_t tile_count_words, int offer_word,
                                           uintptr_t active_ranks) {
  cuda::SendLayoutArgs a;
  a.topk_idx = address<const int64_t>(topk_idx);
  a.num_tokens = num_tokens;
  a.num_topk = num_topk;
  a.num_local = num_local;
  a.num_ranks = num_ranks;
  a.dest = address<int64_t>(dest);
  a.dest_slots = address<int32_t>(dest_slots);
  a.token_index = address<int32_t>(token_index);
  a.counts = address<int32_t>(counts);
  a.count_words = count_words;
  a.shape = address<const int32_t>(shape);
  a.shape_words = shape_words;
  a.tile_counts = address<int32_t>(tile_counts);
  a.tile_count_words = tile_count_words;
  a.offer_word = offer_word;
  a.active_ranks = address<const int32_t>(active_ranks);
  return a;
}

inline cuda::SendTailArgs sendTailArgs(uintptr_t payload, int64_t payload_bytes, uintptr_t scales, int64_t scale_bytes,
                                       uintptr_t topk_idx, uintptr_t weights, int num_tokens, int num_topk,
                                       int64_t head_bytes, int64_t ids_at, uintptr_t tail, int64_t tail_bytes) {
  cuda::SendTailArgs a;
  a.payload = address<const void>(payload);
  a.payload_bytes = payload_bytes;
  a.scales = address<const void>(scales);
  a.scale_bytes = scale_bytes;
  a.topk_idx = address<const int64_t>(topk_idx);
  a.weights = address<const float>(weights);
  a.num_tokens = num_tokens;
  a.num_topk = num_topk;
  a.head_bytes = head_bytes;
  a.ids_at = ids_at;
  a.tail = address<void>(tail);
  a.tail_bytes = tail_bytes;
  return a;
}

// layoutSend's work done in the same launch (SendLayoutArgs::tail, zeroed,
// topk_copy; each 0 for none): the tail's sources as sendTailArgs takes them.
inline void addSendExtras(cuda::SendLayoutArgs& a, uintptr_t payload, int64_t payload_bytes, uintptr_t scales,
                          int64_t scale_bytes, uintptr_t weights, int64_t head_bytes, int64_t ids_at, uintptr_t tail,
                          int64_t tail_bytes, uintptr_t zeroed, int64_t zeroed_words, uintptr_t topk_copy) {
  a.tail = sendTailArgs(payload, payload_bytes, scales, scale_bytes, 0, weights, a.num_tokens, a.num_topk, head_bytes,
                        ids_at, tail, tail_bytes);
  a.zeroed = address<int64_t>(zeroed);
  a.zeroed_words = zeroed_words;
  a.topk_copy = address<int64_t>(topk_copy);
}

inline cuda::ReceiveLayoutArgs receiveLayoutArgs(
    uintptr_t topk_idx, uintptr_t token_index, uintptr_t gathered, int64_t gathered_stride, uintptr_t gathered_ranges,
    int num_tokens, uintptr_t ranges, uintptr_t src_token, uintptr_t recv_tail, int64_t tail_bytes, int64_t ids_at,
    int64_t weights_at, int64_t capacity, int num_topk, int num_local, int num_ranks, int rank, int tokens_per_rank,
    uintptr_t slots, uintptr_t real, uintptr_t local, uintptr_t weights, uintptr_t metadata, uintptr_t per_expert,
    uintptr_t expert_psum, uintptr_t scaleup_psum, uintptr_t finished_blocks) {
  cuda::ReceiveLayoutArgs a;
  a.topk_idx = address<const int64_t>(topk_idx);
  a.token_index = address<const int32_t>(token_index);
  a.gathered = address<const int32_t>(gathered);
  a.gathered_stride = gathered_stride;
  a.gathered_ranges = address<const int64_t>(gathered_ranges);
  a.num_tokens = num_tokens;
  a.ranges = address<const int64_t>(ranges);
  a.src_token = address<const int32_t>(src_token);
  a.recv_tail = address<const void>(recv_tail);
  a.tail_bytes = tail_bytes;
  a.ids_at = ids_at;
  a.weights_at = weights_at;
  a.capacity = capacity;
  a.num_topk = num_topk;
  a.num_local = num_local;
  a.num_ranks = num_ranks;
  a.rank = rank;
  a.tokens_per_rank = tokens_per_rank;
  a.slots = address<int32_t>(slots);
  a.real = address<bool>(real);
  a.local = address<int64_t>(local);
  a.weights = address<float>(weights);
  a.metadata = address<int32_t>(metadata);
  a.per_expert = address<int64_t>(per_expert);
  a.expert_psum = address<int32_t>(expert_psum);
  a.scaleup_psum = address<int32_t>(scaleup_psum);
  a.finished_blocks = address<unsigned long long>(finished_blocks);
  return a;
}

}  // namespace mooncake::ep::python
