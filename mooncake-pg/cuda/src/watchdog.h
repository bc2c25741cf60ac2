// The host thread that bounds every wait of this rank's stream. The stream
// never waits on its own deadline (a stream memory operation waits until
// its flag is set); this thread watches, from the control block alone (no
// CUDA call, so graph capture in any mode is never disturbed):
//   - the stream's progress: an operation that started and has not finished
//     within the timeout breaks the group, naming the ranks whose barrier
//     signal is missing;
//   - the peers' processes (pidfd): a dead peer breaks the group at once,
//     also between operations, so that graph replays are released too;
//   - the kernels' reports: a signature mismatch or a kernel barrier's
//     timeout breaks the group.
// Once the group is broken, by this rank or any other, it releases this
// rank's waits by setting every flag this rank waits on, over and over until
// the stream has drained (each barrier clears them again), and the kernels
// skip their work: the queued operations complete quickly, as failed.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "control_block.h"

namespace mooncake::pg::cuda {

class Watchdog {
 public:
  Watchdog(ControlBlock& control, std::chrono::milliseconds timeout);
  ~Watchdog();  // stops the thread

  // The last eager operation that completed before the group broke: later
  // ones failed. Requires control.broken(); the first caller (this thread or
  // a poll) fixes the value.
  uint32_t finishedAtBreak();
  // Breaks the group if a kernel reported a failure (signature mismatch,
  // barrier timeout); true if one did. Any thread may call it (a poll does,
  // so that an operation is never reported done before its failure is seen).
  bool breakOnDeviceReport();

 private:
  void run();
  // One look at the group; returns how long to sleep before the next.
  std::chrono::microseconds tick();
  void releaseOwnWaits();
  std::vector<int> missingRanks() const;

  ControlBlock& control_;
  const std::chrono::milliseconds timeout_;
  // The operation being timed and since when (steady clock).
  uint32_t watched_id_ = 0;
  std::chrono::steady_clock::time_point watched_since_{};
  bool watching_ = false;
  // While broken: the stream's last finished mark and when it changed, so
  // that the fast drain stops once the stream has nothing left to drain.
  uint32_t drain_finished_ = 0;
  std::chrono::steady_clock::time_point drain_progress_{};

  std::mutex snapshot_mutex_;
  bool snapshot_taken_ = false;
  uint32_t finished_at_break_ = 0;

  std::mutex stop_mutex_;
  std::condition_variable stop_cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace mooncake::pg::cuda
