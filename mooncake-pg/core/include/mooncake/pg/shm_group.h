// Collectives between the processes of one host through one shared-memory
// arena: no sockets, no copies through the kernel.
//
// The arena holds a control block and a staging slot per rank. An operation
// runs in steps; after each step a rank bumps its step counter (release) and
// waits until every rank has reached the same step (acquire), spinning
// briefly and then sleeping on a futex, so that more ranks than cores still
// progress. Large reductions are split: every rank reduces 1/W of the data
// from all slots and then gathers the other ranks' parts, so each rank reads
// and writes O(size) bytes whatever the world size (reduce-scatter +
// all-gather in memory), instead of O(W * size).
//
// Every wait has a deadline and watches the peers' processes: a dead peer or
// an expired deadline ends the operation with an error naming the ranks that
// did not arrive, and marks the arena broken so that every rank fails fast
// instead of waiting on a step that will never come.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "mooncake/pg/collectives.h"
#include "mooncake/pg/shared_region.h"  // kSupersededError

namespace mooncake::pg {

struct ShmGroupOptions {
  size_t slot_bytes = 8u << 20;  // staging bytes per rank (MOONCAKE_PG_SHM_SLOT_BYTES)
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};  // one operation's deadline
  std::chrono::milliseconds attach_timeout{std::chrono::seconds(60)};
  // How error messages name rank r: rank_names[r] (the group rank, when this
  // arena is one host's part of a larger group); empty: r itself.
  std::vector<int> rank_names;
  // Asked (with a rank's name) while waiting for that rank: true when the
  // membership has given up on it (deactivated: e.g. its process went
  // silent), so that nothing waits for the collective timeout on a rank
  // that is alive but stalled or cut off. Empty: never.
  std::function<bool(int rank_name)> deactivated;
  // Asked while waiting: non-empty (the reason) once this rank itself is cut
  // off from the membership (it lost the control plane, so its view is
  // stale and the others go on without it). The wait ends with that reason
  // and the arena breaks naming this rank, so the others learn who is at
  // fault and nobody waits for the deadline. Empty function: never.
  std::function<std::string()> cut_off;
  // Asked while the group forms (waiting for the arena, or for ranks to
  // attach): true once the membership has moved past the configuration the
  // group is formed for, whose other members may then be forming the newer
  // one under another name. Forming ends at once, its error starting with
  // kSupersededError, so that the caller forms the newer configuration
  // instead of waiting out the attach timeout. Empty function: never.
  std::function<bool()> superseded;
};

class ShmArena;

class ShmGroup : public Collectives {
 public:
  // Rank 0 creates the arena `name` (a POSIX shm name, "/..."), the others
  // attach to it; returns null and sets *error when that fails. The name is
  // unlinked as soon as every rank has attached, so nothing is left behind
  // if the job dies.
  static std::unique_ptr<ShmGroup> open(const std::string& name, int rank, int size, const ShmGroupOptions& options,
                                        std::string* error);
  ~ShmGroup() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  size_t slotBytes() const;
  bool broken() const override;
  // Marks the arena broken so that every rank's current and later operations
  // fail with `reason`, naming `failed_ranks` (indices in this ShmGroup): how
  // a layer above tells the other local ranks that its part failed.
  // `outside_failed_ranks` are ranks of that layer (not of this group) at
  // fault; every local rank can read them back with outsideFailedRanks().
  void abort(const std::string& reason, const std::vector<int>& failed_ranks = {},
             const std::vector<int>& outside_failed_ranks = {}, bool mismatch = false);
  std::vector<int> outsideFailedRanks() const;

  OpResult barrier() override;
  OpResult broadcast(void* data, size_t bytes, int root) override;
  OpResult allreduce(const void* input, void* output, size_t count, DataType type, ReduceOp op) override;
  OpResult reduce(const void* input, void* output, size_t count, DataType type, ReduceOp op, int root) override;
  OpResult allgather(const void* input, void* output, size_t bytes) override;
  OpResult reduceScatter(const void* input, void* output, size_t count, DataType type, ReduceOp op) override;
  OpResult alltoall(const void* input, const std::vector<size_t>& send_offsets, const std::vector<size_t>& send_bytes,
                    void* output, const std::vector<size_t>& recv_offsets,
                    const std::vector<size_t>& recv_bytes) override;
  OpResult gather(const void* input, void* output, size_t bytes, int root) override;
  OpResult scatter(const void* input, void* output, size_t bytes, int root) override;

 private:
  ShmGroup(int rank, int size, std::unique_ptr<ShmArena> arena);
  // A group of one meets nobody: `bytes` go straight from input to output
  // (none when they are the same), not through its slot. One round of the
  // arena is still run, so a broken arena fails the call as before.
  OpResult alone(uint64_t signature, const void* input, void* output, size_t bytes);

  int rank_;
  int size_;
  std::unique_ptr<ShmArena> arena_;
};

}  // namespace mooncake::pg
