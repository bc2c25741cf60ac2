// Element-wise reductions of device buffers, with the semantics of the CPU
// reduceInto (mooncake/pg/types.h): every DataType but fp8, every ReduceOp
// (bitwise ones on integers and bool only), fp16/bf16 accumulated in fp32 and
// rounded once, integers wrapping and AVG truncating toward zero, NaN
// propagating through MIN/MAX, bool SUM = OR and PRODUCT = AND.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "mooncake/pg/types.h"

namespace mooncake::pg::cuda {

// dst[i] = op over k < nsrc of srcs[k][i], for i < count, enqueued on
// `stream`. dst may be one of the sources. 1 <= nsrc <= 32. Returns
// cudaErrorInvalidValue for a combination reductionUnsupportedReason rejects.
cudaError_t reduceOnDevice(void* dst, const void* const* srcs, int nsrc, size_t count, DataType type, ReduceOp op,
                           cudaStream_t stream);

}  // namespace mooncake::pg::cuda
