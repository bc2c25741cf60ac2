// One rank of a CudaIpcGroup test, a program of its own so that every rank
// starts CUDA afresh in its own process (test_cuda_ipc_group.cpp starts them).
//
//   pg_cuda_rank <scenario> <group name> <rank> <world> [key=value ...]
//   keys: staging=<bytes> sync=auto|memops|kernels timeout_ms=<ms> one_shot=<bytes>
//
// Exit status 0 when every check of the scenario passed on this rank; the
// reasons of a failure go to stderr, prefixed with the rank.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <string>

#include "common/rank_programs.h"
#include "common/test_gpus.h"
#include "rank_support.h"

using namespace mooncake::pg::cuda;
using namespace mooncake::pg::cuda::testing;

namespace {

int runScenario(const std::string& scenario, CudaIpcGroup& group) {
  if (scenario == "collectives") return everyCollectiveScenario(group);
  if (scenario == "reductions") return reductionsMatchCpuScenario(group);
  if (scenario == "graph") return graphReplayScenario(group);
  if (scenario == "dead") return deadRankScenario(group);
  if (scenario == "stall") return stalledRankScenario(group);
  if (scenario == "mismatch") return mismatchScenario(group);
  std::fprintf(stderr, "unknown scenario '%s'\n", scenario.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  mooncake::testing::RankArgs args;
  if (!mooncake::testing::parseRankArgs(argc, argv, &args)) return 2;
  const std::string& scenario = args.scenario;
  const std::string& name = args.name;
  const int rank = args.rank, world = args.world;
  CudaIpcGroupOptions options;
  if (args.has("staging")) options.staging_bytes = std::stoull(args.get("staging"));
  if (args.has("one_shot")) options.one_shot_bytes = std::stoull(args.get("one_shot"));
  // fused_rank=N: only rank N fuses (the others take the steps).
  if (args.has("fused") && (!args.has("fused_rank") || std::stoi(args.get("fused_rank")) == args.rank)) {
    options.fused_bytes = std::stoull(args.get("fused"));
  }
  if (args.has("timeout_ms")) options.timeout = std::chrono::milliseconds(std::stoll(args.get("timeout_ms")));
  if (args.get("sync") == "kernels") options.sync = SyncMode::kKernels;
  if (args.get("sync") == "memops") options.sync = SyncMode::kStreamMemOps;
  options.attach_timeout = std::chrono::seconds(60);

  const int device = mooncake::testing::testDeviceOf(rank);
  if (device < 0 || cudaSetDevice(device) != cudaSuccess) {
    std::fprintf(stderr, "rank %d: no CUDA device\n", rank);
    return 3;
  }
  std::string error;
  std::unique_ptr<CudaIpcGroup> group = CudaIpcGroup::open(name, rank, world, options, &error);
  if (!group) {
    std::fprintf(stderr, "rank %d: %s\n", rank, error.c_str());
    return 4;
  }
  const int failures = runScenario(scenario, *group);
  if (failures == 0) std::fprintf(stderr, "rank %d: %s passed\n", rank, scenario.c_str());
  group.reset();  // collective close while the others are still here
  return failures == 0 ? 0 : 1;
}
