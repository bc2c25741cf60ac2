#include "rpc/connection_server.h"

#include <arpa/inet.h>
#include <cstdio>
#include <netinet/in.h>
#include <sys/socket.h>

#include "mooncake/te/log.h"
#include "mooncake/te/status.h"
#include "rpc/opening.h"

namespace mooncake::te::rpc {

int ConnectionServer::start(uint16_t min_port, uint16_t max_port, const std::string& bind_address,
                            const std::string& secret, std::chrono::milliseconds hello_timeout) {
  hello_timeout_ = hello_timeout;
  secret_ = secret;
  if (int rc = listener_.open(min_port, max_port, bind_address); rc != kOk) return rc;
  accept_thread_ = std::thread([this] { acceptLoop(); });
  return kOk;
}

void ConnectionServer::acceptLoop() {
  for (;;) {
    net::Socket socket;
    const int rc = listener_.accept(socket);
    if (rc == kTooManyRequests) {  // out of descriptors or memory: let connections end, then go on
      logRefusal(socket, "the process is out of descriptors or memory; accepting again in 50 ms");
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    std::list<std::unique_ptr<Connection>> finished;
    std::lock_guard lock(mutex_);
    reapFinishedLocked(finished);
    if (stopping_) return;
    if (rc != kOk) {
      MC_LOG(Error) << "transfer engine: the listener failed (" << errorName(rc) << "); no longer accepting";
      return;
    }
    if (connections_.size() >= kMaxConnections) {
      // Each connection holds a thread until it ends: a flood must not exhaust them.
      logRefusal(socket, "over " + std::to_string(kMaxConnections) + " connections at once");
      continue;  // closed as it goes out of scope
    }
    auto connection = std::make_unique<Connection>();
    connection->socket = std::move(socket);
    Connection* raw = connection.get();
    connections_.push_back(std::move(connection));
    try {
      raw->thread = std::thread([this, raw] { serve(raw); });
    } catch (const std::system_error& e) {  // no thread to be had: drop this one, serve the others
      connections_.pop_back();
      MC_LOG(Warning) << "transfer engine: dropped a connection: cannot start its thread (" << e.what() << ")";
    }
    // `finished` joins the reaped threads as it goes out of scope, after the
    // lock is released (declared before the lock).
  }
}

void ConnectionServer::reapFinishedLocked(std::list<std::unique_ptr<Connection>>& finished) {
  for (auto it = connections_.begin(); it != connections_.end();) {
    if ((*it)->done) {
      if ((*it)->thread.joinable()) (*it)->thread.join();
      finished.splice(finished.end(), connections_, it++);
    } else {
      ++it;
    }
  }
}

void ConnectionServer::serve(Connection* connection) {
  uint32_t kind = 0;
  std::string why;
  if (acceptOpening(connection->socket, secret_, net::after(hello_timeout_), kind, why) == kOk) {
    auto it = handlers_.find(kind);
    if (it != handlers_.end()) {
      it->second(connection->socket);
    } else {
      logRefusal(connection->socket, "unknown connection kind 0x" + [&] {
        char hex[9];
        std::snprintf(hex, sizeof(hex), "%08x", kind);
        return std::string(hex);
      }());
    }
  } else if (!why.empty()) {
    logRefusal(connection->socket, why);
  }
  // Close under the lock: stop() only shuts down sockets of live connections,
  // so it never touches a descriptor number that was closed and reused.
  std::lock_guard lock(mutex_);
  connection->socket.close();
  connection->done = true;
}

// The first ten refusals, then one in a thousand: a flood of bad
// connections must not flood the log too.
void ConnectionServer::logRefusal(const net::Socket& socket, const std::string& why) {
  const uint64_t n = refusals_.fetch_add(1, std::memory_order_relaxed) + 1;
  if (n > 10 && n % 1000 != 0) return;
  sockaddr_storage peer{};
  socklen_t length = sizeof(peer);
  char text[INET6_ADDRSTRLEN] = "?";
  if (::getpeername(socket.fd(), reinterpret_cast<sockaddr*>(&peer), &length) == 0) {
    const void* at = peer.ss_family == AF_INET6 ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&peer)->sin6_addr)
                                                 : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&peer)->sin_addr);
    ::inet_ntop(peer.ss_family, at, text, sizeof(text));
  }
  MC_LOG(Warning) << "transfer engine: closed a connection from " << text << ": " << why << " (refusal " << n << ")";
}

void ConnectionServer::stop() {
  std::list<std::unique_ptr<Connection>> all;
  {
    std::lock_guard lock(mutex_);
    if (stopping_) return;
    stopping_ = true;
    listener_.stop();
    for (auto& c : connections_) {
      if (!c->done) c->socket.shutdownBoth();
    }
  }
  if (accept_thread_.joinable()) accept_thread_.join();
  {
    std::lock_guard lock(mutex_);
    all.splice(all.end(), connections_);
  }
  for (auto& c : all) {
    if (c->thread.joinable()) c->thread.join();
  }
}

}  // namespace mooncake::te::rpc
