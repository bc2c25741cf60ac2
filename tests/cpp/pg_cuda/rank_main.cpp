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
#include <cstdlib>
#include <map>
#include <string>

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
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s <scenario> <name> <rank> <world> [key=value ...]\n", argv[0]);
    return 2;
  }
  const std::string scenario = argv[1], name = argv[2];
  const int rank = std::atoi(argv[3]), world = std::atoi(argv[4]);
  std::map<std::string, std::string> keys;
  for (int i = 5; i < argc; ++i) {
    const std::string arg = argv[i];
    const size_t eq = arg.find('=');
    if (eq != std::string::npos) keys[arg.substr(0, eq)] = arg.substr(eq + 1);
  }
  CudaIpcGroupOptions options;
  if (keys.count("staging")) options.staging_bytes = std::stoull(keys["staging"]);
  if (keys.count("one_shot")) options.one_shot_bytes = std::stoull(keys["one_shot"]);
  if (keys.count("timeout_ms")) options.timeout = std::chrono::milliseconds(std::stoll(keys["timeout_ms"]));
  if (keys["sync"] == "kernels") options.sync = SyncMode::kKernels;
  if (keys["sync"] == "memops") options.sync = SyncMode::kStreamMemOps;
  options.attach_timeout = std::chrono::seconds(60);

  if (cudaSetDevice(0) != cudaSuccess) {
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
