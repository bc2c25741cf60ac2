#pragma once

#include <cstdint>

namespace mooncake::pg {

enum class OpCode : uint8_t { kBarrier = 1, kBroadcast, kAllreduce, kReduce, kAllgather, kReduceScatter, kAlltoall,
                              kGather, kScatter };

// What every rank must agree on for one collective (see ShmArena::step).
uint64_t opSignature(OpCode op, uint64_t a = 0, uint64_t b = 0, uint64_t c = 0, uint64_t d = 0);

// Messages up to this size reduce in one shot: every rank folds all slots.
constexpr size_t kOneShotReduceBytes = 64 * 1024;

}  // namespace mooncake::pg
