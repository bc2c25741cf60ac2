// The operations that only move bytes: broadcast, all_gather, gather,
// scatter, all_to_all. Each round, the ranks that send stage their part into
// their own staging half, a barrier, and the ranks that receive copy straight
// out of the senders' halves (one kernel for all peers). A rank's own block
// never goes through staging.
#include <algorithm>

#include "group_state.h"

namespace mooncake::pg::cuda {
namespace {

const char* at(const void* base, size_t offset) { return static_cast<const char*>(base) + offset; }
char* at(void* base, size_t offset) { return static_cast<char*>(base) + offset; }

// The part of a `total`-byte block that falls in [begin, begin + length).
size_t partIn(size_t total, size_t begin, size_t length) {
  return begin >= total ? 0 : std::min(length, total - begin);
}

}  // namespace

CudaOp CudaIpcGroup::broadcast(void* data, size_t bytes, int root, cudaStream_t stream) {
  State& g = *state_;
  if (std::string why = checkRoot(g, root); !why.empty()) return rejected("broadcast: " + why);
  return enqueueOp(g, stream, opSignature(OpCode::kBroadcast, bytes, root), [&](OpRun& run) {
    if (g.size == 1) return;
    runRounds(
        run, planRounds(bytes, g.half_bytes, 1),
        [&](int h, size_t begin, size_t n) {
          CopyJob job;
          if (g.rank == root) addCopy(job, at(data, begin), g.half(root, h), n);
          run.copy(job);
        },
        [&](int h, size_t begin, size_t n) {
          CopyJob job;
          if (g.rank != root) addCopy(job, g.half(root, h), at(data, begin), n);
          run.copy(job);
        });
  });
}

// all_gather and gather: everyone stages, `root` (every rank when -1) reads.
static CudaOp gatherCommon(CudaIpcGroup::State& g, OpCode code, const void* input, void* output, size_t bytes,
                           int root, cudaStream_t stream) {
  const bool receives = root < 0 || g.rank == root;
  return enqueueOp(g, stream, opSignature(code, bytes, root), [&](OpRun& run) {
    CopyJob own;
    if (receives) addCopy(own, input, at(output, g.rank * bytes), bytes);  // in place: skipped
    if (g.size == 1) return run.copy(own);
    runRounds(
        run, planRounds(bytes, g.half_bytes, 1),
        [&](int h, size_t begin, size_t n) {
          CopyJob job;
          if (root < 0 || g.rank != root) addCopy(job, at(input, begin), g.half(g.rank, h), n);
          run.copy(job);
        },
        [&](int h, size_t begin, size_t n) {
          CopyJob job = begin == 0 ? own : CopyJob{};
          for (int s = 0; s < g.size && receives; ++s) {
            if (s != g.rank) addCopy(job, g.half(s, h), at(output, s * bytes + begin), n);
          }
          run.copy(job);
        });
  });
}

CudaOp CudaIpcGroup::allgather(const void* input, void* output, size_t bytes, cudaStream_t stream) {
  return gatherCommon(*state_, OpCode::kAllgather, input, output, bytes, -1, stream);
}

CudaOp CudaIpcGroup::gather(const void* input, void* output, size_t bytes, int root, cudaStream_t stream) {
  if (std::string why = checkRoot(*state_, root); !why.empty()) return rejected("gather: " + why);
  return gatherCommon(*state_, OpCode::kGather, input, output, bytes, root, stream);
}

CudaOp CudaIpcGroup::scatter(const void* input, void* output, size_t bytes, int root, cudaStream_t stream) {
  State& g = *state_;
  if (std::string why = checkRoot(g, root); !why.empty()) return rejected("scatter: " + why);
  const size_t slot = g.slotBytes();  // the root stages one slot per receiver
  return enqueueOp(g, stream, opSignature(OpCode::kScatter, bytes, root), [&](OpRun& run) {
    CopyJob own;
    if (g.rank == root) addCopy(own, at(input, root * bytes), output, bytes);
    if (g.size == 1) return run.copy(own);
    runRounds(
        run, planRounds(bytes, slot, 1),
        [&](int h, size_t begin, size_t n) {
          CopyJob job;
          for (int d = 0; d < g.size && g.rank == root; ++d) {
            if (d != root) addCopy(job, at(input, d * bytes + begin), g.half(root, h) + d * slot, n);
          }
          run.copy(job);
        },
        [&](int h, size_t begin, size_t n) {
          CopyJob job = begin == 0 ? own : CopyJob{};
          if (g.rank != root) addCopy(job, g.half(root, h) + g.rank * slot, at(output, begin), n);
          run.copy(job);
        });
  });
}

CudaOp CudaIpcGroup::alltoall(const void* input, const std::vector<size_t>& send_offsets,
                              const std::vector<size_t>& send_bytes, void* output,
                              const std::vector<size_t>& recv_offsets, const std::vector<size_t>& recv_bytes,
                              cudaStream_t stream) {
  State& g = *state_;
  const size_t n = static_cast<size_t>(g.size);
  if (send_offsets.size() != n || send_bytes.size() != n || recv_offsets.size() != n || recv_bytes.size() != n) {
    return rejected("all_to_all: offsets and sizes need one entry per rank (" + std::to_string(n) + ")");
  }
  const size_t slot = g.slotBytes();  // each rank stages one slot per receiver
  return enqueueOp(g, stream, opSignature(OpCode::kAlltoall), [&](OpRun& run) {
    // Every rank must run the same number of rounds, set by the largest
    // block anyone sends: the one number the host has to learn from peers.
    std::vector<std::vector<uint64_t>> table;
    OpResult agreed = g.control->exchangeSendTable(++g.alltoall_round, send_bytes, table, g.options.timeout);
    for (int s = 0; s < g.size && agreed.ok; ++s) {
      if (table[s][g.rank] != recv_bytes[s]) {
        agreed.ok = false;
        agreed.failed_ranks = {s};
        agreed.error = "all_to_all: " + g.control->rankName(s) + " sends " + std::to_string(table[s][g.rank]) +
                       " bytes to " + g.control->rankName(g.rank) + ", which expects " +
                       std::to_string(recv_bytes[s]) + " (split sizes disagree)";
      }
    }
    if (!agreed.ok) return run.fail(agreed);
    size_t largest = 0;
    for (const auto& row : table) largest = std::max<size_t>(largest, *std::max_element(row.begin(), row.end()));
    CopyJob own;
    addCopy(own, at(input, send_offsets[g.rank]), at(output, recv_offsets[g.rank]), send_bytes[g.rank]);
    if (g.size == 1) return run.copy(own);
    runRounds(
        run, planRounds(largest, slot, 1),
        [&](int h, size_t begin, size_t length) {
          CopyJob job;
          for (int d = 0; d < g.size; ++d) {
            if (d != g.rank) {
              addCopy(job, at(input, send_offsets[d] + begin), g.half(g.rank, h) + d * slot,
                      partIn(send_bytes[d], begin, length));
            }
          }
          run.copy(job);
        },
        [&](int h, size_t begin, size_t length) {
          CopyJob job = begin == 0 ? own : CopyJob{};
          for (int s = 0; s < g.size; ++s) {
            if (s != g.rank) {
              addCopy(job, g.half(s, h) + g.rank * slot, at(output, recv_offsets[s] + begin),
                      partIn(recv_bytes[s], begin, length));
            }
          }
          run.copy(job);
        });
  });
}

}  // namespace mooncake::pg::cuda
