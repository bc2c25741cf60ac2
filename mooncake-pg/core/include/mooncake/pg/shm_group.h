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
#include <memory>
#include <string>
#include <vector>

#include "mooncake/pg/types.h"

namespace mooncake::pg {

struct ShmGroupOptions {
  size_t slot_bytes = 8u << 20;  // staging bytes per rank (MOONCAKE_PG_SHM_SLOT_BYTES)
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};  // one operation's deadline
  std::chrono::milliseconds attach_timeout{std::chrono::seconds(60)};
};

// Outcome of one operation.
struct OpResult {
  bool ok = true;
  std::string error;            // why it failed
  std::vector<int> failed_ranks;  // ranks that did not arrive (dead or late), for the failure hint
};

class ShmArena;

class ShmGroup {
 public:
  // Rank 0 creates the arena `name` (a POSIX shm name, "/..."), the others
  // attach to it; returns null and sets *error when that fails. The name is
  // unlinked as soon as every rank has attached, so nothing is left behind
  // if the job dies.
  static std::unique_ptr<ShmGroup> open(const std::string& name, int rank, int size, const ShmGroupOptions& options,
                                        std::string* error);
  ~ShmGroup();

  int rank() const { return rank_; }
  int size() const { return size_; }
  size_t slotBytes() const;
  bool broken() const;

  // All pointers are local memory; in-place where input == output is allowed
  // (allreduce, broadcast, reduce, allgather's own block, alltoall not).
  OpResult barrier();
  OpResult broadcast(void* data, size_t bytes, int root);
  OpResult allreduce(const void* input, void* output, size_t count, DataType type, ReduceOp op);
  // Only the root's output is written.
  OpResult reduce(const void* input, void* output, size_t count, DataType type, ReduceOp op, int root);
  // output holds size() blocks of `bytes`, block r from rank r.
  OpResult allgather(const void* input, void* output, size_t bytes);
  // input holds size() blocks of `count` elements; rank r gets the reduction of every rank's block r.
  OpResult reduceScatter(const void* input, void* output, size_t count, DataType type, ReduceOp op);
  // send_bytes[d]/recv_bytes[s] per peer, with offsets into the buffers (uneven all-to-all).
  OpResult alltoall(const void* input, const std::vector<size_t>& send_offsets, const std::vector<size_t>& send_bytes,
                    void* output, const std::vector<size_t>& recv_offsets, const std::vector<size_t>& recv_bytes);
  // gather: root's output holds size() blocks; scatter: root's input does.
  OpResult gather(const void* input, void* output, size_t bytes, int root);
  OpResult scatter(const void* input, void* output, size_t bytes, int root);

 private:
  ShmGroup(int rank, int size, std::unique_ptr<ShmArena> arena);

  int rank_;
  int size_;
  std::unique_ptr<ShmArena> arena_;
};

}  // namespace mooncake::pg
