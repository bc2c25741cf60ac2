// Collectives over GPU memory between the processes of one host, ordered on
// the caller's CUDA stream. Several ranks may share one GPU (NCCL refuses
// that); ranks on different GPUs of the host work the same way, through peer
// access.
//
// Every rank owns a staging allocation in device memory, exported with CUDA
// IPC and opened by every peer, and a control block in host shared memory
// (registered with CUDA, so that the GPU and the host both read and write it).
// An operation is a schedule of steps enqueued on the caller's stream:
//   stage    a kernel copies this rank's input into its own staging buffer;
//   barrier  this rank writes 1 into a flag of every peer (release), waits
//            until every peer has written 1 into its own flags (acquire), and
//            clears them: stream memory operations, so that a waiting rank
//            holds no SM and the GPU can run the other ranks meanwhile;
//   consume  a kernel reads or reduces straight out of the peers' staging
//            buffers into the output.
// Small reductions take one step (every rank folds all inputs); large ones
// reduce-scatter then all-gather inside device memory, so each rank moves
// O(size) bytes whatever the world size. Nothing in a schedule depends on
// state the host keeps between operations, so a schedule captured into a
// CUDA graph replays correctly any number of times.
//
// Nothing blocks the host on the transfer: an operation returns once it is
// enqueued, with an id to poll. Every wait is bounded: a host watchdog thread
// watches the stream's progress and the peers' processes, and when a peer
// dies or does not arrive within the timeout it marks the group broken,
// naming the ranks at fault, and releases this rank's waits; kernels then
// skip their work (no kernel ever spins on a peer unless SyncMode::kKernels
// is chosen, and then only until the same deadline), and the operation
// completes on the stream as failed. A broken group stays broken: every later
// operation fails fast, as with ShmGroup.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mooncake/pg/collectives.h"
#include "mooncake/pg/types.h"

namespace mooncake::pg::cuda {

// How a barrier waits. kStreamMemOps: the stream waits on the flag in the
// GPU's front end (no SM busy; other processes' kernels run meanwhile).
// kKernels: a one-warp kernel spins on the flags until they are set, the
// group breaks, or its own deadline passes (the fallback where stream memory
// operations are missing, or cannot be captured into a graph). kAuto picks
// stream memory operations when the driver has them, per operation: a
// capturing stream falls back to kernels when memory operations cannot be
// captured. Ranks may differ in their choice: the flags mean the same.
enum class SyncMode : uint8_t { kAuto, kStreamMemOps, kKernels };

struct CudaIpcGroupOptions {
  // Device bytes per rank for staging, split in two halves that alternate
  // between pipeline rounds. Every rank must use the same (open checks).
  // The torch backend takes it from MOONCAKE_PG_CUDA_STAGING_BYTES.
  size_t staging_bytes = 64u << 20;
  // all_reduce / reduce at or below this size (and, with two ranks, at any
  // size that fits one round) go direct: every rank that wants the result
  // folds every input; above it they reduce-scatter then all-gather
  // (cuda_ipc_group_reduce.cpp).
  size_t one_shot_bytes = 256u << 10;
  // A direct all_reduce / reduce of at most this many bytes (and at most
  // one_shot_bytes) in one round runs as one kernel of one block (push,
  // barrier, fold, closing barrier) instead of three kernels and two batches
  // of stream memory operations: fewer launches on the host and no gaps
  // between the steps on the GPU. Its barriers spin on an SM, so it suits one
  // rank per GPU (or MPS), not ranks time-sliced on a shared GPU; and they
  // are the kernel form's, with its deadline, also in a captured graph
  // (whose replays are otherwise not timed out with stream memory
  // operations). Ranks need not agree: both forms use the same inboxes and
  // flags. 0: never (the default until it is measured on a GPU). The torch
  // backend takes it from MOONCAKE_PG_CUDA_FUSED_BYTES.
  size_t fused_bytes = 0;
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};  // one operation's deadline
  std::chrono::milliseconds attach_timeout{std::chrono::seconds(60)};
  int device = -1;  // CUDA ordinal in this process; -1: the current device
  SyncMode sync = SyncMode::kAuto;
  // How error messages name rank r: rank_names[r] if given, else r.
  std::vector<int> rank_names;
};

// What enqueueing an operation gives back.
struct CudaOp {
  OpResult result;  // enqueue outcome: when not ok, nothing was enqueued (or the group broke doing so)
  uint64_t id = 0;  // for poll()/wait(); 0 when nothing can be tracked (failed, or captured into a graph)
};

enum class OpState : uint8_t { kPending, kSucceeded, kFailed };

class CudaIpcGroup {
 public:
  // Rank 0 creates the control block `name` (a POSIX shm name, "/..."), the
  // others attach to it; every rank exports its staging buffer and opens the
  // others'. Collective: every rank of the group must call it. Returns null
  // and sets *error when that fails. Does not fork-protect CUDA: open it in
  // each process after that process's own CUDA start.
  static std::unique_ptr<CudaIpcGroup> open(const std::string& name, int rank, int size,
                                            const CudaIpcGroupOptions& options, std::string* error);
  // Collective when the group is healthy: a last barrier makes sure no peer
  // still reads this rank's staging buffer before it is freed. Waits (bounded
  // by the timeout) for this group's enqueued operations to finish.
  ~CudaIpcGroup();
  CudaIpcGroup(const CudaIpcGroup&) = delete;
  CudaIpcGroup& operator=(const CudaIpcGroup&) = delete;

  int rank() const;
  int size() const;
  int device() const;
  bool broken() const;
  // Why the group broke and which ranks were at fault; ok when it is healthy.
  OpResult failure() const;
  // Breaks the group for every rank: how a layer above reports its own failure.
  void abort(const std::string& reason, const std::vector<int>& failed_ranks = {});
  // Whether barriers on a capturing stream use stream memory operations
  // (true) or fall back to kernels (false).
  bool memOpsCapturable() const;
  bool usesStreamMemOps() const;

  // All data pointers are device memory of device(), or memory the device can
  // address. Each operation is ordered after prior work on `stream` and
  // enqueued without waiting for it; later work on `stream` sees its result.
  // Operations of one group run one at a time in call order, whatever their
  // streams: one on a new stream first waits for the previous one (outside
  // graph capture; inside, keep them on the capturing stream). The caller must
  // not touch the buffers before the operation completes on the stream.
  // Semantics, in-place rules and argument meanings are those of Collectives.
  CudaOp barrier(cudaStream_t stream);
  CudaOp broadcast(void* data, size_t bytes, int root, cudaStream_t stream);
  CudaOp allreduce(const void* input, void* output, size_t count, DataType type, ReduceOp op, cudaStream_t stream);
  CudaOp reduce(const void* input, void* output, size_t count, DataType type, ReduceOp op, int root,
                cudaStream_t stream);
  CudaOp allgather(const void* input, void* output, size_t bytes, cudaStream_t stream);
  CudaOp reduceScatter(const void* input, void* output, size_t count, DataType type, ReduceOp op,
                       cudaStream_t stream);
  // Uneven all-to-all. The only operation whose host call meets the peers'
  // (to agree on the largest block, which fixes the number of rounds): it
  // returns once every rank has called it, never waiting for the transfer.
  CudaOp alltoall(const void* input, const std::vector<size_t>& send_offsets, const std::vector<size_t>& send_bytes,
                  void* output, const std::vector<size_t>& recv_offsets, const std::vector<size_t>& recv_bytes,
                  cudaStream_t stream);
  CudaOp gather(const void* input, void* output, size_t bytes, int root, cudaStream_t stream);
  CudaOp scatter(const void* input, void* output, size_t bytes, int root, cudaStream_t stream);

  // Outcome of operation `id`: pending until the stream has run it.
  OpState poll(uint64_t id, OpResult* result = nullptr) const;
  // Blocks the calling thread until operation `id` has run on its stream
  // (bounded: a stuck peer breaks the group within the timeout).
  OpResult wait(uint64_t id) const;

  struct State;

 private:
  explicit CudaIpcGroup(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace mooncake::pg::cuda
