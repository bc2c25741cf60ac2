// One NCCL communicator whose every collective step is bounded: created
// non-blocking, each step polled until it completes or a deadline passes,
// and aborted then (ncclCommAbort is what releases a step stuck on a peer
// that died or never came). The failure semantics of the rest of the project
// (a dead peer costs a bounded wait and a clear error, never a hang) hold
// for every host-side step of the transport through this class.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <memory>
#include <string>

#include "nccl_library.h"

namespace mooncake::ep::nccl {

using Deadline = std::chrono::steady_clock::time_point;

class NcclCommunicator {
 public:
  // A fresh unique id (rank 0 makes it; the others receive it through the
  // process group), as its NCCL_UNIQUE_ID_BYTES bytes; "" with *error.
  static std::string makeUniqueId(std::string* error);

  // Collective: every rank passes the same id; bounded by `deadline`.
  static std::unique_ptr<NcclCommunicator> create(const std::string& unique_id, int rank, int num_ranks, int device,
                                                  Deadline deadline, std::string* error);
  // Aborts the communicator when close() did not end it.
  ~NcclCommunicator();
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  const NcclLibrary& library() const { return nccl_; }
  ncclComm_t comm() const { return comm_; }
  int device() const { return device_; }

  // The minimum of every rank's `value` (an all-reduce of one int on a
  // stream of this communicator's own): the agreement every collective step
  // of the transport starts with, and a barrier. "" or why not (the
  // communicator is aborted then).
  std::string allMin(int value, int* minimum, Deadline deadline);

  // Collective: registers [base, base + bytes) as a symmetric window.
  std::string registerWindow(void* base, size_t bytes, ncclWindow_t* window, Deadline deadline);
  std::string deregisterWindow(ncclWindow_t window, Deadline deadline);

  // Ends the communicator: finalized and destroyed when every rank gets
  // there by `deadline`, else aborted. Idempotent.
  void close(Deadline deadline);
  // Ends it at once, without waiting for anyone.
  void abort();

 private:
  NcclCommunicator(const NcclLibrary& nccl, int device) : nccl_(nccl), device_(device) {}
  // Polls the communicator's state until the last non-blocking call is done.
  std::string await(ncclResult_t issued, const char* what, Deadline deadline);
  std::string describe(ncclResult_t result, const char* what) const;

  const NcclLibrary& nccl_;
  int device_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  int* scratch_ = nullptr;  // device memory of allMin: [value, result]
};

}  // namespace mooncake::ep::nccl
