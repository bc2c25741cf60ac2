// Compile-time checks that the device fold (fold.cuh) wraps integer sums and
// products around, as torch, Gloo and the CPU reduceInto do. In a constant
// expression an overflow of signed arithmetic is an error rather than silent
// undefined behaviour, so a fold that added or multiplied in the element's
// own (or promoted) signed type would stop this file from compiling; no GPU
// is needed. test_device_reduce.cpp runs the same cases on a GPU.
#include <cstdint>
#include <limits>

#include "fold.cuh"

namespace mooncake::pg::cuda {
namespace {

template <typename T>
constexpr T lowest = std::numeric_limits<T>::lowest();
template <typename T>
constexpr T highest = std::numeric_limits<T>::max();

template <typename T>
__device__ constexpr T sum(T a, T b) {
  return fold::combine<T, ReduceOp::kSum>(a, b);
}
template <typename T>
__device__ constexpr T product(T a, T b) {
  return fold::combine<T, ReduceOp::kProduct>(a, b);
}

// Never called: static_assert inside a device function is checked by the
// device pass, where fold::combine (a __device__ function) may be evaluated.
[[maybe_unused]] __device__ void wrappingChecks() {
  // Sums past the top come back from the bottom, and the other way round.
  static_assert(sum<int32_t>(highest<int32_t>, 1) == lowest<int32_t>, "int32 SUM wraps");
  static_assert(sum<int32_t>(lowest<int32_t>, -1) == highest<int32_t>, "int32 SUM wraps below");
  static_assert(sum<int64_t>(highest<int64_t>, 1) == lowest<int64_t>, "int64 SUM wraps");
  static_assert(sum<int64_t>(lowest<int64_t>, lowest<int64_t>) == 0, "int64 SUM wraps below");
  static_assert(sum<int8_t>(highest<int8_t>, 1) == lowest<int8_t>, "int8 SUM wraps");
  static_assert(sum<int16_t>(highest<int16_t>, 1) == lowest<int16_t>, "int16 SUM wraps");
  static_assert(sum<uint32_t>(highest<uint32_t>, 2) == 1, "uint32 SUM wraps");
  static_assert(sum<uint64_t>(highest<uint64_t>, 2) == 1, "uint64 SUM wraps");
  // AVG folds with SUM before dividing once: the sum wraps the same way.
  static_assert(fold::combine<int32_t, ReduceOp::kAvg>(highest<int32_t>, highest<int32_t>) == -2,
                "int32 AVG's sum wraps");

  // Products keep the low bits: 2**31 * 2 is 0 in 32 bits, 65535**2 in 16.
  static_assert(product<int32_t>(1 << 30, 4) == 0, "int32 PRODUCT wraps");
  static_assert(product<int32_t>(highest<int32_t>, highest<int32_t>) == 1, "int32 PRODUCT wraps");
  static_assert(product<int64_t>(int64_t{1} << 62, 4) == 0, "int64 PRODUCT wraps");
  static_assert(product<int64_t>(lowest<int64_t>, -1) == lowest<int64_t>, "int64 PRODUCT wraps");
  static_assert(product<uint32_t>(highest<uint32_t>, highest<uint32_t>) == 1, "uint32 PRODUCT wraps");
  // uint16 is promoted to (signed) int before *: 65535 * 65535 overflows int.
  static_assert(product<uint16_t>(highest<uint16_t>, highest<uint16_t>) == 1, "uint16 PRODUCT wraps");
  static_assert(product<int16_t>(lowest<int16_t>, -1) == lowest<int16_t>, "int16 PRODUCT wraps");
  static_assert(product<int8_t>(lowest<int8_t>, -1) == lowest<int8_t>, "int8 PRODUCT wraps");
}

}  // namespace
}  // namespace mooncake::pg::cuda
