// Host memory that kernels read and write in place: pinned and mapped into
// the device's address space, portable to every context of the process. The
// control blocks live in such memory because a plain CPU store (a watchdog's)
// reaches a spinning kernel with no CUDA call in between.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

namespace mooncake::pg::cuda {

class HostMapping {
 public:
  HostMapping() = default;
  ~HostMapping() {
    if (host_ != nullptr) cudaHostUnregister(host_);
  }
  HostMapping(const HostMapping&) = delete;
  HostMapping& operator=(const HostMapping&) = delete;

  // Registers [host, host + bytes) (cudaHostRegisterMapped | Portable) and
  // learns its device address. "" or what failed; `what` names the memory in
  // the message. Unregistered on destruction, also after a failed lookup.
  std::string map(void* host, size_t bytes, const std::string& what) {
    cudaError_t err = cudaHostRegister(host, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
    if (err != cudaSuccess) return "cudaHostRegister of " + what + ": " + cudaGetErrorString(err);
    host_ = static_cast<char*>(host);
    void* device = nullptr;
    if ((err = cudaHostGetDevicePointer(&device, host, 0)) != cudaSuccess) {
      return std::string("cudaHostGetDevicePointer: ") + cudaGetErrorString(err);
    }
    device_ = static_cast<char*>(device);
    return {};
  }

  // The address the GPU uses for a word of the mapped memory.
  template <typename T>
  T* device(T* host_word) const {
    return reinterpret_cast<T*>(device_ + (reinterpret_cast<const char*>(host_word) - host_));
  }

 private:
  char* host_ = nullptr;
  char* device_ = nullptr;
};

}  // namespace mooncake::pg::cuda
