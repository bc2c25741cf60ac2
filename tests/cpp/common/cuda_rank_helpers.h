// What the scenarios of any rank program (tests/cpp/pg_cuda, tests/cpp/ep_cuda)
// share on the device: buffers, a stream, and a check that reports and
// counts a failure instead of aborting, so that one rank's report names
// every check it failed.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>
#include <vector>

namespace mooncake::testing {

// Prints why on stderr and counts a failure; `g` is the group in scope and
// `failures` the scenario's count.
#define RANK_CHECK(cond, ...)                                                                  \
  do {                                                                                         \
    if (!(cond)) {                                                                             \
      std::fprintf(stderr, "rank %d: line %d: check failed: %s: ", g.rank(), __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                                       \
      std::fprintf(stderr, "\n");                                                              \
      ++failures;                                                                              \
    }                                                                                          \
  } while (0)

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) { cudaMalloc(&data_, bytes == 0 ? 16 : bytes); }
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  char* get() const { return static_cast<char*>(data_); }
  size_t bytes() const { return bytes_; }
  // Both complete before returning (ordered on `stream`, then synchronized).
  template <typename T>
  void upload(const std::vector<T>& host, cudaStream_t stream, size_t offset_bytes = 0) {
    cudaMemcpyAsync(get() + offset_bytes, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream);
    cudaStreamSynchronize(stream);
  }
  template <typename T>
  std::vector<T> download(size_t count, cudaStream_t stream, size_t offset_bytes = 0) const {
    std::vector<T> host(count);
    cudaMemcpyAsync(host.data(), get() + offset_bytes, count * sizeof(T), cudaMemcpyDeviceToHost, stream);
    cudaStreamSynchronize(stream);
    return host;
  }

 private:
  void* data_ = nullptr;
  size_t bytes_;
};

class Stream {
 public:
  Stream() { cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking); }
  ~Stream() { cudaStreamDestroy(stream_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  operator cudaStream_t() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

}  // namespace mooncake::testing
