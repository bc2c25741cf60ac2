// Reduction kernels: dst[d][i] = op over k of srcs[k][i], with the semantics
// of the CPU reduceInto (reduce.cpp): accumulate in the element's type except
// fp16/bf16 (fp32, rounded once), NaN propagating through MIN/MAX, bool as
// logic, AVG dividing once at the end. The sources are folded in index order,
// so the direct and the two-shot schedules give identical bits.
//
// Each thread handles 16 bytes of every source per step when every pointer is
// 16-byte aligned (one vector load per source), grid-stride, with a scalar
// loop for the tail and for misaligned buffers.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>

#include "kernel_launch.h"
#include "mooncake/pg/cuda/device_reduce.h"
#include "op_guard.cuh"

namespace mooncake::pg::cuda {
namespace {

constexpr int kThreads = 512;

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

template <typename A>
__device__ __forceinline__ A quietNan() {
  if constexpr (std::is_same_v<A, double>) return __longlong_as_double(0x7ff8000000000000ll);
  else return __int_as_float(0x7fc00000);
}

// One step of the fold, exactly as reduce.cpp's combine().
template <typename A, ReduceOp Op>
__device__ __forceinline__ A combine(A a, A b) {
  if constexpr (Op == ReduceOp::kSum || Op == ReduceOp::kAvg) {
    if constexpr (std::is_same_v<A, bool>) return a || b;
    else return static_cast<A>(a + b);
  } else if constexpr (Op == ReduceOp::kProduct) {
    if constexpr (std::is_same_v<A, bool>) return a && b;
    else return static_cast<A>(a * b);
  } else if constexpr (Op == ReduceOp::kMin) {
    if constexpr (std::is_floating_point_v<A>) {
      if (a != a || b != b) return quietNan<A>();
    }
    return b < a ? b : a;  // std::min
  } else if constexpr (Op == ReduceOp::kMax) {
    if constexpr (std::is_floating_point_v<A>) {
      if (a != a || b != b) return quietNan<A>();
    }
    return a < b ? b : a;  // std::max
  } else if constexpr (Op == ReduceOp::kBand) {
    return static_cast<A>(a & b);
  } else if constexpr (Op == ReduceOp::kBor) {
    return static_cast<A>(a | b);
  } else {
    return static_cast<A>(a ^ b);
  }
}

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

template <typename T, ReduceOp Op>
__global__ void __launch_bounds__(kThreads) reduceKernel(ReduceJob job, OpGuard guard, bool vectorized) {
  if (!guardAllows(guard)) return;
  using L = Lane<T>;
  using A = typename L::Acc;
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
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

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <typename T, ReduceOp Op>
cudaError_t launchTypedOp(const ReduceJob& job, const OpGuard& guard, int sm_count, cudaStream_t stream) {
  bool vectorized = true;
  for (int k = 0; k < job.nsrc; ++k) vectorized = vectorized && aligned16(job.srcs[k]);
  for (int d = 0; d < job.ndst; ++d) vectorized = vectorized && aligned16(job.dsts[d]);
  const size_t items = vectorized ? (job.count + Pack<T>::kCount - 1) / Pack<T>::kCount : job.count;
  // No more blocks than the device keeps resident: the kernels of the small
  // types need more than 32 registers, so fewer than 4 blocks fit per SM,
  // and a second partial wave would only add a tail.
  static const int per_sm = [] {
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, reduceKernel<T, Op>, kThreads, 0) != cudaSuccess || n < 1) {
      cudaGetLastError();
      n = 1;
    }
    return n;
  }();
  const size_t wanted = (items + kThreads - 1) / kThreads;
  const size_t room = static_cast<size_t>(std::max(1, sm_count)) * per_sm;
  const unsigned blocks = static_cast<unsigned>(std::max<size_t>(1, std::min(wanted, room)));
  reduceKernel<T, Op><<<blocks, kThreads, 0, stream>>>(job, guard, vectorized);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launchTyped(const ReduceJob& job, const OpGuard& guard, int sm_count, cudaStream_t stream) {
  constexpr bool kBitwise = std::is_integral_v<T> || std::is_same_v<T, BoolByte>;
  switch (job.op) {
    case ReduceOp::kSum: return launchTypedOp<T, ReduceOp::kSum>(job, guard, sm_count, stream);
    case ReduceOp::kAvg:
      if constexpr (!std::is_same_v<T, BoolByte>) return launchTypedOp<T, ReduceOp::kAvg>(job, guard, sm_count, stream);
      break;
    case ReduceOp::kProduct: return launchTypedOp<T, ReduceOp::kProduct>(job, guard, sm_count, stream);
    case ReduceOp::kMin: return launchTypedOp<T, ReduceOp::kMin>(job, guard, sm_count, stream);
    case ReduceOp::kMax: return launchTypedOp<T, ReduceOp::kMax>(job, guard, sm_count, stream);
    case ReduceOp::kBand:
      if constexpr (kBitwise) return launchTypedOp<T, ReduceOp::kBand>(job, guard, sm_count, stream);
      break;
    case ReduceOp::kBor:
      if constexpr (kBitwise) return launchTypedOp<T, ReduceOp::kBor>(job, guard, sm_count, stream);
      break;
    case ReduceOp::kBxor:
      if constexpr (kBitwise) return launchTypedOp<T, ReduceOp::kBxor>(job, guard, sm_count, stream);
      break;
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launchReduce(const ReduceJob& job, const OpGuard& guard, int sm_count, cudaStream_t stream) {
  if (job.count == 0 || job.ndst == 0) return cudaSuccess;
  if (job.nsrc < 1 || job.nsrc > kMaxLocalRanks || job.ndst > kMaxReduceDestinations) return cudaErrorInvalidValue;
  switch (job.type) {
    case DataType::kInt8: return launchTyped<int8_t>(job, guard, sm_count, stream);
    case DataType::kUInt8: return launchTyped<uint8_t>(job, guard, sm_count, stream);
    case DataType::kInt16: return launchTyped<int16_t>(job, guard, sm_count, stream);
    case DataType::kUInt16: return launchTyped<uint16_t>(job, guard, sm_count, stream);
    case DataType::kInt32: return launchTyped<int32_t>(job, guard, sm_count, stream);
    case DataType::kUInt32: return launchTyped<uint32_t>(job, guard, sm_count, stream);
    case DataType::kInt64: return launchTyped<int64_t>(job, guard, sm_count, stream);
    case DataType::kUInt64: return launchTyped<uint64_t>(job, guard, sm_count, stream);
    case DataType::kFloat16: return launchTyped<__half>(job, guard, sm_count, stream);
    case DataType::kBFloat16: return launchTyped<__nv_bfloat16>(job, guard, sm_count, stream);
    case DataType::kFloat32: return launchTyped<float>(job, guard, sm_count, stream);
    case DataType::kFloat64: return launchTyped<double>(job, guard, sm_count, stream);
    case DataType::kBool: return launchTyped<BoolByte>(job, guard, sm_count, stream);
    default: return cudaErrorInvalidValue;  // fp8: moved, never reduced
  }
}

cudaError_t reduceOnDevice(void* dst, const void* const* srcs, int nsrc, size_t count, DataType type, ReduceOp op,
                           cudaStream_t stream) {
  if (nsrc < 1 || nsrc > kMaxLocalRanks || !reductionUnsupportedReason(type, op).empty()) return cudaErrorInvalidValue;
  ReduceJob job;
  for (int k = 0; k < nsrc; ++k) job.srcs[k] = srcs[k];
  job.nsrc = nsrc;
  job.dsts[0] = dst;
  job.ndst = 1;
  job.count = count;
  job.type = type;
  job.op = op;
  int device = 0, sm_count = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  return launchReduce(job, OpGuard{}, sm_count, stream);
}

}  // namespace mooncake::pg::cuda
