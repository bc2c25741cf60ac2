// The engine's one listening port. Every connection opens with its kind (a
// 4-byte magic: handshake RPC, TCP transport data, ...; with a secret, after
// a mutual challenge, rpc/opening.h) and is then served on its own thread by
// the handler registered for that kind, so that the transports share the
// port peers learn from the segment name.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "net/socket.h"

namespace mooncake::te::rpc {

class ConnectionServer {
 public:
  using Handler = std::function<void(net::Socket&)>;

  ~ConnectionServer() { stop(); }

  // Before start(): which handler serves connections opening with `magic`.
  void addHandler(uint32_t magic, Handler handler) { handlers_[magic] = std::move(handler); }

  // Binds a port in [min_port, max_port] on `bind_address` (an IP literal;
  // "" for every interface) and starts accepting. A connection that does not
  // open (rpc/opening.h, with `secret` when it is not empty) within
  // `hello_timeout` is dropped and logged.
  int start(uint16_t min_port, uint16_t max_port, const std::string& bind_address, const std::string& secret,
            std::chrono::milliseconds hello_timeout);
  uint16_t port() const { return listener_.port(); }

  // Stops accepting, wakes every connection (its reads see end of stream) and
  // joins all threads. Idempotent.
  void stop();

 private:
  struct Connection {
    std::thread thread;
    net::Socket socket;
    bool done = false;  // guarded by mutex_; set when the handler returned
  };

  void acceptLoop();
  void serve(Connection* connection);
  void reapFinishedLocked(std::list<std::unique_ptr<Connection>>& finished);

  void logRefusal(const net::Socket& socket, const std::string& why);

  // Connections served at once (each on its own thread); more are closed at once.
  static constexpr size_t kMaxConnections = 1024;

  std::map<uint32_t, Handler> handlers_;
  net::Listener listener_;
  std::string secret_;
  std::atomic<uint64_t> refusals_{0};
  std::chrono::milliseconds hello_timeout_{5000};
  std::thread accept_thread_;
  std::mutex mutex_;
  std::list<std::unique_ptr<Connection>> connections_;
  bool stopping_ = false;
};

}  // namespace mooncake::te::rpc
