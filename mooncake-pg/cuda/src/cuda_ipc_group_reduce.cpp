// The reducing operations: all_reduce, reduce, reduce_scatter.
//
// Data moves between ranks only by writes into the peers' staging (a push:
// over NVLink a write is posted and needs no round trip, so it sustains more
// than a read of the peer, and nothing is staged locally). A rank's staging
// half is cut into inboxes, one per source rank (schedules that need two per
// source have a second row after the first).
//
// all_reduce and reduce go one of two ways, chosen alike on every rank:
// - direct, up to one_shot_bytes, and at any size that fits one round when
//   there are two ranks: in rounds (runRounds), every rank writes its input
//   into its inbox at every rank that wants the result; a barrier; each such
//   rank folds its own input and its inboxes into its output. Two barriers
//   for a small operation, and at two ranks the least data any schedule moves
//   (each rank's input crosses once). One round of at most fused_bytes (and
//   one_shot_bytes: one block does it all) runs as one kernel
//   (fused_kernels.cu), with the same pushes and flags.
// - two-shot otherwise, in an even number of rounds of two steps:
//   1. rank r writes segment d of the round's input into its inbox at rank d
//      (scatter);
//   2. a barrier; rank r folds segment r (its own part from the input, the
//      others from its inboxes) into its output, and writes the result into
//      its second inbox at every peer (gather);
//   3. a barrier; rank r copies the reduced segments from its second inboxes
//      into its output, in one launch with the next round's step 1.
//   Each rank writes 2 (W - 1) / W of its input into the peers (what a ring
//   moves, the least any schedule can at W > 2) and reads and writes its own
//   memory about twice its input.
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

// Where `source` writes into `owner`'s half h (schedule.h: inboxOffset).
char* inbox(const CudaIpcGroup::State& g, int owner, int h, int source, size_t inbox_bytes, int row = 0) {
  return g.half(owner, h) + inboxOffset(owner, source, g.size, inbox_bytes, row);
}

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
    auto wantsResult = [&](int q) { return root < 0 || q == root; };
    const size_t direct_inbox = inboxBytes(g.half_bytes, g.size, 1);
    const ReduceSchedule schedule =
        reduceSchedule(bytes, g.size, g.half_bytes, g.options.one_shot_bytes, g.options.fused_bytes);
    if (schedule != ReduceSchedule::kTwoShot) {
      const RoundPlan plan = planRounds(count, direct_inbox / esize, esize);
      auto foldJob = [&](int h, size_t begin, size_t n) {
        ReduceJob fold = reduceJob(n, type, op);
        for (int q = 0; q < g.size; ++q) {
          fold.srcs[fold.nsrc++] = q == g.rank ? at(input, begin * esize) : inbox(g, g.rank, h, q, direct_inbox);
        }
        if (receives) addDestination(fold, at(output, begin * esize));
        return fold;
      };
      // This rank's inbox in half h of every rank that wants the result: where
      // both forms push (so that ranks may mix them).
      void* receivers[kMaxLocalRanks];
      auto receiverInboxes = [&](int h) {
        int npush = 0;
        for (int d = 0; d < g.size; ++d) {
          if (d != g.rank && wantsResult(d)) receivers[npush++] = inbox(g, d, h, g.rank, direct_inbox);
        }
        return npush;
      };
      if (schedule == ReduceSchedule::kDirectFused) {
        const int npush = receiverInboxes(0);
        return run.fusedDirect(input, receivers, npush, bytes, foldJob(0, 0, count));
      }
      runRounds(
          run, plan,
          [&](int h, size_t begin, size_t n) {
            CopyJob push;
            for (int i = 0, npush = receiverInboxes(h); i < npush; ++i) {
              addCopy(push, at(input, begin * esize), receivers[i], n * esize);
            }
            run.copy(push);
          },
          [&](int h, size_t begin, size_t n) {
            if (receives) run.reduce(foldJob(h, begin, n));
          });
      return;
    }
    const size_t inbox_bytes = inboxBytes(g.half_bytes, g.size, 2);  // row 0: scatter, row 1: gather
    const RoundPlan plan = planRounds(count, inbox_bytes / esize * g.size, esize, /*even_rounds=*/true);
    // Step 3 of the previous round (reads this rank's other half), launched
    // with step 1 of this one (writes the peers' half h, whose inboxes they
    // last read two rounds ago, before the barrier this rank passed last).
    CopyJob gather;
    for (size_t i = 0; i < plan.rounds && !run.failed(); ++i) {
      const int h = static_cast<int>(i % 2);
      const size_t begin = plan.begin(i), n = plan.length(i);
      auto segment = [&](int q, size_t& seg_begin, size_t& seg_length) {
        alignedSegment(n, g.size, q, esize, seg_begin, seg_length);
      };
      CopyJob step = gather;
      for (int d = 0; d < g.size; ++d) {
        if (d == g.rank) continue;
        size_t seg_begin = 0, seg_length = 0;
        segment(d, seg_begin, seg_length);
        addCopy(step, at(input, (begin + seg_begin) * esize), inbox(g, d, h, g.rank, inbox_bytes), seg_length * esize);
      }
      run.copy(step);
      run.barrier();
      size_t own_begin = 0, own_length = 0;
      segment(g.rank, own_begin, own_length);
      ReduceJob fold = reduceJob(own_length, type, op);
      for (int q = 0; q < g.size; ++q) {
        fold.srcs[fold.nsrc++] = q == g.rank ? at(input, (begin + own_begin) * esize) : inbox(g, g.rank, h, q, inbox_bytes);
      }
      if (receives) addDestination(fold, at(output, (begin + own_begin) * esize));
      for (int d = 0; d < g.size; ++d) {
        if (d != g.rank && wantsResult(d)) addDestination(fold, inbox(g, d, h, g.rank, inbox_bytes, 1));
      }
      run.reduce(fold);
      run.barrier();
      gather = CopyJob{};
      for (int s = 0; s < g.size && receives; ++s) {
        if (s == g.rank) continue;
        size_t seg_begin = 0, seg_length = 0;
        segment(s, seg_begin, seg_length);
        addCopy(gather, inbox(g, g.rank, h, s, inbox_bytes, 1), at(output, (begin + seg_begin) * esize), seg_length * esize);
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

// Each round pushes, for every other rank d, a piece of block d into slot r
// (this rank's) of d's half; then, after a barrier, rank r folds the slots of
// its own half (its own block straight from its input) into its output.
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
            addCopy(job, at(input, (d * count + begin) * esize), g.half(d, h) + g.rank * slot, n * esize);
          }
          run.copy(job);
        },
        [&](int h, size_t begin, size_t n) {
          ReduceJob job = reduceJob(n, type, op);
          for (int q = 0; q < g.size; ++q) {
            job.srcs[job.nsrc++] = q == g.rank ? own(begin) : g.half(g.rank, h) + q * slot;
          }
          addDestination(job, at(output, begin * esize));
          run.reduce(job);
        });
  });
}

}  // namespace mooncake::pg::cuda
