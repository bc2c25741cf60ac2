// Engine-owned registered buffers behind allocate_managed_buffer /
// free_managed_buffer: power-of-two size classes from 8 KiB to 256 MiB are
// recycled through free lists (registration is the expensive part); larger
// requests get a dedicated registration that is released on free. The memory
// is shared memory (te/shared_memory.h), so same-host peers reach it with a
// plain memcpy through their own mapping.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <vector>

#include "mooncake/te/shared_memory.h"
#include "mooncake/te/transfer_engine.h"

namespace mooncake::binding {

class ManagedBuffers {
 public:
  explicit ManagedBuffers(te::TransferEngine& engine) : engine_(engine) {}
  ~ManagedBuffers() { releaseAll(); }

  // The address of a registered buffer of at least `length` bytes, 0 on failure.
  uint64_t allocate(size_t length) {
    if (length == 0 || !engine_.initialized()) return 0;
    size_t size = sizeClass(length);
    std::lock_guard lock(mutex_);
    auto& free_list = free_[size];
    if (!free_list.empty()) {
      uint64_t addr = free_list.back();
      free_list.pop_back();
      free_set_.erase(addr);
      return addr;
    }
    void* p = te::allocateSharedMemory(size);
    if (p == nullptr) return 0;
    if (engine_.registerLocalMemory(p, size) != te::kOk) {
      te::freeSharedMemory(p);
      return 0;
    }
    owned_.emplace(reinterpret_cast<uint64_t>(p), size);
    return reinterpret_cast<uint64_t>(p);
  }

  // kInvalidArgument for an address we did not hand out or that is already free.
  int release(uint64_t addr, size_t /*length: the size is known from the address*/) {
    std::lock_guard lock(mutex_);
    auto it = owned_.find(addr);
    if (it == owned_.end() || free_set_.count(addr)) return te::kInvalidArgument;
    if (it->second > kLargestClass) {
      engine_.unregisterLocalMemory(reinterpret_cast<void*>(addr));
      te::freeSharedMemory(reinterpret_cast<void*>(addr));
      owned_.erase(it);
    } else {
      free_[it->second].push_back(addr);
      free_set_.insert(addr);
    }
    return te::kOk;
  }

  void releaseAll() {
    std::lock_guard lock(mutex_);
    for (auto& [addr, size] : owned_) {
      engine_.unregisterLocalMemory(reinterpret_cast<void*>(addr));
      te::freeSharedMemory(reinterpret_cast<void*>(addr));
    }
    owned_.clear();
    free_.clear();
    free_set_.clear();
  }

 private:
  static constexpr size_t kSmallestClass = 8u << 10;
  static constexpr size_t kLargestClass = 256u << 20;

  static size_t sizeClass(size_t length) {
    if (length > kLargestClass) return (length + 4095) & ~size_t{4095};
    size_t size = kSmallestClass;
    while (size < length) size <<= 1;
    return size;
  }

  te::TransferEngine& engine_;
  std::mutex mutex_;
  std::map<uint64_t, size_t> owned_;               // address -> allocated size
  std::map<size_t, std::vector<uint64_t>> free_;   // size class -> free addresses
  std::set<uint64_t> free_set_;                    // every address now on a free list
};

}  // namespace mooncake::binding
