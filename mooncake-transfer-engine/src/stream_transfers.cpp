#include "mooncake/te/stream_transfers.h"

#if MOONCAKE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "mooncake/te/log.h"
#include "mooncake/te/status.h"
#include "mooncake/te/transfer_engine.h"

namespace mooncake::te {

namespace {

struct Job {
  std::shared_ptr<StreamTransfers::State> state;
  std::vector<TransferRequest> requests;
  std::string hint;
  std::string what;
  // Set by the worker once the transfer ended; the host function waits on it.
  std::mutex mutex;
  std::condition_variable ended_cv;
  bool ended = false;
};

}  // namespace

struct StreamTransfers::State {
  std::shared_ptr<TransferEngine> engine;
  std::mutex mutex;
  std::condition_variable work_cv;
  std::deque<std::shared_ptr<Job>> reached;  // their streams got to them
  size_t outstanding = 0;                    // queued on a stream, not yet ended
  bool worker_running = false;
  bool closing = false;
  std::string failure;  // the first since takeFailure()
  size_t later_failures = 0;
};

namespace {

void recordFailure(StreamTransfers::State& state, const std::string& message) {
  MC_LOG(Error) << message;
  std::lock_guard lock(state.mutex);
  if (state.failure.empty()) {
    state.failure = message;
  } else {
    ++state.later_failures;
  }
}

size_t totalBytes(const std::vector<TransferRequest>& requests) {
  size_t bytes = 0;
  for (const auto& r : requests) bytes += r.length;
  return bytes;
}

// The worker: runs the transfers whose streams reached them, one at a time, and
// ends once its owner is gone and no stream still holds one of them.
void serve(const std::shared_ptr<StreamTransfers::State>& state) {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock lock(state->mutex);
      state->work_cv.wait(lock, [&] { return !state->reached.empty() || (state->closing && state->outstanding == 0); });
      if (state->reached.empty()) {
        state->worker_running = false;
        return;
      }
      job = std::move(state->reached.front());
      state->reached.pop_front();
    }
    // Bounded: the engine's budget for the bytes (MC_TRANSFER_TIMEOUT + 1 ns/byte).
    int rc = state->engine->transferSync(job->requests, job->hint);
    if (rc != kOk) {
      recordFailure(*state, job->what + " (" + std::to_string(job->requests.size()) + " requests, " +
                                std::to_string(totalBytes(job->requests)) + " bytes) failed: " + errorName(rc));
    }
    {
      std::lock_guard lock(job->mutex);
      job->ended = true;
    }
    job->ended_cv.notify_all();
    std::lock_guard lock(state->mutex);
    --state->outstanding;
    if (state->closing && state->outstanding == 0) state->work_cv.notify_all();
  }
}

// Runs on CUDA's host-function thread when the stream gets to the transfer: no
// CUDA calls here. Hands the job to the worker and holds the stream until it ended.
void streamReached(void* arg) {
  std::unique_ptr<std::shared_ptr<Job>> owned(static_cast<std::shared_ptr<Job>*>(arg));
  std::shared_ptr<Job> job = *owned;
  {
    std::lock_guard lock(job->state->mutex);
    job->state->reached.push_back(job);
  }
  job->state->work_cv.notify_all();
  std::unique_lock lock(job->mutex);
  job->ended_cv.wait(lock, [&] { return job->ended; });
}

}  // namespace

StreamTransfers::HostFunctionLauncher StreamTransfers::cudaLauncher() {
#if MOONCAKE_WITH_CUDA
  return [](void* stream, void (*fn)(void*), void* arg) {
    cudaError_t err = cudaLaunchHostFunc(static_cast<cudaStream_t>(stream), fn, arg);
    if (err != cudaSuccess) {
      MC_LOG(Error) << "cudaLaunchHostFunc failed: " << cudaGetErrorString(err);
      return static_cast<int>(kEndpointError);
    }
    return static_cast<int>(kOk);
  };
#else
  return [](void*, void (*)(void*), void*) { return static_cast<int>(kNotImplemented); };
#endif
}

StreamTransfers::StreamTransfers(std::shared_ptr<TransferEngine> engine, HostFunctionLauncher launcher)
    : state_(std::make_shared<State>()), launcher_(std::move(launcher)) {
  state_->engine = std::move(engine);
}

StreamTransfers::~StreamTransfers() {
  std::lock_guard lock(state_->mutex);
  state_->closing = true;
  state_->work_cv.notify_all();
}

int StreamTransfers::enqueue(void* stream, std::vector<TransferRequest> requests, std::string transport_hint,
                             std::string what) {
  auto job = std::make_shared<Job>();
  job->state = state_;
  job->requests = std::move(requests);
  job->hint = std::move(transport_hint);
  job->what = std::move(what);
  {
    std::lock_guard lock(state_->mutex);
    ++state_->outstanding;
    if (!state_->worker_running) {
      // Detached: it holds the state (and the engine) while streams still hold transfers.
      state_->worker_running = true;
      std::thread([state = state_] { serve(state); }).detach();
    }
  }
  auto* arg = new std::shared_ptr<Job>(job);
  int rc = launcher_(stream, &streamReached, arg);
  if (rc != kOk) {
    delete arg;
    std::lock_guard lock(state_->mutex);
    --state_->outstanding;
  }
  return rc;
}

std::string StreamTransfers::takeFailure() {
  std::lock_guard lock(state_->mutex);
  std::string failure = std::move(state_->failure);
  if (!failure.empty() && state_->later_failures > 0) {
    failure += " (and " + std::to_string(state_->later_failures) + " later stream-ordered transfers failed)";
  }
  state_->failure.clear();
  state_->later_failures = 0;
  return failure;
}

}  // namespace mooncake::te
