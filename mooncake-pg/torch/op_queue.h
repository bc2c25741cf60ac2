// Runs a group's operations one at a time, in issue order, on one thread:
// every rank issues collectives in the same order, and the shared-memory
// protocol needs them executed in that order.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace mooncake::pg {

class OpQueue {
 public:
  OpQueue() : thread_([this] { loop(); }) {}
  ~OpQueue() { stop(); }

  // False (and `op` dropped) once the queue is stopping.
  bool push(std::function<void()> op) {
    {
      std::lock_guard lock(mutex_);
      if (stopping_) return false;
      ops_.push_back(std::move(op));
      ++outstanding_;
    }
    cv_.notify_one();
    return true;
  }

  // Runs `op` on the calling thread when nothing is queued or running (so
  // issue order is kept) and returns true; false leaves it to the caller to
  // push(). Saves the two thread wake-ups of a hand-off on small operations.
  bool runInlineIfIdle(const std::function<void()>& op) {
    {
      std::lock_guard lock(mutex_);
      if (outstanding_ != 0 || stopping_) return false;
      ++outstanding_;
      running_inline_ = true;
    }
    op();
    {
      std::lock_guard lock(mutex_);
      --outstanding_;
      running_inline_ = false;
    }
    cv_.notify_one();  // an op queued meanwhile by another thread may start now
    return true;
  }

  // Runs what is queued, then ends the thread. Idempotent.
  void stop() {
    {
      std::lock_guard lock(mutex_);
      if (stopping_) return;
      stopping_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> op;
      {
        std::unique_lock lock(mutex_);
        // Never alongside an op running inline on a caller's thread: the
        // group executes one operation at a time.
        cv_.wait(lock, [this] { return !running_inline_ && (stopping_ || !ops_.empty()); });
        if (ops_.empty()) return;
        op = std::move(ops_.front());
        ops_.pop_front();
      }
      op();  // ops catch their own errors and complete their Work
      std::lock_guard lock(mutex_);
      --outstanding_;
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> ops_;
  bool stopping_ = false;
  int outstanding_ = 0;  // queued or running
  bool running_inline_ = false;
  std::thread thread_;
};

}  // namespace mooncake::pg
