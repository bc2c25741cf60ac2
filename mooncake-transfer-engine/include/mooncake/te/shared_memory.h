// Memory that same-host peers can map into their own address space: backed
// by an anonymous memory file (memfd) and mapped MAP_SHARED. Registering a
// buffer that lies in such memory lets the "shm" transport of a peer copy
// with a plain memcpy through its own mapping, instead of a cross-memory-attach
// system call per transfer (which pins pages on every call and reaches about
// a third of memcpy speed). Any other memory still works, through
// process_vm_readv/writev.
//
// The mapping is process-wide: allocate here, then register with any engine.
// allocate_managed_buffer() of mooncake.engine hands out such memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

namespace mooncake::te {

// A zeroed, page-aligned shared allocation of at least `length` bytes; null on failure.
void* allocateSharedMemory(size_t length);
// Releases an allocation made above (its exact base). kOk or kInvalidArgument.
int freeSharedMemory(void* addr);

struct SharedMemoryFile {
  int fd = -1;             // the memfd, open in this process while the allocation lives
  uint64_t base = 0;       // where the allocation is mapped here
  uint64_t size = 0;       // bytes mapped (the file's size)
};
// The shared allocation containing [addr, addr + length), if any.
std::optional<SharedMemoryFile> findSharedMemory(uint64_t addr, uint64_t length);

}  // namespace mooncake::te
