// Row copies by one warp, 16 bytes per lane per access. A lane issues
// kInFlight loads before it stores any of them: a copy whose every load
// waited for the store before it (the compiler cannot reorder a load past a
// store that may alias it) ran at about 4 GB/s per thread block, one
// memory latency per 512 bytes, which bounded a dispatch whose rows go to
// few destinations (one block each): 16 ms for 8192 rows of 14.6 KB.
#pragma once

#include <cstddef>

namespace mooncake::ep::cuda {

constexpr int kCopyWarp = 32;
constexpr int kInFlight = 4;  // 16 registers: the kernels run 3 blocks of 512 threads per SM (42 registers a thread)

// Plain loads: from this rank's own memory (its inputs).
struct PlainLoad {
  __device__ __forceinline__ int4 operator()(const int4* p) const { return *p; }
};

// Out of the receive region, which peers write: cached in L2 only (the
// point of coherence for this GPU, where the peers' stores land), never in
// a possibly stale L1 line of an earlier call.
struct L2Load {
  __device__ __forceinline__ int4 operator()(const int4* p) const { return __ldcg(p); }
};

// Copies `bytes` (a multiple of 16; both pointers 16-byte aligned) with
// lane `lane` of the calling warp.
template <typename Load = PlainLoad>
__device__ __forceinline__ void warpCopy(void* dst, const void* src, size_t bytes, int lane, Load load = Load()) {
  int4* d = static_cast<int4*>(dst);
  const int4* s = static_cast<const int4*>(src);
  const size_t vectors = bytes / 16;
  constexpr size_t kStep = static_cast<size_t>(kCopyWarp) * kInFlight;
  size_t base = 0;
  for (; base + kStep <= vectors; base += kStep) {
    int4 v[kInFlight];
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) v[j] = load(s + base + j * kCopyWarp + lane);
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) d[base + j * kCopyWarp + lane] = v[j];
  }
  // The tail, under kStep vectors: the same, each access guarded.
  int4 v[kInFlight];
#pragma unroll
  for (int j = 0; j < kInFlight; ++j) {
    const size_t i = base + j * kCopyWarp + lane;
    if (i < vectors) v[j] = load(s + i);
  }
#pragma unroll
  for (int j = 0; j < kInFlight; ++j) {
    const size_t i = base + j * kCopyWarp + lane;
    if (i < vectors) d[i] = v[j];
  }
}

// Zeros `bytes` (a multiple of 16; 16-byte aligned) with lane `lane` of the calling warp.
__device__ __forceinline__ void warpZero(void* dst, size_t bytes, int lane) {
  int4* d = static_cast<int4*>(dst);
  for (size_t i = lane; i < bytes / 16; i += kCopyWarp) d[i] = make_int4(0, 0, 0, 0);
}

}  // namespace mooncake::ep::cuda
