#include "mooncake/pg/member_collectives.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "scratch.h"

namespace mooncake::pg {

MemberCollectives::MemberCollectives(std::vector<int> active, int my_seat, std::unique_ptr<Collectives> inner)
    : active_(std::move(active)), my_seat_(my_seat), inner_(std::move(inner)) {
  if (active_.empty() || !std::is_sorted(active_.begin(), active_.end()) ||
      std::adjacent_find(active_.begin(), active_.end()) != active_.end()) {
    throw std::invalid_argument("MemberCollectives: active seats must be ascending and distinct");
  }
  auto me = std::find(active_.begin(), active_.end(), my_seat_);
  if (me == active_.end() || inner_->size() != static_cast<int>(active_.size()) ||
      inner_->rank() != static_cast<int>(me - active_.begin())) {
    throw std::invalid_argument("MemberCollectives: the inner group does not match the active seats");
  }
  extent_ = active_.back() + 1;
}

int MemberCollectives::innerRoot(int seat, const char* op, OpResult* r) const {
  auto it = std::lower_bound(active_.begin(), active_.end(), seat);
  if (it != active_.end() && *it == seat) return static_cast<int>(it - active_.begin());
  r->ok = false;
  r->error = std::string(op) + ": root rank " + std::to_string(seat) + " is not active in the group";
  return -1;
}

OpResult MemberCollectives::toSeats(OpResult r) const {
  for (int& q : r.failed_ranks) {
    if (q >= 0 && q < static_cast<int>(active_.size())) q = active_[q];
  }
  return r;
}

OpResult MemberCollectives::barrier() { return toSeats(inner_->barrier()); }

OpResult MemberCollectives::allreduce(const void* input, void* output, size_t count, DataType type, ReduceOp op) {
  return toSeats(inner_->allreduce(input, output, count, type, op));
}

OpResult MemberCollectives::broadcast(void* data, size_t bytes, int root) {
  OpResult r;
  int inner_root = innerRoot(root, "broadcast", &r);
  return inner_root < 0 ? r : toSeats(inner_->broadcast(data, bytes, inner_root));
}

OpResult MemberCollectives::reduce(const void* input, void* output, size_t count, DataType type, ReduceOp op,
                                   int root) {
  OpResult r;
  int inner_root = innerRoot(root, "reduce", &r);
  return inner_root < 0 ? r : toSeats(inner_->reduce(input, output, count, type, op, inner_root));
}

OpResult MemberCollectives::allgather(const void* input, void* output, size_t bytes) {
  if (dense()) return toSeats(inner_->allgather(input, output, bytes));
  Scratch packed(bytes * active_.size());
  OpResult r = toSeats(inner_->allgather(input, packed.data(), bytes));
  if (!r.ok) return r;
  auto* out = static_cast<char*>(output);
  for (size_t i = 0; i < active_.size(); ++i) std::memcpy(out + active_[i] * bytes, packed.data() + i * bytes, bytes);
  return r;
}

OpResult MemberCollectives::reduceScatter(const void* input, void* output, size_t count, DataType type, ReduceOp op) {
  if (dense()) return toSeats(inner_->reduceScatter(input, output, count, type, op));
  const size_t block = count * elementSize(type);
  Scratch packed(block * active_.size());
  const auto* in = static_cast<const char*>(input);
  for (size_t i = 0; i < active_.size(); ++i) std::memcpy(packed.data() + i * block, in + active_[i] * block, block);
  return toSeats(inner_->reduceScatter(packed.data(), output, count, type, op));
}

OpResult MemberCollectives::alltoall(const void* input, const std::vector<size_t>& send_offsets,
                                     const std::vector<size_t>& send_bytes, void* output,
                                     const std::vector<size_t>& recv_offsets, const std::vector<size_t>& recv_bytes) {
  if (dense()) return toSeats(inner_->alltoall(input, send_offsets, send_bytes, output, recv_offsets, recv_bytes));
  auto pick = [this](const std::vector<size_t>& by_seat) {
    std::vector<size_t> by_inner(active_.size());
    for (size_t i = 0; i < active_.size(); ++i) by_inner[i] = by_seat[active_[i]];
    return by_inner;
  };
  return toSeats(inner_->alltoall(input, pick(send_offsets), pick(send_bytes), output, pick(recv_offsets),
                                  pick(recv_bytes)));
}

OpResult MemberCollectives::gather(const void* input, void* output, size_t bytes, int root) {
  OpResult r;
  int inner_root = innerRoot(root, "gather", &r);
  if (inner_root < 0) return r;
  if (dense()) return toSeats(inner_->gather(input, output, bytes, inner_root));
  const bool at_root = my_seat_ == root;
  Scratch packed(at_root ? bytes * active_.size() : 0);
  r = toSeats(inner_->gather(input, packed.data(), bytes, inner_root));
  if (!r.ok || !at_root) return r;
  auto* out = static_cast<char*>(output);
  for (size_t i = 0; i < active_.size(); ++i) std::memcpy(out + active_[i] * bytes, packed.data() + i * bytes, bytes);
  return r;
}

OpResult MemberCollectives::scatter(const void* input, void* output, size_t bytes, int root) {
  OpResult r;
  int inner_root = innerRoot(root, "scatter", &r);
  if (inner_root < 0) return r;
  if (dense()) return toSeats(inner_->scatter(input, output, bytes, inner_root));
  Scratch packed;
  if (my_seat_ == root) {
    packed.resize(bytes * active_.size());
    const auto* in = static_cast<const char*>(input);
    for (size_t i = 0; i < active_.size(); ++i) std::memcpy(packed.data() + i * bytes, in + active_[i] * bytes, bytes);
  }
  return toSeats(inner_->scatter(packed.data(), output, bytes, inner_root));
}

}  // namespace mooncake::pg
