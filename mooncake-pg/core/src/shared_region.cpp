#include "mooncake/pg/shared_region.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <thread>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

namespace mooncake::pg {

// ---- PeerLiveness ----

PeerLiveness::~PeerLiveness() {
  for (int fd : pidfds_) {
    if (fd >= 0) ::close(fd);
  }
}

void PeerLiveness::watch(std::vector<int32_t> pids, int self, const std::function<bool(int)>& skip) {
  self_ = self;
  pids_ = std::move(pids);
  pidfds_.assign(pids_.size(), -1);
  for (int r = 0; r < static_cast<int>(pids_.size()); ++r) {
    if (r != self && !(skip && skip(r))) pidfds_[r] = static_cast<int>(::syscall(SYS_pidfd_open, pids_[r], 0));
  }
}

bool PeerLiveness::alive(int peer) const {
  const int fd = pidfds_[peer];
  if (fd >= 0) {
    pollfd p{fd, POLLIN, 0};
    return ::poll(&p, 1, 0) == 0;  // readable once the process has exited
  }
  return ::kill(pids_[peer], 0) == 0 || errno == EPERM;
}

std::vector<int> PeerLiveness::dead() const {
  std::vector<int> gone;
  for (int q = 0; q < static_cast<int>(pids_.size()); ++q) {
    if (q != self_ && !alive(q)) gone.push_back(q);
  }
  return gone;
}

// ---- AttachedRegion ----

std::unique_ptr<AttachedRegion> AttachedRegion::map(const std::string& name, bool create, size_t bytes,
                                                    std::chrono::steady_clock::time_point deadline,
                                                    const std::string& what, std::string* error,
                                                    const std::function<bool()>& superseded) {
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
      if (superseded && superseded()) {
        *error = std::string(kSupersededError) + " while waiting for rank 0 to create " + what;
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
  std::unique_ptr<AttachedRegion> region(new AttachedRegion);
  region->name_ = name;
  region->base_ = base;
  region->bytes_ = bytes;
  region->deadline_ = deadline;
  return region;
}

AttachedRegion::~AttachedRegion() {
  if (base_ != nullptr) ::munmap(base_, bytes_);
}

bool AttachedRegion::handshake(const Handshake& steps, std::string* error) {
  const auto absent = [&](int r) { return steps.absent && steps.absent(r); };
  const auto rank_name = [&](int r) { return steps.rank_name ? steps.rank_name(r) : "rank " + std::to_string(r); };
  const auto superseded = [&] { return steps.superseded && steps.superseded(); };
  const bool creator = steps.rank == steps.creator;
  if (creator) {
    // A fresh ftruncate'd object is zero: only non-zero fields need writing.
    if (steps.write_header) steps.write_header();
    steps.ready->store(1, std::memory_order_release);  // release: the header before `ready`
  } else {
    while (steps.ready->load(std::memory_order_acquire) == 0) {
      if (std::chrono::steady_clock::now() > deadline_) {
        *error = steps.never_ready;
        return false;
      }
      if (superseded()) {
        *error = std::string(kSupersededError) + ": " + steps.never_ready;
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (steps.check_header) {
      if (std::string why = steps.check_header(); !why.empty()) {
        *error = why;
        return false;
      }
    }
  }
  RankPresence& me = steps.presence(steps.rank);
  me.pid = static_cast<int32_t>(::getpid());
  if (steps.publish_mine) steps.publish_mine();
  me.attached.store(1, std::memory_order_release);  // release: publishes the pid and the user's fields
  // Wait for everyone, then learn their pids (for liveness checks).
  for (int r = 0; r < steps.size; ++r) {
    while (!absent(r) && steps.presence(r).attached.load(std::memory_order_acquire) == 0) {
      const bool late = std::chrono::steady_clock::now() > deadline_;
      if (late || superseded()) {
        if (creator) ::shm_unlink(name_.c_str());
        *error = late ? rank_name(r) + " did not attach in time"
                      : std::string(kSupersededError) + " while waiting for " + rank_name(r) + " to attach";
        return false;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  if (creator) ::shm_unlink(name_.c_str());  // everyone has it mapped: no name left behind
  std::vector<int32_t> pids(steps.size);
  for (int r = 0; r < steps.size; ++r) pids[r] = steps.presence(r).pid;
  peers_.watch(std::move(pids), steps.rank, absent);
  return true;
}

}  // namespace mooncake::pg
