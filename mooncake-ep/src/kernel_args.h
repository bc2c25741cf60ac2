// What the host passes to the EP kernels (by value). Pointers to peers'
// regions are this process's IPC mappings; the rank's own is its allocation.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "mooncake/ep/cuda/ep_ipc_group.h"
#include "region_layout.h"

namespace mooncake::ep::cuda {

// Where a kernel learns that it need not wait for, or write to, a peer any
// longer: its process exited (set by the watchdog threads), or this rank's
// caller gave up (abortWaits). `departed` and `abort` are host-mapped words
// of the control block (ep_control_block.h says why host memory); reading
// them costs a PCIe round trip, and the reads of many blocks queue behind
// each other (a read per send block made the send kernels about 1.2 us per
// block: 340 us for 288 experts). So only the wait kernels read them, and
// copy what they find into `departed_seen`, device memory of this rank's
// region, which the send kernels read instead, beside `departed_bits`: the
// departures the host knew of when it enqueued the call (frozen in a
// captured graph, where departed_seen still serves).
static_assert(kMaxEpRanks <= 32, "departed_bits holds a bit per rank");

struct WaitEscape {
  const uint32_t* departed = nullptr;  // [R], host-mapped
  const uint32_t* abort = nullptr;     // one word, host-mapped
  uint32_t* departed_seen = nullptr;   // [R], device memory
  uint32_t departed_bits = 0;          // bit r: rank r gone at enqueue
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
