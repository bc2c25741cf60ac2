// A batch: the requests submitted under one BatchId and their completion.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <vector>

#include "mooncake/te/transport.h"
#include "net/socket.h"

namespace mooncake::te {

class Batch {
 public:
  explicit Batch(size_t capacity) : capacity_(capacity) {}

  // Appends tasks for `requests`; kTooManyRequests past the capacity (then
  // nothing is appended). Task addresses stay valid for the batch's life.
  int addTasks(const std::vector<TransferRequest>& requests, std::vector<TransferTask*>& out);
  size_t taskCount() const;
  TransferTask* task(size_t index);
  void cancelAll();

  // Called by a task when it reaches a terminal state: publishes its final
  // `state` and counts it settled.
  void onTaskSettled(std::atomic<TransferState>& state, TransferState value);
  bool settled() const;
  // Waits until every task is terminal; false when `deadline` came first.
  bool waitSettled(net::Deadline deadline);
  // Terminal tasks' aggregate (see TransferEngine::getBatchTransferStatus).
  TransferStatus aggregate() const;
  uint64_t totalBytes() const;

 private:
  const size_t capacity_;
  mutable std::mutex mutex_;
  std::condition_variable settled_cv_;
  std::deque<TransferTask> tasks_;
  size_t unsettled_ = 0;
  uint64_t total_bytes_ = 0;
};

}  // namespace mooncake::te
