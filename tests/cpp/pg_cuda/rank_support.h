// What the CudaIpcGroup rank programs' scenarios share: element types on the
// host and running an operation to completion; device buffers, streams and
// RANK_CHECK come from tests/cpp/common (the EP rank programs use them too).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/cuda_rank_helpers.h"
#include "mooncake/pg/cuda/cuda_ipc_group.h"

namespace mooncake::pg::cuda::testing {

using ::mooncake::testing::DeviceBuffer;
using ::mooncake::testing::Stream;

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
