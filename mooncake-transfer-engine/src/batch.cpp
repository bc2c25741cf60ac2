#include "batch.h"

#include <sys/socket.h>

#include <algorithm>

namespace mooncake::te {

// ---- TransferTask ----

void TransferTask::completeSlice(uint64_t bytes, int error) {
  if (error != kOk) {
    int expected = kOk;
    first_error_.compare_exchange_strong(expected, error, std::memory_order_relaxed);
  } else {
    transferred_.fetch_add(bytes, std::memory_order_relaxed);
  }
  // acq_rel: the slice's effects (and its error) are visible to whoever
  // settles the task after the last decrement.
  if (slices_left_.fetch_sub(1, std::memory_order_acq_rel) == 1) settle();
}

void TransferTask::fail(int error) {
  first_error_.store(error, std::memory_order_relaxed);
  slices_left_.store(0, std::memory_order_relaxed);
  settle();
}

void TransferTask::cancel() {
  std::lock_guard lock(connection_mutex_);
  canceled_.store(true, std::memory_order_release);
  for (int fd : connection_fds_) ::shutdown(fd, SHUT_RDWR);
}

bool TransferTask::onConnection(int fd) {
  std::lock_guard lock(connection_mutex_);
  if (canceled_.load(std::memory_order_relaxed)) return false;
  connection_fds_.push_back(fd);
  return true;
}

void TransferTask::offConnection(int fd) {
  std::lock_guard lock(connection_mutex_);
  auto it = std::find(connection_fds_.begin(), connection_fds_.end(), fd);
  if (it != connection_fds_.end()) connection_fds_.erase(it);
}

void TransferTask::settle() {
  int error = first_error_.load(std::memory_order_relaxed);
  TransferState state = error == kOk         ? TransferState::kCompleted
                        : error == kTimeout  ? TransferState::kTimeout
                        : error == kCanceled ? TransferState::kCanceled
                                             : TransferState::kFailed;
  batch_->onTaskSettled(state_, state);
}

TransferStatus TransferTask::status() const {
  TransferStatus s;
  s.state = state_.load(std::memory_order_acquire);
  s.transferred_bytes = transferred_.load(std::memory_order_relaxed);
  s.error = first_error_.load(std::memory_order_relaxed);
  const uint32_t slices = slices_.load(std::memory_order_relaxed);
  s.sent =
      s.state == TransferState::kCompleted || (slices > 0 && sent_slices_.load(std::memory_order_acquire) >= slices);
  return s;
}

// ---- PeerSegment ----

std::shared_ptr<const SegmentDescriptor> PeerSegment::descriptor() const {
  std::lock_guard lock(mutex_);
  return descriptor_;
}

void PeerSegment::setDescriptor(SegmentDescriptor descriptor) {
  descriptor.index();
  auto snapshot = std::make_shared<const SegmentDescriptor>(std::move(descriptor));
  std::lock_guard lock(mutex_);
  descriptor_ = std::move(snapshot);
}

// ---- Batch ----

void Batch::cancelAll() {
  std::lock_guard lock(mutex_);
  for (TransferTask& t : tasks_) t.cancel();
}

int Batch::addTasks(const std::vector<TransferRequest>& requests, std::vector<TransferTask*>& out) {
  std::lock_guard lock(mutex_);
  if (tasks_.size() + requests.size() > capacity_) return kTooManyRequests;
  out.clear();
  out.reserve(requests.size());
  for (const auto& r : requests) {
    tasks_.emplace_back(this, r);
    out.push_back(&tasks_.back());
    total_bytes_ += r.length;
  }
  unsettled_ += requests.size();
  return kOk;
}

size_t Batch::taskCount() const {
  std::lock_guard lock(mutex_);
  return tasks_.size();
}

TransferTask* Batch::task(size_t index) {
  std::lock_guard lock(mutex_);
  return index < tasks_.size() ? &tasks_[index] : nullptr;
}

void Batch::onTaskSettled(std::atomic<TransferState>& state, TransferState value) {
  // The state is published and the count dropped under one lock: a caller
  // that saw the task end (its status) and then frees the batch finds it
  // settled, never busy.
  std::lock_guard lock(mutex_);
  state.store(value, std::memory_order_release);
  if (--unsettled_ == 0) settled_cv_.notify_all();
}

bool Batch::settled() const {
  std::lock_guard lock(mutex_);
  return unsettled_ == 0;
}

bool Batch::waitSettled(net::Deadline deadline) {
  std::unique_lock lock(mutex_);
  auto done = [this] { return unsettled_ == 0; };
  if (deadline == net::never()) {
    settled_cv_.wait(lock, done);
    return true;
  }
  return settled_cv_.wait_until(lock, deadline, done);
}

TransferStatus Batch::aggregate() const {
  std::lock_guard lock(mutex_);
  TransferStatus out;
  bool all_completed = true;
  bool all_sent = !tasks_.empty();
  for (const auto& t : tasks_) {
    TransferStatus s = t.status();
    out.transferred_bytes += s.transferred_bytes;
    all_sent = all_sent && s.sent;
    if (s.state == TransferState::kFailed || s.state == TransferState::kTimeout || s.state == TransferState::kCanceled) {
      if (out.error == kOk) {
        out.error = s.error;
        out.state = s.state;
      }
    } else if (s.state != TransferState::kCompleted) {
      all_completed = false;
    }
  }
  if (out.error == kOk) out.state = all_completed ? TransferState::kCompleted : TransferState::kPending;
  out.sent = all_sent;
  return out;
}

uint64_t Batch::totalBytes() const {
  std::lock_guard lock(mutex_);
  return total_bytes_;
}

}  // namespace mooncake::te
