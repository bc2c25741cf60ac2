#include "net/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "mooncake/te/log.h"
#include "mooncake/te/status.h"
#include "net/ip_literal.h"

namespace mooncake::te::net {
namespace {

// Milliseconds poll() may wait before `deadline`, rounded up; -1 for never.
int pollTimeoutMs(Deadline deadline) {
  if (deadline == never()) return -1;
  auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now()).count();
  if (left <= 0) return 0;
  return static_cast<int>(std::min<int64_t>((left + 999) / 1000, 1 << 30));
}

// Waits for `events` on fd. kOk, kTimeout, or kSocketFailed.
int waitFor(int fd, short events, Deadline deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    int timeout = pollTimeoutMs(deadline);
    int rc = ::poll(&p, 1, timeout);
    if (rc > 0) return kOk;  // readiness or an error condition: the next call reports which
    if (rc == 0) {
      if (Clock::now() >= deadline) return kTimeout;
      continue;
    }
    if (errno != EINTR) return kSocketFailed;
  }
}

int classifyErrno(int err) {
  switch (err) {
    case ECONNREFUSED:
    case ECONNRESET:
    case EPIPE:
    case EHOSTUNREACH:
    case ENETUNREACH:
    case ENOTCONN:
      return kPeerUnreachable;
    case ETIMEDOUT:
      return kTimeout;
    default:
      return kSocketFailed;
  }
}

}  // namespace

void Socket::close() {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

void Socket::shutdownBoth() const {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

void setNoDelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

int connectTo(const std::string& host, uint16_t port, Deadline deadline, Socket& out) {
  if (host.find('%') != std::string::npos) {
    // getaddrinfo takes "fe80::1%eth0" as well, but says only "Name or
    // service not known" for a zone that names no interface here.
    sockaddr_storage unused{};
    socklen_t unused_length = 0;
    std::string why;
    if (parseIpLiteral(host, port, unused, unused_length, why) != kOk) {
      MC_LOG(Warning) << "cannot connect to '" << host << "': " << why;
      return kDnsFailed;
    }
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  std::string service = std::to_string(port);
  if (int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &result); rc != 0) {
    MC_LOG(Warning) << "cannot resolve '" << host << "': " << gai_strerror(rc);
    return kDnsFailed;
  }
  int last_error = kPeerUnreachable;
  for (addrinfo* ai = result; ai != nullptr; ai = ai->ai_next) {
    Socket s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol));
    if (!s.valid()) {
      last_error = kSocketFailed;
      continue;
    }
    int rc = ::connect(s.fd(), ai->ai_addr, ai->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      rc = waitFor(s.fd(), POLLOUT, deadline);
      if (rc != kOk) {
        last_error = rc;
        continue;
      }
      int err = 0;
      socklen_t len = sizeof(err);
      ::getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
      rc = err == 0 ? 0 : -1;
      errno = err;
    }
    if (rc != 0) {
      last_error = classifyErrno(errno);
      continue;
    }
    // Back to blocking mode: every later wait goes through poll() anyway, and
    // blocking calls avoid spinning on EAGAIN.
    ::fcntl(s.fd(), F_SETFL, ::fcntl(s.fd(), F_GETFL) & ~O_NONBLOCK);
    setNoDelay(s.fd());
    out = std::move(s);
    ::freeaddrinfo(result);
    return kOk;
  }
  ::freeaddrinfo(result);
  return last_error;
}

int sendPieces(int fd, std::initializer_list<Piece> pieces, Deadline deadline) {
  constexpr size_t kMaxPieces = 4;
  iovec iov[kMaxPieces];
  size_t count = 0;
  for (const Piece& piece : pieces) {
    if (piece.length == 0) continue;
    if (count == kMaxPieces) return kInvalidArgument;
    iov[count++] = iovec{const_cast<void*>(piece.data), piece.length};
  }
  size_t first = 0;  // iov[first..count) is what is left, iov[first] advanced past what went out
  // Try first, poll only when the socket is full: a poll before every call
  // doubles the system calls of a bulk transfer.
  while (first < count) {
    msghdr message{};
    message.msg_iov = iov + first;
    message.msg_iovlen = count - first;
    ssize_t n = ::sendmsg(fd, &message, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        if (int rc = waitFor(fd, POLLOUT, deadline); rc != kOk) return rc;
        continue;
      }
      return classifyErrno(errno);
    }
    auto sent = static_cast<size_t>(n);
    while (first < count && sent >= iov[first].iov_len) sent -= iov[first++].iov_len;
    if (first < count) {
      iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + sent;
      iov[first].iov_len -= sent;
    }
  }
  return kOk;
}

int sendAll(int fd, const void* data, size_t length, Deadline deadline) {
  return sendPieces(fd, {{data, length}}, deadline);
}

int recvAll(int fd, void* data, size_t length, Deadline deadline) {
  auto* p = static_cast<char*>(data);
  while (length > 0) {
    ssize_t n = ::recv(fd, p, length, MSG_DONTWAIT);
    if (n == 0) return kPeerUnreachable;  // orderly close before the message ended
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        if (int rc = waitFor(fd, POLLIN, deadline); rc != kOk) return rc;
        continue;
      }
      return classifyErrno(errno);
    }
    p += n;
    length -= static_cast<size_t>(n);
  }
  return kOk;
}

int waitReadable(int fd, Deadline deadline) { return waitFor(fd, POLLIN, deadline); }

int Listener::open(uint16_t min_port, uint16_t max_port, const std::string& address) {
  sockaddr_storage bound{};
  socklen_t bound_length = 0;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&bound);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&bound);
  std::string why;
  if (parseIpLiteral(address, 0, bound, bound_length, why) != kOk) {
    MC_LOG(Error) << "listen: '" << address << "': " << why;
    return kInvalidArgument;
  }
  const bool ipv6 = bound.ss_family == AF_INET6;
  uint32_t span = static_cast<uint32_t>(max_port - min_port) + 1;
  std::random_device rd;
  uint32_t start = std::uniform_int_distribution<uint32_t>(0, span - 1)(rd);
  for (uint32_t i = 0; i < span; ++i) {
    uint16_t port = static_cast<uint16_t>(min_port + (start + i) % span);
    Socket s(::socket(bound.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!s.valid()) return kSocketFailed;
    int one = 1;
    ::setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (ipv6) {
      int zero = 0;  // "::" takes IPv4 peers too
      ::setsockopt(s.fd(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
      v6->sin6_port = htons(port);
    } else {
      v4->sin_port = htons(port);
    }
    if (::bind(s.fd(), reinterpret_cast<sockaddr*>(&bound), bound_length) != 0) {
      if (errno == EADDRNOTAVAIL) {
        MC_LOG(Error) << "listen: " << address << " is not an address of this host (pass one of its addresses, "
                      << "or set MC_LISTEN_ALL=1 to listen on every interface)";
        return kSocketFailed;
      }
      continue;  // taken (or reserved): try the next port
    }
    if (::listen(s.fd(), 512) != 0) continue;
    if (port == 0) {  // the kernel's pick
      socklen_t length = bound_length;
      if (::getsockname(s.fd(), reinterpret_cast<sockaddr*>(&bound), &length) != 0) return kSocketFailed;
      port = ntohs(ipv6 ? v6->sin6_port : v4->sin_port);
    }
    socket_ = std::move(s);
    port_ = port;
    return kOk;
  }
  MC_LOG(Error) << "no free port in [" << min_port << ", " << max_port << "] (MC_MIN_RPC_PORT/MC_MAX_RPC_PORT)";
  return kSocketFailed;
}

int Listener::accept(Socket& out) {
  for (;;) {
    int fd = ::accept4(socket_.fd(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) {
      setNoDelay(fd);
      out = Socket(fd);
      return kOk;
    }
    // A connection that went away before it was taken, or a network error
    // Linux reports on the new socket: take the next one.
    if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO || errno == ENETDOWN || errno == ENOPROTOOPT ||
        errno == EHOSTDOWN || errno == ENONET || errno == EHOSTUNREACH || errno == ENETUNREACH) {
      continue;
    }
    // Out of descriptors or memory: the caller waits a little and tries again.
    if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) return kTooManyRequests;
    return kSocketFailed;  // EINVAL after stop(), or a fatal error
  }
}

void Listener::stop() { socket_.shutdownBoth(); }

}  // namespace mooncake::te::net
