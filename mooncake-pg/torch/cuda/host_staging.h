// The staged path of the "mooncake" backend: an operation on CUDA tensors
// run by the host backend (mooncake-cpu's planes: shared memory inside a
// host, the transfer engine between hosts, P2P over the credit protocol) on
// pinned host copies. It serves what the CUDA IPC plane does not: holes in
// the active set, groups spanning hosts, joiners before activation, a plane
// that broke, and P2P; and it carries the elastic semantics of the host
// backend (survivors rerun, failure hints) to CUDA tensors.
//
// Stream semantics as Gloo's CUDA path: a side stream waits for the caller's
// current stream and copies the inputs to the host; the operation thread
// waits for those copies (never the caller's thread); after the host
// operation, the outputs are copied back on the side stream and an event is
// recorded, which Work.wait() makes the current stream wait for.
#pragma once

#include <c10/cuda/CUDAStream.h>

#include <functional>
#include <mutex>
#include <vector>

#include "../cpu_backend.h"
#include "cuda_work.h"

namespace mooncake::pg {

class HostStaging {
 public:
  explicit HostStaging(MooncakeCpuBackend& host) : host_(host) {}

  // The host operation, given the host copies of `reads` and the host
  // buffers of `writes` (the same tensor where a write aliases a read).
  using HostCall = std::function<c10::intrusive_ptr<c10d::Work>(std::vector<at::Tensor>& reads,
                                                                 std::vector<at::Tensor>& writes)>;
  enum class Start {
    kOnOperationThread,  // queued operations: the operation thread waits for the input copies
    kNow,                // P2P sends, which start at once: the caller waits for the input copies
  };

  // Runs `call` on host copies of `reads`; copies `writes` back to the
  // device when it succeeds. `op` names the operation in errors.
  c10::intrusive_ptr<c10d::Work> run(c10d::OpType type, const char* op, const std::vector<at::Tensor>& reads,
                                     const std::vector<at::Tensor>& writes, const HostCall& call,
                                     Start start = Start::kOnOperationThread);

 private:
  c10::cuda::CUDAStream sideStream(c10::DeviceIndex device);

  MooncakeCpuBackend& host_;
  std::mutex mutex_;
  std::vector<std::optional<c10::cuda::CUDAStream>> side_;  // per device
};

}  // namespace mooncake::pg
