// A set of point-to-point messages posted together and awaited together: one
// step of a collective built on P2pChannel (a ring step, a fan-out). Posting
// never blocks; wait() returns once every message has ended, successfully or
// not, so no message can still write into a buffer after its step returned.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>

#include "mooncake/pg/p2p_channel.h"

namespace mooncake::pg {

class P2pExchange {
 public:
  P2pExchange(P2pChannel& channel, int tag) : channel_(channel), tag_(tag), state_(std::make_shared<State>()) {}

  void send(int peer, const void* data, size_t bytes);
  void recv(int peer, void* data, size_t bytes);
  // The first error among the messages, with every failed peer named.
  OpResult wait();

 private:
  struct State {
    std::mutex mutex;
    std::condition_variable done;
    int pending = 0;
    OpResult result;
  };
  P2pChannel::Done completion();

  P2pChannel& channel_;
  const int tag_;
  std::shared_ptr<State> state_;  // shared with the callbacks, which may outlive a thrown-out caller
};

}  // namespace mooncake::pg
