// Moving GPU bytes through host memory, for transports that can only read
// and write host memory (tcp: sockets). Each thread gets a pinned bounce
// buffer of kStagingChunk bytes and a non-blocking stream per device, so a
// staging copy neither waits behind the application's work on the legacy
// default stream nor contends with other threads.
//
// Without MOONCAKE_WITH_CUDA there is no GPU memory to stage: the functions
// below fail with kNotImplemented and the buffer is null.
#pragma once

#include <cstddef>

#include "mooncake/te/status.h"

namespace mooncake::te::cuda {

// Bytes staged at a time: large enough for full-speed copies, small enough
// that every thread may own one.
constexpr size_t kStagingChunk = 4u << 20;

#if MOONCAKE_WITH_CUDA
// The calling thread's pinned buffer of kStagingChunk bytes, null when it
// cannot be allocated. `device` is the GPU the caller is about to copy with
// (the buffer is portable; the device only decides where the context lives).
char* stagingBuffer(int device);
// Synchronous copies (of any size) between GPU memory on `device` and host
// memory. kOk, or kEndpointError with the CUDA error logged.
int copyToHost(void* host, const void* gpu, size_t n, int device);
int copyToDevice(void* gpu, const void* host, size_t n, int device);
#else
inline char* stagingBuffer(int) { return nullptr; }
inline int copyToHost(void*, const void*, size_t, int) { return kNotImplemented; }
inline int copyToDevice(void*, const void*, size_t, int) { return kNotImplemented; }
#endif

}  // namespace mooncake::te::cuda
