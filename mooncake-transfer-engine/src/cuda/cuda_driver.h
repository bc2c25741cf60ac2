// The few CUDA driver calls the engine needs beside the runtime: what kind of
// memory a pointer is, which allocation contains it, and the current context.
//
// The driver is opened with dlopen rather than linked, for two reasons: a
// CUDA build of the engine must still load on a host without a GPU driver
// (there it treats all memory as host memory), and the driver's pointer
// query needs no CUDA context, so a process that registers only host memory
// never gets one (the runtime works through a context it would create).
// Compiled only when MOONCAKE_WITH_CUDA.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mooncake::te::cuda {

// The ordinal (in this process) of the GPU holding `ptr`, or -1 when it is
// host memory, or when no driver or GPU is present.
int deviceOfPointer(const void* ptr);

// The cudaMalloc allocation containing `ptr`: caching allocators (torch)
// hand out pieces of larger allocations, and CUDA IPC exports whole ones.
// Needs the context of the pointer's device to be current. False on failure.
bool allocationRange(const void* ptr, uint64_t& base, uint64_t& size);

// A dma-buf file descriptor exporting the GPU pages under [ptr, ptr +
// length), for a NIC to map (ibv_reg_dmabuf_mr): `offset` is where `ptr`
// lies in it. The caller closes `fd`. False where the driver cannot
// (before CUDA 11.7, or memory that is not exportable).
bool exportDmabuf(const void* ptr, size_t length, int& fd, uint64_t& offset);

// Makes `device`'s primary context current for the calling thread while in
// scope, and puts the caller's context (possibly none) back afterwards, so
// that a thread of the application (a torch thread, say) keeps its device.
class DeviceScope {
 public:
  explicit DeviceScope(int device);
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  bool ok() const { return ok_; }

 private:
  void* saved_ = nullptr;  // CUcontext
  bool ok_ = false;
};

}  // namespace mooncake::te::cuda
