// One step of every reduction, a op b, written once for the host fold
// (core/src/reduce.cpp, compiled by the host compiler) and the device fold
// (cuda/src/fold.cuh, compiled by nvcc), so that the two agree bit for bit:
//   - integers wrap around on overflow, as torch's and Gloo's reductions do.
//     A signed overflow is undefined behaviour in C++ and CUDA C++, and
//     int8/int16 (and their unsigned kin) are promoted to int before + and *,
//     so sums and products are computed in an unsigned type at least as wide
//     as int, whose overflow wraps; converting back keeps the low bits (two's
//     complement), which is the wrapped result;
//   - NaN propagates through MIN and MAX (torch's semantics), as a quiet NaN;
//   - bool is logic: SUM is OR, PRODUCT is AND.
// What surrounds the step stays with each fold: the accumulation type
// (fp16/bf16 in float32), the conversions, AVG's division at the end.
// constexpr, so that the integer cases can be checked at compile time, where
// a signed overflow is an error (tests/cpp/pg_cuda/fold_wrapping_checks.cu).
#pragma once

#include <limits>
#include <type_traits>

#include "mooncake/pg/types.h"

#if defined(__CUDACC__)
#define MOONCAKE_REDUCE_STEP __host__ __device__ __forceinline__ constexpr
#else
#define MOONCAKE_REDUCE_STEP inline constexpr
#endif

namespace mooncake::pg::reduce_step {

template <typename A>
using WrapType = std::conditional_t<(sizeof(A) <= sizeof(unsigned)), unsigned, unsigned long long>;

template <typename A>
MOONCAKE_REDUCE_STEP A quietNan() {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<A, double>)
    return __longlong_as_double(0x7ff8000000000000ll);
  else
    return __int_as_float(0x7fc00000);
#else
  return std::numeric_limits<A>::quiet_NaN();
#endif
}

template <typename A, ReduceOp Op>
MOONCAKE_REDUCE_STEP A combine(A a, A b) {
  if constexpr (Op == ReduceOp::kSum || Op == ReduceOp::kAvg) {
    if constexpr (std::is_same_v<A, bool>)
      return a || b;
    else if constexpr (std::is_integral_v<A>)
      return static_cast<A>(static_cast<WrapType<A>>(a) + static_cast<WrapType<A>>(b));
    else
      return static_cast<A>(a + b);
  } else if constexpr (Op == ReduceOp::kProduct) {
    if constexpr (std::is_same_v<A, bool>)
      return a && b;
    else if constexpr (std::is_integral_v<A>)
      return static_cast<A>(static_cast<WrapType<A>>(a) * static_cast<WrapType<A>>(b));
    else
      return static_cast<A>(a * b);
  } else if constexpr (Op == ReduceOp::kMin) {
    if constexpr (std::is_floating_point_v<A>) {
      if (a != a || b != b) return quietNan<A>();  // a != a: NaN, without <cmath> on the device
    }
    return b < a ? b : a;  // std::min
  } else if constexpr (Op == ReduceOp::kMax) {
    if constexpr (std::is_floating_point_v<A>) {
      if (a != a || b != b) return quietNan<A>();
    }
    return a < b ? b : a;  // std::max
  } else if constexpr (std::is_integral_v<A>) {
    if constexpr (Op == ReduceOp::kBand)
      return static_cast<A>(a & b);
    else if constexpr (Op == ReduceOp::kBor)
      return static_cast<A>(a | b);
    else
      return static_cast<A>(a ^ b);
  } else {
    return a;  // unreachable: bitwise operations on other types are refused before any fold
  }
}

}  // namespace mooncake::pg::reduce_step

#undef MOONCAKE_REDUCE_STEP
