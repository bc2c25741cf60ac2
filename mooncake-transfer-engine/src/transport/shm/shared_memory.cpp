#include "mooncake/te/shared_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <map>
#include <mutex>

#include "mooncake/te/log.h"
#include "mooncake/te/status.h"

namespace mooncake::te {
namespace {

struct Registry {
  std::mutex mutex;
  std::map<uint64_t, SharedMemoryFile> by_base;
};

Registry& registry() {
  static Registry* r = new Registry;  // outlives every static engine's destructor
  return *r;
}

}  // namespace

void* allocateSharedMemory(size_t length) {
  if (length == 0) return nullptr;
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  size_t size = (length + page - 1) / page * page;
  int fd = ::memfd_create("mooncake-shared", MFD_CLOEXEC);
  if (fd < 0) {
    MC_LOG(Warning) << "memfd_create failed; shared memory unavailable";
    return nullptr;
  }
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    ::close(fd);
    return nullptr;
  }
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    ::close(fd);
    return nullptr;
  }
  auto& r = registry();
  std::lock_guard lock(r.mutex);
  r.by_base[reinterpret_cast<uint64_t>(p)] = SharedMemoryFile{fd, reinterpret_cast<uint64_t>(p), size};
  return p;
}

int freeSharedMemory(void* addr) {
  auto& r = registry();
  SharedMemoryFile f;
  {
    std::lock_guard lock(r.mutex);
    auto it = r.by_base.find(reinterpret_cast<uint64_t>(addr));
    if (it == r.by_base.end()) return kInvalidArgument;
    f = it->second;
    r.by_base.erase(it);
  }
  // Peers that mapped the file keep its pages until they unmap: their copies
  // never land in memory this process reuses for something else.
  ::munmap(addr, f.size);
  ::close(f.fd);
  return kOk;
}

std::optional<SharedMemoryFile> findSharedMemory(uint64_t addr, uint64_t length) {
  auto& r = registry();
  std::lock_guard lock(r.mutex);
  auto it = r.by_base.upper_bound(addr);
  if (it == r.by_base.begin()) return std::nullopt;
  --it;
  const SharedMemoryFile& f = it->second;
  if (addr - f.base > f.size || length > f.size - (addr - f.base)) return std::nullopt;
  return f;
}

}  // namespace mooncake::te
