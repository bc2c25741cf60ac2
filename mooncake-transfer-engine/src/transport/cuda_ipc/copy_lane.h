// Where the cuda_ipc transport's copies run on one local GPU: a stream of its
// own (so copies never wait behind the application's kernels, nor make them
// wait), and a thread that completes tasks when their copies are done, so a
// submitting thread that does not wait is never held up by the GPU.
// Compiled only when MOONCAKE_WITH_CUDA.
#pragma once

#include <cuda_runtime_api.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "mooncake/te/transport.h"

namespace mooncake::te {

class CopyLane {
 public:
  // A task whose single slice ends with the copies enqueued before it.
  struct Completion {
    TransferTask* task;
    uint64_t bytes;
  };

  // Null (logged) when the device's stream cannot be made.
  static std::unique_ptr<CopyLane> create(int device);
  // Completes every task in flight (their copies finish first).
  ~CopyLane();
  CopyLane(const CopyLane&) = delete;
  CopyLane& operator=(const CopyLane&) = delete;

  int device() const { return device_; }

  // The calls below need this lane's device current (cuda::DeviceScope).
  // Enqueues a copy of `n` bytes (cudaMemcpyAsync: into a peer's mapping on
  // the same GPU it runs at about 95% of a local device copy, measured on an
  // H200, so no copy kernel of our own). kOk, or kEndpointError with nothing
  // enqueued.
  int copy(void* dst, const void* src, size_t n);
  // Completes `completions` once every copy enqueued so far has finished:
  // on this thread before returning when `wait_here` (its caller waits for
  // the result anyway, and a hand-off would only add a wake-up), else on the
  // lane's thread. `holds` (mappings the copies use) are released after.
  void finish(std::vector<Completion> completions, std::vector<std::shared_ptr<void>> holds, bool wait_here);

 private:
  struct InFlight {
    cudaEvent_t event = nullptr;
    std::vector<Completion> completions;
    std::vector<std::shared_ptr<void>> holds;
  };

  CopyLane(int device, cudaStream_t stream);
  void completerLoop();
  void settle(InFlight& work);  // waits for the event, completes, recycles the event
  cudaEvent_t takeEvent();

  const int device_;
  cudaStream_t const stream_;

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<InFlight> in_flight_;  // in recording order
  std::vector<cudaEvent_t> free_events_;
  bool stopping_ = false;
  std::thread completer_;
};

}  // namespace mooncake::te
