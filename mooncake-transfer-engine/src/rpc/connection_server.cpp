#include "rpc/connection_server.h"

#include "mooncake/te/log.h"
#include "mooncake/te/status.h"

namespace mooncake::te::rpc {

int ConnectionServer::start(uint16_t min_port, uint16_t max_port, bool ipv6, std::chrono::milliseconds hello_timeout) {
  hello_timeout_ = hello_timeout;
  if (int rc = listener_.open(min_port, max_port, ipv6); rc != kOk) return rc;
  accept_thread_ = std::thread([this] { acceptLoop(); });
  return kOk;
}

void ConnectionServer::acceptLoop() {
  for (;;) {
    net::Socket socket;
    if (!listener_.accept(socket)) return;
    std::list<std::unique_ptr<Connection>> finished;
    std::lock_guard lock(mutex_);
    reapFinishedLocked(finished);
    if (stopping_) return;
    auto connection = std::make_unique<Connection>();
    connection->socket = std::move(socket);
    Connection* raw = connection.get();
    connections_.push_back(std::move(connection));
    raw->thread = std::thread([this, raw] { serve(raw); });
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
  uint32_t magic = 0;
  int fd = connection->socket.fd();
  if (net::recvAll(fd, &magic, sizeof(magic), net::after(hello_timeout_)) == kOk) {
    auto it = handlers_.find(magic);
    if (it != handlers_.end()) {
      it->second(connection->socket);
    } else {
      MC_LOG(Warning) << "dropping a connection with unknown magic 0x" << std::hex << magic;
    }
  }
  // Close under the lock: stop() only shuts down sockets of live connections,
  // so it never touches a descriptor number that was closed and reused.
  std::lock_guard lock(mutex_);
  connection->socket.close();
  connection->done = true;
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
