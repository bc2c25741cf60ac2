#include "host_staging.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

namespace mooncake::pg {
namespace {

at::Tensor pinnedLike(const at::Tensor& t) {
  return at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
}

// `t` is used on `stream` (not the stream it was allocated on): its memory
// must not be reused before that stream is done with it.
void usedOn(const at::Tensor& t, const c10::cuda::CUDAStream& stream) {
  if (t.numel() > 0) c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream);
}

}  // namespace

c10::cuda::CUDAStream HostStaging::sideStream(c10::DeviceIndex device) {
  std::lock_guard lock(mutex_);
  if (side_.size() <= static_cast<size_t>(device)) side_.resize(device + 1);
  if (!side_[device]) side_[device] = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device);
  return *side_[device];
}

c10::intrusive_ptr<c10d::Work> HostStaging::run(c10d::OpType type, const char* op, const std::vector<at::Tensor>& reads,
                                                const std::vector<at::Tensor>& writes, const HostCall& call,
                                                Start start) {
  const at::Tensor& any = !reads.empty() ? reads[0] : writes[0];
  const c10::DeviceIndex device = any.device().index();
  c10::cuda::CUDAGuard guard(device);
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(current.stream(), &capture));
  TORCH_CHECK(capture == cudaStreamCaptureStatusNone, op, ": cannot be captured into a CUDA graph in this group: "
              "it runs through host memory here (point-to-point, or active ranks that are not seats 0..n-1 of one "
              "host); only collectives on the CUDA IPC plane are capturable");

  const c10::cuda::CUDAStream side = sideStream(device);
  at::cuda::CUDAEvent prior(cudaEventDisableTiming);
  prior.record(current);
  prior.block(side);  // the inputs are read after the work the caller enqueued before this call
  std::vector<at::Tensor> host_reads, host_writes;
  {
    c10::cuda::CUDAStreamGuard on_side(side);
    for (const at::Tensor& t : reads) {
      host_reads.push_back(pinnedLike(t));
      host_reads.back().copy_(t, /*non_blocking=*/true);
      usedOn(t, side);
    }
    for (const at::Tensor& t : writes) {
      auto alias = std::find_if(reads.begin(), reads.end(), [&](const at::Tensor& r) { return r.is_same(t); });
      host_writes.push_back(alias != reads.end() ? host_reads[alias - reads.begin()] : pinnedLike(t));
    }
  }
  auto ready = std::make_shared<at::cuda::CUDAEvent>(cudaEventDisableTiming);
  ready->record(side);

  auto work = c10::make_intrusive<MooncakeCudaWork>(host_.getRank(), type, host_.maxGroupSize(), writes, device,
                                                    MooncakeCudaWork::Kind::kStaged);
  c10::intrusive_ptr<c10d::Work> host_work;
  if (start == Start::kNow) {
    if (!reads.empty()) ready->synchronize();
    host_work = call(host_reads, host_writes);
  } else {
    OpGate gate([ready]() -> std::string {
      try {
        ready->synchronize();
        return {};
      } catch (const std::exception& e) {
        return std::string("copying the inputs to host memory failed: ") + e.what();
      }
    });
    host_work = call(host_reads, host_writes);
  }
  auto* host_mooncake_work = dynamic_cast<MooncakeWork*>(host_work.get());
  TORCH_INTERNAL_ASSERT(host_mooncake_work != nullptr, "the host backend returned a foreign Work");
  // Runs where the host operation ends (its operation thread, or the P2P
  // progress thread), once.
  host_work->getFuture()->addCallback(
      [work, host_work, host_mooncake_work, device, side, writes, host_writes](c10::ivalue::Future&) {
        OpResult result = host_mooncake_work->outcome();
        if (result.ok) {
          try {
            c10::cuda::CUDAGuard guard(device);
            c10::cuda::CUDAStreamGuard on_side(side);
            for (size_t i = 0; i < writes.size(); ++i) {
              writes[i].copy_(host_writes[i], /*non_blocking=*/true);
              usedOn(writes[i], side);
            }
            work->recordDone(side);
          } catch (const std::exception& e) {
            result.ok = false;
            result.error = std::string("copying the outputs back to the device failed: ") + e.what();
          }
        }
        work->complete(result);
      });
  return work;
}

}  // namespace mooncake::pg
