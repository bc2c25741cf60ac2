// FP8 (e4m3) quantisation of one token, one warp, 128 channels per scale,
// with the collective path's arithmetic on CUDA (python/mooncake/
// _ep_collective/fp8.py run by torch's CUDA kernels), operation by operation,
// so that both paths give identical bytes and scales:
//   amax   = max(max |x| over the 128 channels, 1e-4f)
//   factor = (1 / amax) * 448     torch computes `448 / amax` as reciprocal(amax) * 448
//   data   = e4m3(clamp(x * factor, -448, 448)), round to nearest even
//   scale  = amax * (1 / 448)     torch's CUDA division by a scalar multiplies by its reciprocal
// Every step is an explicitly rounded intrinsic: no contraction into FMA and
// no approximate division, whatever the compiler flags.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "region_layout.h"

namespace mooncake::ep::cuda {

constexpr float kE4m3Max = 448.0f;
constexpr float kAmaxFloor = 1e-4f;

__device__ __forceinline__ uint8_t toE4m3(float v) {
  v = fminf(fmaxf(v, -kE4m3Max), kE4m3Max);
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// The whole warp calls it. src: bf16 [H]; data: e4m3 [H]; scales: float [H / 128].
__device__ __forceinline__ void quantizeTokenWarp(const __nv_bfloat16* src, uint8_t* data, float* scales, int hidden,
                                                  int lane) {
  for (int g = 0; g < hidden / kChannelsPerScale; ++g) {
    const int c = g * kChannelsPerScale + lane * 4;  // four channels per lane
    const uint2 raw = *reinterpret_cast<const uint2*>(src + c);
    const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
    const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
    const float v[4] = {__low2float(lo), __high2float(lo), __low2float(hi), __high2float(hi)};
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
    for (int offset = 16; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    amax = fmaxf(amax, kAmaxFloor);
    const float factor = __fmul_rn(__frcp_rn(amax), kE4m3Max);
    uint32_t packed = 0;
    for (int i = 0; i < 4; ++i) packed |= static_cast<uint32_t>(toE4m3(__fmul_rn(v[i], factor))) << (8 * i);
    *reinterpret_cast<uint32_t*>(data + c) = packed;
    if (lane == 0) scales[g] = __fmul_rn(amax, 1.0f / kE4m3Max);
  }
}

}  // namespace mooncake::ep::cuda
