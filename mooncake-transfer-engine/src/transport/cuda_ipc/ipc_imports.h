// Peers' GPU allocations opened in this process (cudaIpcOpenMemHandle).
//
// One process-wide table, keyed by the handle: CUDA maps a handle once per
// process, yet several engines of one process, or several peers' buffers in
// one allocation, may need the same mapping. Each holder keeps a
// shared_ptr; the mapping is closed when the last one lets go (a copy in
// flight holds one, so a mapping never disappears under a copy).
// Compiled only when MOONCAKE_WITH_CUDA.
#pragma once

#include <memory>
#include <string>

namespace mooncake::te {

class IpcImport {
 public:
  IpcImport(std::string handle, char* base, int device) : handle_(std::move(handle)), base_(base), device_(device) {}
  ~IpcImport();  // closes the mapping if this was the last holder
  IpcImport(const IpcImport&) = delete;
  IpcImport& operator=(const IpcImport&) = delete;

  const std::string& handle() const { return handle_; }
  char* base() const { return base_; }  // the allocation's start in our address space
  int device() const { return device_; }  // local ordinal it was opened on

 private:
  const std::string handle_;
  char* const base_;
  const int device_;
};

// Opens the allocation behind `handle` (CudaIpcBuffer::kHandleBytes) on
// local `device`, or shares the mapping already open. Null on failure,
// with the CUDA error logged.
std::shared_ptr<IpcImport> openIpcAllocation(const std::string& handle, int device);

// Mappings currently open in this process (for tests).
size_t openIpcAllocationCount();

}  // namespace mooncake::te
