// ShmGroup: opening, and the collectives that only move bytes. The reducing
// ones are in shm_group_reduce.cpp.
#include <algorithm>
#include <cstring>

#include "shm_arena.h"
#include "shm_group_internal.h"

namespace mooncake::pg {

uint64_t opSignature(OpCode op, uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  uint64_t h = 1469598103934665603ull ^ static_cast<uint64_t>(op);
  for (uint64_t v : {a, b, c, d}) h = (h ^ v) * 1099511628211ull + (h >> 29);
  return h;
}

std::unique_ptr<ShmGroup> ShmGroup::open(const std::string& name, int rank, int size, const ShmGroupOptions& options,
                                         std::string* error) {
  std::unique_ptr<ShmArena> arena = ShmArena::open(name, rank, size, options, error);
  if (!arena) return nullptr;
  return std::unique_ptr<ShmGroup>(new ShmGroup(rank, size, std::move(arena)));
}

ShmGroup::ShmGroup(int rank, int size, std::unique_ptr<ShmArena> arena)
    : rank_(rank), size_(size), arena_(std::move(arena)) {}
ShmGroup::~ShmGroup() = default;

size_t ShmGroup::slotBytes() const { return arena_->slotBytes(); }
bool ShmGroup::broken() const { return arena_->broken(); }
void ShmGroup::abort(const std::string& reason, const std::vector<int>& failed_ranks,
                     const std::vector<int>& outside_failed_ranks, bool mismatch) {
  arena_->breakArena(reason, failed_ranks, outside_failed_ranks, mismatch);
}
std::vector<int> ShmGroup::outsideFailedRanks() const { return arena_->outsideFailedRanks(); }

OpResult ShmGroup::barrier() {
  ShmArena& a = *arena_;
  OpResult r = a.begin(opSignature(OpCode::kBarrier));
  return r.ok ? a.step() : r;
}

OpResult ShmGroup::alone(uint64_t signature, const void* input, void* output, size_t bytes) {
  ShmArena& a = *arena_;
  OpResult r = a.begin(signature);
  if (r.ok) r = a.step();
  if (!r.ok) return r;
  if (input != output && bytes > 0) std::memmove(output, input, bytes);
  a.finish();
  return r;
}

OpResult ShmGroup::broadcast(void* data, size_t bytes, int root) {
  if (size_ == 1) return alone(opSignature(OpCode::kBroadcast), data, data, bytes);
  ShmArena& a = *arena_;
  OpResult r;
  const size_t chunk = a.slotBytes();
  for (size_t off = 0; off < bytes || off == 0; off += chunk) {
    size_t n = std::min(chunk, bytes - off);
    // A receiver whose earlier chunks landed has lost part of what it held.
    if (!(r = a.begin(opSignature(OpCode::kBroadcast, bytes, root))).ok) {
      r.output_written = rank_ != root && off > 0;
      break;
    }
    if (rank_ == root) std::memcpy(a.slot(root), static_cast<char*>(data) + off, n);
    if (!(r = a.step()).ok) {
      r.output_written = rank_ != root && off > 0;
      break;
    }
    if (rank_ != root) std::memcpy(static_cast<char*>(data) + off, a.slot(root), n);
    a.finish();
    if (bytes == 0) break;
  }
  return r;
}

OpResult ShmGroup::allgather(const void* input, void* output, size_t bytes) {
  if (size_ == 1) return alone(opSignature(OpCode::kAllgather), input, output, bytes);
  ShmArena& a = *arena_;
  OpResult r;
  const size_t chunk = a.slotBytes();
  for (size_t off = 0; off < bytes || off == 0; off += chunk) {
    size_t n = std::min(chunk, bytes - off);
    if (!(r = a.begin(opSignature(OpCode::kAllgather, bytes))).ok) break;
    std::memcpy(a.slot(rank_), static_cast<const char*>(input) + off, n);
    if (!(r = a.step()).ok) break;
    for (int s = 0; s < size_; ++s) std::memcpy(static_cast<char*>(output) + s * bytes + off, a.slot(s), n);
    a.finish();
    if (bytes == 0) break;
  }
  return r;
}

OpResult ShmGroup::gather(const void* input, void* output, size_t bytes, int root) {
  if (size_ == 1) return alone(opSignature(OpCode::kGather), input, output, bytes);
  ShmArena& a = *arena_;
  OpResult r;
  const size_t chunk = a.slotBytes();
  for (size_t off = 0; off < bytes || off == 0; off += chunk) {
    size_t n = std::min(chunk, bytes - off);
    if (!(r = a.begin(opSignature(OpCode::kGather, bytes, root))).ok) break;
    std::memcpy(a.slot(rank_), static_cast<const char*>(input) + off, n);
    if (!(r = a.step()).ok) break;
    if (rank_ == root) {
      for (int s = 0; s < size_; ++s) std::memcpy(static_cast<char*>(output) + s * bytes + off, a.slot(s), n);
    }
    a.finish();
    if (bytes == 0) break;
  }
  return r;
}

OpResult ShmGroup::scatter(const void* input, void* output, size_t bytes, int root) {
  if (size_ == 1) return alone(opSignature(OpCode::kScatter), input, output, bytes);
  ShmArena& a = *arena_;
  OpResult r;
  // The root stages one piece for every rank in its slot per round.
  const size_t piece = std::max<size_t>(1, a.slotBytes() / size_);
  for (size_t off = 0; off < bytes || off == 0; off += piece) {
    size_t n = std::min(piece, bytes - off);
    if (!(r = a.begin(opSignature(OpCode::kScatter, bytes, root))).ok) break;
    if (rank_ == root) {
      for (int d = 0; d < size_; ++d) {
        std::memcpy(a.slot(root) + d * piece, static_cast<const char*>(input) + d * bytes + off, n);
      }
    }
    if (!(r = a.step()).ok) break;
    std::memcpy(static_cast<char*>(output) + off, a.slot(root) + rank_ * piece, n);
    a.finish();
    if (bytes == 0) break;
  }
  return r;
}

OpResult ShmGroup::alltoall(const void* input, const std::vector<size_t>& send_offsets,
                            const std::vector<size_t>& send_bytes, void* output,
                            const std::vector<size_t>& recv_offsets, const std::vector<size_t>& recv_bytes) {
  if (size_ == 1 && send_bytes[0] == recv_bytes[0]) {
    return alone(opSignature(OpCode::kAlltoall), static_cast<const char*>(input) + send_offsets[0],
                 static_cast<char*>(output) + recv_offsets[0], send_bytes[0]);
  }
  ShmArena& a = *arena_;
  // First step: every rank stages what it will send to each peer. Each rank
  // checks that it expects exactly that from everyone (a mismatch is an
  // error for the whole group, never silently truncated or padded data),
  // and all agree on the number of rounds from the largest block.
  OpResult r = a.begin(opSignature(OpCode::kAlltoall));
  if (!r.ok) return r;
  if (static_cast<size_t>(size_) * sizeof(uint64_t) > a.slotBytes()) {
    r.ok = false;
    r.error = "all_to_all: the staging slot is too small for the size table";
    return r;
  }
  auto* my_sizes = reinterpret_cast<uint64_t*>(a.slot(rank_));
  for (int p = 0; p < size_; ++p) my_sizes[p] = send_bytes[p];
  if (!(r = a.step()).ok) return r;
  size_t global_max = 0;
  for (int s = 0; s < size_; ++s) {
    const auto* sizes = reinterpret_cast<const uint64_t*>(a.slot(s));
    for (int p = 0; p < size_; ++p) global_max = std::max<size_t>(global_max, sizes[p]);
    if (sizes[rank_] != recv_bytes[s] && r.ok) {
      r.ok = false;
      r.failed_ranks.push_back(s);
      r.mismatch = true;
      r.error = "all_to_all: " + a.rankName(s) + " sends " + std::to_string(sizes[rank_]) + " bytes to " +
                a.rankName(rank_) + ", which expects " + std::to_string(recv_bytes[s]) +
                " (split sizes disagree)";
    }
  }
  a.finish();
  if (!r.ok) {
    a.breakArena(r.error, r.failed_ranks, {}, r.mismatch);
    return r;
  }
  const size_t piece = std::max<size_t>(1, a.slotBytes() / size_);
  for (size_t off = 0; off < global_max; off += piece) {
    if (!(r = a.begin(opSignature(OpCode::kAlltoall, global_max))).ok) break;
    for (int d = 0; d < size_; ++d) {
      if (off < send_bytes[d]) {
        std::memcpy(a.slot(rank_) + d * piece, static_cast<const char*>(input) + send_offsets[d] + off,
                    std::min(piece, send_bytes[d] - off));
      }
    }
    if (!(r = a.step()).ok) break;
    for (int s = 0; s < size_; ++s) {
      if (off < recv_bytes[s]) {
        std::memcpy(static_cast<char*>(output) + recv_offsets[s] + off, a.slot(s) + rank_ * piece,
                    std::min(piece, recv_bytes[s] - off));
      }
    }
    a.finish();
  }
  return r;
}

}  // namespace mooncake::pg
