#pragma once

#include <cstdint>

#include "ep_reference.h"
#include "mooncake/ep/cuda/ep_ipc_group.h"

namespace mooncake::ep::cuda::testing {

int exchangeScenario(EpIpcGroup& g, const Sizes& s, uint64_t seed, int calls);
int timingScenario(EpIpcGroup& g, const Sizes& s, uint64_t seed, int calls);
int absentRankScenario(EpIpcGroup& g, const Sizes& s, uint64_t seed);
int lateRankScenario(EpIpcGroup& g, const Sizes& s, uint64_t seed);
int maskedRankScenario(EpIpcGroup& g, const Sizes& s, uint64_t seed);
int deadRankScenario(EpIpcGroup& g, const Sizes& s, uint64_t seed);
// ep_rank_direct_heads.cpp
int directHeadsLossScenario(EpIpcGroup& g, const Sizes& s, uint64_t seed);
int directHeadsLateScenario(EpIpcGroup& g, const Sizes& s, uint64_t seed);

}  // namespace mooncake::ep::cuda::testing
