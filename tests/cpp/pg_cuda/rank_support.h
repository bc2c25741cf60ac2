// What the rank programs' scenarios share: device buffers, element types on
// the host, running an operation to completion, and checks that report.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "mooncake/pg/cuda/cuda_ipc_group.h"

namespace mooncake::pg::cuda::testing {

// Prints why on stderr and counts a failure; `g` is the group in scope.
#define RANK_CHECK(cond, ...)                                                              \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      std::fprintf(stderr, "rank %d: line %d: check failed: %s: ", g.rank(), __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                                   \
      std::fprintf(stderr, "\n");                                                          \
      ++failures;                                                                          \
    }                                                                                      \
  } while (0)

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) { cudaMalloc(&data_, bytes == 0 ? 16 : bytes); }
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  char* get() const { return static_cast<char*>(data_); }
  size_t bytes() const { return bytes_; }
  // Both complete before returning (ordered on `stream`, then synchronized).
  template <typename T>
  void upload(const std::vector<T>& host, cudaStream_t stream, size_t offset_bytes = 0) {
    cudaMemcpyAsync(get() + offset_bytes, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream);
    cudaStreamSynchronize(stream);
  }
  template <typename T>
  std::vector<T> download(size_t count, cudaStream_t stream, size_t offset_bytes = 0) const {
    std::vector<T> host(count);
    cudaMemcpyAsync(host.data(), get() + offset_bytes, count * sizeof(T), cudaMemcpyDeviceToHost, stream);
    cudaStreamSynchronize(stream);
    return host;
  }

 private:
  void* data_ = nullptr;
  size_t bytes_;
};

// Element types as the host makes and reads them (exact for the small
// integers the closed formulas produce).
template <typename T>
struct Host;
template <>
struct Host<int32_t> {
  static constexpr DataType kType = DataType::kInt32;
  static int32_t make(double v) { return static_cast<int32_t>(v); }
  static double read(int32_t v) { return v; }
};
template <>
struct Host<float> {
  static constexpr DataType kType = DataType::kFloat32;
  static float make(double v) { return static_cast<float>(v); }
  static double read(float v) { return v; }
};
template <>
struct Host<__half> {
  static constexpr DataType kType = DataType::kFloat16;
  static __half make(double v) { return __float2half(static_cast<float>(v)); }
  static double read(__half v) { return __half2float(v); }
};
template <>
struct Host<__nv_bfloat16> {
  static constexpr DataType kType = DataType::kBFloat16;
  static __nv_bfloat16 make(double v) { return __float2bfloat16(static_cast<float>(v)); }
  static double read(__nv_bfloat16 v) { return __bfloat162float(v); }
};

class Stream {
 public:
  Stream() { cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking); }
  ~Stream() { cudaStreamDestroy(stream_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  operator cudaStream_t() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// Waits for the operation on the host and says whether it succeeded.
inline OpResult complete(CudaIpcGroup& group, const CudaOp& op) {
  if (!op.result.ok) return op.result;
  return group.wait(op.id);
}

int everyCollectiveScenario(CudaIpcGroup& group);
int reductionsMatchCpuScenario(CudaIpcGroup& group);
int graphReplayScenario(CudaIpcGroup& group);
int deadRankScenario(CudaIpcGroup& group);
int stalledRankScenario(CudaIpcGroup& group);
int mismatchScenario(CudaIpcGroup& group);

}  // namespace mooncake::pg::cuda::testing
