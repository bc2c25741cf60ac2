#include "p2p_exchange.h"

#include <algorithm>

namespace mooncake::pg {

P2pChannel::Done P2pExchange::completion(size_t bytes) {
  largest_ = std::max(largest_, bytes);
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    ++state_->pending;
  }
  return [state = state_](const OpResult& r) {
    std::lock_guard<std::mutex> lock(state->mutex);
    if (!r.ok) {
      state->result.mismatch |= r.mismatch;
      if (state->result.ok) {
        state->result.ok = false;
        state->result.error = r.error;
      }
      for (int q : r.failed_ranks) {
        auto& named = state->result.failed_ranks;
        if (std::find(named.begin(), named.end(), q) == named.end()) named.push_back(q);
      }
    }
    if (--state->pending == 0) state->done.notify_all();
  };
}

void P2pExchange::send(int peer, const void* data, size_t bytes) {
  // A collective learns of a lost or refused message from its next one: a
  // small send need not wait a round trip for the receiver to take it.
  channel_.send(toChannel(peer), tag_, data, bytes, completion(bytes), /*caller_drives=*/true,
                /*ends_when_sent=*/true);
}

void P2pExchange::recv(int peer, void* data, size_t bytes) {
  channel_.recv(toChannel(peer), tag_, data, bytes, completion(bytes), /*caller_drives=*/true);
}

void P2pExchange::recv(int peer, size_t bytes, P2pChannel::Sink sink) {
  channel_.recv(toChannel(peer), tag_, bytes, std::move(sink), completion(bytes), /*caller_drives=*/true);
}

OpResult P2pExchange::wait() {
  // Small messages: this thread moves them itself for a while (their bytes
  // are due within about a round trip), instead of sleeping until the
  // progress thread has.
  channel_.drive(
      [state = state_.get()] {
        std::lock_guard<std::mutex> lock(state->mutex);
        return state->pending == 0;
      },
      largest_);
  largest_ = 0;
  // No deadline here: the channel ends every message, at the latest when its
  // peer made no progress for the channel's timeout.
  std::unique_lock<std::mutex> lock(state_->mutex);
  state_->done.wait(lock, [&] { return state_->pending == 0; });
  OpResult r = state_->result;
  state_->result = OpResult{};
  if (!channel_rank_of_.empty()) {  // back to the caller's numbering; ranks outside it stay as they are
    for (int& q : r.failed_ranks) {
      auto it = std::find(channel_rank_of_.begin(), channel_rank_of_.end(), q);
      if (it != channel_rank_of_.end()) q = static_cast<int>(it - channel_rank_of_.begin());
    }
  }
  return r;
}

}  // namespace mooncake::pg
