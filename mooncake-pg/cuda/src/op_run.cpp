#include <string>

#include "group_state.h"
#include "kernel_launch.h"

namespace mooncake::pg::cuda {

std::string checkRoot(const CudaIpcGroup::State& g, int root) {
  if (root >= 0 && root < g.size) return {};
  return "root " + std::to_string(root) + " is not a rank of this group (size " + std::to_string(g.size) + ")";
}

std::string checkReduction(DataType type, ReduceOp op) { return reductionUnsupportedReason(type, op); }

CudaOp rejected(const std::string& why) {
  CudaOp op;
  op.result.ok = false;
  op.result.error = why;
  return op;
}

OpRun::OpRun(CudaIpcGroup::State& group, cudaStream_t stream, uint32_t signature)
    : g_(group), stream_(stream), signature_(signature) {
  if (g_.control->broken()) {
    result_ = g_.control->failure();
    return;
  }
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(stream_, &capture), "cudaStreamIsCapturing");
  capturing_ = capture == cudaStreamCaptureStatusActive;
  must_break_ = false;  // nothing enqueued yet
  if (failed() || capturing_) return;
  id_ = ++g_.next_id;
  if (static_cast<uint32_t>(id_) == 0) id_ = ++g_.next_id;  // 0 means "inside a graph" on the stream
  // Operations run one at a time whatever their streams: a new stream first
  // waits for the previous operation.
  if (g_.have_last_stream && g_.last_stream != stream_) {
    check(cudaStreamWaitEvent(stream_, g_.last_op_done, 0), "cudaStreamWaitEvent");
  }
}

void OpRun::check(cudaError_t err, const char* what) {
  if (err == cudaSuccess || failed()) return;
  cudaGetLastError();
  result_.ok = false;
  result_.error = std::string(what) + ": " + cudaGetErrorString(err);
  must_break_ = true;
}

void OpRun::fail(const OpResult& why) {
  if (failed()) return;
  result_ = why;
  result_.ok = false;
  must_break_ = true;
}

OpGuard OpRun::guard() {
  ControlBlock& control = *g_.control;
  OpGuard guard;
  guard.abort_word = g_.abortWord();
  guard.report = control.device(&control.mine().report);
  guard.op_id = static_cast<uint32_t>(id_);
  guard.signature = signature_;
  guard.size = g_.size;
  // The kernel right after the first barrier compares signatures: every
  // peer wrote its own with that barrier's signal, and none can write its
  // next one before this rank signals the second barrier.
  if (barriers_ == 1 && !signature_checked_ && g_.size > 1) {
    signature_checked_ = true;
    guard.check_signature = 1;
    for (int q = 0; q < g_.size; ++q) {
      if (q != g_.rank) guard.peer_signature[q] = g_.signatureWord(q);
    }
  }
  return guard;
}

StreamSync::BarrierExtras OpRun::barrierExtras(bool first) const {
  StreamSync::BarrierExtras extras;
  extras.op_id = static_cast<uint32_t>(id_);
  if (first) {
    if (!capturing_) {
      extras.started = &g_.control->mine().started;
      extras.started_value = static_cast<uint32_t>(id_);
    }
    extras.signature_word = g_.signatureWord(g_.rank);
    extras.signature = signature_;
  }
  return extras;
}

void OpRun::barrier() {
  if (failed()) return;
  flushBarrier();
  const bool first = barriers_ == 0;
  ++barriers_;
  if (g_.size == 1) return;
  pending_extras_ = barrierExtras(first);
  barrier_pending_ = true;
}

void OpRun::flushBarrier(bool finished, bool gate) {
  if (!barrier_pending_ || failed()) return;
  barrier_pending_ = false;
  if (finished) {
    pending_extras_.finished = &g_.control->mine().finished;
    pending_extras_.finished_value = static_cast<uint32_t>(id_);
  }
  const int set = (barriers_ - 1) % kBarrierSets;  // the held-back barrier is the last one counted
  check(g_.sync->barrier(stream_, capturing_, set, pending_extras_, gate), "enqueueing a barrier");
}

void OpRun::copy(const CopyJob& job) {
  if (failed() || job.count == 0) return;
  flushBarrier(/*finished=*/false, /*gate=*/true);
  check(launchCopy(job, guard(), g_.sm_count, stream_), "launching a copy kernel");
}

void OpRun::reduce(const ReduceJob& job) {
  if (failed() || job.count == 0 || job.ndst == 0) return;
  flushBarrier(/*finished=*/false, /*gate=*/true);
  check(launchReduce(job, guard(), g_.sm_count, stream_), "launching a reduction kernel");
}

void OpRun::fusedDirect(const void* src, void* const* push_dst, int npush, size_t bytes, const ReduceJob& fold) {
  if (failed()) return;
  if (barriers_ != 0 || barrier_pending_ || g_.size == 1) {
    return fail(OpResult{false, "internal error: a fused operation must be the operation's only step", {}});
  }
  FusedDirectArgs args;
  args.push_src = src;
  for (int d = 0; d < npush; ++d) args.push_dst[d] = push_dst[d];
  args.npush = npush;
  args.push_bytes = bytes;
  args.start_guard = guard();  // before any barrier: no signature to check yet
  args.first = g_.sync->kernelBarrierArgs(0, barrierExtras(/*first=*/true));
  barriers_ = 1;
  args.fold_guard = guard();  // after the first barrier: checks the peers' signatures
  args.fold = fold;
  args.closing = g_.sync->kernelBarrierArgs(1, barrierExtras(/*first=*/false));
  barriers_ = 2;
  if (!capturing_) {
    args.finished_word = g_.control->deviceWord(&g_.control->mine().finished);
    args.finished_value = static_cast<uint32_t>(id_);
    finished_marked_ = true;
  }
  check(launchFusedDirect(args, stream_), "launching the fused all_reduce kernel");
}

CudaOp OpRun::finish() {
  if (!failed() && barriers_ % 2 != 0) {
    fail(OpResult{false, "internal error: an operation ran an odd number of barriers", {}});
  }
  if (barrier_pending_) {
    flushBarrier(/*finished=*/!capturing_);
  } else if (!failed() && !capturing_ && !finished_marked_) {
    check(g_.sync->mark(stream_, false, &g_.control->mine().finished, static_cast<uint32_t>(id_)),
          "marking the end of an operation");
  }
  if (!failed() && !capturing_) {
    check(cudaEventRecord(g_.last_op_done, stream_), "cudaEventRecord");
    g_.last_stream = stream_;
    g_.have_last_stream = true;
  }
  if (failed()) {
    // The peers would wait for steps this rank never enqueued.
    if (must_break_) g_.control->breakGroup(g_.control->rankName(g_.rank) + ": " + result_.error, result_.failed_ranks);
    return CudaOp{result_, 0};
  }
  return CudaOp{result_, capturing_ ? 0 : id_};
}

}  // namespace mooncake::pg::cuda
