#include "stream_sync.h"

#include <cuda.h>  // types of the stream memory operations; the function itself is found at run time

#include "kernel_launch.h"

namespace mooncake::pg::cuda {
namespace {

using BatchMemOpFn = CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int);

// cuStreamBatchMemOp from the driver the runtime already loaded (the library
// links the runtime statically and never libcuda itself).
BatchMemOpFn batchMemOp() {
  static const BatchMemOpFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuStreamBatchMemOp", &p, 12000, cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<BatchMemOpFn>(nullptr);
    }
    return reinterpret_cast<BatchMemOpFn>(p);
  }();
  return fn;
}

// The driver's codes for what these calls return coincide with the
// runtime's (1, 801, 900, ...); anything else is reported as unknown.
cudaError_t toRuntimeError(CUresult r) {
  switch (r) {
    case CUDA_SUCCESS: return cudaSuccess;
    case CUDA_ERROR_INVALID_VALUE: return cudaErrorInvalidValue;
    case CUDA_ERROR_NOT_SUPPORTED: return cudaErrorNotSupported;
    case CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: return cudaErrorStreamCaptureUnsupported;
    case CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: return cudaErrorStreamCaptureInvalidated;
    default: return cudaErrorUnknown;
  }
}

class MemOpBatch {
 public:
  // Preceded by a system-scope fence scoped to the stream: a release.
  void writeRelease(const void* device_address, uint32_t value) {
    CUstreamBatchMemOpParams& p = next();
    p.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
    p.writeValue.address = reinterpret_cast<CUdeviceptr>(device_address);
    p.writeValue.value = value;
    p.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  }
  // Later work of the stream starts once *address == value: an acquire.
  void waitEqualAcquire(const void* device_address, uint32_t value) {
    CUstreamBatchMemOpParams& p = next();
    p.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
    p.waitValue.address = reinterpret_cast<CUdeviceptr>(device_address);
    p.waitValue.value = value;
    p.waitValue.flags = CU_STREAM_WAIT_VALUE_EQ;
  }
  cudaError_t enqueue(cudaStream_t stream) {
    if (count_ == 0) return cudaSuccess;
    return toRuntimeError(batchMemOp()(reinterpret_cast<CUstream>(stream), count_, ops_, 0));
  }

 private:
  CUstreamBatchMemOpParams& next() {
    ops_[count_] = CUstreamBatchMemOpParams{};
    return ops_[count_++];
  }
  static constexpr unsigned kCapacity = 3 * kMaxLocalRanks + 2;  // the driver takes fewer than 256
  CUstreamBatchMemOpParams ops_[kCapacity];
  unsigned count_ = 0;
};

}  // namespace

StreamSync::StreamSync(ControlBlock& control, SyncMode requested, std::chrono::milliseconds timeout,
                       uint32_t* abort_word)
    : control_(control), requested_(requested), timeout_(timeout), abort_word_(abort_word) {}

std::string StreamSync::init() {
  if (requested_ == SyncMode::kKernels) return {};
  if (batchMemOp() == nullptr) {
    if (requested_ == SyncMode::kStreamMemOps) return "the driver has no stream memory operations (cuStreamBatchMemOp)";
    return {};
  }
  // Try them: eagerly, then under capture (a graph whose replay must pass).
  std::atomic<uint32_t>& probe = control_.mine().probe;
  const void* word = control_.deviceWord(&probe);
  auto probeBatch = [&](uint32_t value) {
    MemOpBatch batch;
    batch.writeRelease(word, value);
    batch.waitEqualAcquire(word, value);
    batch.writeRelease(word, value + 1);
    return batch;
  };
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
    cudaGetLastError();
    return "cudaStreamCreate failed";
  }
  cudaError_t err = probeBatch(1).enqueue(stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  memops_available_ = err == cudaSuccess && probe.load(std::memory_order_acquire) == 2;
  if (memops_available_) {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    bool ok = cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
    const bool enqueued = ok && probeBatch(3).enqueue(stream) == cudaSuccess;
    ok = cudaStreamEndCapture(stream, &graph) == cudaSuccess && enqueued;
    ok = ok && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
    ok = ok && cudaGraphLaunch(exec, stream) == cudaSuccess && cudaStreamSynchronize(stream) == cudaSuccess;
    memops_capturable_ = ok && probe.load(std::memory_order_acquire) == 4;
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    if (graph != nullptr) cudaGraphDestroy(graph);
  }
  cudaGetLastError();  // a failed try is an answer, not an error to leave behind
  cudaStreamDestroy(stream);
  if (!memops_available_ && requested_ == SyncMode::kStreamMemOps) {
    return std::string("stream memory operations do not work here: ") + cudaGetErrorString(err);
  }
  return {};
}

bool StreamSync::useMemOps(bool capturing) const {
  if (requested_ == SyncMode::kKernels || !memops_available_) return false;
  return !capturing || memops_capturable_;
}

cudaError_t StreamSync::barrier(cudaStream_t stream, bool capturing, int set, const BarrierExtras& extras,
                                bool gate) {
  if (useMemOps(capturing)) return barrierWithMemOps(stream, set, extras, gate);
  return barrierWithKernel(stream, set, extras);
}

cudaError_t StreamSync::barrierWithMemOps(cudaStream_t stream, int set, const BarrierExtras& extras, bool gate) {
  const int me = control_.rank();
  RankControl& mine = control_.mine();
  MemOpBatch batch;
  if (extras.started != nullptr) batch.writeRelease(control_.deviceWord(extras.started), extras.started_value);
  if (extras.signature_word != nullptr) batch.writeRelease(extras.signature_word, extras.signature);
  for (int q = 0; q < control_.size(); ++q) {
    if (q != me) batch.writeRelease(control_.deviceWord(&control_.block(q).arrival[set][me]), 1);
  }
  for (int q = 0; q < control_.size(); ++q) {
    if (q != me) batch.waitEqualAcquire(control_.deviceWord(&mine.arrival[set][q]), 1);
  }
  for (int q = 0; q < control_.size(); ++q) {
    if (q != me) batch.writeRelease(control_.deviceWord(&mine.arrival[set][q]), 0);
  }
  if (extras.finished != nullptr) batch.writeRelease(control_.deviceWord(extras.finished), extras.finished_value);
  cudaError_t err = batch.enqueue(stream);
  if (err == cudaSuccess && gate) {
    err = launchGateKernel(control_.device(reinterpret_cast<int32_t*>(&control_.header().broken_by)), abort_word_,
                           control_.device(&control_.mine().report), extras.op_id, stream);
  }
  return err;
}

cudaError_t StreamSync::barrierWithKernel(cudaStream_t stream, int set, const BarrierExtras& extras) {
  cudaError_t err = launchBarrierKernel(kernelBarrierArgs(set, extras), stream);
  if (err == cudaSuccess && extras.finished != nullptr) {
    err = launchMarkKernel(control_.deviceWord(extras.finished), extras.finished_value, stream);
  }
  return err;
}

BarrierKernelArgs StreamSync::kernelBarrierArgs(int set, const BarrierExtras& extras) const {
  const int me = control_.rank();
  BarrierKernelArgs args{};
  for (int q = 0; q < control_.size(); ++q) {
    if (q == me) continue;
    args.signal[q] = control_.deviceWord(&control_.block(q).arrival[set][me]);
    args.arrival[q] = control_.deviceWord(&control_.mine().arrival[set][q]);
  }
  args.started_word = extras.started != nullptr ? control_.deviceWord(extras.started) : nullptr;
  args.started_value = extras.started_value;
  args.signature_word = extras.signature_word;
  args.signature = extras.signature;
  args.broken_by = control_.device(reinterpret_cast<int32_t*>(&control_.header().broken_by));
  args.abort_word = abort_word_;
  args.report = control_.device(&control_.mine().report);
  args.op_id = extras.op_id;
  args.size = control_.size();
  args.timeout_ns = static_cast<unsigned long long>(timeout_.count()) * 1000000ull;
  return args;
}

cudaError_t StreamSync::mark(cudaStream_t stream, bool capturing, std::atomic<uint32_t>* word, uint32_t value) {
  if (useMemOps(capturing)) {
    MemOpBatch batch;
    batch.writeRelease(control_.deviceWord(word), value);
    return batch.enqueue(stream);
  }
  return launchMarkKernel(control_.deviceWord(word), value, stream);
}

}  // namespace mooncake::pg::cuda
