#include "cuda/host_staging.h"

#include <cuda_runtime_api.h>

#include <map>

#include "cuda/cuda_driver.h"
#include "mooncake/te/log.h"

namespace mooncake::te::cuda {
namespace {

// Per-thread staging state, released when the thread ends.
struct ThreadStaging {
  char* buffer = nullptr;
  std::map<int, cudaStream_t> streams;  // by device

  ~ThreadStaging() {
    // Errors are ignored: at process exit the runtime may already be gone.
    for (auto& [device, stream] : streams) {
      DeviceScope scope(device);
      cudaStreamDestroy(stream);
    }
    if (buffer != nullptr) cudaFreeHost(buffer);
  }

  // Needs `device`'s context current.
  cudaStream_t stream(int device) {
    auto it = streams.find(device);
    if (it != streams.end()) return it->second;
    cudaStream_t s = nullptr;
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) return nullptr;
    streams.emplace(device, s);
    return s;
  }
};

ThreadStaging& threadStaging() {
  thread_local ThreadStaging staging;
  return staging;
}

int copy(void* dst, const void* src, size_t n, int device, cudaMemcpyKind kind) {
  DeviceScope scope(device);
  cudaStream_t stream = scope.ok() ? threadStaging().stream(device) : nullptr;
  cudaError_t err = stream == nullptr ? cudaErrorInvalidDevice : cudaMemcpyAsync(dst, src, n, kind, stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) {
    MC_LOG(Warning) << "staging copy of " << n << " bytes on cuda:" << device << " failed: " << cudaGetErrorString(err);
    return kEndpointError;
  }
  return kOk;
}

}  // namespace

char* stagingBuffer(int device) {
  ThreadStaging& staging = threadStaging();
  if (staging.buffer == nullptr) {
    DeviceScope scope(device);
    void* p = nullptr;
    if (scope.ok() && cudaHostAlloc(&p, kStagingChunk, cudaHostAllocPortable) == cudaSuccess) {
      staging.buffer = static_cast<char*>(p);
    } else {
      MC_LOG(Warning) << "cannot allocate a pinned staging buffer of " << kStagingChunk << " bytes";
    }
  }
  return staging.buffer;
}

int copyToHost(void* host, const void* gpu, size_t n, int device) {
  return copy(host, gpu, n, device, cudaMemcpyDeviceToHost);
}

int copyToDevice(void* gpu, const void* host, size_t n, int device) {
  return copy(gpu, host, n, device, cudaMemcpyHostToDevice);
}

}  // namespace mooncake::te::cuda
