// The collective operations a process group runs, whatever carries the bytes:
// ShmGroup (the processes of one host, through one shared-memory arena) and
// HostSpanningGroup (hosts joined through the transfer engine) implement it,
// and the torch adapter only sees this interface.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "mooncake/pg/types.h"

namespace mooncake::pg {

// Outcome of one operation.
struct OpResult {
  bool ok = true;
  std::string error;            // why it failed
  std::vector<int> failed_ranks;  // ranks that did not arrive (dead or late), for the failure hint
  // A failed reduction had already written part of its output (so, in
  // place, part of its input is gone and it cannot simply be run again).
  // Only reductions set it: the other operations never modify their input.
  bool output_written = false;
  // Ranks disagreed on the operation (different collectives, sizes or
  // splits): a program error, not a failure of any rank, so membership is
  // left alone and the operation is not run again.
  bool mismatch = false;
  // A point-to-point message made no progress before its deadline: its peer
  // may well be alive and simply not sending (application logic), so this
  // is the caller's to judge, not failure evidence for the membership.
  bool timed_out = false;

  // A failed outcome with its reason and the ranks at fault.
  static OpResult failure(std::string why, std::vector<int> ranks = {}) {
    OpResult r;
    r.ok = false;
    r.error = std::move(why);
    r.failed_ranks = std::move(ranks);
    return r;
  }
};

class Collectives {
 public:
  virtual ~Collectives() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // True once an operation failed: every later one fails fast with the reason.
  virtual bool broken() const = 0;

  // All pointers are local memory; in-place where input == output is allowed
  // (allreduce, broadcast, reduce, allgather's own block; alltoall not).
  virtual OpResult barrier() = 0;
  virtual OpResult broadcast(void* data, size_t bytes, int root) = 0;
  virtual OpResult allreduce(const void* input, void* output, size_t count, DataType type, ReduceOp op) = 0;
  // Only the root's output is written.
  virtual OpResult reduce(const void* input, void* output, size_t count, DataType type, ReduceOp op, int root) = 0;
  // output holds size() blocks of `bytes`, block r from rank r.
  virtual OpResult allgather(const void* input, void* output, size_t bytes) = 0;
  // input holds size() blocks of `count` elements; rank r gets the reduction of every rank's block r.
  virtual OpResult reduceScatter(const void* input, void* output, size_t count, DataType type, ReduceOp op) = 0;
  // send_bytes[d]/recv_bytes[s] per peer, with offsets into the buffers (uneven all-to-all).
  virtual OpResult alltoall(const void* input, const std::vector<size_t>& send_offsets,
                            const std::vector<size_t>& send_bytes, void* output,
                            const std::vector<size_t>& recv_offsets, const std::vector<size_t>& recv_bytes) = 0;
  // gather: root's output holds size() blocks; scatter: root's input does.
  // Only the root's output (gather) / input (scatter) is used.
  virtual OpResult gather(const void* input, void* output, size_t bytes, int root) = 0;
  virtual OpResult scatter(const void* input, void* output, size_t bytes, int root) = 0;
};

}  // namespace mooncake::pg
