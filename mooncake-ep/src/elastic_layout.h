// ElasticBuffer's IPC-path layout, per token and per received row
// (python/mooncake/_ep_elastic/rows_layout.py is the same rules in torch):
// the functions here are __host__ __device__ so that the kernels of
// elastic_layout.cu call them and the CPU tests check the same code against
// closed forms (tests/cpp/ep_cuda/test_elastic_layout.cpp).
#pragma once

#include <cuda_runtime_api.h>  // __host__ __device__ in host-only translation units

#include <climits>
#include <cstdint>
#include <string>

#include "mooncake/ep/cuda/elastic_layout.h"  // SendTailArgs

namespace mooncake::ep::cuda::layout {

// The destination rank of a pick (a global expert id), or -1: a -1 pick,
// and ids outside [0, L * R), which the IPC path counts as -1 (it reads no
// top-k value on the host, so bad ids cannot be refused there).
__host__ __device__ inline int destinationOf(int64_t id, int num_local, int num_ranks) {
  const int64_t experts = static_cast<int64_t>(num_local) * num_ranks;
  if (id < 0 || id >= experts) return -1;
  // A 32-bit division where the ids fit (always, in practice): a GPU divides 64-bit integers in software.
  if (experts <= INT32_MAX) return static_cast<int32_t>(id) / num_local;
  return static_cast<int>(id / num_local);
}

// The functions below take a token's picks as their destinations
// (destinationOf, -1 for none), one byte each: the send kernel stages a
// tile's destinations in shared memory, read in order from the picks.

// Bit d: the token has a pick on rank d (num_ranks <= 32).
__host__ __device__ inline uint32_t destinationMask(const int8_t* dests, int num_topk) {
  uint32_t mask = 0;
  for (int j = 0; j < num_topk; ++j) {
    if (dests[j] >= 0) mask |= 1u << dests[j];
  }
  return mask;
}

// The token's destinations sorted ascending, each rank once, the repeats -1
// where they sorted (rows_layout.unique_destinations): -1 for each pick
// without a destination, then per rank d ascending: d, and -1 for each
// further pick on d. The kernels send a row to each rank here once, and
// combine adds the returned rows in this order. Writes num_topk values.
__host__ __device__ inline void uniqueDestinations(const int8_t* dests, int num_topk, int64_t* out) {
  int at = 0;
  for (int j = 0; j < num_topk; ++j) {
    if (dests[j] < 0) out[at++] = -1;
  }
  uint32_t mask = destinationMask(dests, num_topk);
  for (int d = 0; mask != 0; ++d, mask >>= 1) {
    if ((mask & 1u) == 0) continue;
    bool first = true;
    for (int j = 0; j < num_topk; ++j) {
      if (dests[j] != d) continue;
      out[at++] = first ? d : -1;
      first = false;
    }
  }
}

// Where rank d (a destination of the token) stands in uniqueDestinations'
// output: after the picks without a destination and those on lower ranks.
__host__ __device__ inline int uniquePosition(const int8_t* dests, int num_topk, int d) {
  int before = 0;
  for (int j = 0; j < num_topk; ++j) before += dests[j] < d ? 1 : 0;
  return before;
}

// Where a row's bytes come from: the send tail of token t is bytes
// [head, head + tail_bytes) of its row (ipc_rows.RowFormat): the payload
// (only when it is not sent as the head), the scales, zeros up to `ids_at`,
// the top-k ids as int32, the weights as float32, zeros to the end.
struct TailSources {
  const uint8_t* payload = nullptr;   // [N, payload_bytes]
  const uint8_t* scales = nullptr;    // [N, scale_bytes], or null
  const int64_t* topk_idx = nullptr;  // [N, num_topk], or null (no ids sent)
  const uint8_t* weights = nullptr;   // float32 [N, num_topk] as bytes, or null (zeros sent)
  int64_t payload_bytes = 0, scale_bytes = 0, head_bytes = 0, tail_bytes = 0;
  int64_t ids_at = 0;  // the ids' offset in the row (RowFormat.ids); the weights follow them
  int num_topk = 0;
};

__host__ __device__ inline uint8_t tailByte(const TailSources& s, int64_t token, int64_t at) {
  const int64_t b = s.head_bytes + at;  // offset in the row
  if (b < s.payload_bytes) return s.payload[token * s.payload_bytes + b];
  if (b < s.payload_bytes + s.scale_bytes) return s.scales[token * s.scale_bytes + (b - s.payload_bytes)];
  const int64_t ids_end = s.ids_at + 4 * static_cast<int64_t>(s.num_topk);
  if (b >= s.ids_at && b < ids_end) {
    if (s.topk_idx == nullptr) return 0;
    const int64_t i = (b - s.ids_at) / 4;
    // int32 as torch's .to(torch.int32) makes it (the low 32 bits), little-endian bytes.
    const auto id = static_cast<uint32_t>(static_cast<uint64_t>(s.topk_idx[token * s.num_topk + i]));
    return static_cast<uint8_t>(id >> (8 * ((b - s.ids_at) % 4)));
  }
  if (b >= ids_end && b < ids_end + 4 * static_cast<int64_t>(s.num_topk)) {
    if (s.weights == nullptr) return 0;
    return s.weights[token * 4 * s.num_topk + (b - ids_end)];
  }
  return 0;
}

// The 4 bytes at `at` of `token`'s tail, as tailByte's little-endian: a
// whole id, weight or word of the zeros past them at once (the send tail's
// usual words, when the payload goes as the head), byte by byte elsewhere
// (the payload and scales, whose bounds need not fall on words). `weights`
// are float32, so their words are aligned.
__host__ __device__ inline uint32_t tailWord(const TailSources& s, int64_t token, int64_t at) {
  const int64_t b = s.head_bytes + at;  // offset in the row
  const int64_t ids_end = s.ids_at + 4 * static_cast<int64_t>(s.num_topk);
  const int64_t weights_end = ids_end + 4 * static_cast<int64_t>(s.num_topk);
  if (b >= s.ids_at && (b - s.ids_at) % 4 == 0 && b >= s.payload_bytes + s.scale_bytes) {
    if (b + 4 <= ids_end) {
      if (s.topk_idx == nullptr) return 0;
      return static_cast<uint32_t>(static_cast<uint64_t>(s.topk_idx[token * s.num_topk + (b - s.ids_at) / 4]));
    }
    if (b >= ids_end && b + 4 <= weights_end) {
      if (s.weights == nullptr) return 0;
      return *reinterpret_cast<const uint32_t*>(s.weights + token * 4 * s.num_topk + (b - ids_end));
    }
    if (b >= weights_end) return 0;
  }
  uint32_t word = 0;
  for (int i = 0; i < 4; ++i) word |= static_cast<uint32_t>(tailByte(s, token, at + i)) << (8 * i);
  return word;
}

// The sources of a staged tail as SendTailArgs names them.
__host__ __device__ inline TailSources tailSourcesOf(const SendTailArgs& a) {
  TailSources s;
  s.payload = static_cast<const uint8_t*>(a.payload);
  s.scales = static_cast<const uint8_t*>(a.scales);
  s.topk_idx = a.topk_idx;
  s.weights = reinterpret_cast<const uint8_t*>(a.weights);
  s.payload_bytes = a.payload_bytes;
  s.scale_bytes = a.scales != nullptr ? a.scale_bytes : 0;
  s.head_bytes = a.head_bytes;
  s.tail_bytes = a.tail_bytes;
  s.ids_at = a.ids_at;
  s.num_topk = a.num_topk;
  return s;
}

// The local expert of a received pick on rank `rank` (rows_layout.local_picks):
// the global id less rank * L when the id is on this rank and the row is real, else -1.
__host__ __device__ inline int64_t localPick(int32_t global_id, bool real, int rank, int num_local) {
  if (!real || global_id < 0 || global_id / num_local != rank) return -1;
  return static_cast<int64_t>(global_id) - static_cast<int64_t>(rank) * num_local;
}

// The source rank of received row `row` (rows_layout.received): how many
// sources end at or before it, the last source past the real rows. `ends`:
// the inclusive prefix sums of the received count per source.
__host__ __device__ inline int sourceOfRow(int64_t row, const int64_t* ends, int num_ranks) {
  int s = 0;
  while (s < num_ranks - 1 && ends[s] <= row) ++s;
  return s;
}

}  // namespace mooncake::ep::cuda::layout

namespace mooncake::ep::cuda {

// A staged tail's format (SendTailArgs) checked, or "" when it is fine:
// layoutSend's and sendTail's rules, and DispatchArgs::own_send's.
std::string tailFormatError(const SendTailArgs& a);

}  // namespace mooncake::ep::cuda
