#include "transport/cuda_ipc/copy_lane.h"

#include <chrono>

#include "cuda/cuda_driver.h"
#include "mooncake/te/log.h"

namespace mooncake::te {
namespace {

// A finished copy is noticed by polling for this long, then by blocking in
// the driver: small copies complete in microseconds without a wake-up from
// an interrupt, and long ones do not keep a core spinning.
constexpr auto kSpinBudget = std::chrono::microseconds(200);

cudaError_t waitFor(cudaEvent_t event) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    cudaError_t err = cudaEventQuery(event);
    if (err != cudaErrorNotReady) return err;
    if (std::chrono::steady_clock::now() - start > kSpinBudget) return cudaEventSynchronize(event);
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
}

}  // namespace

std::unique_ptr<CopyLane> CopyLane::create(int device) {
  cuda::DeviceScope scope(device);
  cudaStream_t stream = nullptr;
  cudaError_t err = scope.ok() ? cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) : cudaErrorInvalidDevice;
  if (err != cudaSuccess) {
    cudaGetLastError();
    MC_LOG(Warning) << "cuda_ipc: cannot set up copies on cuda:" << device << ": " << cudaGetErrorString(err);
    return nullptr;
  }
  return std::unique_ptr<CopyLane>(new CopyLane(device, stream));
}

CopyLane::CopyLane(int device, cudaStream_t stream)
    : device_(device), stream_(stream), completer_([this] { completerLoop(); }) {}

CopyLane::~CopyLane() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  completer_.join();  // it drains in_flight_ first
  cuda::DeviceScope scope(device_);
  for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
  cudaStreamDestroy(stream_);
}

int CopyLane::copy(void* dst, const void* src, size_t n) {
  cudaError_t err = cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, stream_);
  if (err == cudaSuccess) return kOk;
  cudaGetLastError();
  MC_LOG(Warning) << "cuda_ipc: copy of " << n << " bytes on cuda:" << device_
                  << " failed: " << cudaGetErrorString(err);
  return kEndpointError;
}

cudaEvent_t CopyLane::takeEvent() {
  {
    std::lock_guard lock(mutex_);
    if (!free_events_.empty()) {
      cudaEvent_t e = free_events_.back();
      free_events_.pop_back();
      return e;
    }
  }
  cudaEvent_t e = nullptr;
  // Blocking sync: a waiter that stops spinning sleeps in the driver.
  if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventBlockingSync) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return e;
}

void CopyLane::finish(std::vector<Completion> completions, std::vector<std::shared_ptr<void>> holds, bool wait_here) {
  if (completions.empty()) return;
  InFlight work{takeEvent(), std::move(completions), std::move(holds)};
  cudaError_t err = work.event == nullptr ? cudaErrorMemoryAllocation : cudaEventRecord(work.event, stream_);
  if (err != cudaSuccess) {
    // Without an event nothing tells us when the copies end: wait for the
    // whole stream instead.
    cudaGetLastError();
    err = cudaStreamSynchronize(stream_);
    for (const Completion& c : work.completions) {
      c.task->completeSlice(err == cudaSuccess ? c.bytes : 0, err == cudaSuccess ? kOk : kEndpointError);
    }
    if (work.event != nullptr) {
      std::lock_guard lock(mutex_);
      free_events_.push_back(work.event);
    }
    return;
  }
  if (wait_here) {
    settle(work);
    return;
  }
  {
    std::lock_guard lock(mutex_);
    in_flight_.push_back(std::move(work));
  }
  cv_.notify_one();
}

void CopyLane::settle(InFlight& work) {
  cudaError_t err = waitFor(work.event);
  if (err != cudaSuccess) {
    cudaGetLastError();
    MC_LOG(Warning) << "cuda_ipc: copies on cuda:" << device_ << " failed: " << cudaGetErrorString(err);
  }
  for (const Completion& c : work.completions) {
    c.task->completeSlice(err == cudaSuccess ? c.bytes : 0, err == cudaSuccess ? kOk : kEndpointError);
  }
  work.holds.clear();
  std::lock_guard lock(mutex_);
  free_events_.push_back(work.event);
}

void CopyLane::completerLoop() {
  cudaSetDevice(device_);  // our own thread: no context of the application to keep
  for (;;) {
    InFlight work;
    {
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [this] { return stopping_ || !in_flight_.empty(); });
      if (in_flight_.empty()) return;  // stopping, and nothing left
      work = std::move(in_flight_.front());
      in_flight_.pop_front();
    }
    settle(work);
  }
}

}  // namespace mooncake::te
