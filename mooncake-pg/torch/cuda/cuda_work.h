// The Work of an operation on CUDA tensors, with NCCL's stream semantics:
// wait() makes the caller's current stream wait for the operation (an event
// recorded after it) instead of blocking the host on the transfer.
//
// Two kinds, by where the operation runs:
//   on the stream (the CUDA IPC plane): the operation is already ordered on
//     the caller's stream when the call returns. wait() only orders the
//     current stream after it (a no-op on the same stream) and never blocks
//     the host; the host learns the outcome later (a watcher thread), which
//     then completes the Work, its future and its failure hint.
//   through host memory (the staged path: holes in the active set, several
//     hosts, P2P): the event exists only once the host part has finished and
//     the copies back to the device are enqueued, so wait() first blocks until
//     then (as Gloo's CUDA work does), then orders the current stream.
#pragma once

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>

#include <optional>

#include "../work.h"

namespace mooncake::pg {

class MooncakeCudaWork : public MooncakeWork {
 public:
  enum class Kind { kOnStream, kStaged };
  MooncakeCudaWork(int rank, c10d::OpType type, int max_group_size, std::vector<at::Tensor> outputs,
                   c10::DeviceIndex device, Kind kind);

  // After the operation (and its copies back) were enqueued on `stream`.
  // Before complete() for staged work; right after the launch otherwise.
  void recordDone(const c10::cuda::CUDAStream& stream);

  bool isCompleted() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override;
  void awaitOutcome() override;

 private:
  // Orders the current stream of the device after the operation.
  void blockCurrentStreamOnDone();

  c10::DeviceIndex device_;
  Kind kind_;
  std::optional<at::cuda::CUDAEvent> done_;  // unset under graph capture: the captured stream orders it
};

}  // namespace mooncake::pg
