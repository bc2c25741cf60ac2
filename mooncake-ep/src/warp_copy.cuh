// Row copies by one warp, 16 bytes per lane per access. A lane issues
// kInFlight loads before it stores any of them: a copy whose every load
// waited for the store before it (the compiler cannot reorder a load past a
// store that may alias it) ran at about 4 GB/s per thread block, one
// memory latency per 512 bytes, which bounded a dispatch whose rows go to
// few destinations (one block each): 16 ms for 8192 rows of 14.6 KB.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mooncake::ep::cuda {

constexpr int kCopyWarp = 32;
constexpr int kInFlight = 4;  // 16 registers of the kernels' cap (see their __launch_bounds__)

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
  // The lane is folded into the pointers once and the vectors are counted in
  // 32 bits (a row is far under 64 GiB): a 64-bit index per access took
  // registers that the kernels' bounds (40 a thread in combine, 64 in
  // dispatch) cannot spare, and most of their spills were in these loops.
  int4* d = static_cast<int4*>(dst) + lane;
  const int4* s = static_cast<const int4*>(src) + lane;
  constexpr uint32_t kStep = static_cast<uint32_t>(kCopyWarp) * kInFlight;
  uint32_t left = static_cast<uint32_t>(bytes / 16);  // vectors from the warp's next step on
  for (; left >= kStep; left -= kStep, s += kStep, d += kStep) {
    int4 v[kInFlight];
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) v[j] = load(s + j * kCopyWarp);
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) d[j * kCopyWarp] = v[j];
  }
  // The tail, under kStep vectors: the same, each access guarded.
  int4 v[kInFlight];
#pragma unroll
  for (int j = 0; j < kInFlight; ++j) {
    if (static_cast<uint32_t>(j * kCopyWarp + lane) < left) v[j] = load(s + j * kCopyWarp);
  }
#pragma unroll
  for (int j = 0; j < kInFlight; ++j) {
    if (static_cast<uint32_t>(j * kCopyWarp + lane) < left) d[j * kCopyWarp] = v[j];
  }
}

// Zeros `bytes` (a multiple of 16; 16-byte aligned) with lane `lane` of the calling warp.
__device__ __forceinline__ void warpZero(void* dst, size_t bytes, int lane) {
  int4* d = static_cast<int4*>(dst);
  const uint32_t vectors = static_cast<uint32_t>(bytes / 16);
  for (uint32_t i = lane; i < vectors; i += kCopyWarp) d[i] = make_int4(0, 0, 0, 0);
}

}  // namespace mooncake::ep::cuda
