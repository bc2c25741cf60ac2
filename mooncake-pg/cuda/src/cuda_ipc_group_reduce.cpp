// The reducing operations: all_reduce, reduce, reduce_scatter.
//
// all_reduce and reduce up to one_shot_bytes take one step: every rank
// stages its input, a barrier, and each rank that wants the result folds all
// the inputs straight out of the peers' staging halves, then a closing
// barrier. Larger ones go in an even number of rounds of two steps: rank r
// folds segment r of the round from every rank's half into segment r of its
// own half and of its output (reduce-scatter), a barrier, then copies the
// other segments from their owners' halves (all-gather, launched together
// with the next round's staging). A rank stages all but its own segment, so
// it reads (3 - 2/W)x and writes 2x its input in all (5x at first).
// The sources are folded in rank order in both schedules, so the bits of the
// result do not depend on the path or on who reduced which segment.
#include "group_state.h"

namespace mooncake::pg::cuda {
namespace {

const char* at(const void* base, size_t offset) { return static_cast<const char*>(base) + offset; }
char* at(void* base, size_t offset) { return static_cast<char*>(base) + offset; }

ReduceJob reduceJob(size_t count, DataType type, ReduceOp op) {
  ReduceJob job;
  job.count = count;
  job.type = type;
  job.op = op;
  return job;
}

void addDestination(ReduceJob& job, void* dst) { job.dsts[job.ndst++] = dst; }

}  // namespace

// all_reduce (root < 0: everyone gets the result) and reduce.
static CudaOp reduceCommon(CudaIpcGroup::State& g, OpCode code, const void* input, void* output, size_t count,
                           DataType type, ReduceOp op, int root, cudaStream_t stream) {
  const size_t esize = elementSize(type);
  const size_t bytes = count * esize;
  const bool receives = root < 0 || g.rank == root;
  const uint32_t signature =
      opSignature(code, count, static_cast<uint64_t>(type), static_cast<uint64_t>(op), static_cast<uint64_t>(root));
  return enqueueOp(g, stream, signature, [&](OpRun& run) {
    if (g.size == 1) {  // the fold of one input still applies AVG and bool's normalization
      ReduceJob job = reduceJob(count, type, op);
      job.srcs[job.nsrc++] = input;
      addDestination(job, output);
      return run.reduce(job);
    }
    if (bytes == 0) return;
    if (bytes <= g.options.one_shot_bytes && bytes <= g.half_bytes) {
      CopyJob stage;
      addCopy(stage, input, g.half(g.rank, 0), bytes);
      run.copy(stage);
      run.barrier();
      ReduceJob job = reduceJob(count, type, op);
      for (int q = 0; q < g.size; ++q) job.srcs[job.nsrc++] = q == g.rank ? input : g.half(q, 0);
      if (receives) addDestination(job, output);
      run.reduce(job);
      run.barrier();  // closing: nobody reads a staging half after it
      return;
    }
    const RoundPlan plan = planRounds(count, g.half_bytes / esize, esize, /*even_rounds=*/true);
    // The previous round's all-gather goes in one launch with this round's
    // staging: it reads the peers' other half and writes another part of the
    // output, while the staging reads this round's input and writes this
    // rank's other half (no peer reads that half any more: they passed the
    // last barrier after their own previous all-gather, which read it).
    CopyJob gather;
    for (size_t i = 0; i < plan.rounds && !run.failed(); ++i) {
      const int h = static_cast<int>(i % 2);
      const size_t begin = plan.begin(i), n = plan.length(i);
      size_t own_begin = 0, own_length = 0;
      alignedSegment(n, g.size, g.rank, esize, own_begin, own_length);
      // The peers read every segment of this rank's half but its own, which
      // the fold below fills from the input directly: it is not staged.
      CopyJob step = gather;
      const size_t own_end = own_begin + own_length;
      addCopy(step, at(input, begin * esize), g.half(g.rank, h), own_begin * esize);
      addCopy(step, at(input, (begin + own_end) * esize), g.half(g.rank, h) + own_end * esize, (n - own_end) * esize);
      run.copy(step);
      run.barrier();
      ReduceJob fold = reduceJob(own_length, type, op);
      for (int q = 0; q < g.size; ++q) {
        fold.srcs[fold.nsrc++] =
            q == g.rank ? at(input, (begin + own_begin) * esize) : g.half(q, h) + own_begin * esize;
      }
      // Only this rank touches segment `rank` of the halves in this step.
      addDestination(fold, g.half(g.rank, h) + own_begin * esize);
      if (receives) addDestination(fold, at(output, (begin + own_begin) * esize));
      run.reduce(fold);
      run.barrier();
      gather = CopyJob{};
      for (int s = 0; s < g.size && receives; ++s) {
        if (s == g.rank) continue;
        size_t seg_begin = 0, seg_length = 0;
        alignedSegment(n, g.size, s, esize, seg_begin, seg_length);
        addCopy(gather, g.half(s, h) + seg_begin * esize, at(output, (begin + seg_begin) * esize), seg_length * esize);
      }
    }
    run.copy(gather);
  });
}

CudaOp CudaIpcGroup::allreduce(const void* input, void* output, size_t count, DataType type, ReduceOp op,
                               cudaStream_t stream) {
  if (std::string why = checkReduction(type, op); !why.empty()) return rejected("all_reduce: " + why);
  return reduceCommon(*state_, OpCode::kAllreduce, input, output, count, type, op, -1, stream);
}

CudaOp CudaIpcGroup::reduce(const void* input, void* output, size_t count, DataType type, ReduceOp op, int root,
                            cudaStream_t stream) {
  if (std::string why = checkReduction(type, op); !why.empty()) return rejected("reduce: " + why);
  if (std::string why = checkRoot(*state_, root); !why.empty()) return rejected("reduce: " + why);
  return reduceCommon(*state_, OpCode::kReduce, input, output, count, type, op, root, stream);
}

// Each round stages, for every other rank d, a piece of block d into slot d
// of this rank's half; then rank r folds slot r of every half (its own block
// straight from its input) into its output.
CudaOp CudaIpcGroup::reduceScatter(const void* input, void* output, size_t count, DataType type, ReduceOp op,
                                   cudaStream_t stream) {
  State& g = *state_;
  if (std::string why = checkReduction(type, op); !why.empty()) return rejected("reduce_scatter: " + why);
  const size_t esize = elementSize(type);
  const size_t slot = g.slotBytes();
  const uint32_t signature =
      opSignature(OpCode::kReduceScatter, count, static_cast<uint64_t>(type), static_cast<uint64_t>(op));
  return enqueueOp(g, stream, signature, [&](OpRun& run) {
    auto own = [&](size_t begin) { return at(input, (g.rank * count + begin) * esize); };
    if (g.size == 1) {
      ReduceJob job = reduceJob(count, type, op);
      job.srcs[job.nsrc++] = own(0);
      addDestination(job, output);
      return run.reduce(job);
    }
    runRounds(
        run, planRounds(count, slot / esize, esize),
        [&](int h, size_t begin, size_t n) {
          CopyJob job;
          for (int d = 0; d < g.size; ++d) {
            if (d == g.rank) continue;
            addCopy(job, at(input, (d * count + begin) * esize), g.half(g.rank, h) + d * slot, n * esize);
          }
          run.copy(job);
        },
        [&](int h, size_t begin, size_t n) {
          ReduceJob job = reduceJob(n, type, op);
          for (int q = 0; q < g.size; ++q) {
            job.srcs[job.nsrc++] = q == g.rank ? own(begin) : g.half(q, h) + g.rank * slot;
          }
          addDestination(job, at(output, begin * esize));
          run.reduce(job);
        });
  });
}

}  // namespace mooncake::pg::cuda
