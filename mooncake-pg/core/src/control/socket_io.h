// The few socket operations the control plane needs, each bounded by a
// deadline: listen, connect, send a whole buffer, read what is there.
// Sockets are TCP with TCP_NODELAY (control messages are small and latency
// matters more than batching).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "control/clock.h"

namespace mooncake::pg::control {

// Owns a file descriptor.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// Milliseconds poll() may sleep before `deadline`, rounded up; -1 for
// TimePoint::max() (no deadline).
int pollTimeoutMs(TimePoint deadline);

// "host:port" and "[v6 address]:port".
std::string joinHostPort(const std::string& host, uint16_t port);
bool splitHostPort(const std::string& address, std::string* host, uint16_t* port);

// A non-blocking listening socket on host:0 (an ephemeral port).
UniqueFd listenOn(const std::string& host, uint16_t* port, std::string* error);
// A connected (blocking) socket, or an invalid one with *error.
UniqueFd connectTo(const std::string& host, uint16_t port, TimePoint deadline, std::string* error);
// Sends every byte or fails (peer gone, deadline) with *error.
bool sendAll(int fd, const void* data, size_t size, TimePoint deadline, std::string* error);
// Waits until fd is readable or the deadline passes, then reads what is
// there: > 0 bytes read, 0 end of stream, -1 error (*error set; "timed out"
// at the deadline).
ssize_t receiveSome(int fd, void* buffer, size_t size, TimePoint deadline, std::string* error);

void setNoDelay(int fd);
bool setNonBlocking(int fd);

}  // namespace mooncake::pg::control
