// The reducing collectives of ShmGroup.
//
// Small messages (<= kOneShotReduceBytes) take one step: every rank stages
// its input and folds all slots itself. Larger ones take two steps per chunk:
// rank r folds segment r of all slots into segment r of its own slot
// (reduce-scatter), then every rank copies the reduced segments out
// (all-gather). Each rank then reads about 2x and writes about 2x the chunk,
// whatever the world size.
#include <algorithm>
#include <cstring>
#include <vector>

#include "shm_arena.h"
#include "shm_group_internal.h"

namespace mooncake::pg {
namespace {

// Bounds of segment `index` when `count` elements are split in `parts`.
void segment(size_t count, int parts, int index, size_t& begin, size_t& length) {
  size_t base = count / parts, extra = count % parts;
  begin = index * base + std::min<size_t>(index, extra);
  length = base + (static_cast<size_t>(index) < extra ? 1 : 0);
}

}  // namespace

// Shared by allreduce (every rank gets the result) and reduce (only `root`).
static OpResult reduceCommon(ShmArena& a, OpCode code, const void* input, void* output, size_t count, DataType type,
                             ReduceOp op, int root) {
  const int size = a.size(), rank = a.rank();
  const size_t esize = elementSize(type);
  const bool gets_result = code == OpCode::kAllreduce || rank == root;
  std::vector<const void*> srcs(size);
  OpResult r;
  if (count * esize <= kOneShotReduceBytes) {
    if (!(r = a.begin(opSignature(code, count, static_cast<uint64_t>(type), static_cast<uint64_t>(op), root))).ok) {
      return r;
    }
    std::memcpy(a.slot(rank), input, count * esize);
    if (!(r = a.step()).ok) return r;
    if (gets_result) {
      for (int s = 0; s < size; ++s) srcs[s] = a.slot(s);
      reduceInto(output, srcs.data(), size, count, type, op);
    }
    a.finish();
    return r;
  }
  const size_t chunk = a.slotBytes() / esize;
  for (size_t off = 0; off < count; off += chunk) {
    const size_t n = std::min(chunk, count - off);
    if (!(r = a.begin(opSignature(code, count, static_cast<uint64_t>(type), static_cast<uint64_t>(op), root))).ok) {
      r.output_written = off > 0;  // earlier chunks are out
      break;
    }
    std::memcpy(a.slot(rank), static_cast<const char*>(input) + off * esize, n * esize);
    if (!(r = a.step()).ok) {
      r.output_written = off > 0;
      break;
    }
    size_t seg_begin, seg_len;
    segment(n, size, rank, seg_begin, seg_len);
    if (seg_len > 0) {
      for (int s = 0; s < size; ++s) srcs[s] = a.slot(s) + seg_begin * esize;
      // Rank r alone touches segment r of every slot in this step, so the
      // result can go back into its own slot.
      reduceInto(a.slot(rank) + seg_begin * esize, srcs.data(), size, seg_len, type, op);
    }
    if (!(r = a.step()).ok) {
      r.output_written = off > 0;
      break;
    }
    if (gets_result) {
      for (int s = 0; s < size; ++s) {
        segment(n, size, s, seg_begin, seg_len);
        std::memcpy(static_cast<char*>(output) + (off + seg_begin) * esize, a.slot(s) + seg_begin * esize,
                    seg_len * esize);
      }
    }
    a.finish();
  }
  if (!r.ok) r.output_written = gets_result && r.output_written;
  return r;
}

// Alone, every reduction of one value is that value (AVG divides by one).
OpResult ShmGroup::allreduce(const void* input, void* output, size_t count, DataType type, ReduceOp op) {
  if (size_ == 1) return alone(opSignature(OpCode::kAllreduce), input, output, count * elementSize(type));
  return reduceCommon(*arena_, OpCode::kAllreduce, input, output, count, type, op, -1);
}

OpResult ShmGroup::reduce(const void* input, void* output, size_t count, DataType type, ReduceOp op, int root) {
  if (size_ == 1) return alone(opSignature(OpCode::kReduce), input, output, count * elementSize(type));
  return reduceCommon(*arena_, OpCode::kReduce, input, output, count, type, op, root);
}

OpResult ShmGroup::reduceScatter(const void* input, void* output, size_t count, DataType type, ReduceOp op) {
  if (size_ == 1) return alone(opSignature(OpCode::kReduceScatter), input, output, count * elementSize(type));
  ShmArena& a = *arena_;
  const int size = size_;
  const size_t esize = elementSize(type);
  // Each round stages `piece` elements of every destination block.
  const size_t piece = std::max<size_t>(1, a.slotBytes() / esize / size);
  std::vector<const void*> srcs(size);
  OpResult r;
  for (size_t off = 0; off < count || off == 0; off += piece) {
    const size_t n = std::min(piece, count - off);
    if (!(r = a.begin(opSignature(OpCode::kReduceScatter, count, static_cast<uint64_t>(type),
                                  static_cast<uint64_t>(op)))).ok) {
      break;
    }
    for (int d = 0; d < size; ++d) {
      std::memcpy(a.slot(rank_) + d * piece * esize, static_cast<const char*>(input) + (d * count + off) * esize,
                  n * esize);
    }
    if (!(r = a.step()).ok) break;
    for (int s = 0; s < size; ++s) srcs[s] = a.slot(s) + rank_ * piece * esize;
    reduceInto(static_cast<char*>(output) + off * esize, srcs.data(), size, n, type, op);
    a.finish();
    if (count == 0) break;
  }
  return r;
}

}  // namespace mooncake::pg
