// What one rank of an EP kernel test does (ep_rank_main.cpp runs it): real
// dispatch and combine calls against the CPU reference (ep_reference.h).
#include "ep_rank_scenarios.h"

#include <chrono>
#include <csignal>
#include <thread>
#include <cstdio>
#include <cstring>

#include "common/cuda_rank_helpers.h"
#include "ep_reference.h"

namespace mooncake::ep::cuda::testing {
namespace {

using mooncake::testing::DeviceBuffer;
using mooncake::testing::Stream;
using Clock = std::chrono::steady_clock;

// Device memory for one rank's calls, sized for the most tokens.
struct Buffers {
  explicit Buffers(const Sizes& s)
      : x(static_cast<size_t>(s.T) * s.H * 2),
        idx(static_cast<size_t>(s.T) * s.K * 8),
        weights(static_cast<size_t>(s.T) * s.K * 4),
        active(static_cast<size_t>(s.R) * 4),
        recv_x(static_cast<size_t>(s.L) * s.S() * s.H * 2),
        recv_scales(static_cast<size_t>(s.L) * s.S() * (s.H / 128) * 4),
        recv_count(static_cast<size_t>(s.L) * 4),
        src_info(static_cast<size_t>(s.L) * s.S() * 4),
        layout_range(static_cast<size_t>(s.L) * s.R * 8),
        y(static_cast<size_t>(s.L) * s.S() * s.H * 2),
        out(static_cast<size_t>(s.T) * s.H * 2) {}
  DeviceBuffer x, idx, weights, active, recv_x, recv_scales, recv_count, src_info, layout_range, y, out;
};

// The arguments of one rank's calls over `b` (`mine`: the rank's inputs).
DispatchArgs dispatchArgs(Buffers& b, const Sizes& s, const RankInputs& mine, bool use_fp8, int64_t timeout_us) {
  DispatchArgs d;
  d.x = b.x.get();
  d.topk_idx = reinterpret_cast<const int64_t*>(b.idx.get());
  d.num_tokens = mine.num_tokens;
  d.num_topk = s.K;
  d.active_ranks = reinterpret_cast<int32_t*>(b.active.get());
  d.timeout_us = timeout_us;
  d.use_fp8 = use_fp8;
  d.recv_x = b.recv_x.get();
  d.recv_scales = reinterpret_cast<float*>(b.recv_scales.get());
  d.recv_count = reinterpret_cast<int32_t*>(b.recv_count.get());
  d.src_info = reinterpret_cast<int32_t*>(b.src_info.get());
  d.layout_range = reinterpret_cast<int64_t*>(b.layout_range.get());
  return d;
}

CombineArgs combineArgs(Buffers& b, const Sizes& s, const RankInputs& mine, int64_t timeout_us) {
  CombineArgs c;
  c.y = b.y.get();
  c.src_info = reinterpret_cast<const int32_t*>(b.src_info.get());
  c.layout_range = reinterpret_cast<const int64_t*>(b.layout_range.get());
  c.topk_idx = reinterpret_cast<const int64_t*>(b.idx.get());
  c.topk_weights = reinterpret_cast<const float*>(b.weights.get());
  c.num_tokens = mine.num_tokens;
  c.num_topk = s.K;
  c.active_ranks = reinterpret_cast<int32_t*>(b.active.get());
  c.timeout_us = timeout_us;
  c.out = b.out.get();
  return c;
}

struct CallResult {
  int failures = 0;
  double dispatch_seconds = 0, combine_seconds = 0;
};

// Both halves of a call, in one go or (split) as two enqueues.
template <typename Args>
bool enqueue(bool (EpIpcGroup::*call)(const Args&, cudaStream_t, std::string*, EpStages), EpIpcGroup& g,
             const Args& args, cudaStream_t stream, bool split, std::string* error) {
  if (!split) return (g.*call)(args, stream, error, EpStages::kAll);
  return (g.*call)(args, stream, error, EpStages::kSendOnly) && (g.*call)(args, stream, error, EpStages::kReceiveOnly);
}

// One dispatch and one combine of call `call`, checked against the CPU.
// `expected_active` is the mask the dispatch must end with, and the combine
// too unless `expected_after_combine` says otherwise. With `split` each is
// enqueued in two halves (EpStages).
CallResult runCall(EpIpcGroup& g, const Sizes& s, uint64_t seed, int call, bool use_fp8, bool split, int64_t timeout_us,
                   Buffers& b, cudaStream_t stream, const std::vector<int>& expected_active,
                   const std::vector<int>* expected_after_combine = nullptr) {
  CallResult result;
  int& failures = result.failures;
  const int me = g.rank();
  std::vector<RankInputs> all;
  for (int r = 0; r < s.R; ++r) all.push_back(makeInputs(s, seed, r, call));
  const RankInputs& mine = all[me];
  if (mine.num_tokens > 0) {
    b.x.upload(mine.x, stream);
    b.idx.upload(mine.idx, stream);
    b.weights.upload(mine.weights, stream);
  }
  // Garbage where the kernels must write: a missing write shows.
  cudaMemsetAsync(b.src_info.get(), 0x5a, b.src_info.bytes(), stream);
  cudaMemsetAsync(b.layout_range.get(), 0x5a, b.layout_range.bytes(), stream);
  cudaMemsetAsync(b.recv_count.get(), 0x5a, b.recv_count.bytes(), stream);

  const DispatchArgs d = dispatchArgs(b, s, mine, use_fp8, timeout_us);
  std::string error;
  auto start = Clock::now();
  const bool enqueued = enqueue(&EpIpcGroup::dispatch, g, d, stream, split, &error);
  RANK_CHECK(enqueued, "dispatch: %s", error.c_str());
  RANK_CHECK(cudaStreamSynchronize(stream) == cudaSuccess, "dispatch ran: %s", cudaGetErrorString(cudaGetLastError()));
  result.dispatch_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (failures) return result;

  const std::vector<int32_t> active = b.active.download<int32_t>(s.R, stream);
  for (int r = 0; r < s.R; ++r) {
    RANK_CHECK((active[r] != 0) == (expected_active[r] != 0), "call %d: active_ranks[%d] = %d after dispatch", call,
               r, active[r]);
  }
  const auto count = b.recv_count.download<int32_t>(s.L, stream);
  const auto info = b.src_info.download<int32_t>(static_cast<size_t>(s.L) * s.S(), stream);
  const auto range = b.layout_range.download<int64_t>(static_cast<size_t>(s.L) * s.R, stream);
  const auto rx = b.recv_x.download<uint8_t>(b.recv_x.bytes(), stream);
  const auto rs = b.recv_scales.download<float>(static_cast<size_t>(s.L) * s.S() * (s.H / 128), stream);
  std::vector<uint16_t> y(static_cast<size_t>(s.L) * s.S() * s.H, kBf16Nan);  // past the counts: NaN, never read
  std::vector<uint8_t> data(s.H);
  std::vector<float> scales(s.H / 128);
  for (int le = 0; le < s.L && failures < 20; ++le) {
    const std::vector<Row> rows = expectedRows(s, all, expected_active, me, le);
    RANK_CHECK(count[le] == static_cast<int>(rows.size()), "call %d: recv_count[%d] = %d, expected %zu", call, le,
               count[le], rows.size());
    int64_t begin = 0;
    for (int src = 0; src < s.R; ++src) {
      int64_t n = 0;
      for (const Row& row : rows) n += row.src == src;
      RANK_CHECK(range[le * s.R + src] == (begin << 32 | n), "call %d: layout_range[%d][%d] = %#llx, expected %#llx",
                 call, le, src, static_cast<unsigned long long>(range[le * s.R + src]),
                 static_cast<unsigned long long>(begin << 32 | n));
      begin += n;
    }
    for (int j = 0; j < s.S() && failures < 20; ++j) {
      const size_t row_index = static_cast<size_t>(le) * s.S() + j;
      if (j >= static_cast<int>(rows.size())) {
        RANK_CHECK(info[row_index] == -1, "call %d: src_info[%d][%d] = %d past the count", call, le, j,
                   info[row_index]);
        continue;
      }
      const Row& row = rows[j];
      RANK_CHECK(info[row_index] == row.token, "call %d: src_info[%d][%d] = %d, expected %d", call, le, j,
                 info[row_index], row.token);
      const uint16_t* x = &all[row.src].x[static_cast<size_t>(row.token) * s.H];
      if (use_fp8) {
        quantize(x, s.H, data.data(), scales.data());
        const int bad = std::memcmp(&rx[row_index * s.H], data.data(), s.H);
        RANK_CHECK(bad == 0, "call %d: fp8 row %d of expert %d (rank %d token %d) differs", call, j, le, row.src,
                   row.token);
        for (int gi = 0; gi < s.H / 128; ++gi) {
          const float got = rs[(static_cast<size_t>(le) * (s.H / 128) + gi) * s.S() + j];
          RANK_CHECK(std::memcmp(&got, &scales[gi], 4) == 0, "call %d: scale %d of row %d expert %d: %a, expected %a",
                     call, gi, j, le, got, scales[gi]);
        }
      } else {
        const int bad = std::memcmp(&rx[row_index * s.H * 2], x, static_cast<size_t>(s.H) * 2);
        RANK_CHECK(bad == 0, "call %d: bf16 row %d of expert %d (rank %d token %d) differs", call, j, le, row.src,
                   row.token);
      }
      for (int h = 0; h < s.H; ++h) y[row_index * s.H + h] = expertOutput(x[h], me * s.L + le, h);
    }
  }
  if (failures) return result;

  b.y.upload(y, stream);
  cudaMemsetAsync(b.out.get(), 0x5a, b.out.bytes(), stream);
  const CombineArgs c = combineArgs(b, s, mine, timeout_us);
  start = Clock::now();
  const bool combined = enqueue(&EpIpcGroup::combine, g, c, stream, split, &error);
  RANK_CHECK(combined, "combine: %s", error.c_str());
  RANK_CHECK(cudaStreamSynchronize(stream) == cudaSuccess, "combine ran: %s", cudaGetErrorString(cudaGetLastError()));
  result.combine_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const std::vector<int>& final_active = expected_after_combine ? *expected_after_combine : expected_active;
  const std::vector<uint16_t> expected = expectedCombine(s, mine, final_active, me);
  const auto out = b.out.download<uint16_t>(expected.size(), stream);
  for (size_t i = 0; i < expected.size() && failures < 20; ++i) {
    RANK_CHECK(out[i] == expected[i], "call %d: out[token %zu][%zu] = %#06x, expected %#06x", call, i / s.H, i % s.H,
               out[i], expected[i]);
  }
  const auto after = b.active.download<int32_t>(s.R, stream);
  for (int r = 0; r < s.R; ++r) {
    RANK_CHECK((after[r] != 0) == (final_active[r] != 0), "call %d: active_ranks[%d] = %d after combine", call, r,
               after[r]);
  }
  return result;
}

}  // namespace

// Several calls in a row (both parities, twice), BF16 and FP8 alternating,
// token counts from 0 to T, masked picks; nobody times out. Every third call
// is enqueued in two halves.
int exchangeScenario(EpIpcGroup& g, const Sizes& s, uint64_t seed, int calls) {
  int failures = 0;
  Stream stream;
  Buffers b(s);
  std::vector<int> ones(s.R, 1);
  b.active.upload(std::vector<int32_t>(s.R, 1), stream);
  for (int call = 0; call < calls && failures == 0; ++call) {
    const CallResult r = runCall(g, s, seed, call, call % 2 == 1, call % 3 == 2, 20'000'000, b, stream, ones);
    failures += r.failures;
  }
  return failures;
}

// The last rank never calls: the others return within the timeout with it
// masked, their results right for the rest; the next call does not wait
// for it at all.
int absentRankScenario(EpIpcGroup& g, const Sizes& s, uint64_t seed) {
  int failures = 0;
  const int victim = s.R - 1;
  if (g.rank() == victim) return 0;  // closing waits for the others (no region freed under their writes)
  Stream stream;
  Buffers b(s);
  b.active.upload(std::vector<int32_t>(s.R, 1), stream);
  std::vector<int> survivors(s.R, 1);
  survivors[victim] = 0;
  const int64_t timeout_us = 1'000'000;  // far above the ranks' start skew
  for (int call = 0; call < 3 && failures == 0; ++call) {
    const CallResult r = runCall(g, s, seed, call, call == 1, false, timeout_us, b, stream, survivors);
    failures += r.failures;
    const double limit = call == 0 ? 5.0 : 1.0;  // the first call waits out the timeout; the later ones do not wait
    RANK_CHECK(r.dispatch_seconds < limit, "call %d: dispatch took %.3f s", call, r.dispatch_seconds);
    RANK_CHECK(r.combine_seconds < 1.0, "call %d: combine took %.3f s (the victim was already masked)", call,
               r.combine_seconds);
    std::fprintf(stderr, "rank %d: call %d: dispatch %.3f s, combine %.3f s\n", g.rank(), call, r.dispatch_seconds,
                 r.combine_seconds);
  }
  return failures;
}

// The last rank calls 2.5 s late (the others time out on it after 1 s and
// go on with two more calls without it). Its dispatch still finds the
// others' rows of that call (they had sent them while it was active) and
// returns at once with everything; in its combine nobody answers (they
// masked it), so after the timeout it masks them all and keeps only its own
// experts' contributions. Nothing hangs, nothing of a later call leaks in.
int lateRankScenario(EpIpcGroup& g, const Sizes& s, uint64_t seed) {
  const int victim = s.R - 1;
  if (g.rank() != victim) return absentRankScenario(g, s, seed);
  int failures = 0;
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  Stream stream;
  Buffers b(s);
  b.active.upload(std::vector<int32_t>(s.R, 1), stream);
  const std::vector<int> everyone(s.R, 1);
  std::vector<int> alone(s.R, 0);
  alone[victim] = 1;
  const CallResult r = runCall(g, s, seed, 0, false, false, 1'000'000, b, stream, everyone, &alone);
  failures += r.failures;
  RANK_CHECK(r.dispatch_seconds < 1.0, "the late dispatch took %.3f s (everything had arrived)", r.dispatch_seconds);
  RANK_CHECK(r.combine_seconds < 5.0, "the late combine took %.3f s", r.combine_seconds);
  return failures;
}

// Every rank's caller masks the last rank from the start, the last rank
// included, and nobody has a timeout: nobody may wait for it (a wait would
// hang until the test's limit kills the ranks). The masked rank gets empty
// dispatch outputs and a zero combine.
int maskedRankScenario(EpIpcGroup& g, const Sizes& s, uint64_t seed) {
  int failures = 0;
  Stream stream;
  Buffers b(s);
  std::vector<int> mask(s.R, 1);
  mask[s.R - 1] = 0;
  b.active.upload(std::vector<int32_t>(mask.begin(), mask.end()), stream);
  for (int call = 0; call < 3 && failures == 0; ++call) {
    failures += runCall(g, s, seed, call, call == 1, false, -1, b, stream, mask).failures;
  }
  return failures;
}

// The last rank's process dies before the call; the others call with no
// timeout: the watchdog's `departed` word ends their waits, the rank is
// masked, and the rest is right.
int deadRankScenario(EpIpcGroup& g, const Sizes& s, uint64_t seed) {
  int failures = 0;
  const int victim = s.R - 1;
  if (g.rank() == victim) {
    // Late enough that every peer has finished opening (and mapped this
    // rank's region), early enough that they have not called yet.
    std::this_thread::sleep_for(std::chrono::milliseconds(1000));
    std::raise(SIGKILL);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // the watchdogs see the exit first
  Stream stream;
  Buffers b(s);
  b.active.upload(std::vector<int32_t>(s.R, 1), stream);
  std::vector<int> survivors(s.R, 1);
  survivors[victim] = 0;
  for (int call = 0; call < 2 && failures == 0; ++call) {
    const CallResult r = runCall(g, s, seed, call, call == 1, false, -1, b, stream, survivors);
    failures += r.failures;
    RANK_CHECK(r.dispatch_seconds < 2.0, "call %d: dispatch took %.3f s", call, r.dispatch_seconds);
  }
  return failures;
}

}  // namespace mooncake::ep::cuda::testing

namespace mooncake::ep::cuda::testing {

// Not a test: the kernels' own time (CUDA events around each enqueue, no
// Python, nothing checked) of FP8 dispatch and BF16 combine, averaged over
// `calls` after 3 warm-up calls, printed to stderr. For locating where the
// time of benchmarks/ep_ll_bench.py goes, e.g.
//   ep_cuda_rank timing /ep-timing 0 1 tokens=128 hidden=7168 local_experts=288 topk=8
int timingScenario(EpIpcGroup& g, const Sizes& s, uint64_t seed, int calls) {
  constexpr int kWarmup = 3;
  if (calls <= kWarmup) {
    std::fprintf(stderr, "timing: calls must be > %d\n", kWarmup);
    return 1;
  }
  Stream stream;
  Buffers b(s);
  b.active.upload(std::vector<int32_t>(s.R, 1), stream);
  const RankInputs mine = makeInputs(s, seed, g.rank(), 0);
  if (mine.num_tokens > 0) {
    b.x.upload(mine.x, stream);
    b.idx.upload(mine.idx, stream);
    b.weights.upload(mine.weights, stream);
  }
  const DispatchArgs d = dispatchArgs(b, s, mine, /*use_fp8=*/true, -1);
  const CombineArgs c = combineArgs(b, s, mine, -1);
  cudaEvent_t marks[3];
  for (cudaEvent_t& e : marks) cudaEventCreate(&e);
  double dispatch_ms = 0, combine_ms = 0;
  std::string error;
  int failures = 0;
  for (int i = 0; i < calls && failures == 0; ++i) {
    cudaEventRecord(marks[0], stream);
    RANK_CHECK(g.dispatch(d, stream, &error), "dispatch: %s", error.c_str());
    cudaEventRecord(marks[1], stream);
    RANK_CHECK(g.combine(c, stream, &error), "combine: %s", error.c_str());
    cudaEventRecord(marks[2], stream);
    RANK_CHECK(cudaEventSynchronize(marks[2]) == cudaSuccess, "call %d ran: %s", i,
               cudaGetErrorString(cudaGetLastError()));
    float dispatch = 0, combine = 0;
    cudaEventElapsedTime(&dispatch, marks[0], marks[1]);
    cudaEventElapsedTime(&combine, marks[1], marks[2]);
    if (i >= kWarmup) {
      dispatch_ms += dispatch;
      combine_ms += combine;
    }
  }
  for (cudaEvent_t& e : marks) cudaEventDestroy(e);
  const int timed = calls - kWarmup;
  std::fprintf(stderr, "rank %d: dispatch %.1f us, combine %.1f us (%d tokens, %d calls)\n", g.rank(),
               1e3 * dispatch_ms / timed, 1e3 * combine_ms / timed, mine.num_tokens, timed);
  return failures;
}

}  // namespace mooncake::ep::cuda::testing
