// Reduction kernels. Elements are processed in blocks: each block of every
// source is folded into an accumulator array, so half-precision inputs are
// converted once per element and summed in fp32, and the loops are simple
// enough for the compiler to vectorize.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <type_traits>

#include "mooncake/pg/reduce_step.h"
#include "mooncake/pg/types.h"

namespace mooncake::pg {
namespace {

struct Half { uint16_t bits; };
struct BFloat16 { uint16_t bits; };

inline float toFloat(BFloat16 v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline BFloat16 fromFloatBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return BFloat16{static_cast<uint16_t>((u >> 16) | 0x40)};  // keep NaN quiet
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return BFloat16{static_cast<uint16_t>(u >> 16)};
}

inline float toFloat(Half v) {
  uint32_t sign = (v.bits & 0x8000u) << 16, exp = (v.bits >> 10) & 0x1f, mant = v.bits & 0x3ff, u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      u = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline Half fromFloatHalf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return Half{static_cast<uint16_t>(sign | 0x7e00u)};  // NaN
  if (abs >= 0x477ff000u) return Half{static_cast<uint16_t>(sign | 0x7c00u)};  // overflow -> inf
  if (abs < 0x38800000u) {  // subnormal or zero in half
    float magnitude;
    std::memcpy(&magnitude, &abs, 4);
    // Scale so that the half subnormal unit is 1, and round to nearest even.
    float scaled = magnitude * 16777216.0f;  // 2^24
    uint32_t m = static_cast<uint32_t>(std::nearbyint(scaled));
    return Half{static_cast<uint16_t>(sign | m)};
  }
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);  // round to nearest even at bit 13
  uint32_t h = ((rounded >> 13) - ((127 - 15) << 10));
  return Half{static_cast<uint16_t>(sign | h)};
}

template <typename T> struct Accum { using type = T; static T load(T v) { return v; } static T store(T v) { return v; } };
template <> struct Accum<Half> {
  using type = float;
  static float load(Half v) { return toFloat(v); }
  static Half store(float v) { return fromFloatHalf(v); }
};
template <> struct Accum<BFloat16> {
  using type = float;
  static float load(BFloat16 v) { return toFloat(v); }
  static BFloat16 store(float v) { return fromFloatBf16(v); }
};

using reduce_step::combine;  // the step, shared with the device fold

template <typename T, ReduceOp Op>
void reduceTyped(void* dst_raw, const void* const* srcs_raw, int nsrc, size_t count) {
  using A = typename Accum<T>::type;
  constexpr size_t kBlock = 512;
  A acc[kBlock];
  auto* dst = static_cast<T*>(dst_raw);
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t n = std::min(kBlock, count - base);
    const T* s0 = static_cast<const T*>(srcs_raw[0]) + base;
    for (size_t i = 0; i < n; ++i) acc[i] = Accum<T>::load(s0[i]);
    for (int k = 1; k < nsrc; ++k) {
      const T* s = static_cast<const T*>(srcs_raw[k]) + base;
      for (size_t i = 0; i < n; ++i) acc[i] = combine<A, Op>(acc[i], Accum<T>::load(s[i]));
    }
    if constexpr (Op == ReduceOp::kAvg && !std::is_same_v<A, bool>) {
      for (size_t i = 0; i < n; ++i) acc[i] = static_cast<A>(acc[i] / static_cast<A>(nsrc));
    }
    for (size_t i = 0; i < n; ++i) dst[base + i] = Accum<T>::store(acc[i]);
  }
}

template <typename T>
void reduceWithOp(void* dst, const void* const* srcs, int nsrc, size_t count, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return reduceTyped<T, ReduceOp::kSum>(dst, srcs, nsrc, count);
    case ReduceOp::kAvg: return reduceTyped<T, ReduceOp::kAvg>(dst, srcs, nsrc, count);
    case ReduceOp::kProduct: return reduceTyped<T, ReduceOp::kProduct>(dst, srcs, nsrc, count);
    case ReduceOp::kMin: return reduceTyped<T, ReduceOp::kMin>(dst, srcs, nsrc, count);
    case ReduceOp::kMax: return reduceTyped<T, ReduceOp::kMax>(dst, srcs, nsrc, count);
    case ReduceOp::kBand: return reduceTyped<T, ReduceOp::kBand>(dst, srcs, nsrc, count);
    case ReduceOp::kBor: return reduceTyped<T, ReduceOp::kBor>(dst, srcs, nsrc, count);
    case ReduceOp::kBxor: return reduceTyped<T, ReduceOp::kBxor>(dst, srcs, nsrc, count);
  }
}

// Calls f(T{}) with the C++ type of `type`; false for the types that are
// moved but never reduced (fp8).
template <typename F>
bool visitReducible(DataType type, F&& f) {
  switch (type) {
    case DataType::kInt8: f(int8_t{}); return true;
    case DataType::kUInt8: f(uint8_t{}); return true;
    case DataType::kInt16: f(int16_t{}); return true;
    case DataType::kUInt16: f(uint16_t{}); return true;
    case DataType::kInt32: f(int32_t{}); return true;
    case DataType::kUInt32: f(uint32_t{}); return true;
    case DataType::kInt64: f(int64_t{}); return true;
    case DataType::kUInt64: f(uint64_t{}); return true;
    case DataType::kFloat16: f(Half{}); return true;
    case DataType::kBFloat16: f(BFloat16{}); return true;
    case DataType::kFloat32: f(float{}); return true;
    case DataType::kFloat64: f(double{}); return true;
    case DataType::kBool: f(bool{}); return true;
    default: return false;
  }
}

bool isFloating(DataType t) {
  return t == DataType::kFloat16 || t == DataType::kBFloat16 || t == DataType::kFloat32 || t == DataType::kFloat64;
}

}  // namespace

size_t elementSize(DataType type) {
  switch (type) {
    case DataType::kInt8: case DataType::kUInt8: case DataType::kBool:
    case DataType::kFloat8E4M3: case DataType::kFloat8E5M2: return 1;
    case DataType::kInt16: case DataType::kUInt16: case DataType::kFloat16: case DataType::kBFloat16: return 2;
    case DataType::kInt32: case DataType::kUInt32: case DataType::kFloat32: return 4;
    case DataType::kInt64: case DataType::kUInt64: case DataType::kFloat64: return 8;
  }
  return 0;
}

const char* dataTypeName(DataType type) {
  static const char* names[] = {"int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                                "float16", "bfloat16", "float32", "float64", "bool", "float8_e4m3fn", "float8_e5m2"};
  return names[static_cast<int>(type)];
}

const char* reduceOpName(ReduceOp op) {
  static const char* names[] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"};
  return names[static_cast<int>(op)];
}

std::string reductionUnsupportedReason(DataType type, ReduceOp op) {
  if (type == DataType::kFloat8E4M3 || type == DataType::kFloat8E5M2) {
    return std::string("reductions on ") + dataTypeName(type) + " are not supported (it can be moved, not reduced)";
  }
  bool bitwise = op == ReduceOp::kBand || op == ReduceOp::kBor || op == ReduceOp::kBxor;
  if (bitwise && isFloating(type)) {
    return std::string(reduceOpName(op)) + " needs an integer or bool dtype, got " + dataTypeName(type);
  }
  if (op == ReduceOp::kAvg && type == DataType::kBool) return "AVG is not defined for bool";
  return {};
}

void reduceInto(void* dst, const void* const* srcs, int nsrc, size_t count, DataType type, ReduceOp op) {
  bool known = visitReducible(type, [&](auto tag) { reduceWithOp<decltype(tag)>(dst, srcs, nsrc, count, op); });
  if (!known) throw std::invalid_argument(reductionUnsupportedReason(type, op));
}

void divideBy(void* data, size_t count, DataType type, int divisor) {
  bool known = visitReducible(type, [&](auto tag) {
    using T = decltype(tag);
    using A = typename Accum<T>::type;
    if constexpr (!std::is_same_v<A, bool>) {
      auto* p = static_cast<T*>(data);
      for (size_t i = 0; i < count; ++i) p[i] = Accum<T>::store(static_cast<A>(Accum<T>::load(p[i]) / static_cast<A>(divisor)));
    }
  });
  if (!known || type == DataType::kBool) throw std::invalid_argument(reductionUnsupportedReason(type, ReduceOp::kAvg));
}

}  // namespace mooncake::pg
