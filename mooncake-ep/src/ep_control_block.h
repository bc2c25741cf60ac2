// The EP group's control block: a POSIX shared-memory object (created by
// rank 0, attached by the others through AttachedRegion) holding what the
// ranks exchange when they attach (pid, device, the receive region's IPC
// handle), per-rank words the GPU reads (departed: the process exited; the
// rank's abort word), and the close handshake. Registered with CUDA (mapped)
// so that kernels read the words directly. A watchdog thread sets
// `departed` for a peer whose process exits (pidfd), which ends the waits of
// calls with no timeout.
//
// Why host memory: a plain CPU store reaches a spinning kernel with no CUDA
// call. Words in device memory, raised with cudaMemcpyAsync from the
// watchdog, were tried: the dead-rank test hung, the copy never landing
// while the caller's thread sat in a pageable copy (torch's .tolist())
// behind the spinning kernel. Only the wait kernels read these words, every
// 16th spin (kernel_args.h, WaitEscape, says why not the send kernels).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "mooncake/pg/cuda/common/cuda_calls.h"  // kIpcHandleBytes
#include "mooncake/pg/cuda/common/host_mapping.h"
#include "mooncake/ep/cuda/ep_ipc_group.h"
#include "mooncake/pg/shared_region.h"

namespace mooncake::ep::cuda {

using mooncake::pg::cuda::kIpcHandleBytes;

struct alignas(64) EpRankSlot {
  mooncake::pg::RankPresence presence;  // attached (release: device and handle are written too), pid
  int32_t device;
  uint32_t reserved;
  uint64_t region_bytes;
  unsigned char region_handle[kIpcHandleBytes];
  alignas(64) std::atomic<uint32_t> abort;  // read by this rank's kernels only
  std::atomic<uint32_t> closing;  // close handshake phase reached (1, 2)
};
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));

struct EpControlHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t num_ranks;
  int32_t tokens, hidden, experts, output_slots;
  std::atomic<uint32_t> ready;
  // Read by the GPU: departed[r] = 1 once rank r's process is gone (set by
  // any peer's watchdog). Packed, so that a
  // kernel indexes it by rank.
  alignas(64) std::atomic<uint32_t> departed[kMaxEpRanks];
};

class EpControlBlock {
 public:
  struct Identity {
    int device = -1;
    uint64_t region_bytes = 0;
    unsigned char region_handle[kIpcHandleBytes] = {};
  };
  static std::unique_ptr<EpControlBlock> open(const std::string& name, int rank, int num_ranks,
                                              const EpIpcGroupOptions& options, const Identity& mine,
                                              std::string* error);
  ~EpControlBlock();

  std::string registerWithCuda();
  // The GPU's addresses of the departed words [R] and of this rank's abort word.
  const uint32_t* deviceDeparted() const { return device_departed_; }
  const uint32_t* deviceAbort() const { return device_abort_; }

  EpRankSlot& slot(int r) const { return slots_[r]; }
  EpControlHeader& header() const { return *header_; }
  bool peerAlive(int r) const { return region_->peers().alive(r); }
  // Close handshake: marks `phase` and waits until every live peer has
  // reached it, or until `deadline`.
  void closePhase(uint32_t phase, std::chrono::steady_clock::time_point deadline);

 private:
  EpControlBlock() = default;
  void watch();

  int rank_ = 0, num_ranks_ = 0;
  std::unique_ptr<mooncake::pg::AttachedRegion> region_;  // the mapping and the peers' liveness
  mooncake::pg::cuda::HostMapping mapping_;               // the region, seen by the GPU (unregistered before the unmap)
  EpControlHeader* header_ = nullptr;
  EpRankSlot* slots_ = nullptr;
  const uint32_t* device_departed_ = nullptr;
  const uint32_t* device_abort_ = nullptr;
  std::atomic<bool> stop_{false};
  std::thread watchdog_;
};

}  // namespace mooncake::ep::cuda
