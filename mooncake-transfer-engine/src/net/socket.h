// Blocking TCP sockets whose every wait is bounded by a deadline (poll before
// each read/write), the building block of the handshake and the TCP transport.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace mooncake::te::net {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;
inline Deadline never() { return Deadline::max(); }
inline Deadline after(std::chrono::nanoseconds d) { return Clock::now() + d; }

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() { close(); }
  Socket(Socket&& other) noexcept : fd_(other.release()) {}
  Socket& operator=(Socket&& other) noexcept {
    if (this != &other) {
      close();
      fd_ = other.release();
    }
    return *this;
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void close();
  // Wakes any thread blocked on this socket (its reads see end of stream).
  void shutdownBoth() const;

 private:
  int fd_ = -1;
};

// Each returns kOk or an ErrorCode: kDnsFailed, kPeerUnreachable (refused,
// reset, closed by the peer), kTimeout, kSocketFailed.
int connectTo(const std::string& host, uint16_t port, Deadline deadline, Socket& out);
int sendAll(int fd, const void* data, size_t length, Deadline deadline);
// A message in pieces (a header, its payload, a trailer), sent as one
// stream of bytes: the small pieces ride in the payload's segments instead
// of going out alone (TCP_NODELAY sends each send() at once).
struct Piece {
  const void* data;
  size_t length;
};
int sendPieces(int fd, std::initializer_list<Piece> pieces, Deadline deadline);
int recvAll(int fd, void* data, size_t length, Deadline deadline);
// Waits until the socket is readable (data or end of stream).
int waitReadable(int fd, Deadline deadline);

void setNoDelay(int fd);

// A listening socket bound to one local address, on a free port of a range.
class Listener {
 public:
  // `address`: an IPv4 or IPv6 literal; "0.0.0.0" is every IPv4 interface,
  // "::" every interface (dual-stack). kInvalidArgument for anything else,
  // kSocketFailed (logged) when the address is not this host's. A range of
  // [0, 0] takes any free port the kernel picks (port() says which).
  int open(uint16_t min_port, uint16_t max_port, const std::string& address);
  uint16_t port() const { return port_; }
  // Blocks until a connection arrives: kOk; kTooManyRequests when the
  // process is out of descriptors or memory for now (try again later);
  // kSocketFailed once stop() was called (or on a fatal error).
  int accept(Socket& out);
  void stop();

 private:
  Socket socket_;
  uint16_t port_ = 0;
};

}  // namespace mooncake::te::net
