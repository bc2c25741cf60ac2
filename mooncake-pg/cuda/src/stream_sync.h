// The stream's side of the group's synchronization: barriers between the
// ranks' streams, and progress marks the host watchdog reads.
//
// Barrier protocol. Rank r's block holds arrival[set][q] for every peer q.
// A barrier of `set` on rank r's stream:
//   1. writes 1 into arrival[set][r] of every peer (release: everything the
//      stream did before, the data it staged or pushed into the peers
//      included, is visible first);
//   2. waits until its own arrival[set][q] == 1 for every peer (acquire:
//      the kernels after it see what the peers staged or pushed here);
//   3. clears its own arrival[set][q] to 0.
// Every value is a constant, so a captured barrier replays as it ran. A flag
// is reused safely because consecutive barriers alternate sets: q writes
// arrival[set][r] again only after passing the next barrier (the other set),
// which needs r's signal of that barrier, which r's stream issues after step
// 3 of this one. Every operation therefore runs an even number of barriers,
// starting with set 0, so that no state carries from one operation (or one
// graph replay) to the next.
//
// With stream memory operations the three steps are one batch on the stream:
// a waiting stream occupies no SM, and other ranks' kernels (other processes
// on the same GPU) run meanwhile. With kernels, one warp does the same and
// also gives up at its own deadline or when the group breaks.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "control_block.h"
#include "mooncake/pg/cuda/cuda_ipc_group.h"

namespace mooncake::pg::cuda {

class StreamSync {
 public:
  // Words written in the same step as a barrier's signals (null: none).
  struct BarrierExtras {
    std::atomic<uint32_t>* started = nullptr;  // progress word (host), set to started_value
    uint32_t started_value = 0;
    uint32_t* signature_word = nullptr;  // this rank's staging header (device memory)
    uint32_t signature = 0;
    uint32_t op_id = 0;
    // Progress word (host) set to finished_value once the barrier has passed:
    // the end of an operation whose last step is this barrier.
    std::atomic<uint32_t>* finished = nullptr;
    uint32_t finished_value = 0;
  };

  // abort_word: this rank's device abort word (kernel_args.h), which the
  // gate after a barrier sets when the group is broken.
  StreamSync(ControlBlock& control, SyncMode requested, std::chrono::milliseconds timeout, uint32_t* abort_word);
  // Finds the driver's stream memory operations and tries them (eagerly and
  // under capture) on the current device; empty on success.
  std::string init();

  bool memOpsAvailable() const { return memops_available_; }
  bool memOpsCapturable() const { return memops_capturable_; }

  // gate: a kernel that reads the peers' memory follows, so the barrier
  // ends with the gate (sync_kernels.cu): one read of the group's broken
  // state, which sets the device abort word that the kernels check. A
  // barrier kernel always does it; after memory operations it is a
  // one-thread kernel.
  cudaError_t barrier(cudaStream_t stream, bool capturing, int set, const BarrierExtras& extras, bool gate);
  // The kernel form's arguments for a barrier of `set` (barrier_warp.cuh),
  // for a kernel that runs the barrier itself.
  BarrierKernelArgs kernelBarrierArgs(int set, const BarrierExtras& extras) const;
  // *word = value once everything before on the stream has completed.
  cudaError_t mark(cudaStream_t stream, bool capturing, std::atomic<uint32_t>* word, uint32_t value);

 private:
  bool useMemOps(bool capturing) const;
  cudaError_t barrierWithMemOps(cudaStream_t stream, int set, const BarrierExtras& extras, bool gate);
  cudaError_t barrierWithKernel(cudaStream_t stream, int set, const BarrierExtras& extras);

  ControlBlock& control_;
  SyncMode requested_;
  std::chrono::milliseconds timeout_;
  uint32_t* abort_word_;
  bool memops_available_ = false;
  bool memops_capturable_ = false;
};

}  // namespace mooncake::pg::cuda
