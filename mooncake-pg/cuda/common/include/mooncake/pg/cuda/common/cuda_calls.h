// Small helpers around CUDA runtime calls, header only: shared by the
// process group's CUDA plane and the host side of the EP kernels (target
// mooncake::cuda_common).
#pragma once

#include <cuda_runtime_api.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace mooncake::pg::cuda {

// "call: message" for a failed runtime call. Clears the error, so that the
// next call does not report it again.
inline std::string cudaWhat(const char* call, cudaError_t err) {
  cudaGetLastError();
  return std::string(call) + ": " + cudaGetErrorString(err);
}

// The device a group opens on: `requested` when it is an ordinal (>= 0),
// else the calling thread's current device. "" or why not.
inline std::string chosenDevice(int requested, int* device) {
  if (requested >= 0) {
    *device = requested;
    return {};
  }
  const cudaError_t err = cudaGetDevice(device);
  return err == cudaSuccess ? std::string() : cudaWhat("cudaGetDevice", err);
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

// The bytes of a cudaIpcMemHandle_t, as control blocks store them.
constexpr size_t kIpcHandleBytes = sizeof(cudaIpcMemHandle_t);
static_assert(kIpcHandleBytes == 64);

// Exports the allocation at `base` into `out`; "" or what failed.
inline std::string exportIpcHandle(void* base, unsigned char (&out)[kIpcHandleBytes]) {
  cudaIpcMemHandle_t handle;
  if (const cudaError_t err = cudaIpcGetMemHandle(&handle, base); err != cudaSuccess) {
    return cudaWhat("cudaIpcGetMemHandle", err);
  }
  std::memcpy(out, &handle, sizeof(handle));
  return {};
}

// Maps every peer's exported allocation (`handle_of(q)`, the bytes exportIpcHandle
// wrote) into this process: mapped[q], with mapped[rank] = `own`. Lazy peer
// access, so that ranks on other GPUs of the host are reached too. On a
// failure, returns what failed and sets *failed to the peer; the mappings
// already made stay in `mapped` for the caller's cleanup.
inline std::string mapPeerAllocations(int size, int rank, char* own,
                                      const std::function<const unsigned char*(int)>& handle_of,
                                      std::vector<char*>* mapped, int* failed) {
  mapped->assign(size, nullptr);
  (*mapped)[rank] = own;
  for (int q = 0; q < size; ++q) {
    const unsigned char* published = q == rank ? nullptr : handle_of(q);
    if (published == nullptr) continue;  // itself, or a peer that takes no part: nothing to map
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, published, sizeof(handle));
    void* base = nullptr;
    if (const cudaError_t err = cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess);
        err != cudaSuccess) {
      *failed = q;
      return cudaWhat("cudaIpcOpenMemHandle", err);
    }
    (*mapped)[q] = static_cast<char*>(base);
  }
  return {};
}

}  // namespace mooncake::pg::cuda
