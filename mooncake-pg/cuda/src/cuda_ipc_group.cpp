// CudaIpcGroup: opening and closing, the outcome of operations, and the
// barrier. The moving and reducing operations are in cuda_ipc_group_move.cpp
// and cuda_ipc_group_reduce.cpp.
#include <algorithm>
#include <thread>

#include "group_state.h"

namespace mooncake::pg::cuda {
namespace {

bool after(uint32_t a, uint32_t b) { return static_cast<int32_t>(a - b) > 0; }

// Waits for `event`, bounded; false when it did not complete in time.
bool waitEvent(cudaEvent_t event, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (;;) {
    const cudaError_t err = cudaEventQuery(event);
    if (err != cudaErrorNotReady) return true;  // done, or the context is gone: nothing will run any more
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

}  // namespace

CudaIpcGroup::State::~State() {
  watchdog.reset();  // no more releases once nothing is left to run
  for (int q = 0; q < static_cast<int>(peer_staging.size()); ++q) {
    if (q != rank && peer_staging[q] != nullptr) cudaIpcCloseMemHandle(peer_staging[q]);
  }
  if (staging != nullptr) cudaFree(staging);
  if (last_op_done != nullptr) cudaEventDestroy(last_op_done);
  sync.reset();
  control.reset();  // unregisters and unmaps the control block
}

std::unique_ptr<CudaIpcGroup> CudaIpcGroup::open(const std::string& name, int rank, int size,
                                                 const CudaIpcGroupOptions& options, std::string* error) {
  auto state = std::make_unique<State>();
  auto fail = [&](const std::string& why) -> std::unique_ptr<CudaIpcGroup> {
    if (error) *error = "CUDA IPC group '" + name + "' (rank " + std::to_string(rank) + "): " + why;
    // The peers that did open must not wait for this rank.
    if (state->control) state->control->breakGroup(state->control->rankName(rank) + " failed to open: " + why, {rank});
    return nullptr;
  };
  state->rank = rank;
  state->size = size;
  state->options = options;
  if (std::string why = chosenDevice(options.device, &state->device); !why.empty()) return fail(why);
  cudaError_t err = cudaSuccess;
  DeviceScope scope(state->device);
  if ((err = cudaDeviceGetAttribute(&state->sm_count, cudaDevAttrMultiProcessorCount, state->device)) != cudaSuccess) {
    return fail(cudaWhat("cudaDeviceGetAttribute", err));
  }
  // Halves hold a 16-byte-aligned slot per rank of at least 4 KiB.
  const size_t min_half = static_cast<size_t>(std::max(size, 1)) * 4096;
  state->half_bytes = std::max(min_half, options.staging_bytes / 2 / 4096 * 4096);
  const size_t staging_bytes = kStagingHeaderBytes + 2 * state->half_bytes;
  if ((err = cudaMalloc(reinterpret_cast<void**>(&state->staging), staging_bytes)) != cudaSuccess) {
    return fail(cudaWhat("cudaMalloc", err));
  }
  // The header must read 0 (no signature, abort word clear) before any
  // kernel of the group runs, whatever stream it runs on: a device memset is
  // asynchronous, so wait for it.
  if ((err = cudaMemsetAsync(state->staging, 0, kStagingHeaderBytes, nullptr)) != cudaSuccess ||
      (err = cudaStreamSynchronize(nullptr)) != cudaSuccess) {
    return fail(cudaWhat("cudaMemset", err));
  }

  ControlBlock::Identity identity;
  identity.device = state->device;
  identity.staging_bytes = staging_bytes;
  identity.one_shot_bytes = options.one_shot_bytes;
  std::string why;
  if (size > 1 && !(why = exportIpcHandle(state->staging, identity.staging_handle)).empty()) return fail(why);
  state->control = ControlBlock::open(name, rank, size, options.attach_timeout, options.rank_names, identity, &why);
  if (!state->control) {
    if (error) *error = why;
    return nullptr;
  }
  if (!(why = state->control->registerWithCuda()).empty()) return fail(why);

  int failed = -1;
  why = mapPeerAllocations(
      size, rank, state->staging, [&](int q) { return state->control->block(q).staging_handle; },
      &state->peer_staging, &failed);
  if (!why.empty()) {
    return fail("opening the staging buffer of " + state->control->rankName(failed) + " (cuda:" +
                std::to_string(state->control->block(failed).device) + " in its process): " + why);
  }

  state->sync = std::make_unique<StreamSync>(*state->control, options.sync, options.timeout, state->abortWord());
  if (!(why = state->sync->init()).empty()) return fail(why);
  if ((err = cudaEventCreateWithFlags(&state->last_op_done, cudaEventDisableTiming)) != cudaSuccess) {
    return fail(cudaWhat("cudaEventCreate", err));
  }
  state->watchdog = std::make_unique<Watchdog>(*state->control, options.timeout);
  return std::unique_ptr<CudaIpcGroup>(new CudaIpcGroup(std::move(state)));
}

CudaIpcGroup::CudaIpcGroup(std::unique_ptr<State> state) : state_(std::move(state)) {}

CudaIpcGroup::~CudaIpcGroup() {
  State& g = *state_;
  DeviceScope scope(g.device);
  // Two last barriers: after the first, no peer reads this rank's staging
  // buffer any more (an operation may end with reads after its last
  // barrier), so every rank closes its mappings of the others'; after the
  // second, no peer maps it any more, and it can be freed.
  if (g.size > 1 && !g.control->broken()) {
    cudaStream_t stream = nullptr;
    if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess) {
      const CudaOp done_reading = barrier(stream);
      if (done_reading.id != 0 && wait(done_reading.id).ok) {
        for (int q = 0; q < g.size; ++q) {
          if (q != g.rank && g.peer_staging[q] != nullptr) cudaIpcCloseMemHandle(g.peer_staging[q]);
          if (q != g.rank) g.peer_staging[q] = nullptr;
        }
        const CudaOp done_mapping = barrier(stream);
        if (done_mapping.id != 0) wait(done_mapping.id);
      }
      cudaStreamDestroy(stream);
    }
  }
  // The watchdog keeps releasing this rank's waits while the stream drains.
  const bool drained = !g.have_last_stream || waitEvent(g.last_op_done, g.options.timeout + std::chrono::seconds(5));
  if (!drained) {
    // The GPU may still touch the staging buffer and the control block:
    // leave them allocated rather than free memory in use.
    g.watchdog.reset();
    g.staging = nullptr;
    g.peer_staging.clear();
    (void)g.control.release();
  }
  state_.reset();
}

int CudaIpcGroup::rank() const { return state_->rank; }
int CudaIpcGroup::size() const { return state_->size; }
int CudaIpcGroup::device() const { return state_->device; }
bool CudaIpcGroup::broken() const { return state_->control->broken(); }
OpResult CudaIpcGroup::failure() const { return state_->control->failure(); }
bool CudaIpcGroup::memOpsCapturable() const { return state_->sync->memOpsCapturable(); }
bool CudaIpcGroup::usesStreamMemOps() const {
  return state_->options.sync != SyncMode::kKernels && state_->sync->memOpsAvailable();
}

void CudaIpcGroup::abort(const std::string& reason, const std::vector<int>& failed_ranks) {
  state_->control->breakGroup(reason, failed_ranks);
}

OpState CudaIpcGroup::poll(uint64_t id, OpResult* result) const {
  State& g = *state_;
  g.watchdog->breakOnDeviceReport();  // a kernel's failure counts before the operation does
  OpResult outcome;
  if (id == 0) {
    outcome = g.control->failure();  // untracked: only the group's state says anything
  } else {
    const uint32_t finished = g.control->mine().finished.load(std::memory_order_acquire);
    if (after(static_cast<uint32_t>(id), finished)) return OpState::kPending;
    if (g.control->broken() && after(static_cast<uint32_t>(id), g.watchdog->finishedAtBreak())) {
      outcome = g.control->failure();
    }
  }
  if (result != nullptr) *result = outcome;
  return outcome.ok ? OpState::kSucceeded : OpState::kFailed;
}

OpResult CudaIpcGroup::wait(uint64_t id) const {
  OpResult result;
  auto pause = std::chrono::microseconds(0);
  std::chrono::steady_clock::time_point broken_since{};
  for (;;) {
    if (poll(id, &result) != OpState::kPending) return result;
    // A broken group drains quickly; a stream that does not (its context
    // died, say) must not hold the caller forever.
    if (broken()) {
      const auto now = std::chrono::steady_clock::now();
      if (broken_since == std::chrono::steady_clock::time_point{}) broken_since = now;
      if (now - broken_since > std::chrono::seconds(5)) {
        result = failure();
        result.error += " (the operation's stream did not drain)";
        return result;
      }
    }
    if (pause.count() == 0) {
      std::this_thread::yield();
      pause = std::chrono::microseconds(1);
    } else {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(100));
    }
  }
}

CudaOp CudaIpcGroup::barrier(cudaStream_t stream) {
  return enqueueOp(*state_, stream, opSignature(OpCode::kBarrier), [](OpRun& run) {
    run.barrier();
    run.barrier();
  });
}

}  // namespace mooncake::pg::cuda
