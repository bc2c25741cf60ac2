#include "device_mask.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace mooncake::pg {

void copyMaskToDevice(const at::Tensor& host, const at::Tensor& device) {
  const c10::DeviceIndex index = device.device().index();
  c10::cuda::CUDAGuard guard(index);
  const c10::cuda::CUDAStream stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, index);
  c10::cuda::CUDAStreamGuard on_stream(stream);
  device.narrow(0, 0, host.numel()).copy_(host, /*non_blocking=*/true);
  stream.synchronize();
}

}  // namespace mooncake::pg
