// ElasticBuffer's NCCL transport: the EP dispatch/combine kernels of
// mooncake-ep (the ones EpIpcGroup runs over CUDA IPC) over one NCCL
// communicator and one symmetric window per group. Every rank's receive
// region is its part of the window; NCCL's LSA team (the ranks whose memory
// this GPU can load and store: one host over NVLink/PCIe, or a multi-node
// NVLink domain) gives every peer's address, and the kernels write into
// them as they do into CUDA IPC mappings. Torch-free and NCCL-free in this
// header: NCCL is opened at run time (src/nccl_library.h says why).
//
// Reaches only peers of the LSA team: a group whose ranks are not all in one
// LSA team is refused at open(), on every rank alike (GIN, NCCL's network
// path for the ranks outside it, is not written yet: docs/ep-elastic.md).
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <string>

#include "mooncake/ep/cuda/ep_ipc_group.h"  // DispatchArgs, CombineArgs, EpStages, the options

namespace mooncake::ep::nccl {

using cuda::CombineArgs;
using cuda::DispatchArgs;
using cuda::EpIpcGroupOptions;
using cuda::EpStages;

// The version of the NCCL headers this was built against, and of the NCCL
// library in this process (0: none could be opened); "" when the two go
// together, else why not and what to preload (nccl_rules.h).
int ncclHeaderVersion();
int ncclLoadedVersion();
std::string ncclRuntimeProblem();

class EpNcclGroup {
 public:
  // A fresh NCCL unique id (rank 0 makes it, the process group carries it to
  // the others); "" with *error.
  static std::string makeUniqueId(std::string* error);

  // Collective over every rank (NCCL has no absent ranks: options.absent
  // must be 0), bounded by options.attach_timeout: joins the communicator of
  // `unique_id`, checks that every rank is in this rank's LSA team,
  // allocates and registers the window, and learns every peer's address.
  // Null with *error on every rank alike when any of it fails anywhere.
  static std::unique_ptr<EpNcclGroup> open(const std::string& unique_id, int rank, int num_ranks,
                                           const EpIpcGroupOptions& options, std::string* error);
  // Collective, bounded by options.attach_timeout: releases this rank's
  // pending waits, waits for its kernels, meets the peers (so that nobody
  // writes into a window being freed), then deregisters and frees the
  // window and ends the communicator; aborts it when a peer does not come.
  ~EpNcclGroup();
  EpNcclGroup(const EpNcclGroup&) = delete;
  EpNcclGroup& operator=(const EpNcclGroup&) = delete;

  int rank() const;
  int numRanks() const;
  int device() const;

  // As EpIpcGroup's (ep_ipc_group.h): enqueued on `stream`, numbered by the
  // kernels, every wait for a peer bounded by the call's timeout_us.
  bool dispatch(const DispatchArgs& args, cudaStream_t stream, std::string* error, EpStages stages = EpStages::kAll);
  bool combine(const CombineArgs& args, cudaStream_t stream, std::string* error, EpStages stages = EpStages::kAll);

  // Releases every wait of this rank's kernels, now and later.
  void abortWaits();
  // After a failure: releases this rank's waits and aborts the communicator,
  // so that closing does not wait for peers that are gone.
  void abandon();

  struct State;

 private:
  explicit EpNcclGroup(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace mooncake::ep::nccl
