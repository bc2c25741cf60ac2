#include "transport/cuda_ipc/ipc_imports.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <map>
#include <mutex>

#include "cuda/cuda_driver.h"
#include "mooncake/te/log.h"
#include "transport/cuda_ipc/ipc_buffer.h"

namespace mooncake::te {
namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == CudaIpcBuffer::kHandleBytes);

struct Mapping {
  char* base = nullptr;
  int device = -1;
  int holders = 0;
};

// Explicit holder counts under one mutex (rather than weak_ptrs) so that a
// handle is never opened again while its last holder is still closing it.
std::mutex& tableMutex() {
  static std::mutex mutex;
  return mutex;
}
std::map<std::string, Mapping>& table() {
  static auto* mappings = new std::map<std::string, Mapping>;  // outlives engines destroyed at exit
  return *mappings;
}

}  // namespace

IpcImport::~IpcImport() {
  std::lock_guard lock(tableMutex());
  auto it = table().find(handle_);
  if (it == table().end() || --it->second.holders > 0) return;
  cuda::DeviceScope scope(it->second.device);
  cudaError_t err = cudaIpcCloseMemHandle(it->second.base);
  if (err != cudaSuccess && err != cudaErrorCudartUnloading) {
    MC_LOG(Warning) << "cuda_ipc: closing a peer's allocation failed: " << cudaGetErrorString(err);
  }
  table().erase(it);
}

std::shared_ptr<IpcImport> openIpcAllocation(const std::string& handle, int device) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t)) return nullptr;
  std::lock_guard lock(tableMutex());
  auto it = table().find(handle);
  if (it == table().end()) {
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    void* base = nullptr;
    cuda::DeviceScope scope(device);
    // Lazy peer access: copies issued from another GPU's stream reach it too.
    cudaError_t err = scope.ok() ? cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess)
                                 : cudaErrorInvalidDevice;
    if (err != cudaSuccess) {
      cudaGetLastError();
      MC_LOG(Warning) << "cuda_ipc: cannot open a peer's allocation on cuda:" << device << ": "
                      << cudaGetErrorString(err);
      return nullptr;
    }
    it = table().emplace(handle, Mapping{static_cast<char*>(base), device, 0}).first;
  }
  ++it->second.holders;
  return std::make_shared<IpcImport>(handle, it->second.base, it->second.device);
}

size_t openIpcAllocationCount() {
  std::lock_guard lock(tableMutex());
  return table().size();
}

}  // namespace mooncake::te
