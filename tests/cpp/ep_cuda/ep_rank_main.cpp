// One rank of an EP kernel test, a program of its own so that every rank
// starts CUDA afresh in its own process (test_ep_ipc_group.cpp starts them).
//
//   ep_cuda_rank <scenario> <group name> <rank> <world> [key=value ...]
//   scenarios: exchange, absent, late, masked, dead, direct_loss, direct_late; timing (a measurement, not a test)
//   keys: tokens=T hidden=H local_experts=L topk=K seed=N calls=N output_slots=O
//
// Exit status 0 when every check passed on this rank; reasons go to stderr.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <string>

#include "common/rank_programs.h"
#include "common/test_gpus.h"
#include "ep_rank_scenarios.h"

using namespace mooncake::ep::cuda;
using namespace mooncake::ep::cuda::testing;

int main(int argc, char** argv) {
  mooncake::testing::RankArgs args;
  if (!mooncake::testing::parseRankArgs(argc, argv, &args)) return 2;
  const std::string& scenario = args.scenario;
  const std::string& name = args.name;
  const int rank = args.rank, world = args.world;
  auto key = [&](const char* k, long fallback) { return args.has(k) ? std::stol(args.get(k)) : fallback; };
  Sizes s;
  s.R = world;
  s.T = static_cast<int>(key("tokens", 24));
  s.H = static_cast<int>(key("hidden", 384));
  s.L = static_cast<int>(key("local_experts", 3));
  s.K = static_cast<int>(key("topk", 4));
  const uint64_t seed = static_cast<uint64_t>(key("seed", 1));

  const int device = mooncake::testing::testDeviceOf(rank);
  if (device < 0 || cudaSetDevice(device) != cudaSuccess) {
    std::fprintf(stderr, "rank %d: no CUDA device\n", rank);
    return 3;
  }
  EpIpcGroupOptions options;
  options.max_tokens_per_rank = s.T;
  options.hidden = s.H;
  options.num_experts = s.E();
  options.output_slots = static_cast<int>(key("output_slots", 0));
  options.attach_timeout = std::chrono::seconds(30);
  std::string error;
  std::unique_ptr<EpIpcGroup> group = EpIpcGroup::open(name, rank, world, options, &error);
  if (!group) {
    std::fprintf(stderr, "rank %d: %s\n", rank, error.c_str());
    return 4;
  }
  int failures = 0;
  if (scenario == "exchange") {
    failures = exchangeScenario(*group, s, seed, static_cast<int>(key("calls", 4)));
  } else if (scenario == "timing") {
    failures = timingScenario(*group, s, seed, static_cast<int>(key("calls", 20)));
  } else if (scenario == "absent") {
    failures = absentRankScenario(*group, s, seed);
  } else if (scenario == "late") {
    failures = lateRankScenario(*group, s, seed);
  } else if (scenario == "masked") {
    failures = maskedRankScenario(*group, s, seed);
  } else if (scenario == "dead") {
    failures = deadRankScenario(*group, s, seed);
  } else if (scenario == "direct_loss") {
    failures = directHeadsLossScenario(*group, s, seed);
  } else if (scenario == "direct_late") {
    failures = directHeadsLateScenario(*group, s, seed);
  } else {
    std::fprintf(stderr, "unknown scenario '%s'\n", scenario.c_str());
    failures = 1;
  }
  if (failures == 0) std::fprintf(stderr, "rank %d: %s passed\n", rank, scenario.c_str());
  group.reset();  // collective close while the others are still here
  return failures == 0 ? 0 : 1;
}
