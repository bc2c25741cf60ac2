// Collectives over the active seats of an elastic group.
//
// A group has fixed seats (in-group ranks) that are never renumbered; some
// may be inactive (failed, not yet joined): holes. Callers keep addressing
// ranks by seat, and the group's size is the extent of the seats in use
// (highest active seat + 1). This adapter runs each operation on `inner`, a
// Collectives over the active seats only (inner rank i = active[i]), and
// maps seats to inner ranks both ways:
//
//   - all_reduce, barrier: as they are; only active seats contribute
//     (excluded explicitly, never through a zeroed buffer).
//   - broadcast, reduce, gather, scatter: the root must be an active seat.
//   - all_gather, gather: the output has one block per seat; the blocks of
//     holes are left untouched (as the reference does).
//   - reduce_scatter: the input has one block per seat; holes' blocks are
//     ignored.
//   - all_to_all: the pieces for and from holes are not exchanged; the
//     output pieces from holes are left untouched.
#pragma once

#include <memory>
#include <vector>

#include "mooncake/pg/collectives.h"

namespace mooncake::pg {

class MemberCollectives : public Collectives {
 public:
  // `active`: ascending seats, including `my_seat`; inner->size() == active.size().
  MemberCollectives(std::vector<int> active, int my_seat, std::unique_ptr<Collectives> inner);

  int rank() const override { return my_seat_; }
  int size() const override { return extent_; }
  bool broken() const override { return inner_->broken(); }
  const std::vector<int>& active() const { return active_; }

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
  // The inner rank of `seat`, or -1 (and *r set to the error) when it is a hole.
  int innerRoot(int seat, const char* op, OpResult* r) const;
  // Inner results name inner ranks; callers know seats.
  OpResult toSeats(OpResult r) const;
  // Whether the active seats are 0..n-1: then blocks need no moving.
  bool dense() const { return extent_ == static_cast<int>(active_.size()); }

  std::vector<int> active_;
  int my_seat_;
  int extent_;
  std::unique_ptr<Collectives> inner_;
};

}  // namespace mooncake::pg
