// Which GPU a rank of a multi-process GPU test or benchmark runs on:
// rank % G, where G is MOONCAKE_TEST_GPUS when set (1: every rank on GPU 0,
// the mode of a one-GPU host; N: spread over the first N GPUs) and otherwise
// every visible device. python/mooncake/_gpu_placement.py (gpu_of_rank)
// follows the same rule, so a C++ and a Python run of a suite place ranks alike.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>

namespace mooncake::testing {

// -1 when no CUDA device is visible.
inline int testDeviceOf(int rank) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count <= 0) return -1;
  int gpus = count;
  if (const char* value = std::getenv("MOONCAKE_TEST_GPUS"); value != nullptr && *value != '\0') {
    gpus = std::clamp(std::atoi(value), 1, count);
  }
  return rank % gpus;
}

}  // namespace mooncake::testing
