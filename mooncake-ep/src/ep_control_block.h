// The EP group's control block: a POSIX shared-memory object (created by
// rank 0, attached by the others through mapSharedRegion) holding what the
// ranks exchange when they attach (pid, device, the receive region's IPC
// handle), per-rank words (departed: the process exited; the rank's abort
// word), and the close handshake. A watchdog thread sets `departed` for a
// peer whose process exits (pidfd) and reports every departure, whoever
// noticed it, to this rank's callback: EpIpcGroup copies it into device
// memory, where its kernels read it (a kernel never reads host memory: a
// PCIe read per block was suspected of the send kernels' slowness).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "mooncake/ep/cuda/ep_ipc_group.h"

namespace mooncake::ep::cuda {

constexpr size_t kIpcHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t)

struct alignas(64) EpRankSlot {
  std::atomic<uint32_t> attached;  // release: pid, device and handle are written
  int32_t pid;
  int32_t device;
  uint32_t reserved;
  uint64_t region_bytes;
  unsigned char region_handle[kIpcHandleBytes];
  alignas(64) std::atomic<uint32_t> abort;  // set by abortWaits (mirrored to the device by this rank)
  std::atomic<uint32_t> closing;  // close handshake phase reached (1, 2)
};
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));

struct EpControlHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t num_ranks;
  int32_t tokens, hidden, experts, reserved;
  std::atomic<uint32_t> ready;
  // departed[r] = 1 once rank r's process is gone (set by any peer's
  // watchdog, or by a rank whose open failed).
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

  // Called (from the watchdog thread) for every peer found departed,
  // including those already departed when it is set, until it returns true.
  void onDeparted(std::function<bool(int)> callback);

  EpRankSlot& slot(int r) const { return slots_[r]; }
  EpControlHeader& header() const { return *header_; }
  bool peerAlive(int r) const;
  // Close handshake: marks `phase` and waits until every live peer has
  // reached it, or until `deadline`.
  void closePhase(uint32_t phase, std::chrono::steady_clock::time_point deadline);

 private:
  EpControlBlock() = default;
  void watch();

  int rank_ = 0, num_ranks_ = 0;
  void* base_ = nullptr;
  size_t mapped_bytes_ = 0;
  EpControlHeader* header_ = nullptr;
  EpRankSlot* slots_ = nullptr;
  std::mutex callback_mutex_;
  std::function<bool(int)> on_departed_;  // guarded by callback_mutex_
  std::vector<bool> reported_;            // watchdog thread only
  std::vector<int> pidfds_;
  std::atomic<bool> stop_{false};
  std::thread watchdog_;
};

}  // namespace mooncake::ep::cuda
