// The shared-memory arena behind ShmGroup: layout, attachment and the
// step-counter synchronization. See shm_group.h for the protocol.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mooncake/pg/shared_region.h"
#include "mooncake/pg/shm_group.h"

namespace mooncake::pg {

constexpr int kMaxFailedMaskWords = 4;  // failure hints name ranks below 256

// One rank's control block, on its own cache lines.
struct alignas(64) RankBlock {
  std::atomic<uint32_t> step;     // steps this rank has completed (futex word)
  std::atomic<uint32_t> waiters;  // ranks sleeping on `step`
  RankPresence presence;          // attached, pid (shared_region.h)
  std::atomic<uint64_t> signature[4];  // operation signature by op index % 4
};
static_assert(sizeof(RankBlock) % 64 == 0);

struct ArenaHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t size;
  uint64_t slot_bytes;
  uint64_t slots_offset;
  std::atomic<uint32_t> ready;   // set by the creator once the layout is written
  std::atomic<int32_t> broken_by;  // -1, or the rank that declared the arena broken
  char broken_reason[240];
  std::atomic<uint64_t> failed_mask[kMaxFailedMaskWords];  // ranks named by the failure, one bit each
  // Ranks outside this arena's group named by the layer above (group ranks of
  // a HostSpanningGroup), so every local rank can name them in its hint.
  std::atomic<uint64_t> outside_failed_mask[kMaxFailedMaskWords];
  std::atomic<uint32_t> broken_by_mismatch;  // 1: broken because ranks disagreed (OpResult::mismatch)
};

class ShmArena {
 public:
  static std::unique_ptr<ShmArena> open(const std::string& name, int rank, int size, const ShmGroupOptions& options,
                                        std::string* error);
  ~ShmArena();

  int rank() const { return rank_; }
  int size() const { return size_; }
  size_t slotBytes() const { return header_->slot_bytes; }
  char* slot(int r) const { return slots_ + static_cast<size_t>(r) * header_->slot_bytes; }
  RankBlock& block(int r) const { return blocks_[r]; }
  RankBlock& mine() const { return blocks_[rank_]; }
  bool broken() const { return header_->broken_by.load(std::memory_order_acquire) >= 0; }
  std::chrono::milliseconds timeout() const { return options_.timeout; }

  // Starts one chunk of an operation with `signature`: waits until every rank
  // has finished (finish()) everything this rank finished, so that no one is
  // still reading the slot this rank is about to overwrite.
  OpResult begin(uint64_t signature);
  // Publishes one more completed step, then waits for every rank to reach it.
  // The first step() of an operation also checks that all ranks run the same
  // operation (signatures).
  OpResult step();
  // Publishes that this rank is done reading peers' slots for the current
  // chunk, without waiting: the next begin() of any rank waits for it.
  void finish() { signal(); }
  // Marks the arena broken (idempotent), records the ranks at fault, and
  // wakes every sleeper.
  void breakArena(const std::string& reason, const std::vector<int>& failed_ranks = {},
                  const std::vector<int>& outside_failed_ranks = {}, bool mismatch = false);
  std::vector<int> outsideFailedRanks() const;
  // "rank N" for messages, N as the user knows rank r (ShmGroupOptions::rank_names).
  std::string rankName(int r) const;

 private:
  ShmArena() = default;
  OpResult waitAll(uint32_t target);
  // kOk-like: empty optional when reached; otherwise the failure.
  bool waitFor(int peer, uint32_t target, std::chrono::steady_clock::time_point deadline, OpResult& result);
  bool peerAlive(int peer) const { return region_->peers().alive(peer); }
  // The first peer that has not reached `target` and whose process is gone, or -1.
  int deadLaggard(uint32_t target) const;
  OpResult brokenResult() const;
  void signal();

  int rank_ = 0;
  int size_ = 0;
  ShmGroupOptions options_;
  std::unique_ptr<AttachedRegion> region_;  // the mapping and the peers' liveness
  ArenaHeader* header_ = nullptr;
  RankBlock* blocks_ = nullptr;
  char* slots_ = nullptr;
  uint32_t steps_ = 0;       // steps this rank completed (mirrors mine().step)
  uint64_t op_index_ = 0;    // operations begun
  uint64_t signature_ = 0;   // of the current operation
  bool checked_signature_ = true;
  bool oversubscribed_ = false;  // more ranks than cores: do not spin
};

}  // namespace mooncake::pg
