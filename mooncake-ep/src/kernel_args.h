// What the host passes to the EP kernels (by value). Pointers to peers'
// regions are this process's IPC mappings; the rank's own is its allocation.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "mooncake/ep/cuda/ep_ipc_group.h"
#include "region_layout.h"

namespace mooncake::ep::cuda {

// Where a waiting kernel learns that it need not wait any longer for a peer:
// its process exited, or this rank's caller gave up (abortWaits). The
// EscapeWords of the rank's own region (device memory).
// In device memory of the rank's own region: departed[r] once rank r's
// process exited, abort once the caller gave up (abortWaits). The host writes
// them with cudaMemcpy (the watchdog thread, abortWaits).
struct EscapeWords {
  uint32_t departed[kMaxEpRanks];
  uint32_t abort;
};
static_assert(kEscapeWordsOffset + sizeof(EscapeWords) <= kCountersBytes);

struct WaitEscape {
  const uint32_t* departed = nullptr;  // [R]
  const uint32_t* abort = nullptr;     // one word
};

struct GroupCounters;  // call_sequence.cuh (device code only)

struct EpKernelContext {
  RegionLayout layout;
  int rank = 0;
  GroupCounters* counters = nullptr;  // this rank's call numbers, inside its own region
  char* regions[kMaxEpRanks] = {};  // every rank's receive region as this process addresses it
  WaitEscape escape;
  int64_t timeout_ns = -1;  // -1: no deadline
};

cudaError_t launchDispatch(const EpKernelContext& ctx, const DispatchArgs& args, EpStages stages, cudaStream_t stream);
cudaError_t launchCombine(const EpKernelContext& ctx, const CombineArgs& args, EpStages stages, cudaStream_t stream);

}  // namespace mooncake::ep::cuda
