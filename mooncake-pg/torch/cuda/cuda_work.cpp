#include "cuda_work.h"

#include <c10/cuda/CUDAGuard.h>

namespace mooncake::pg {

MooncakeCudaWork::MooncakeCudaWork(int rank, c10d::OpType type, int max_group_size, std::vector<at::Tensor> outputs,
                                   c10::DeviceIndex device, Kind kind)
    : MooncakeWork(rank, type, max_group_size, std::move(outputs), "mooncake"), device_(device), kind_(kind) {}

void MooncakeCudaWork::recordDone(const c10::cuda::CUDAStream& stream) {
  at::cuda::CUDAEvent event(cudaEventDisableTiming);
  event.record(stream);
  std::lock_guard lock(mutex_);
  done_.emplace(std::move(event));
}

void MooncakeCudaWork::blockCurrentStreamOnDone() {
  std::optional<at::cuda::CUDAEvent>* done = nullptr;
  {
    std::lock_guard lock(mutex_);
    if (done_) done = &done_;
  }
  if (done == nullptr) return;
  c10::cuda::CUDAGuard guard(device_);
  (*done)->block(c10::cuda::getCurrentCUDAStream(device_));
}

bool MooncakeCudaWork::isCompleted() {
  if (!c10d::Work::isCompleted()) return false;
  std::lock_guard lock(mutex_);
  return !done_ || done_->query();
}

bool MooncakeCudaWork::wait(std::chrono::milliseconds timeout) {
  {
    std::unique_lock lock(mutex_);
    if (kind_ == Kind::kStaged) {
      // Until the host part ends there is no event to order the stream on.
      // (Not c10d::Work::wait: it calls synchronize() with mutex_ held.)
      auto done = [this] { return completed_; };
      if (timeout == kNoTimeout) {
        cv_.wait(lock, done);
      } else if (!cv_.wait_for(lock, timeout, done)) {
        C10_THROW_ERROR(DistBackendError, "mooncake: Work.wait timed out after " + std::to_string(timeout.count()) +
                                              " ms; the operation is still running");
      }
    }
    if (completed_ && exception_) std::rethrow_exception(exception_);
  }
  blockCurrentStreamOnDone();
  return true;
}

void MooncakeCudaWork::synchronize() { blockCurrentStreamOnDone(); }

void MooncakeCudaWork::awaitOutcome() {
  std::unique_lock lock(mutex_);
  cv_.wait(lock, [this] { return completed_; });
}

}  // namespace mooncake::pg
