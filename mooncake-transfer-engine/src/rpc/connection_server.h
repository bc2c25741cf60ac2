// The engine's one listening port. Every connection starts with a 4-byte
// magic naming its kind (handshake RPC, TCP transport data, ...) and is then
// served on its own thread by the handler registered for that kind, so that
// the transports share the port peers learn from the segment name.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "net/socket.h"

namespace mooncake::te::rpc {

class ConnectionServer {
 public:
  using Handler = std::function<void(net::Socket&)>;

  ~ConnectionServer() { stop(); }

  // Before start(): which handler serves connections opening with `magic`.
  void addHandler(uint32_t magic, Handler handler) { handlers_[magic] = std::move(handler); }

  // Binds a port in [min_port, max_port] and starts accepting. A connection
  // that does not send its magic within `hello_timeout` is dropped.
  int start(uint16_t min_port, uint16_t max_port, bool ipv6, std::chrono::milliseconds hello_timeout);
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

  std::map<uint32_t, Handler> handlers_;
  net::Listener listener_;
  std::chrono::milliseconds hello_timeout_{5000};
  std::thread accept_thread_;
  std::mutex mutex_;
  std::list<std::unique_ptr<Connection>> connections_;
  bool stopping_ = false;
};

}  // namespace mooncake::te::rpc
