#include "control/socket_io.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace mooncake::pg::control {
namespace {

std::string errnoText(const std::string& what) { return std::string(what) + ": " + std::strerror(errno); }

// Waits for `events` on fd until the deadline: true when ready (or in an
// error state the next call will report), false with *error otherwise.
bool waitFor(int fd, short events, TimePoint deadline, std::string* error) {
  for (;;) {
    pollfd p{fd, events, 0};
    int rc = ::poll(&p, 1, pollTimeoutMs(deadline));
    if (rc > 0) return true;
    if (rc == 0 && Clock::now() >= deadline) {
      *error = "timed out";
      return false;
    }
    if (rc < 0 && errno != EINTR) {
      *error = errnoText("poll");
      return false;
    }
  }
}

struct AddrInfoList {
  addrinfo* head = nullptr;
  ~AddrInfoList() {
    if (head != nullptr) ::freeaddrinfo(head);
  }
};

bool resolve(const std::string& host, uint16_t port, bool passive, AddrInfoList* list, std::string* error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  std::string service = std::to_string(port);
  int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &list->head);
  if (rc != 0) {
    *error = "cannot resolve '" + host + "': " + gai_strerror(rc);
    return false;
  }
  return true;
}

uint16_t boundPort(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) return 0;
  if (address.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&address)->sin_port);
  return ntohs(reinterpret_cast<sockaddr_in6*>(&address)->sin6_port);
}

}  // namespace

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

int pollTimeoutMs(TimePoint deadline) {
  if (deadline == TimePoint::max()) return -1;
  auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now()).count();
  if (left <= 0) return 0;
  return static_cast<int>(std::min<int64_t>((left + 999) / 1000, 1 << 30));
}

std::string joinHostPort(const std::string& host, uint16_t port) {
  bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

bool splitHostPort(const std::string& address, std::string* host, uint16_t* port) {
  size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 == address.size()) return false;
  std::string name = address.substr(0, colon);
  if (name.size() >= 2 && name.front() == '[' && name.back() == ']') name = name.substr(1, name.size() - 2);
  char* end = nullptr;
  long value = std::strtol(address.c_str() + colon + 1, &end, 10);
  if (*end != '\0' || value <= 0 || value > 65535 || name.empty()) return false;
  *host = name;
  *port = static_cast<uint16_t>(value);
  return true;
}

void setNoDelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

bool setNonBlocking(int fd) {
  int flags = ::fcntl(fd, F_GETFL);
  return flags >= 0 && ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0;
}

UniqueFd listenOn(const std::string& host, uint16_t* port, std::string* error) {
  AddrInfoList list;
  if (!resolve(host, 0, true, &list, error)) return UniqueFd();
  for (addrinfo* ai = list.head; ai != nullptr; ai = ai->ai_next) {
    UniqueFd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol));
    if (!fd.valid()) {
      *error = errnoText("socket");
      continue;
    }
    int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd.get(), 1024) != 0) {
      *error = errnoText("bind/listen on " + host);
      continue;
    }
    *port = boundPort(fd.get());
    return fd;
  }
  return UniqueFd();
}

UniqueFd connectTo(const std::string& host, uint16_t port, TimePoint deadline, std::string* error) {
  AddrInfoList list;
  if (!resolve(host, port, false, &list, error)) return UniqueFd();
  for (addrinfo* ai = list.head; ai != nullptr; ai = ai->ai_next) {
    UniqueFd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol));
    if (!fd.valid()) {
      *error = errnoText("socket");
      continue;
    }
    int rc = ::connect(fd.get(), ai->ai_addr, ai->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      if (!waitFor(fd.get(), POLLOUT, deadline, error)) continue;
      int so_error = 0;
      socklen_t length = sizeof(so_error);
      ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &so_error, &length);
      errno = so_error;
      rc = so_error == 0 ? 0 : -1;
    }
    if (rc != 0) {
      *error = errnoText("connect to " + joinHostPort(host, port));
      continue;
    }
    // Blocking from here on: every wait goes through poll() with a deadline.
    ::fcntl(fd.get(), F_SETFL, ::fcntl(fd.get(), F_GETFL) & ~O_NONBLOCK);
    setNoDelay(fd.get());
    return fd;
  }
  return UniqueFd();
}

bool sendAll(int fd, const void* data, size_t size, TimePoint deadline, std::string* error) {
  auto* bytes = static_cast<const uint8_t*>(data);
  while (size > 0) {
    if (!waitFor(fd, POLLOUT, deadline, error)) return false;
    ssize_t n = ::send(fd, bytes, size, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      *error = errnoText("send");
      return false;
    }
    bytes += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

ssize_t receiveSome(int fd, void* buffer, size_t size, TimePoint deadline, std::string* error) {
  for (;;) {
    if (!waitFor(fd, POLLIN, deadline, error)) return -1;
    ssize_t n = ::recv(fd, buffer, size, MSG_DONTWAIT);
    if (n >= 0) return n;
    if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
    *error = errnoText("recv");
    return -1;
  }
}

}  // namespace mooncake::pg::control
