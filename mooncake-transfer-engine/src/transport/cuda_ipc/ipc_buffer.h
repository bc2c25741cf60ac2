// What a peer needs to reach one registered GPU buffer through CUDA IPC,
// carried in the attributes of its BufferDescriptor ("cuda_ipc.<field>"), so
// the segment descriptor's codec needs no new fields and older readers skip
// them. Plain C++ (no CUDA), so that the codec is tested in every build.
//
// CUDA IPC exports whole allocations, while a registered buffer is often a
// piece of one (torch's caching allocator carves tensors out of large
// cudaMalloc blocks). So the handle names the allocation, and the peer finds
// the buffer at `addr - allocation_base` inside its mapping of it.
#pragma once

#include <cstdint>
#include <string>

#include "mooncake/te/segment_descriptor.h"

namespace mooncake::te {

struct CudaIpcBuffer {
  static constexpr size_t kHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t)
  static constexpr size_t kUuidBytes = 16;    // sizeof(cudaUUID_t)

  std::string handle;            // kHandleBytes of cudaIpcMemHandle_t, for the allocation
  uint64_t allocation_base = 0;  // where the allocation starts in the owner's address space
  uint64_t allocation_size = 0;
  int32_t device = -1;           // the owner's ordinal of the GPU (its CUDA_VISIBLE_DEVICES numbering)
  std::string device_uuid;       // kUuidBytes naming that GPU the same way in every process

  // Adds the attributes to `buffer`.
  void store(BufferDescriptor& buffer) const;
  // False when `buffer` has no CUDA IPC attributes, or malformed ones, or
  // ones whose allocation does not contain the buffer.
  static bool load(const BufferDescriptor& buffer, CudaIpcBuffer& out);
};

}  // namespace mooncake::te
