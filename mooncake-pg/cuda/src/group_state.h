// Inside CudaIpcGroup: its resources, and OpRun, the builder every
// operation's schedule is written with.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "control_block.h"
#include "mooncake/pg/cuda/common/cuda_calls.h"  // DeviceScope, cudaWhat
#include "kernel_args.h"
#include "mooncake/pg/cuda/cuda_ipc_group.h"
#include "schedule.h"
#include "stream_sync.h"
#include "watchdog.h"

namespace mooncake::pg::cuda {

// Layout of a staging allocation: a header (the operation signature at 0,
// read by peers; the rank's abort word at kAbortWordOffset, read by its own
// kernels), then two halves that alternate between rounds.
constexpr size_t kStagingHeaderBytes = 4096;
constexpr size_t kAbortWordOffset = 128;  // a cache line of its own

struct CudaIpcGroup::State {
  int rank = 0;
  int size = 0;
  int device = 0;
  int sm_count = 0;
  CudaIpcGroupOptions options;
  size_t half_bytes = 0;

  char* staging = nullptr;                  // this rank's allocation (device)
  std::vector<char*> peer_staging;          // every rank's, through IPC (this rank's own for itself)
  std::unique_ptr<ControlBlock> control;
  std::unique_ptr<StreamSync> sync;
  std::unique_ptr<Watchdog> watchdog;

  std::mutex mutex;                 // operations are enqueued one at a time
  uint64_t next_id = 0;             // ids of eager operations
  cudaStream_t last_stream = nullptr;
  bool have_last_stream = false;
  cudaEvent_t last_op_done = nullptr;  // recorded at the end of every eager operation
  uint32_t alltoall_round = 0;     // all_to_all size exchanges done; the first is 1 (the control block starts at 0)

  char* half(int r, int h) const { return peer_staging[r] + kStagingHeaderBytes + static_cast<size_t>(h) * half_bytes; }
  uint32_t* signatureWord(int r) const { return reinterpret_cast<uint32_t*>(peer_staging[r]); }
  uint32_t* abortWord() const { return reinterpret_cast<uint32_t*>(staging + kAbortWordOffset); }
  // Bytes of one rank's slot when a half is shared by `size` slots.
  size_t slotBytes() const { return half_bytes / size / kRoundAlignBytes * kRoundAlignBytes; }

  ~State();
};

// One operation being enqueued. The schedules call stage/consume kernels and
// barriers in order; OpRun adds what every operation needs: joining the
// previous operation's stream, the progress marks, the signature (written
// with the first barrier, checked by the kernel right after it), the guard
// of every kernel, and the parity rule (an even number of barriers). A
// barrier is held back until the next step, so that an operation ending
// with one writes its finished mark in the same batch.
class OpRun {
 public:
  OpRun(CudaIpcGroup::State& group, cudaStream_t stream, uint32_t signature);
  // Failed before anything was enqueued (broken group, CUDA error).
  bool failed() const { return !result_.ok; }
  const OpResult& result() const { return result_; }
  // Fails the operation for a reason found while scheduling it (nothing more
  // is enqueued); the group breaks, as for a CUDA error.
  void fail(const OpResult& why);

  void barrier();
  void copy(const CopyJob& job);
  void reduce(const ReduceJob& job);
  // The direct schedule's single round as one kernel (fused_kernels.cu):
  // `bytes` of `src` pushed to each of the `npush` destinations, the first
  // barrier, `fold`, the closing barrier and the finished mark. It is the
  // whole operation: nothing may come before or after it.
  void fusedDirect(const void* src, void* const* push_dst, int npush, size_t bytes, const ReduceJob& fold);
  // Ends the operation: the finished mark, the event the next operation on
  // another stream waits for. A CUDA error while enqueueing breaks the group
  // (the peers would otherwise wait for steps that never come).
  CudaOp finish();

 private:
  OpGuard guard();
  // The words written with a barrier's signals: the started mark (eager)
  // and the signature with the operation's first barrier.
  StreamSync::BarrierExtras barrierExtras(bool first) const;
  void check(cudaError_t err, const char* what);
  // Enqueues the held-back barrier, if any, with `finished` as its last
  // write, and gated (StreamSync::barrier) when a kernel follows it.
  void flushBarrier(bool finished = false, bool gate = false);

  CudaIpcGroup::State& g_;
  cudaStream_t stream_;
  bool capturing_ = false;
  uint64_t id_ = 0;  // eager operations only; the stream sees its low 32 bits
  uint32_t signature_;
  int barriers_ = 0;
  bool barrier_pending_ = false;
  StreamSync::BarrierExtras pending_extras_;
  bool signature_checked_ = false;
  bool must_break_ = false;  // failed after enqueueing began
  bool finished_marked_ = false;  // a kernel of the operation writes its finished mark
  OpResult result_;
};

// Appends a copy to `job` (skipped when empty or in place).
inline void addCopy(CopyJob& job, const void* src, void* dst, size_t bytes) {
  if (bytes == 0 || src == dst) return;
  job.piece[job.count++] = CopyPiece{src, dst, bytes};
}

// The shape most moving operations share: for each round, stage (this
// rank's part into its own staging half, or pushed into the peers' halves),
// barrier, consume (from the peers' halves, or from its own). Whichever way,
// a write into a half of round i follows the barrier of round i - 1, which
// every rank signals only after its reads of round i - 2 (the same half). See
// RoundPlan for why the rounds and barriers come out even.
template <typename Stage, typename Consume>
void runRounds(OpRun& run, const RoundPlan& plan, Stage&& stage, Consume&& consume) {
  for (size_t i = 0; i < plan.rounds && !run.failed(); ++i) {
    const int h = static_cast<int>(i % 2);
    stage(h, plan.begin(i), plan.length(i));
    run.barrier();
    consume(h, plan.begin(i), plan.length(i));
  }
  if (plan.closing_barrier) run.barrier();
}

// Runs `schedule(run)` as one operation on `stream`: one at a time, on the
// group's device, nothing enqueued when the group is already broken.
template <typename Schedule>
CudaOp enqueueOp(CudaIpcGroup::State& g, cudaStream_t stream, uint32_t signature, Schedule&& schedule) {
  std::lock_guard lock(g.mutex);
  DeviceScope scope(g.device);
  OpRun run(g, stream, signature);
  if (run.failed()) return CudaOp{run.result(), 0};
  schedule(run);
  return run.finish();
}

// Checks shared by the operations; empty when fine.
std::string checkRoot(const CudaIpcGroup::State& g, int root);
std::string checkReduction(DataType type, ReduceOp op);
CudaOp rejected(const std::string& why);

}  // namespace mooncake::pg::cuda
