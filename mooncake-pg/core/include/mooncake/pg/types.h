// Element types and reduction operators of the torch-free PG core, and the
// reduction kernel every collective uses.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace mooncake::pg {

enum class DataType : uint8_t {
  kInt8, kUInt8, kInt16, kUInt16, kInt32, kUInt32, kInt64, kUInt64,
  kFloat16, kBFloat16, kFloat32, kFloat64, kBool,
  kFloat8E4M3, kFloat8E5M2,  // moved, never reduced
};

enum class ReduceOp : uint8_t { kSum, kAvg, kProduct, kMin, kMax, kBand, kBor, kBxor };

size_t elementSize(DataType type);
const char* dataTypeName(DataType type);
const char* reduceOpName(ReduceOp op);

// Empty when `op` can reduce `type`, else why not (for the error message).
std::string reductionUnsupportedReason(DataType type, ReduceOp op);

// dst[i] = op over k of srcs[k][i], for i < count. dst may be any of the
// sources (each element is read from every source before it is written).
// fp16 and bf16 accumulate in fp32 and are rounded once. AVG divides the sum
// by `nsrc` (integers truncate toward zero, as NCCL does).
void reduceInto(void* dst, const void* const* srcs, int nsrc, size_t count, DataType type, ReduceOp op);

// data[i] /= divisor, the last step of an AVG whose sum was taken in parts
// (across hosts): floating types in their accumulation type, integers
// truncating toward zero like reduceInto's AVG.
void divideBy(void* data, size_t count, DataType type, int divisor);

}  // namespace mooncake::pg
