// Small helpers around CUDA runtime calls, header only: shared by the
// process group's CUDA plane and the host side of the EP kernels
// (mooncake-ep reaches this folder through MOONCAKE_PG_CUDA_PRIVATE_INCLUDE).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

namespace mooncake::pg::cuda {

// "call: message" for a failed runtime call. Clears the error, so that the
// next call does not report it again.
inline std::string cudaWhat(const char* call, cudaError_t err) {
  cudaGetLastError();
  return std::string(call) + ": " + cudaGetErrorString(err);
}

// Makes `device` current while in scope; the previous device is current
// again afterwards (nothing is switched when it already was `device`).
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&saved_) != cudaSuccess || saved_ == device) {
      saved_ = -1;
      return;
    }
    cudaSetDevice(device);
  }
  ~DeviceScope() {
    if (saved_ >= 0) cudaSetDevice(saved_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int saved_ = -1;
};

}  // namespace mooncake::pg::cuda
