// Host entry points of the kernels (defined in the .cu files), so that the
// group's schedules stay plain C++.
#pragma once

#include <cuda_runtime_api.h>

#include "kernel_args.h"

namespace mooncake::pg::cuda {

// Grid sizes are chosen from the job and the device's multiprocessor count.
cudaError_t launchCopy(const CopyJob& job, const OpGuard& guard, int sm_count, cudaStream_t stream);
cudaError_t launchReduce(const ReduceJob& job, const OpGuard& guard, int sm_count, cudaStream_t stream);
cudaError_t launchBarrierKernel(const BarrierKernelArgs& args, cudaStream_t stream);
// One block; cudaErrorInvalidValue for a reduction no kernel exists for.
cudaError_t launchFusedDirect(const FusedDirectArgs& args, cudaStream_t stream);
// *word = value after all prior work of the stream (release, system scope).
cudaError_t launchMarkKernel(uint32_t* word, uint32_t value, cudaStream_t stream);
// If the group is broken (*broken_by >= 0, host-mapped): reports kDeviceAborted
// and sets *abort_word (device memory), for the kernels after it to skip.
cudaError_t launchGateKernel(const int32_t* broken_by, uint32_t* abort_word, DeviceReport* report, uint32_t op_id,
                             cudaStream_t stream);

}  // namespace mooncake::pg::cuda
