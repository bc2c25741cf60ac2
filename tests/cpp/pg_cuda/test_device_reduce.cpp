// reduceOnDevice on integers whose sums and products overflow: the device
// fold wraps around (two's complement), as torch, Gloo and the CPU
// reduceInto do. The reference is computed here in uint64_t, whose
// arithmetic wraps by definition, and cut to the element's width. Without a
// GPU every test skips and says why; fold_wrapping_checks.cu checks the same
// arithmetic at compile time.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "common/gpu_test_support.h"
#include "mooncake/pg/cuda/device_reduce.h"

namespace mooncake::pg::cuda {
namespace {

constexpr int kSources = 4;
// 37 elements of 16-byte packs and a scalar tail for every width.
constexpr size_t kCount = 37;

template <typename T>
constexpr DataType dataTypeOf() {
  if constexpr (std::is_same_v<T, int8_t>)
    return DataType::kInt8;
  else if constexpr (std::is_same_v<T, uint8_t>)
    return DataType::kUInt8;
  else if constexpr (std::is_same_v<T, int16_t>)
    return DataType::kInt16;
  else if constexpr (std::is_same_v<T, uint16_t>)
    return DataType::kUInt16;
  else if constexpr (std::is_same_v<T, int32_t>)
    return DataType::kInt32;
  else if constexpr (std::is_same_v<T, uint32_t>)
    return DataType::kUInt32;
  else if constexpr (std::is_same_v<T, int64_t>)
    return DataType::kInt64;
  else {
    static_assert(std::is_same_v<T, uint64_t>, "an integer type of the DataType list");
    return DataType::kUInt64;
  }
}

// Source k, element i: values near the top of T's range (elements 0, 3, ...),
// near the bottom (1, 4, ...) or alternating between both (2, 5, ...), so that
// sums and products of the four sources overflow in either direction, and
// the partial sums of the alternating ones overflow on the way.
template <typename T>
T sourceValue(int k, size_t i) {
  const T step = static_cast<T>((i * 7 + static_cast<size_t>(k) * 3) % 5);
  const bool near_top = i % 3 == 2 ? k % 2 == 1 : i % 3 == 0;
  return near_top ? static_cast<T>(std::numeric_limits<T>::max() - step)
                  : static_cast<T>(std::numeric_limits<T>::lowest() + step);
}

template <typename T>
std::vector<T> expected(ReduceOp op) {
  std::vector<T> out(kCount);
  for (size_t i = 0; i < kCount; ++i) {
    uint64_t acc = static_cast<uint64_t>(sourceValue<T>(0, i));
    for (int k = 1; k < kSources; ++k) {
      const uint64_t v = static_cast<uint64_t>(sourceValue<T>(k, i));
      acc = op == ReduceOp::kProduct ? acc * v : acc + v;
    }
    T wrapped = static_cast<T>(acc);
    if (op == ReduceOp::kAvg) wrapped = static_cast<T>(wrapped / static_cast<T>(kSources));
    out[i] = wrapped;
  }
  return out;
}

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

template <typename T>
void expectWrapping(ReduceOp op) {
  SCOPED_TRACE(std::string(dataTypeName(dataTypeOf<T>())) + " " + reduceOpName(op));
  std::vector<void*> device_sources(kSources, nullptr);
  void* device_result = nullptr;
  CUDA_OK(cudaMalloc(&device_result, kCount * sizeof(T)));
  for (int k = 0; k < kSources; ++k) {
    std::vector<T> host(kCount);
    for (size_t i = 0; i < kCount; ++i) host[i] = sourceValue<T>(k, i);
    CUDA_OK(cudaMalloc(&device_sources[k], kCount * sizeof(T)));
    CUDA_OK(cudaMemcpy(device_sources[k], host.data(), kCount * sizeof(T), cudaMemcpyHostToDevice));
  }
  CUDA_OK(reduceOnDevice(device_result, device_sources.data(), kSources, kCount, dataTypeOf<T>(), op, nullptr));
  std::vector<T> result(kCount);
  CUDA_OK(cudaMemcpy(result.data(), device_result, kCount * sizeof(T), cudaMemcpyDeviceToHost));
  EXPECT_EQ(result, expected<T>(op));
  for (void* p : device_sources) cudaFree(p);
  cudaFree(device_result);
}

template <typename T>
void expectWrappingForEveryArithmeticOp() {
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kProduct}) expectWrapping<T>(op);
}

TEST(DeviceReduce, IntegerSumsAndProductsWrapAround) {
  REQUIRE_GPU();
  expectWrappingForEveryArithmeticOp<int8_t>();
  expectWrappingForEveryArithmeticOp<uint8_t>();
  expectWrappingForEveryArithmeticOp<int16_t>();
  expectWrappingForEveryArithmeticOp<uint16_t>();
  expectWrappingForEveryArithmeticOp<int32_t>();
  expectWrappingForEveryArithmeticOp<uint32_t>();
  expectWrappingForEveryArithmeticOp<int64_t>();
  expectWrappingForEveryArithmeticOp<uint64_t>();
}

}  // namespace
}  // namespace mooncake::pg::cuda
