#include "mooncake/pg/shared_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

namespace mooncake::pg {

void* mapSharedRegion(const std::string& name, bool create, size_t bytes,
                      std::chrono::steady_clock::time_point deadline, const std::string& what, std::string* error) {
  int fd = -1;
  if (create) {
    fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) {
      *error = std::string("shm_open(create): ") + std::strerror(errno);
      return nullptr;
    }
    if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {  // a fresh object is zero-filled
      *error = std::string("ftruncate: ") + std::strerror(errno);
      ::close(fd);
      ::shm_unlink(name.c_str());
      return nullptr;
    }
  } else {
    // The creator may not have made it yet (or not sized it yet): retry.
    for (;;) {
      fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
      if (fd >= 0) {
        struct stat st {};
        if (::fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) == bytes) break;
        ::close(fd);
        fd = -1;
      }
      if (std::chrono::steady_clock::now() > deadline) {
        *error = "rank 0 did not create " + what + " in time";
        return nullptr;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) {
    *error = std::string("mmap: ") + std::strerror(errno);
    if (create) ::shm_unlink(name.c_str());
    return nullptr;
  }
  return base;
}

}  // namespace mooncake::pg
