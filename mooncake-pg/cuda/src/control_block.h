// The group's control block: one POSIX shared-memory object holding a header
// and one RankControl per rank, mapped by every rank and registered with CUDA
// (mapped), so that the same words are read and written by the host (its
// watchdog) and by the GPU (stream memory operations and kernels).
//
// It carries what the ranks exchange when they attach (pids, the staging
// buffer's IPC handle), the barrier flags, each stream's progress, what the
// kernels report, the group's broken state, and the all_to_all size table.
// Attach, liveness (pidfd) and the broken state follow ShmArena's rules.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mooncake/pg/cuda/common/cuda_calls.h"  // kIpcHandleBytes
#include "mooncake/pg/cuda/common/host_mapping.h"
#include "kernel_args.h"
#include "mooncake/pg/collectives.h"
#include "mooncake/pg/shared_region.h"

namespace mooncake::pg::cuda {

constexpr int kBarrierSets = 2;       // barriers alternate between two sets of flags (stream_sync.h)

struct alignas(64) RankControl {
  // Written once while attaching, read by peers after `attached` (acquire).
  RankPresence presence;  // attached, pid (shared_region.h)
  int32_t device;  // CUDA ordinal in that process (for messages)
  std::atomic<uint32_t> probe;  // scratch word for trying stream memory operations at open
  uint64_t staging_bytes;
  unsigned char staging_handle[kIpcHandleBytes];
  // arrival[set][q]: set to 1 by rank q's stream when q reaches a barrier of
  // `set` (release), awaited and cleared to 0 by this rank's stream (acquire).
  // The watchdog sets them to 1 to release this rank once the group is broken.
  alignas(64) std::atomic<uint32_t> arrival[kBarrierSets][kMaxLocalRanks];
  // This rank's stream progress, as ids of eager operations: `started` when
  // the operation's first barrier begins, `finished` once it has completed.
  alignas(64) std::atomic<uint32_t> started;
  std::atomic<uint32_t> finished;
  DeviceReport report;  // written by this rank's kernels
  // all_to_all: the send sizes of the round `table_round`, double-buffered.
  alignas(64) std::atomic<uint32_t> table_round;
  uint64_t send_table[2][kMaxLocalRanks];
};
static_assert(sizeof(RankControl) % 64 == 0);
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t) && sizeof(std::atomic<int32_t>) == sizeof(int32_t));

struct ControlHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t size;
  uint64_t staging_bytes;
  uint64_t one_shot_bytes;
  std::atomic<uint32_t> ready;      // set by the creator once the layout is written
  std::atomic<int32_t> breaker;     // -1, or the rank writing the reason
  std::atomic<int32_t> broken_by;   // -1, or the rank that broke the group; kernels read it (acquire)
  uint32_t reserved;
  std::atomic<uint64_t> failed_mask;  // ranks named by the failure, one bit each
  char broken_reason[240];
};
static_assert(kMaxLocalRanks <= 64, "failed_mask has one bit per rank");

class ControlBlock {
 public:
  struct Identity {
    int device = -1;
    uint64_t staging_bytes = 0;
    uint64_t one_shot_bytes = 0;  // schedules depend on it: every rank must agree
    unsigned char staging_handle[kIpcHandleBytes] = {};
  };

  // Rank 0 creates `name`, the others attach (retrying until attach_timeout);
  // every rank publishes `mine` and waits for all the others. The name is
  // unlinked once everyone has attached.
  static std::unique_ptr<ControlBlock> open(const std::string& name, int rank, int size,
                                            std::chrono::milliseconds attach_timeout, std::vector<int> rank_names,
                                            const Identity& mine, std::string* error);
  ~ControlBlock();

  // Pins and maps the block for the current device's context.
  std::string registerWithCuda();
  // The address the GPU uses for a word of the block.
  template <typename T>
  T* device(T* host_word) const {
    return mapping_.device(host_word);
  }
  uint32_t* deviceWord(std::atomic<uint32_t>* word) const { return device(reinterpret_cast<uint32_t*>(word)); }

  int rank() const { return rank_; }
  int size() const { return size_; }
  ControlHeader& header() const { return *header_; }
  RankControl& block(int r) const { return blocks_[r]; }
  RankControl& mine() const { return blocks_[rank_]; }

  bool broken() const { return header_->broken_by.load(std::memory_order_acquire) >= 0; }
  // Marks the group broken for every rank with `reason` (the first reason
  // wins) and names `failed_ranks`. Kernels see it through broken_by.
  void breakGroup(const std::string& reason, const std::vector<int>& failed_ranks);
  OpResult failure() const;
  std::string rankName(int r) const;

  bool peerAlive(int peer) const { return region_->peers().alive(peer); }
  // Peers whose process has exited.
  std::vector<int> deadPeers() const { return region_->peers().dead(); }

  // all_to_all: publishes this rank's send sizes for `round` and reads every
  // rank's (table[s][d] = bytes s sends to d), waiting until all have
  // published, within `timeout`, watching for dead peers.
  OpResult exchangeSendTable(uint32_t round, const std::vector<size_t>& send_bytes,
                             std::vector<std::vector<uint64_t>>& table, std::chrono::milliseconds timeout);

 private:
  ControlBlock() = default;

  int rank_ = 0;
  int size_ = 0;
  std::vector<int> rank_names_;
  std::unique_ptr<AttachedRegion> region_;  // the mapping and the peers' liveness
  HostMapping mapping_;                     // the region, seen by the GPU (unregistered before the unmap)
  ControlHeader* header_ = nullptr;
  RankControl* blocks_ = nullptr;
};

}  // namespace mooncake::pg::cuda
