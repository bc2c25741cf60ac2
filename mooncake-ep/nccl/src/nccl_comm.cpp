#include "nccl_comm.h"

#include <thread>

#include "mooncake/pg/cuda/common/cuda_calls.h"  // cudaWhat, DeviceScope
#include "mooncake/te/log.h"

namespace mooncake::ep::nccl {
namespace {

using mooncake::pg::cuda::cudaWhat;
using mooncake::pg::cuda::DeviceScope;

constexpr auto kPollInterval = std::chrono::microseconds(200);

bool pastDeadline(Deadline deadline) { return std::chrono::steady_clock::now() > deadline; }

}  // namespace

std::string NcclCommunicator::makeUniqueId(std::string* error) {
  const NcclLibrary* nccl = ncclLibrary(error);
  if (nccl == nullptr) return {};
  ncclUniqueId id;
  if (const ncclResult_t r = nccl->getUniqueId(&id); r != ncclSuccess) {
    if (error) *error = std::string("ncclGetUniqueId: ") + nccl->getErrorString(r);
    return {};
  }
  return std::string(id.internal, sizeof(id.internal));
}

std::unique_ptr<NcclCommunicator> NcclCommunicator::create(const std::string& unique_id, int rank, int num_ranks,
                                                           int device, Deadline deadline, std::string* error) {
  auto fail = [&](const std::string& why) -> std::unique_ptr<NcclCommunicator> {
    if (error)
      *error = "NCCL communicator (rank " + std::to_string(rank) + " of " + std::to_string(num_ranks) + "): " + why;
    return nullptr;
  };
  const NcclLibrary* nccl = ncclLibrary(error);
  if (nccl == nullptr) return nullptr;
  ncclUniqueId id;
  if (unique_id.size() != sizeof(id.internal)) {
    return fail("the unique id has " + std::to_string(unique_id.size()) + " bytes, NCCL's has " +
                std::to_string(sizeof(id.internal)));
  }
  unique_id.copy(id.internal, sizeof(id.internal));
  std::unique_ptr<NcclCommunicator> c(new NcclCommunicator(*nccl, device));
  DeviceScope scope(device);
  cudaError_t err = cudaStreamCreateWithFlags(&c->stream_, cudaStreamNonBlocking);
  if (err == cudaSuccess) err = cudaMalloc(reinterpret_cast<void**>(&c->scratch_), 2 * sizeof(int));
  if (err != cudaSuccess) return fail(cudaWhat("setting up the communicator's stream", err));
  // Non-blocking: every step returns at once and is polled, so that a peer
  // that never comes costs the deadline, not a hang.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  config.commName = "mooncake-ep-elastic";
  const ncclResult_t issued = nccl->commInitRankConfig(&c->comm_, num_ranks, id, rank, &config);
  if (std::string why = c->await(issued, "ncclCommInitRankConfig", deadline); !why.empty()) return fail(why);
  MC_LOG(Info) << "NCCL communicator up: rank " << rank << " of " << num_ranks << ", NCCL " << nccl->version;
  return c;
}

NcclCommunicator::~NcclCommunicator() {
  if (comm_ != nullptr) abort();
  DeviceScope scope(device_);
  if (scratch_ != nullptr) cudaFree(scratch_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

std::string NcclCommunicator::describe(ncclResult_t result, const char* what) const {
  std::string why = std::string(what) + ": " + nccl_.getErrorString(result);
  const char* last = comm_ != nullptr ? nccl_.getLastError(comm_) : nullptr;
  if (last != nullptr && *last != '\0') why += std::string(" (") + last + ")";
  return why;
}

std::string NcclCommunicator::await(ncclResult_t issued, const char* what, Deadline deadline) {
  if (issued != ncclSuccess && issued != ncclInProgress) {
    std::string why = describe(issued, what);
    abort();
    return why;
  }
  while (true) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t polled = nccl_.commGetAsyncError(comm_, &state);
    if (polled != ncclSuccess) state = polled;
    if (state == ncclSuccess) return {};
    if (state != ncclInProgress) {
      std::string why = describe(state, what);
      abort();
      return why;
    }
    if (pastDeadline(deadline)) {
      abort();
      return std::string(what) +
             ": not complete by the deadline (a peer died or never came); the communicator "
             "was aborted";
    }
    std::this_thread::sleep_for(kPollInterval);
  }
}

std::string NcclCommunicator::allMin(int value, int* minimum, Deadline deadline) {
  if (comm_ == nullptr) return "the communicator was aborted earlier";
  DeviceScope scope(device_);
  cudaError_t err = cudaMemcpyAsync(scratch_, &value, sizeof(int), cudaMemcpyHostToDevice, stream_);
  if (err != cudaSuccess) return cudaWhat("cudaMemcpyAsync", err);
  const ncclResult_t issued = nccl_.allReduce(scratch_, scratch_ + 1, 1, ncclInt32, ncclMin, comm_, stream_);
  if (std::string why = await(issued, "ncclAllReduce", deadline); !why.empty()) return why;
  // The all-reduce waits on the device for every peer: poll its stream, so
  // that a missing peer costs the deadline (then the abort releases it).
  while ((err = cudaStreamQuery(stream_)) == cudaErrorNotReady) {
    if (pastDeadline(deadline)) {
      abort();
      return "the agreement with the peers (ncclAllReduce) did not complete by the deadline (a peer died or never "
             "came); the communicator was aborted";
    }
    std::this_thread::sleep_for(kPollInterval);
  }
  if (err != cudaSuccess) return cudaWhat("ncclAllReduce on the device", err);
  if ((err = cudaMemcpy(minimum, scratch_ + 1, sizeof(int), cudaMemcpyDeviceToHost)) != cudaSuccess) {
    return cudaWhat("cudaMemcpy", err);
  }
  return {};
}

std::string NcclCommunicator::registerWindow(void* base, size_t bytes, ncclWindow_t* window, Deadline deadline) {
  if (comm_ == nullptr) return "the communicator was aborted earlier";
  return await(nccl_.commWindowRegister(comm_, base, bytes, window, NCCL_WIN_COLL_SYMMETRIC), "ncclCommWindowRegister",
               deadline);
}

std::string NcclCommunicator::deregisterWindow(ncclWindow_t window, Deadline deadline) {
  if (comm_ == nullptr) return "the communicator was aborted earlier";
  return await(nccl_.commWindowDeregister(comm_, window), "ncclCommWindowDeregister", deadline);
}

void NcclCommunicator::close(Deadline deadline) {
  if (comm_ == nullptr) return;
  if (!await(nccl_.commFinalize(comm_), "ncclCommFinalize", deadline).empty()) return;  // aborted
  nccl_.commDestroy(comm_);
  comm_ = nullptr;
}

void NcclCommunicator::abort() {
  if (comm_ == nullptr) return;
  MC_LOG(Warning) << "aborting the NCCL communicator of ElasticBuffer's NCCL transport";
  nccl_.commAbort(comm_);
  comm_ = nullptr;
}

}  // namespace mooncake::ep::nccl
