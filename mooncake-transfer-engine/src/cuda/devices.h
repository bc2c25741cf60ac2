// The GPUs this process sees, and how to name one across processes: device
// ordinals depend on each process's CUDA_VISIBLE_DEVICES, UUIDs do not.
// Asked lazily (the first question initializes the CUDA runtime, no context),
// and answered from a table built once. Compiled only when MOONCAKE_WITH_CUDA.
#pragma once

#include <string>

namespace mooncake::te::cuda {

// GPUs usable by this process; 0 without a driver or device.
int deviceCount();
// The 16-byte UUID of local `device`, "" when there is no such device.
std::string deviceUuid(int device);
// The local ordinal of the GPU with `uuid`, -1 when this process cannot see it.
int deviceWithUuid(const std::string& uuid);
// The PCI address of local `device` ("0000:3b:00.0", as sysfs names it), ""
// when there is no such device.
std::string devicePciAddress(int device);

}  // namespace mooncake::te::cuda
