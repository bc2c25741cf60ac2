// The fold at the heart of every reduction: dst[d][i] = op over k of
// srcs[k][i], with the semantics of the CPU reduceInto (reduce.cpp):
// accumulate in the element's type except fp16/bf16 (fp32, rounded once), NaN
// propagating through MIN/MAX, bool as logic, AVG dividing once at the end.
// The sources are folded in index order, so every schedule that lists them in
// rank order gives identical bits. Shared by the reduce kernel and the fused
// small all_reduce (reduce_kernels.cu, fused_kernels.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <type_traits>
#include <utility>

#include "kernel_args.h"
#include "mooncake/pg/reduce_step.h"

namespace mooncake::pg::cuda {
namespace fold {

// bool travels as one byte; any non-zero byte is true.
struct BoolByte {
  uint8_t bits;
};

// How an element is stored (T) and accumulated (Acc).
template <typename T>
struct Lane {
  using Acc = T;
  static __device__ __forceinline__ T load(T v) { return v; }
  static __device__ __forceinline__ T store(T a) { return a; }
};
template <>
struct Lane<__half> {
  using Acc = float;
  static __device__ __forceinline__ float load(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half store(float a) { return __float2half_rn(a); }  // nearest even
};
template <>
struct Lane<__nv_bfloat16> {
  using Acc = float;
  static __device__ __forceinline__ float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 store(float a) { return __float2bfloat16_rn(a); }
};
template <>
struct Lane<BoolByte> {
  using Acc = bool;
  static __device__ __forceinline__ bool load(BoolByte v) { return v.bits != 0; }
  static __device__ __forceinline__ BoolByte store(bool a) { return BoolByte{static_cast<uint8_t>(a ? 1 : 0)}; }
};

using reduce_step::combine;  // one step of the fold, exactly as reduce.cpp's (reduce_step.h)

template <typename A, ReduceOp Op>
__device__ __forceinline__ A finish(A acc, int nsrc) {
  if constexpr (Op == ReduceOp::kAvg && !std::is_same_v<A, bool>) return static_cast<A>(acc / static_cast<A>(nsrc));
  else return acc;
}

template <typename T>
struct alignas(16) Pack {
  static constexpr int kCount = 16 / sizeof(T);
  T v[kCount];
};

// Elements [first, count) of `job` with step `stride`: 16 bytes of every
// source per step when `vectorized` (every pointer 16-byte aligned), then a
// scalar loop for the tail (or everything, when not vectorized).
template <typename T, ReduceOp Op>
__device__ __forceinline__ void foldRange(const ReduceJob& job, size_t first, size_t stride, bool vectorized) {
  using L = Lane<T>;
  using A = typename L::Acc;
  size_t vector_elements = 0;
  if (vectorized) {
    constexpr int V = Pack<T>::kCount;
    const size_t packs = job.count / V;
    for (size_t p = first; p < packs; p += stride) {
      const Pack<T> in = static_cast<const Pack<T>*>(job.srcs[0])[p];
      A acc[V];
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] = L::load(in.v[j]);
#pragma unroll 4
      for (int k = 1; k < job.nsrc; ++k) {
        const Pack<T> next = static_cast<const Pack<T>*>(job.srcs[k])[p];
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = combine<A, Op>(acc[j], L::load(next.v[j]));
      }
      Pack<T> out;
#pragma unroll
      for (int j = 0; j < V; ++j) out.v[j] = L::store(finish<A, Op>(acc[j], job.nsrc));
      for (int d = 0; d < job.ndst; ++d) static_cast<Pack<T>*>(job.dsts[d])[p] = out;
    }
    vector_elements = packs * V;
  }
  for (size_t i = vector_elements + first; i < job.count; i += stride) {
    A acc = L::load(static_cast<const T*>(job.srcs[0])[i]);
    for (int k = 1; k < job.nsrc; ++k) acc = combine<A, Op>(acc, L::load(static_cast<const T*>(job.srcs[k])[i]));
    const T out = L::store(finish<A, Op>(acc, job.nsrc));
    for (int d = 0; d < job.ndst; ++d) static_cast<T*>(job.dsts[d])[i] = out;
  }
}

// Calls f(T{}, std::integral_constant<ReduceOp, Op>{}) with the element type
// and the operation of (type, op); cudaErrorInvalidValue for a combination no
// kernel exists for (fp8 is moved, never reduced; bitwise ops need integers;
// AVG of bool).
template <typename F>
cudaError_t withReduction(DataType type, ReduceOp op, F&& f) {
  auto byOp = [&](auto element) -> cudaError_t {
    using T = decltype(element);
    constexpr bool kBitwise = std::is_integral_v<T> || std::is_same_v<T, BoolByte>;
    switch (op) {
      case ReduceOp::kSum: return f(T{}, std::integral_constant<ReduceOp, ReduceOp::kSum>{});
      case ReduceOp::kAvg:
        if constexpr (!std::is_same_v<T, BoolByte>) return f(T{}, std::integral_constant<ReduceOp, ReduceOp::kAvg>{});
        break;
      case ReduceOp::kProduct: return f(T{}, std::integral_constant<ReduceOp, ReduceOp::kProduct>{});
      case ReduceOp::kMin: return f(T{}, std::integral_constant<ReduceOp, ReduceOp::kMin>{});
      case ReduceOp::kMax: return f(T{}, std::integral_constant<ReduceOp, ReduceOp::kMax>{});
      case ReduceOp::kBand:
        if constexpr (kBitwise) return f(T{}, std::integral_constant<ReduceOp, ReduceOp::kBand>{});
        break;
      case ReduceOp::kBor:
        if constexpr (kBitwise) return f(T{}, std::integral_constant<ReduceOp, ReduceOp::kBor>{});
        break;
      case ReduceOp::kBxor:
        if constexpr (kBitwise) return f(T{}, std::integral_constant<ReduceOp, ReduceOp::kBxor>{});
        break;
    }
    return cudaErrorInvalidValue;
  };
  switch (type) {
    case DataType::kInt8: return byOp(int8_t{});
    case DataType::kUInt8: return byOp(uint8_t{});
    case DataType::kInt16: return byOp(int16_t{});
    case DataType::kUInt16: return byOp(uint16_t{});
    case DataType::kInt32: return byOp(int32_t{});
    case DataType::kUInt32: return byOp(uint32_t{});
    case DataType::kInt64: return byOp(int64_t{});
    case DataType::kUInt64: return byOp(uint64_t{});
    case DataType::kFloat16: return byOp(__half{});
    case DataType::kBFloat16: return byOp(__nv_bfloat16{});
    case DataType::kFloat32: return byOp(float{});
    case DataType::kFloat64: return byOp(double{});
    case DataType::kBool: return byOp(BoolByte{});
    default: return cudaErrorInvalidValue;
  }
}

// True when every source and destination of `job` is 16-byte aligned.
inline bool vectorizable(const ReduceJob& job) {
  auto aligned16 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  for (int k = 0; k < job.nsrc; ++k) {
    if (!aligned16(job.srcs[k])) return false;
  }
  for (int d = 0; d < job.ndst; ++d) {
    if (!aligned16(job.dsts[d])) return false;
  }
  return true;
}

}  // namespace fold
}  // namespace mooncake::pg::cuda
