// all_reduce captured in a CUDA graph (global capture mode, as torch uses)
// and replayed with new inputs; eager operations before and after must
// still agree with the replays (no state carries between operations).
#include "rank_support.h"

namespace mooncake::pg::cuda::testing {
namespace {

std::vector<float> inputs(size_t count, int rank, int replay) {
  std::vector<float> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = static_cast<float>(100 * rank + replay + i % 5);
  return v;
}

int expectSums(CudaIpcGroup& g, const char* what, const std::vector<float>& got, int replay) {
  int failures = 0;
  const int W = g.size();
  for (size_t i = 0; i < got.size(); ++i) {
    const float want = static_cast<float>(100.0 * W * (W - 1) / 2 + W * (replay + i % 5));
    if (got[i] != want) {
      RANK_CHECK(false, "%s, replay %d: element %zu is %g, expected %g", what, replay, i, got[i], want);
      break;
    }
  }
  return failures;
}

}  // namespace

int graphReplayScenario(CudaIpcGroup& g) {
  int failures = 0;
  const int R = g.rank();
  // Small: direct, one round. Large (4 MiB): direct at world 2 with the
  // default staging, otherwise two-shot (reduce-scatter + all-gather) in an
  // even number of rounds.
  const size_t small = 1000, large = 1u << 20;
  DeviceBuffer small_in(small * 4), small_out(small * 4), large_io(large * 4);
  Stream stream;
  auto eager = [&](int tag) {
    large_io.upload(inputs(large, R, tag), stream);
    const OpResult r = complete(g, g.allreduce(large_io.get(), large_io.get(), large, DataType::kFloat32,
                                               ReduceOp::kSum, stream));
    RANK_CHECK(r.ok, "eager all_reduce %d: %s", tag, r.error.c_str());
    if (r.ok) failures += expectSums(g, "eager all_reduce", large_io.download<float>(large, stream), tag);
  };
  eager(-1);

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  RANK_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal) == cudaSuccess, "begin capture");
  const CudaOp a = g.allreduce(small_in.get(), small_out.get(), small, DataType::kFloat32, ReduceOp::kSum, stream);
  const CudaOp b = g.allreduce(large_io.get(), large_io.get(), large, DataType::kFloat32, ReduceOp::kSum, stream);
  const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
  RANK_CHECK(a.result.ok && b.result.ok, "capturing: %s %s", a.result.error.c_str(), b.result.error.c_str());
  RANK_CHECK(a.id == 0 && b.id == 0, "captured operations have no id");
  RANK_CHECK(ended == cudaSuccess, "end capture: %s", cudaGetErrorString(ended));
  if (failures) return failures;
  RANK_CHECK(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess, "instantiate");
  if (failures) return failures;
  std::fprintf(stderr, "rank %d: captured with %s\n", R,
               g.usesStreamMemOps() && g.memOpsCapturable() ? "stream memory operations" : "barrier kernels");

  for (int replay = 0; replay < 6; ++replay) {
    small_in.upload(inputs(small, R, replay), stream);
    large_io.upload(inputs(large, R, replay), stream);
    RANK_CHECK(cudaGraphLaunch(exec, stream) == cudaSuccess, "launch replay %d", replay);
    RANK_CHECK(cudaStreamSynchronize(stream) == cudaSuccess, "replay %d", replay);
    failures += expectSums(g, "captured small all_reduce", small_out.download<float>(small, stream), replay);
    failures += expectSums(g, "captured large all_reduce", large_io.download<float>(large, stream), replay);
    if (replay == 2) eager(100);  // eager operations between replays
  }
  RANK_CHECK(!g.broken(), "the group should be healthy after the replays");
  eager(200);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return failures;
}

}  // namespace mooncake::pg::cuda::testing
