// A set of point-to-point messages posted together and awaited together: one
// step of a collective built on P2pChannel (a ring step, a fan-out). Posting
// never blocks; wait() returns once every message has ended, successfully or
// not, so no message can still write into a buffer after its step returned.
// Messages of at most the channel's eager size are moved by the waiting
// caller itself (P2pChannel::drive), and posting them does not wake the
// progress thread: call wait() right after posting, without waiting for
// anything else in between.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <vector>

#include "mooncake/pg/p2p_channel.h"

namespace mooncake::pg {

class P2pExchange {
 public:
  // Peers are named in the caller's numbering; `channel_rank_of[i]` is the
  // channel's rank of the caller's rank i (empty: the same numbering).
  // Failed ranks come back in the caller's numbering.
  P2pExchange(P2pChannel& channel, int tag, const std::vector<int>& channel_rank_of = {})
      : channel_(channel), tag_(tag), channel_rank_of_(channel_rank_of), state_(std::make_shared<State>()) {}

  void send(int peer, const void* data, size_t bytes);
  void recv(int peer, void* data, size_t bytes);
  void recv(int peer, size_t bytes, P2pChannel::Sink sink);
  // The first error among the messages, with every failed peer named.
  OpResult wait();

 private:
  struct State {
    std::mutex mutex;
    std::condition_variable done;
    int pending = 0;
    OpResult result;
  };
  P2pChannel::Done completion(size_t bytes);
  int toChannel(int rank) const { return channel_rank_of_.empty() ? rank : channel_rank_of_[rank]; }

  P2pChannel& channel_;
  const int tag_;
  const std::vector<int>& channel_rank_of_;
  std::shared_ptr<State> state_;  // shared with the callbacks, which may outlive a thrown-out caller
  size_t largest_ = 0;            // the largest message posted since the last wait()
};

}  // namespace mooncake::pg
