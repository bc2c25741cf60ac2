// The host-side checks of one dispatch or combine call, and the gate that
// refuses calls once a launch failed: shared by every group that runs the EP
// kernels (EpIpcGroup over CUDA IPC, EpNcclGroup over an NCCL window).
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <string>

#include "mooncake/ep/cuda/ep_ipc_group.h"
#include "region_layout.h"

namespace mooncake::ep::cuda {

// "" when a group of `num_ranks` may be opened with these sizes, else why not.
std::string checkGroupSizes(int rank, int num_ranks, const EpIpcGroupOptions& options);

// "" when the arguments are valid for a region of `layout`, else why not.
std::string checkDispatchCall(const DispatchArgs& args, const RegionLayout& layout);
std::string checkCombineCall(const CombineArgs& args, const RegionLayout& layout);

// Runs one call's launches unless an earlier launch failed. A failed launch
// leaves this rank's call numbers out of step with the peers' (a send
// enqueued without its receive, or the other way round), so every later call
// is refused rather than paired with the wrong data.
class LaunchGate {
 public:
  // "" or why not; on a failed launch, `on_failure` runs once (it releases
  // whatever this rank enqueued from waiting for peers).
  std::string run(int device, const std::function<cudaError_t()>& launch, const std::function<void()>& on_failure);

 private:
  std::string broken_;
};

}  // namespace mooncake::ep::cuda
